"""`compare` of two runs in `lmtrace serve`: `analysis.compare.compare_runs` on the two archives
(never `--exact`, which would load models), its verdict, notes and per-pair summaries (first
divergence, the paired texts), as `lmtrace compare --json` has them."""

from __future__ import annotations

from ..analysis.compare import compare_runs
from ..archive.reader import Run

PAIRS_SHOWN = 200  # pairs sent at most; the total is in `n_pairs`


def comparison(run_a: Run, run_b: Run) -> dict:
    """The comparison of A and B, read from their archives (a running run: its committed steps)."""
    result = compare_runs(run_a, run_b, allow_incomplete=True)
    s = result.summary(include_steps=False)
    keep = ("a", "b", "identical", "verdict", "notes", "spec_differences", "first_changed_layer", "layers", "heads")
    out = {k: s[k] for k in keep}
    for side in ("a", "b"):  # the runs by name: where they are on disk is not the page's business
        out[side] = _without_paths(out[side])
    out["pairing"] = {k: v for k, v in s["pairing"].items() if k != "pairs"}
    out["n_pairs"] = len(s["pairs"])
    out["pairs"] = s["pairs"][:PAIRS_SHOWN]
    out["compatibility"] = {k: v for k, v in s["compatibility"].items() if k in ("notes", "common_layers")}
    return out


def _without_paths(d):
    """A run's summary without its `path` entries (the run's own, its parent's)."""
    if isinstance(d, dict):
        return {k: _without_paths(v) for k, v in d.items() if k != "path"}
    return d
