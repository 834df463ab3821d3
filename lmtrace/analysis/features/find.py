"""Finding features in a run's archived feature arrays (docs/features.md, "Finding features").

`occurrences`: every archived activation of a latent over the run (or some of its sequences), read
shard by shard, the values only of the sequences that hold it: its max-activating tokens (`top`) and
its density (the share of the run's tokens where it is among the archived top-k), the one answer
under `lmtrace features --feature` and the views' feature pages (viewdata/features.py);
`logit_effects_np`: its decoder direction through the final norm and unembedding (kept in the run for
the views that load no model: `store_logit_effects`); `by_groups`: the latents whose mean activation
differs most between groups of sequences, with 95 % bootstrap intervals over each group's sequences
(the resamples of `analysis/sweep/effects.bootstrap_weights`, as `sweep --by` draws them).

Activations are the archived ones: a latent outside a token's top-k counts as 0 there, so density and
means are lower bounds when a token had more than top_k active latents.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..sweep.effects import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, bootstrap_weights


@dataclass
class FeatureArrays:
    """One SAE's archived arrays of a run, in memory: idx, val [sequence, step, k] and the tokens
    archived (steps < generated_len). With `prompt`: the prompt positions' arrays instead, idx, val
    [sequence, prompt_pos, k], and `generated_len` holds each sequence's prompt length (the positions
    archived), so every function below reads them the same way, a position where it says step."""

    idx: np.ndarray
    val: np.ndarray
    generated_len: np.ndarray
    prompt: bool = False

    @classmethod
    def read(cls, run, name: str, prompt: bool = False) -> FeatureArrays:
        from ...archive.feature_arrays import read_whole

        prefix = "prompt_" if prompt else ""
        lengths = run.prompt_len() if prompt else run.generated_len()
        return cls(
            read_whole(run.array(f"{prefix}feat_{name}_idx")),
            read_whole(run.array(f"{prefix}feat_{name}_val")),
            np.maximum(np.asarray(lengths, dtype=np.int64), 0),
            prompt,
        )

    @property
    def n_tokens(self) -> int:
        return int(self.generated_len.sum())


@dataclass(frozen=True)
class Occurrences:
    """Every archived activation of one latent over a run's tokens (or over the sequences asked for):
    sequence, step (a prompt position over the prompt arrays) and value of each, in (sequence, step)
    order, and the number of archived tokens they were found among."""

    sequence: np.ndarray
    step: np.ndarray
    value: np.ndarray
    n_tokens: int
    n_active: int  # tokens where the latent is among the archived top-k

    @property
    def density(self) -> float:
        return self.n_active / max(self.n_tokens, 1)

    def top(self, n: int) -> list[tuple[int, int, float]]:
        """(sequence, step, activation) of the `n` largest activations, largest first (ties: the
        smaller sequence, then step, first)."""
        order = np.lexsort((self.step, self.sequence, -self.value))[:n]
        return [(int(self.sequence[i]), int(self.step[i]), float(self.value[i])) for i in order]


def occurrences(run, name: str, feature: int, sequences: list[int] | None = None, prompt: bool = False) -> Occurrences:
    """Where latent `feature` of the run's SAE `name` is among a token's archived top-k, and its values
    there: what `lmtrace features --feature` and the views' feature pages answer from. The arrays are
    read shard file by shard file (`archive/feature_arrays.read_whole`): every token's ids (of
    `sequences` only, when given), and the values of only the sequences where `feature` occurs.
    `prompt`: over the prompt positions' arrays (`prompt_feat_*`)."""
    from ...archive.feature_arrays import read_whole

    prefix = "prompt_" if prompt else ""
    lengths = np.maximum(np.asarray(run.prompt_len() if prompt else run.generated_len(), dtype=np.int64), 0)
    chosen = None
    if sequences is not None:
        chosen = np.zeros(len(lengths), dtype=bool)
        chosen[np.asarray(sorted(set(sequences)), dtype=np.int64)] = True
    idx = read_whole(run.array(f"{prefix}feat_{name}_idx"), chosen)
    hits = idx == feature
    seq, step, k = np.nonzero(hits)
    has = np.zeros(idx.shape[0], dtype=bool)
    has[seq] = True
    val = read_whole(run.array(f"{prefix}feat_{name}_val"), has)
    return Occurrences(
        seq.astype(np.int64),
        step.astype(np.int64),
        val[seq, step, k],
        int(lengths.sum() if chosen is None else lengths[chosen].sum()),
        int(hits.any(-1).sum()),
    )


def window_bounds(n: int, position: int, window: int, after: int = 2) -> tuple[int, int]:
    """The positions [lo, hi) of `context`: `window` before `position` to `after` after it, within n tokens."""
    return max(0, position - window), min(n, position + after + 1)


def context(tokens: list[str], position: int, window: int, after: int = 2) -> str:
    """The tokens from `window` before `position` to `after` after it, the token at `position` in [[ ]]."""
    lo, hi = window_bounds(len(tokens), position, window, after)
    return "".join(f"[[{t}]]" if p == position else t for p, t in zip(range(lo, hi), tokens[lo:hi]))


def hook_label(entry: dict) -> str:
    """The hook point an SAE reads (`entry`: its manifest record, or a view's answer with the same
    keys), or a transcoder's two, "input → output" (it reads the MLP's input and writes its output)."""
    out = entry.get("hook_name_out")
    return f"{entry['hook_name']} → {out}" if out else entry["hook_name"]


def logit_effects_file(name: str) -> str:
    """Where a run keeps the logit effects `lmtrace features RUN --sae NAME --feature F` computed (relative
    to the run): analysis/feature_logit_effects_<name>.json, {sha256, features: {F: effects}}."""
    return f"analysis/feature_logit_effects_{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.json"


def store_logit_effects(run_path: Path, entry: dict, feature: int, effects: dict) -> None:
    """Keep one latent's logit effects (`commands/feature_find`'s answer) in the run, for the views that
    load no model (serve, report): merged into the SAE's file under the run's lock and recorded in the
    run's checksums (archive/recorded_files.py). A run directory that cannot be written, or whose file
    is damaged (left as it is, for `lmtrace verify`), keeps none."""
    from ...archive.recorded_files import update_recorded
    from ...exits.errors import ArchiveError

    def merged(data: bytes | None) -> str:
        kept = _parsed(data)
        if kept is None or kept.get("sha256") != entry["sha256"]:
            kept = {"sae": entry["name"], "sha256": entry["sha256"], "features": {}}
        kept["features"][str(feature)] = effects
        return json.dumps(kept, indent=2, default=str) + "\n"

    try:
        update_recorded(Path(run_path), logit_effects_file(entry["name"]), merged)
    except (OSError, ArchiveError):
        pass


def stored_logit_effects(run_path: Path, entry: dict, feature: int) -> dict | None:
    """The logit effects kept for `feature` of the SAE `entry` (manifest `features`), or None when
    none were computed for these weights. A file that fails its recorded checksum raises ArchiveDamaged
    naming it: damaged effects are never shown."""
    from ...archive.recorded_files import read_recorded

    kept = _parsed(read_recorded(Path(run_path), logit_effects_file(entry["name"])))
    if kept is None or kept.get("sha256") != entry["sha256"]:
        return None
    return (kept.get("features") or {}).get(str(feature))


def _parsed(data: bytes | None) -> dict | None:
    try:
        out = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def logit_effects_np(final, direction: np.ndarray, n: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """The decoder direction [d_model] through the final norm and unembedding, as SAELens's and
    Neuronpedia's logit tables compute it with the norm folded in: centred (a LayerNorm's mean
    subtraction), times the norm's gain, through any linear map after the norm (OPT's project_out),
    times the unembedding; the norm's 1/σ (one scale for every token) and the biases left out.
    `final`: `unembedding.FinalUnembedding`'s float32 arrays (numpy, no torch: `lmtrace features
    --feature` answers without importing it). Returns the n most promoted and the n most suppressed
    (token id, effect), largest |effect| first, ties in the order of the token ids."""
    v = np.asarray(direction, dtype=np.float32)
    if final.kind == "layer":
        v = v - v.mean(dtype=np.float32)
    if final.gain is not None:
        v = v * final.gain
    for params in final.linear_params:
        v = params["weight"] @ v
    effects = final.unembed @ v  # [vocab]
    n = min(n, effects.size)
    up = np.argsort(-effects, kind="stable")[:n]
    down = np.argsort(effects, kind="stable")[:n]
    return ([(int(i), float(effects[i])) for i in up], [(int(i), float(effects[i])) for i in down])


def by_groups(
    arrays: FeatureArrays,
    d_sae: int,
    groups: dict,
    top: int,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[list, list[dict]]:
    """The `top` latents whose mean activation per token differs most between groups (largest group
    mean − smallest). groups: sequence -> group value (None: no value). Returns (group values in the
    order of the lists, rows): each row {feature, spread, groups: [{mean, low, high, n_sequences,
    n_tokens}]}, the interval the 2.5th and 97.5th percentiles of the mean over `resamples` resamples of
    the group's sequences with replacement (each resample's mean over every token of the sequences drawn)."""
    from ...archive.groups import group_order

    n_seq = arrays.idx.shape[0]
    values = sorted(dict.fromkeys(groups.get(s) for s in range(n_seq)), key=group_order)
    code = np.asarray([values.index(groups.get(s)) for s in range(n_seq)])
    # per sequence: the sum of each latent's activation over its tokens, sparse (sequence, latent) pairs
    active = arrays.idx >= 0
    seq = np.broadcast_to(np.arange(n_seq)[:, None, None], arrays.idx.shape)[active]
    feat, val = arrays.idx[active].astype(np.int64), arrays.val[active].astype(np.float64)
    sums = np.zeros((len(values), d_sae))
    np.add.at(sums, (code[seq], feat), val)
    tokens = np.bincount(code, weights=arrays.generated_len, minlength=len(values))
    means = sums / np.maximum(tokens, 1)[:, None]
    spread = means.max(0) - means.min(0)
    chosen = np.argsort(-spread, kind="stable")[:top]
    # the chosen latents' per-sequence sums [n_seq, top], for the bootstrap
    per_seq = np.zeros((n_seq, len(chosen)))
    col = {int(f): j for j, f in enumerate(chosen)}
    keep = np.isin(feat, chosen)
    np.add.at(per_seq, (seq[keep], np.asarray([col[int(f)] for f in feat[keep]], dtype=np.int64)), val[keep])
    stats = []
    for g in range(len(values)):
        seqs = np.flatnonzero(code == g)
        w = bootstrap_weights(len(seqs), resamples, seed)  # [B, n]
        with np.errstate(invalid="ignore", divide="ignore"):
            boot = (w @ per_seq[seqs]) / (w @ arrays.generated_len[seqs])[:, None]  # [B, top]
        low, high = np.nanpercentile(boot, [2.5, 97.5], axis=0)
        stats.append((low, high, len(seqs), int(tokens[g])))
    rows = [
        {
            "feature": int(f),
            "spread": float(spread[f]),
            "groups": [
                {
                    "mean": float(means[g, f]),
                    "low": float(stats[g][0][j]),
                    "high": float(stats[g][1][j]),
                    "n_sequences": stats[g][2],
                    "n_tokens": stats[g][3],
                }
                for g in range(len(values))
            ],
        }
        for j, f in enumerate(chosen)
    ]
    return values, rows
