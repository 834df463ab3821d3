"""Feature cells in the sweep's forwards: the edit of each batch row at the SAE's hook, and the change of
the activation an edit makes (for attribution patching). Every edit goes through `features/edits.py`,
the SAE's reconstruction error kept (x' = x + decode(f') - decode(f)):

  zero    `apply_feature_edits` with `FeatureEdit("ablate", F)`: the latent set to 0
  clamp   `apply_feature_edits` with `FeatureEdit("clamp", F, V)`: the latent set to V
  patch   `set_latent`: the latent set to the source run's own latent at the same position (the source's
          activation at the hook, encoded by the same SAE)

A row's edit applies at every position the forward computes (or the cell's one position), as the
sweep's other edits do.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ...features.edits import FeatureEdit, apply_feature_edits, latent_delta, set_latent
from ...features.sae import InputNorm
from ...features.sites import at_site
from .cells import Cell

SOURCE_KIND = "feature"  # SourceValues key: ("feature", Site) -> the source's activation at the SAE's hook


def source_key(features) -> tuple:
    return (SOURCE_KIND, features.site)


def check_site_shape(adapter, features) -> None:
    """Refuse (one line, exit 2) an SAE whose hook the model computes over flattened tokens ([batch*pos,
    width]: OPT's fc2, so its mlp_post and mlp_out): a sweep's rows are edited per sequence. Found by a
    forward of two tokens with the hook watching, before anything is written."""
    from ...exits.errors import SpecError

    dims = []
    with torch.inference_mode(), at_site(adapter, features.site, lambda x: dims.append(x.dim())):
        adapter.model(torch.zeros((1, 2), dtype=torch.long, device=next(adapter.model.parameters()).device))
    if dims and dims[0] != 3:
        raise SpecError(
            f"SAE {features.path}: sweep --over features does not support {features.site.hook_name} on "
            f"{adapter.family.name} models, which compute it over flattened tokens; an SAE at another "
            f"site (resid_pre, resid_post, attn_out, attn_z) can be swept, and `lmtrace intervene "
            f"--feature-*` edits this one"
        )


class FeatureEdits:
    """Row b's feature edit (cells[b]) at the SAE's hook; `sources[b]`: its patch source's SourceValues.
    The forward computes positions `offset`.. (after the unedited prefix)."""

    def __init__(
        self, adapter, features, cells: list[Cell], edit: str, value: float | None, sources=None, offset: int = 0
    ):
        self.adapter, self.features, self.cells, self.edit, self.value = adapter, features, cells, edit, value
        self.sources, self.offset = sources, offset
        self._latents: dict = {}  # id(SourceValues) -> (its latents [n, d_sae], its first position)

    def _source_latent(self, b: int, feature: int) -> tuple[torch.Tensor, int]:
        src = self.sources[b]
        if id(src) not in self._latents:
            x = src.values[source_key(self.features)]
            self._latents[id(src)] = (self.features.sae.encode(x.to(self.features.sae.W_enc.device)), src.start)
        acts, start = self._latents[id(src)]
        return acts[:, feature], start

    def _edit_row(self, x: torch.Tensor, b: int, c: Cell) -> torch.Tensor:
        """x [t, d] (positions offset..) of row b, edited."""
        lo, sae = self.offset, self.features.sae
        sl = slice(None) if c.position is None else slice(c.position - lo, c.position - lo + 1)
        if c.position is not None and not 0 <= c.position - lo < x.shape[0]:
            return x
        x = x.clone()
        if self.edit == "patch":
            latent, s0 = self._source_latent(b, c.neuron)  # latent[i]: position s0 + i
            p0 = lo if c.position is None else c.position
            n = min(x[sl].shape[0], s0 + latent.shape[0] - p0)  # the positions the source has
            if n > 0:
                rows = x[sl][:n]
                x[sl][:n] = set_latent(rows, sae, c.neuron, latent[p0 - s0 : p0 - s0 + n].to(rows.device))
            return x
        kind = "ablate" if self.edit == "zero" else "clamp"
        x[sl] = apply_feature_edits(x[sl], sae, [FeatureEdit(kind, c.neuron, self.value or 0.0)])
        return x

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError("feature sweeps need the hook's activation as [batch, positions, width]")
        return torch.stack([self._edit_row(x[b], b, c) for b, c in enumerate(self.cells)])

    @contextmanager
    def attached(self):
        with at_site(self.adapter, self.features.site, self._apply):
            yield


class _FeatureDelta:
    """One feature's change of the hook's activation, per sequence on demand (`delta[q]`: [T, d_in]
    float32): the decoder direction times the latent's change (`features/edits.latent_delta`), zero
    before `edit_start`. Only the latent's change [K, T] is kept, not K x T x d_in per feature."""

    def __init__(self, sae, feature: int, change: torch.Tensor, norm, edit_start: int):
        self.sae, self.feature, self.change, self.norm, self.edit_start = sae, feature, change, norm, edit_start

    def __getitem__(self, q: int) -> torch.Tensor:
        n = self.norm
        norm = InputNorm(None if n.scale is None else n.scale[q], None if n.shift is None else n.shift[q])
        d = latent_delta(self.sae, self.feature, self.change[q], norm)
        d[: self.edit_start] = 0
        return d


def feature_deltas(features, saved: dict, cells, edit: str, value, sources, T: int, edit_start: int) -> dict:
    """(feature, Site, id) -> the change the edit of feature `id` makes to the hook's activation
    (saved[source_key(features)], [K, T, d_in]), indexed by sequence (`_FeatureDelta`); zero before
    `edit_start` and where a patch source has no position."""
    x = saved[source_key(features)]
    sae = features.sae
    acts, norm = sae.encode_with_norm(x.detach().float())
    if edit == "patch":
        src_acts = acts.clone()
        for q, source in enumerate(sources):
            src = source.values[source_key(features)].to(x.device)  # row i: position source.start + i
            n = min(T, source.start + src.shape[0])
            src_acts[q, source.start : n] = sae.encode(src[: n - source.start])
    out = {}
    for f in sorted({c.neuron for c in cells}):
        now = acts[..., f]
        target = src_acts[..., f] if edit == "patch" else torch.full_like(now, 0.0 if edit == "zero" else float(value))
        out[(*source_key(features), f)] = _FeatureDelta(sae, f, target - now, norm, edit_start)
    return out


class _Reader:
    """A hook-like handle (`.remove()`) that reads a Site's tensor at every forward."""

    def __init__(self, adapter, site, fn):
        self._cm = at_site(adapter, site, lambda x: fn(x) and None)
        self._cm.__enter__()

    def remove(self) -> None:
        self._cm.__exit__(None, None, None)


def site_reader(adapter, site, fn) -> _Reader:
    """Call fn(tensor) on the site's tensor at every forward until `.remove()` (as `read_component`)."""
    return _Reader(adapter, site, fn)
