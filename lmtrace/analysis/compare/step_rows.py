"""The per-step rows of one sequence pair: each side's chosen token and stored figures at every
step, and, where both sides took the step from an identical context (up to and including the first
divergence), the paired figures: each token's logprob under the other side, deltas, top-k KL/JS.

Definitions are in docs/compare.md; the row schema is `STEP_FIELDS`."""

from __future__ import annotations

import pyarrow as pa

from .divergence import stored_logprobs, topk_divergence
from .values import finite

STEP_FIELDS = [
    ("pair", pa.int32()),
    ("seq_a", pa.int32()),
    ("seq_b", pa.int32()),
    ("step", pa.int32()),
    ("phase", pa.string()),
    ("context_identical", pa.bool_()),
    ("token_a", pa.int32()),
    ("token_b", pa.int32()),
    ("text_a", pa.string()),
    ("text_b", pa.string()),
    ("logprob_a", pa.float64()),
    ("logprob_b", pa.float64()),
    ("logprob_a_under_b", pa.float64()),
    ("logprob_b_under_a", pa.float64()),
    ("sampling_logprob_a", pa.float64()),
    ("sampling_logprob_b", pa.float64()),
    ("entropy_a", pa.float64()),
    ("entropy_b", pa.float64()),
    ("entropy_delta", pa.float64()),
    ("margin_a", pa.float64()),
    ("margin_b", pa.float64()),
    ("margin_delta", pa.float64()),
    ("top1_a", pa.int32()),
    ("top1_b", pa.int32()),
    ("top1_agree", pa.bool_()),
    ("same_stored", pa.bool_()),
    ("kl_ab", pa.float64()),
    ("kl_ba", pa.float64()),
    ("js", pa.float64()),
    ("tail_a", pa.float64()),
    ("tail_b", pa.float64()),
    ("n_common", pa.int32()),
    ("kl_stored_max", pa.float64()),
    # --exact only (null otherwise): full-vocabulary figures from the two models rescoring the shared context
    ("exact_kl_ab", pa.float64()),
    ("exact_kl_ba", pa.float64()),
    ("exact_js", pa.float64()),
    ("exact_max_abs_logit_diff", pa.float64()),
    ("exact_chosen_logit_diff", pa.float64()),
]
EXACT_FIELDS = ("exact_kl_ab", "exact_kl_ba", "exact_js", "exact_max_abs_logit_diff", "exact_chosen_logit_diff")
PAIRED_STEP_FIGURES = (
    "logprob_a_under_b",
    "logprob_b_under_a",
    "entropy_delta",
    "margin_delta",
    "top1_agree",
    "same_stored",
    "kl_ab",
    "kl_ba",
    "js",
    "tail_a",
    "tail_b",
    "n_common",
    "kl_stored_max",
)


def stored_alternatives(g: dict, s: int) -> dict[int, float]:
    """Token id -> logprob of the top-k alternatives stored at step s, without the chosen token's own entry."""
    return {int(i): float(v) for i, v in zip(g["alt_ids"][s], g["alt_logprobs"][s]) if int(i) >= 0}


def known_logprobs(g: dict, s: int) -> dict[int, float]:
    """Token id -> logprob stored at step s: the top-k alternatives and the chosen token."""
    return stored_logprobs(g["alt_ids"][s], g["alt_logprobs"][s], g["token_id"][s], g["logprob"][s])


def is_paired(row: dict) -> bool:
    """Both sides took this step from the same context: the paired figures exist."""
    return bool(row["context_identical"]) and row["token_a"] is not None and row["token_b"] is not None


def pair_step_rows(
    k: int,
    sa: int,
    sb: int,
    ga: dict | None,
    gb: dict | None,
    na: int,
    nb: int,
    same_prompt: bool,
    first: int | None,
    kind: str | None,
) -> list[dict]:
    """Rows (schema `STEP_FIELDS`) of pair k over steps 0..max(na, nb)-1; `ga`/`gb` are the sides'
    per-sequence columns (`Side.gen`), `first` the first divergence step (None: none), exact_* left null."""
    rows = []
    for s in range(max(na, nb)):
        ha, hb = s < na, s < nb
        ctx = same_prompt and (first is None or s <= first) and ((ha and hb) or s == first)
        if not same_prompt:
            phase = "different_prompt"
        elif first is None and not (ha and hb):
            phase = "one_side_only"  # the other archive is incomplete: this step is not (yet) on its side
        elif first is None or s < first:
            phase = "shared"
        elif s == first:
            phase = "divergence"
        else:
            phase = "after_divergence"
        row = {"pair": k, "seq_a": sa, "seq_b": sb, "step": s, "phase": phase, "context_identical": ctx}
        for tag, g, h in (("a", ga, ha), ("b", gb, hb)):
            row[f"token_{tag}"] = int(g["token_id"][s]) if h else None
            row[f"text_{tag}"] = g["token_text"][s] if h else None
            row[f"logprob_{tag}"] = finite(g["logprob"][s]) if h else None
            row[f"sampling_logprob_{tag}"] = finite(g["sampling_logprob"][s]) if h else None
            row[f"entropy_{tag}"] = finite(g["entropy"][s]) if h else None
            row[f"margin_{tag}"] = finite(g["margin"][s]) if h else None
            row[f"top1_{tag}"] = int(g["greedy_id"][s]) if h else None
        if ctx and ha and hb:
            ka, kb = known_logprobs(ga, s), known_logprobs(gb, s)
            row["logprob_a_under_b"] = kb.get(row["token_a"])
            row["logprob_b_under_a"] = ka.get(row["token_b"])
            row["entropy_delta"] = row["entropy_b"] - row["entropy_a"]
            row["margin_delta"] = row["margin_b"] - row["margin_a"]
            row["top1_agree"] = row["top1_a"] == row["top1_b"]
            # judged without the chosen tokens' own entries: a sampled token outside the top-k is not a model difference
            sa_, sb_ = stored_alternatives(ga, s), stored_alternatives(gb, s)
            row["same_stored"] = (
                sa_ == sb_ and row["entropy_a"] == row["entropy_b"] and row["margin_a"] == row["margin_b"]
            )
            row.update({key: (finite(v) if isinstance(v, float) else v) for key, v in topk_divergence(ka, kb).items()})
            stored = topk_divergence(sa_, sb_)
            row["kl_stored_max"] = None if stored["kl_ab"] is None else finite(max(stored["kl_ab"], stored["kl_ba"]))
        else:
            row.update({key: None for key in PAIRED_STEP_FIGURES})
        row.update({key: None for key in EXACT_FIELDS})
        rows.append(row)
    return rows


def step0_logit_diff(ga: dict, gb: dict) -> dict | None:
    """logit(A's step-0 token) − logit(B's step-0 token) in each run's own step-0 distribution.

    The quantity activation patching normalises by (clean vs corrupted prompt: the clean answer's
    logit minus the corrupted answer's). Within one distribution a logit difference equals the
    logprob difference, so it is read from the stored top-k; null on a side whose stored top-k
    lacks one of the two tokens. None when both runs chose the same token (the difference is 0)."""
    x, y = int(ga["token_id"][0]), int(gb["token_id"][0])
    if x == y:
        return None
    known_a, known_b = known_logprobs(ga, 0), known_logprobs(gb, 0)

    def diff(known: dict[int, float]) -> float | None:
        return finite(known[x] - known[y]) if x in known and y in known else None

    return {
        "token_a": x,
        "text_a": ga["token_text"][0],
        "token_b": y,
        "text_b": gb["token_text"][0],
        "under_a": diff(known_a),
        "under_b": diff(known_b),
    }
