"""`lmtrace sweep --over features --sae SAE`: the SAE, its feature cells and the top active features.

A feature cell is `Cell("feature", layer=<the SAE's layer>, neuron=<the feature id>)`: the tables'
`neuron` column holds the latent's index, `layer` the layer of the SAE's hook (the engine's shortcut
skips the layers below it). The SAE is a SAELens directory or the short name of one the run's manifest
records (`features`, written by `generate --sae` / `lmtrace features`); it is read and its hook point
checked against the run's model shape before the model is loaded.

The swept features are `--features 12,40,7` or the `--top-features N` (default 20) largest at the
measured positions: per feature its largest activation over every swept sequence's measured steps
(step s at position prompt length - 1 + s), from the run's archived top-k latents when the run holds
this SAE's arrays, else from the SAE applied to a forward of each swept sequence (`top_from_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...exits.errors import SpecError
from .cells import Cell

DEFAULT_TOP_FEATURES = 20
EDITS = ("zero", "clamp", "patch")


@dataclass
class SweepSae:
    """The swept SAE: its short name (the run's, else its directory's), path, weights' sha256, the loaded
    `Sae`, its `Site`, and whether the run archived its latents (feat_<name>_idx / _val)."""

    name: str
    path: Path
    sha256: str
    sae: object
    site: object
    archived: bool

    def record(self) -> dict:
        """sweep.json's `features`: the SAE as every record names it, its name under `sae`."""
        from ...features.refs import sae_record

        record = sae_record(self.name, self.path, self.sha256, self.sae, self.site)
        return {"sae": record.pop("name"), **record}


def is_features(over: str) -> bool:
    return over.strip() == "features"


def resolve_sae(run, ref: str) -> SweepSae:
    """`--sae`: one of the run's SAE names (manifest `features`) or a SAELens directory; read, its hook
    point and width checked against the run's model (SpecError, one line)."""
    from ...features import parse_hook_name, read_sae
    from ...features.refs import resolve_sae_ref

    found = resolve_sae_ref(ref, run.manifest.get("features") or [], "--sae", f"run {run.id}")
    sae = read_sae(found.path)
    if sae.cfg.transcoder:
        raise SpecError(
            f"--sae {ref}: sweep --over features does not support transcoders ({sae.cfg.architecture}) yet; "
            f"use an SAE (standard, jumprelu, topk)"
        )
    site = parse_hook_name(sae.cfg.hook_name, f"SAE {found.path}")
    _check_site(run, site, sae.cfg.d_in, found.path)
    archived = found.recorded is not None and f"feat_{found.recorded['name']}_idx" in run.array_names()
    return SweepSae(found.name, found.path, found.sha256, sae, site, archived)


def _check_site(run, site, d_in: int, path: Path) -> None:
    """The SAE's hook point exists in the run's model (layer in range) and has width d_in."""
    shape, cfg = run.shape, run.manifest["model"]["config"]
    n_layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    if not 0 <= site.layer < n_layers:
        raise SpecError(
            f"SAE {path}: hook point {site.hook_name} is not in this model (layers 0..{n_layers - 1}); "
            f"use an SAE trained on this model"
        )
    width = {"attn_z": shape["n_heads"] * shape["head_dim"], "mlp_post": shape.get("d_ffn")}.get(
        site.kind, shape["d_model"]
    )
    if width is not None and d_in != width:
        raise SpecError(
            f"SAE {path}: d_in {d_in} does not match {site.hook_name} of this model, which has width {width} "
            f"({site.kind}); use an SAE trained on this model"
        )


def check_feature_spec(spec, d_sae: int, sae_name: str) -> list[int] | None:
    """The explicit `--features` list (None: the top N, chosen later); SpecError for what does not fit."""
    from ...capture.interventions import parse_range_list

    if spec.edit not in EDITS:
        raise SpecError(
            f"--over features takes --edit zero (the latent set to 0), clamp --value V or patch --source RUN_B, "
            f"not {spec.edit}"
        )
    if spec.edit == "clamp" and spec.value is None:
        raise SpecError("--edit clamp needs --value V (the value the latent is set to)")
    if spec.value is not None and (spec.edit != "clamp" or not np.isfinite(spec.value)):
        raise SpecError("--value is --edit clamp's value, a finite number")
    if spec.features is not None and spec.top_features is not None:
        raise SpecError("give --features F,G,... or --top-features N, not both")
    if spec.features is None:
        return None
    given = spec.features
    ids = sorted(set(given if isinstance(given, list) else parse_range_list(given, "--features")))
    bad = [f for f in ids if not 0 <= f < d_sae]
    if bad:
        raise SpecError(f"--features: {bad} not in SAE {sae_name} (latents 0..{d_sae - 1})")
    if not ids:
        raise SpecError("--features: the sweep is empty (no features)")
    return ids


def feature_cells(ids: list[int], layer: int, positions: list[int] | None) -> list[Cell]:
    """One cell per feature (and position, with --positions), sorted as build_cells sorts."""
    cells = [Cell("feature", layer, neuron=f, position=p) for f in ids for p in (positions or [None])]
    return sorted(cells, key=lambda c: (c.neuron, -1 if c.position is None else c.position))


def top_features(maxima: np.ndarray, n: int) -> list[int]:
    """The n features with the largest maxima (> 0; ties by id), as ids."""
    order = np.lexsort((np.arange(len(maxima)), -maxima))
    return [int(f) for f in order[:n] if maxima[f] > 0]


def maxima_from_archive(run, name: str, seq_steps: dict[int, list[int]], d_sae: int) -> np.ndarray:
    """Per feature its largest archived activation over the swept sequences' measured steps [d_sae]."""
    idx, val = run.array(f"feat_{name}_idx"), run.array(f"feat_{name}_val")
    out = np.zeros(d_sae)
    for s, steps in seq_steps.items():
        i = np.asarray(idx[s])[steps].reshape(-1)
        v = np.asarray(val[s])[steps].reshape(-1)
        keep = (i >= 0) & np.isfinite(v)
        np.maximum.at(out, i[keep], v[keep])
    return out


def maxima_from_forward(adapter, sae: SweepSae, view, seq_steps: dict[int, list[int]]) -> np.ndarray:
    """Per feature its largest activation over the measured positions of the swept sequences, the SAE
    applied to the site in a forward of each sequence [d_sae]."""
    import torch

    from ...features.sites import at_site

    model = adapter.model
    device = next(model.parameters()).device
    out = torch.zeros(sae.sae.cfg.d_sae)
    got: list = []
    for s, steps in seq_steps.items():
        P = len(view.prompt_ids[s])
        ids = (view.prompt_ids[s] + view.generated[s])[: P + max(steps)]
        got.clear()
        with torch.inference_mode(), at_site(adapter, sae.site, lambda x: got.append(x.detach())):
            model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)
        x = got[0].reshape(-1, got[0].shape[-1])[[P - 1 + st for st in steps]]
        out = torch.maximum(out, sae.sae.encode(x.to(sae.sae.W_enc.device)).amax(0).cpu())
    return out.numpy().astype(np.float64)


def chosen_cells(inp, adapter, recorded: list[int] | None, positions: list[int] | None, note) -> list[Cell]:
    """The cells of the top `inp.top_features` features of a forward of each swept sequence (`recorded`:
    the ones an unfinished sweep chose, reused so that every shard and resume sweeps the same)."""
    ids = recorded
    if ids is None:
        note(f"top {inp.top_features} features of SAE {inp.features.name}: one forward over each swept sequence")
        maxima = maxima_from_forward(adapter, inp.features, inp.view, inp.seq_steps)
        ids = top_features(maxima, inp.top_features)
        if not ids:
            raise SpecError(f"--over features: no feature of SAE {inp.features.name} is active at the measured steps")
    return feature_cells(ids, inp.features.site.layer, positions)


def feature_effect_array(names: list[str], coords: dict, values: np.ndarray) -> tuple[list[str], dict, np.ndarray]:
    """`effects.effect_array` of feature cells ([layer, neuron(, position)], one layer: the SAE's) as
    effects.zarr holds it: [feature(, position)]."""
    if "layer" in names:
        axis = names.index("layer")
        values = values.take(0, axis=axis)
        names = [n for n in names if n != "layer"]
    out = ["feature" if n == "neuron" else n for n in names]
    return out, {o: coords[n] for o, n in zip(out, names)}, values


def feature_label(feature: int, sae_name: str) -> str:
    """A feature cell's label in serve and the report: 'feature 123 (sae-l10)'."""
    return f"feature {feature} ({sae_name})"
