"""`compare` of two runs in `lmtrace serve`: `analysis.compare.compare_runs` on the two archives
(never `--exact`, which would load models), its verdict, notes and per-pair summaries (first
divergence, the paired texts), its layer and head rankings, as `lmtrace compare --json` has them;
and per pair, the per-layer and per-head figures over its paired steps (the rows of the
`per_layer.parquet` and `per_head.parquet` that `lmtrace compare --out` writes), as step-by-layer
and step-by-head matrices for the page's heatmaps. An intervention child's sequence page asks for
its pair with its parent."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..analysis.compare import Comparison, compare_runs
from ..archive.reader import Run
from ..output.jsonout import strict
from .errors import NotFound

PAIRS_SHOWN = 200  # pairs sent at most; the total is in `n_pairs`
KEPT = 4  # comparisons of complete runs kept (each holds its per-step, per-layer and per-head tables)
# per_layer.parquet's columns the page draws as layer × step heatmaps, and what each is
LAYER_FIGURES = {
    "attn_js_mean": "attention JS between the sides' rows, mean over heads (nats)",
    "delta_norm_delta": "norm of the layer's own output, B − A",
    "resid_norm_rel_delta": "residual norm after the layer, (B − A) / A",
    "resid_dist": "L2 distance of the residual vectors",
    "lens_changed": "logit lens top-1 differs (1) or not (0)",
    "lens_top1_prob_delta": "logit lens top-1 probability, B − A",
    "margin_contrib_delta": "direct logit attribution to the margin (DLA), B − A, where both sides' final "
    "top-2 are the same tokens",
}

_kept: OrderedDict[tuple, tuple[Run, Run, Comparison]] = OrderedDict()
_lock = threading.Lock()


def compared(run_a: Run, run_b: Run) -> Comparison:
    """compare_runs(A, B) from the archives, kept for complete runs (a new manifest opens a new Run)."""
    key = (id(run_a), id(run_b))
    with _lock:
        found = _kept.get(key)
        if found is not None and found[0] is run_a and found[1] is run_b:
            _kept.move_to_end(key)
            return found[2]
    result = compare_runs(run_a, run_b, allow_incomplete=True)
    if run_a.status == "complete" and run_b.status == "complete":
        with _lock:
            _kept[key] = (run_a, run_b, result)
            while len(_kept) > KEPT:
                _kept.popitem(last=False)
    return result


def comparison(run_a: Run, run_b: Run) -> dict:
    """The comparison of A and B, read from their archives (a running run: its committed steps)."""
    s = compared(run_a, run_b).summary(include_steps=False)
    keep = ("a", "b", "identical", "verdict", "notes", "spec_differences", "first_changed_layer", "layers", "heads")
    out = {k: s[k] for k in keep}
    for side in ("a", "b"):  # the runs by name: where they are on disk is not the page's business
        out[side] = _without_paths(out[side])
    out["pairing"] = {k: v for k, v in s["pairing"].items() if k != "pairs"}
    out["n_pairs"] = len(s["pairs"])
    out["pairs"] = s["pairs"][:PAIRS_SHOWN]
    out["compatibility"] = {k: v for k, v in s["compatibility"].items() if k in ("notes", "common_layers")}
    out["figures"] = LAYER_FIGURES
    return out


def _rows_of(table: pa.Table, pair: int) -> dict[str, np.ndarray]:
    t = table.filter(pc.equal(table.column("pair"), pair))
    return {name: t.column(name).cast(pa.float64()).to_numpy(zero_copy_only=False) for name in t.column_names}


def _matrix(rows: dict, name: str, index: tuple[str, ...], shape: tuple[int, ...], where=None) -> list:
    """rows[name] placed at rows[index...] in an array of `shape` (NaN elsewhere), as nested lists (null for NaN)."""
    out = np.full(shape, np.nan)
    if name in rows and len(rows[name]):
        keep = np.ones(len(rows[name]), bool) if where is None else where
        at = tuple(rows[i][keep].astype(int) for i in index)
        out[at] = rows[name][keep]
    return strict(out)


def pair_figures(run_a: Run, run_b: Run, pair: int) -> dict:
    """Pair `pair`'s per-layer figures as {figure: [layer][step]}, its per-head attention JS and head DLA
    delta (B − A, at steps where both sides' final top-2 are the same tokens; null without head DLA on both
    sides) as [layer][head][step] over its paired steps, with its first divergence and both runs' sequences."""
    cmp = compared(run_a, run_b)
    summary = next((p for p in cmp.pairs if p["pair"] == pair), None)
    if summary is None:
        raise NotFound(f"compare {run_a.id} {run_b.id} has pairs 0-{len(cmp.pairs) - 1}, not {pair}")
    return _figures(cmp, summary, run_a, run_b)


def _figures(cmp: Comparison, summary: dict, run_a: Run, run_b: Run) -> dict:
    pair = summary["pair"]
    rows = _rows_of(cmp.per_layer, pair)
    heads = _rows_of(cmp.per_head, pair)
    layers = sorted({int(x) for x in cmp.per_layer.column("layer").to_pylist()}) or list(run_a.layers)
    n = int(summary.get("paired_steps") or 0)
    if len(rows.get("step", [])):
        n = max(n, int(rows["step"].max()) + 1)
    li = {x: i for i, x in enumerate(layers)}
    if len(rows.get("layer", [])):
        rows["li"] = np.asarray([li[int(x)] for x in rows["layer"]], dtype=np.float64)
    figures = {}
    for name in LAYER_FIGURES:
        where = rows["same_final_top2"] == 1 if name == "margin_contrib_delta" and "same_final_top2" in rows else None
        figures[name] = _matrix(rows, name, ("li", "step"), (len(layers), n), where)
    head_js = head_dla = None
    if len(heads.get("step", [])):
        H = int(heads["q_head"].max()) + 1
        heads["li"] = np.asarray([li[int(x)] for x in heads["layer"]], dtype=np.float64)
        if np.isfinite(heads["attn_js"]).any():
            head_js = _matrix(heads, "attn_js", ("li", "q_head", "step"), (len(layers), H, n))
        if np.isfinite(heads["head_dla_delta"]).any():  # both runs captured head DLA
            same = {int(s) for s, ok in zip(rows.get("step", []), rows.get("same_final_top2", [])) if ok == 1}
            where = np.asarray([int(s) in same for s in heads["step"]], dtype=bool)
            head_dla = _matrix(heads, "head_dla_delta", ("li", "q_head", "step"), (len(layers), H, n), where)
    fd = summary.get("first_divergence")
    return {
        "a": run_a.id,
        "b": run_b.id,
        "pair": pair,
        "seq_a": summary["seq_a"],
        "seq_b": summary["seq_b"],
        "steps": n,
        "layers": layers,
        "figures": figures,
        "meaning": LAYER_FIGURES,
        "has": {k: any(v is not None for row in m for v in row) for k, m in figures.items()},
        "head_js": head_js,
        "head_dla_delta": head_dla,
        "first_divergence": strict(fd),
    }


def child_figures(parent: Run, child: Run, seq: int) -> dict:
    """An intervention child's sequence `seq` against the same sequence of its parent: the figures of the
    pair (parent as A, child as B) that holds it."""
    cmp = compared(parent, child)
    summary = next((p for p in cmp.pairs if p["seq_a"] == seq and p["seq_b"] == seq), None)
    if summary is None:
        raise NotFound(f"sequence {seq} of run {child.id} has no pair with its parent {parent.id}")
    return _figures(cmp, summary, parent, child)


def _without_paths(d):
    """A run's summary without its `path` entries (the run's own, its parent's)."""
    if isinstance(d, dict):
        return {k: _without_paths(v) for k, v in d.items() if k != "path"}
    return d
