"""Two runs compared from their archives: what differs, step by step, layer by layer, head by head.

    engine          compare_runs: two runs -> a Comparison (pairs, divergences, tables, rankings, verdict)
    sides           one side: a run's prompt ids and committed steps, per sequence
    pairing         compatibility of two runs, spec differences, which sequences pair
    step_rows       the per-step rows of a pair (paired figures where the contexts are identical)
    divergence      KL/JS over stored top-k distributions and attention rows; `stored_kl`, the top-k KL that
                    compare and intervene both report
    layer_figures   the per-layer and per-head figures of a pair over its paired steps
    pair_summary    one pair summarised: divergence and why, texts, means of the paired figures
    ranking         the layers and heads that changed most
    verdict         the one-line verdict
    result          the Comparison: its JSON form and its tables
    values          finite-or-null floats, means that skip missing values, strict-JSON values

Exact full-vocabulary figures (`--exact`) are `lmtrace.analysis.compare.exact`.
"""

from .divergence import stored_kl, stored_logprobs
from .engine import compare_runs
from .result import DEFINITIONS, Comparison

__all__ = ["Comparison", "DEFINITIONS", "compare_runs", "stored_kl", "stored_logprobs"]
