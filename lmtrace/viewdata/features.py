"""Features in the views (docs/serve.md, "A feature"; docs/report.md, "Features"): a latent's page and
the latents active at a selected token, read from the run's archived feature arrays (`feat_<sae>_idx`
/ `_val`, written by `generate --sae` / `capture.features` or `lmtrace features RUN --sae DIR`).

The numbers are `lmtrace features RUN --sae NAME --feature F`'s (analysis/features/find.py:
`occurrences`, `window_bounds`), computed by the same code. A long-lived reader (the server) keeps a
latent's occurrences per complete run (its Run object: one per manifest version, so a run that is
resumed or gets features computed again is read afresh) and SAE weights (sha256): asking again with
another `top` or `window` reads no feature array; a run still being written is read on every request. Logit effects need the model's final norm and
unembedding, and the views load no model: a page shows the ones `lmtrace features --feature F`
computed and kept in the run (`find.stored_logit_effects`), else says which command computes them.

Positions and steps are the token view's: example (sequence, step) is the generated token at position
prompt_len + step, and its context's generated tokens carry the latent's activation at their step
(prompt tokens have none: the feature arrays of the steps are what every example is found in).
`positions="prompt"` reads the prompt positions' arrays instead (`prompt_feat_*`: `generate --sae`
with `prompt: true`, `lmtrace features RUN --sae DIR --prompt`): an example is then a prompt position
(its step null), and its context's prompt tokens carry the activations.
"""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc

from ..analysis.features.find import (
    Occurrences,
    hook_label,
    logit_effects_file,
    occurrences,
    stored_logit_effects,
    window_bounds,
)
from ..archive.reader import Run
from . import kept
from .errors import BadParameter, NotFound
from .queries import check_sequence, steps_ready, table_rows

TOKEN_TOP = 10  # latents per SAE listed for a selected token
PAGE_TOP = 20  # examples on a feature page by default
PAGE_WINDOW = 8  # tokens of context before an example (two after, as `features --feature`)
MAX_TOP, MAX_WINDOW = 200, 64
HISTOGRAM_BINS = 20
KEPT_PER_RUN = 32  # latents' occurrences kept per complete run (the server keeps at most 16 runs open)


def sae_entries(run: Run) -> list[dict]:
    """The run's SAEs (manifest `features`) whose arrays are in the archive."""
    names = kept.array_names(run)
    return [f for f in run.manifest.get("features") or [] if f"feat_{f['name']}_idx" in names]


def sae_entry(run: Run, sae: str) -> dict:
    for f in sae_entries(run):
        if f["name"] == sae:
            return f
    known = ", ".join(f["name"] for f in sae_entries(run))
    raise NotFound(
        f"run {run.id} has no feature activations of an SAE named {sae!r} "
        + (f"(its SAEs: {known})" if known else f"(it has none: `lmtrace features {run.id} --sae DIR` computes them)")
    )


def token_features(run: Run, seq: int, step: int, top: int | None = TOKEN_TOP) -> list[dict] | None:
    """Per SAE of the run: the selected token's archived active latents, largest first (ties: the
    smaller latent first; at most `top`, every one with None: `lmtrace show --step`), with the SAE's
    name, hook and width and how many were active; None when the run has no feature arrays."""
    entries = sae_entries(run)
    if not entries:
        return None
    out = []
    for f in entries:
        ids = np.asarray(kept.array(run, f"feat_{f['name']}_idx")[seq, step])
        vals = np.asarray(kept.array(run, f"feat_{f['name']}_val")[seq, step], dtype=np.float64)
        keep = ids >= 0
        order = np.lexsort((ids[keep], -vals[keep]))[:top]
        out.append(
            {
                "sae": f["name"],
                "hook_name": f["hook_name"],
                **({"hook_name_out": f["hook_name_out"]} if f.get("hook_name_out") else {}),
                "hook": hook_label(f),
                "d_sae": int(f["d_sae"]),
                "active": int(keep.sum()),
                "features": [{"feature": int(ids[keep][i]), "activation": float(vals[keep][i])} for i in order],
            }
        )
    return out


def _bounded(value: int, name: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise BadParameter(f"{name}={value}: expected a whole number from {low} to {high}")
    return value


def feature_page(
    run: Run,
    sae: str,
    feature: int,
    *,
    top: int = PAGE_TOP,
    window: int = PAGE_WINDOW,
    sequences: list[int] | None = None,
    positions: str = "generated",
) -> dict:
    """One latent of one SAE over the run (or over `sequences`): its `top` max-activating examples, each
    with its context (`window` tokens before, two after: text, position, step and the latent's
    activation at each generated token), the density, a histogram of its activations where active, and
    its logit effects where `lmtrace features --feature` kept them (else null and `logit_note`).
    `positions`: "generated" (the steps' arrays) or "prompt" (the prompt positions')."""
    entry = sae_entry(run, sae)
    prompt = _prompt_positions(run, entry, positions)
    if not 0 <= feature < int(entry["d_sae"]):
        raise NotFound(f"SAE {entry['name']} has latents 0-{int(entry['d_sae']) - 1}, not {feature}")
    _bounded(top, "top", 1, MAX_TOP)
    _bounded(window, "window", 0, MAX_WINDOW)
    for s in sequences or []:
        check_sequence(run, s)
    occ = kept_occurrences(run, entry, feature, sequences, prompt)
    values = occ.value
    counts, edges = np.histogram(values.astype(np.float64), bins=HISTOGRAM_BINS) if len(values) else ([], [])
    effects = stored_logit_effects(run.path, entry, feature)
    return {
        "run_id": run.path.name,
        "sae": entry["name"],
        "hook_name": entry["hook_name"],
        **({"hook_name_out": entry["hook_name_out"]} if entry.get("hook_name_out") else {}),
        "hook": hook_label(entry),
        "d_sae": int(entry["d_sae"]),
        "feature": feature,
        "positions": positions,
        "has_prompt_positions": f"prompt_feat_{entry['name']}_idx" in kept.array_names(run),
        "sequences": None if sequences is None else sorted(set(sequences)),
        "tokens": occ.n_tokens,
        "active_tokens": occ.n_active,
        "density": occ.density,
        "max_activation": float(values.max()) if len(values) else None,
        "histogram": {"counts": [int(c) for c in counts], "edges": [float(e) for e in edges]},
        "examples": _examples(run, entry, feature, occ.top(top), window, prompt),
        "logit_effects": effects,
        "logit_note": None
        if effects
        else (
            f"not computed: `lmtrace features {run.path.name} --sae {entry['name']} --feature {feature}` "
            f"computes them with the run's model and keeps them in the run ({logit_effects_file(entry['name'])})"
        ),
    }


def kept_occurrences(
    run: Run, entry: dict, feature: int, sequences: list[int] | None = None, prompt: bool = False
) -> Occurrences:
    """`find.occurrences` of latent `feature` of the SAE `entry` (manifest `features`), kept per complete
    Run object and (SAE name, weights sha256, latent, sequences, positions), the latest KEPT_PER_RUN
    (`kept.latest`); read every time for a run still being written (its arrays grow)."""
    key = (
        entry["name"],
        entry["sha256"],
        feature,
        prompt,
        None if sequences is None else tuple(sorted(set(sequences))),
    )
    return kept.latest(
        run,
        "occurrences",
        key,
        lambda: occurrences(run, entry["name"], feature, sequences, prompt=prompt),
        KEPT_PER_RUN,
    )


def _prompt_positions(run: Run, entry: dict, positions: str) -> bool:
    if positions not in ("generated", "prompt"):
        raise BadParameter(f"positions={positions}: expected generated or prompt")
    if positions == "prompt" and f"prompt_feat_{entry['name']}_idx" not in kept.array_names(run):
        raise NotFound(
            f"run {run.id} has no prompt-position features of SAE {entry['name']} "
            f"(`lmtrace features {run.id} --sae DIR --prompt` computes them)"
        )
    return positions == "prompt"


def _examples(run: Run, entry: dict, feature: int, found: list, window: int, prompt: bool = False) -> list[dict]:
    """Each example (sequence, step or prompt position, activation) with its context window: one read of
    the tokens table for the examples' sequences, and each window's part of the feature arrays."""
    if not found:
        return []
    seqs = sorted({s for s, _, _ in found})
    t = table_rows(run, "tokens", ["sequence", "position", "token_text"], where=pc.field("sequence").isin(seqs))
    texts: dict[int, list[str]] = {s: [] for s in seqs}
    for s, _, text in sorted(zip(*(t.column(c).to_pylist() for c in ("sequence", "position", "token_text")))):
        texts[s].append(text)
    prompt_len = kept.lengths(run, "prompt_len")
    prefix = "prompt_" if prompt else ""
    idx_a = kept.array(run, f"{prefix}feat_{entry['name']}_idx")
    val_a = kept.array(run, f"{prefix}feat_{entry['name']}_val")
    rows = []
    for seq, at_, value in found:
        p0 = int(prompt_len[seq])
        base = 0 if prompt else p0  # the position of the arrays' first entry
        position = base + at_
        lo, hi = window_bounds(len(texts[seq]), position, window)
        first = max(lo - base, 0)
        last = min(hi - base, p0 if prompt else steps_ready(run, seq))
        ids = np.asarray(idx_a[seq, first:last]) if last > first else np.zeros((0, 1), np.int32)
        vals = np.asarray(val_a[seq, first:last], dtype=np.float64) if last > first else np.zeros((0, 1))
        acts = {first + i: float(vals[i][ids[i] == feature][0]) for i in range(len(ids)) if (ids[i] == feature).any()}
        in_arrays = range(0, p0) if prompt else range(p0, len(texts[seq]))  # positions the arrays cover

        rows.append(
            {
                "sequence": seq,
                "step": None if prompt else at_,
                "position": position,
                "activation": value,
                "context": [
                    {
                        "position": p,
                        "step": p - p0 if p >= p0 else None,
                        "text": texts[seq][p],
                        "activation": acts.get(p - base, 0.0) if p in in_arrays else None,
                    }
                    for p in range(lo, hi)
                ],
            }
        )
    return rows
