"""Feature capture (`capture.features`, docs/features.md): sparse autoencoders applied at their hook
point in the generation's own forward, each token's top-k active latents archived (a transcoder's
latents are read at its input site, the MLP's input).

`load_feature_saes` reads and checks every SAE of the spec before the model is loaded (a missing
directory, NaN weights, an unknown architecture: one line, exit 2), `check_sites` refuses a hook point
the model lacks or a `d_in` that does not match it once the model is there, before any step runs.
`FeatureProbe` taps each SAE's site (lmtrace/capture/taps.py) and encodes the query position of every
forward (at the prefill also every prompt position, where asked): ids [B, k_feat] int32 (-1 = fewer
active latents) and values [B, k_feat] float32 (NaN there), largest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..digest import file_sha256
from ..exits.errors import SpecError
from ..features import Sae, Site, parse_hook_name, read_sae
from ..features.format import WEIGHTS
from ..features.refs import sae_record, short_names
from ..features.sites import check_sae_sites
from .taps import tap


@dataclass
class LoadedSae:
    name: str  # the run's short name for it: feat_<name>_idx / _val
    path: Path
    sae: Sae
    site: Site
    top_k: int
    prompt: bool
    sha256: str

    def record(self) -> dict:
        """The manifest's entry for this SAE (manifest `features`)."""
        return {
            **sae_record(self.name, self.path, self.sha256, self.sae, self.site),
            "top_k": self.top_k,
            "prompt": self.prompt,
        }


def load_feature_saes(features) -> list[LoadedSae]:
    """`capture.features` -> the SAEs, read and checked (SpecError, one line, for bad ones)."""
    paths = [Path(f.sae).expanduser() for f in features]
    out = []
    for f, path, name in zip(features, paths, short_names(paths)):
        sae = read_sae(path)
        site = parse_hook_name(sae.cfg.hook_name, f"SAE {path}")
        out.append(LoadedSae(name, path.resolve(), sae, site, f.top_k, f.prompt, file_sha256(path / WEIGHTS)))
    return out


def check_sites(saes: list[LoadedSae], adapter) -> None:
    """Refuse an SAE whose hook point the model lacks or whose d_in does not match it (a transcoder: its
    output hook point and d_out too)."""
    for s in saes:
        check_sae_sites(adapter, s.sae.cfg, f"SAE {s.path}")


def check_unchanged(existing: dict, saes: list[LoadedSae], run_id: str) -> None:
    """A resumed (or joined) run's SAEs must be the ones it was started with."""
    had = {f["name"]: f["sha256"] for f in existing.get("features") or []}
    has = {s.name: s.sha256 for s in saes}
    if had != has:
        changed = sorted(set(had) ^ set(has) | {n for n in set(had) & set(has) if had[n] != has[n]})
        raise SpecError(
            f"run {run_id}: the SAE weights of {', '.join(changed)} differ from those the run was started "
            f"with; resume with the SAE directories the run names in manifest.json `features`"
        )


def top_features(sae: Sae, x: torch.Tensor, top_k: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d_in] -> (ids [..., width] int32, values [..., width] float32): the `top_k` largest
    activations, largest first; -1 / NaN past the active ones and past top_k."""
    ids, vals = sae.top_active(x, top_k)
    active = vals > 0
    ids = torch.where(active, ids, -1).to(torch.int32)
    vals = torch.where(active, vals, torch.nan)
    pad = width - ids.shape[-1]
    if pad > 0:
        ids = torch.nn.functional.pad(ids, (0, pad), value=-1)
        vals = torch.nn.functional.pad(vals, (0, pad), value=float("nan"))
    return ids, vals


class FeatureProbe:
    """Encodes each SAE's site at the query position of every forward (and every prompt position at
    the prefill, for SAEs with `prompt: true`). `ctx()` gives the probes' ForwardContext."""

    def __init__(self, adapter, saes: list[LoadedSae], width: int, max_prompt: int):
        self.adapter = adapter
        self.saes = saes
        self.width = width
        self.max_prompt = max_prompt
        self.step: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.prompt: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self) -> None:
        self.step, self.prompt = {}, {}

    def attach(self, ctx) -> list:
        handles = []
        for s in self.saes:
            module, where = s.site.locate(self.adapter)
            handles.append(tap(module, self._tap(s, where, ctx)))
        return handles

    def _tap(self, s: LoadedSae, where: str, ctx):
        def encode(module, args, kwargs, output):
            if where == "output":
                t = output[0] if type(output) is tuple else output
            else:
                t = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
            c = ctx()
            B = len(c.pads)
            t = t.reshape(B, -1, t.shape[-1])  # a family that flattens tokens (OPT's fc2) gives [B*pos, w]
            if s.sae.W_enc.device != t.device:
                s.sae.to(t.device)
            if c.prefill and s.prompt:
                ids, vals = top_features(s.sae, t, s.top_k, self.width)  # [B, T, width]
                self.prompt[s.name] = (ids, vals)
                self.step[s.name] = (ids[:, -1], vals[:, -1])
            else:
                self.step[s.name] = top_features(s.sae, t[:, -1], s.top_k, self.width)

        return encode

    def collect(self) -> dict[str, np.ndarray]:
        out = {}
        for name, (ids, vals) in self.step.items():
            out[f"feat_{name}_idx"] = ids.cpu().numpy()
            out[f"feat_{name}_val"] = vals.cpu().numpy()
        return out

    def collect_prefill(self, pads: list[int]) -> dict[str, np.ndarray]:
        """The prompt positions, left-aligned (prompt_pos p = the p-th token): [B, max_prompt, width]."""
        out = {}
        for name, (ids, vals) in self.prompt.items():
            ids, vals = ids.cpu().numpy(), vals.cpu().numpy()
            B, T = ids.shape[:2]
            idx_out = np.full((B, self.max_prompt, self.width), -1, dtype=np.int32)
            val_out = np.full((B, self.max_prompt, self.width), np.nan, dtype=np.float32)
            for b, pad in enumerate(pads):
                idx_out[b, : T - pad] = ids[b, pad:]
                val_out[b, : T - pad] = vals[b, pad:]
            out[f"prompt_feat_{name}_idx"], out[f"prompt_feat_{name}_val"] = idx_out, val_out
        return out
