"""The summary of one sequence pair: its first divergence and why it happened, the texts split at
the divergence, the means of the paired figures, per-side means after the divergence (not paired),
and, for different prompts, step 0 side by side."""

from __future__ import annotations

import numpy as np

from .divergence import topk_divergence
from .sides import Side
from .step_rows import is_paired, known_logprobs, step0_logit_diff
from .values import finite, mean_of


def summarise_pair(
    k: int,
    A: Side,
    B: Side,
    sa: int,
    sb: int,
    matched_by: str,
    rows: list[dict],
    first: int | None,
    kind: str | None,
    n_paired: int,
    same_prompt: bool,
    note: str | None,
) -> dict:
    """Pair k (A's sequence sa, B's sb) from its step rows; `first`/`kind` its first divergence, `n_paired` its
    paired steps, `note` why it has none or fewer than expected."""
    ga, gb = A.gen.get(sa), B.gen.get(sb)
    na, nb = A.n_steps(sa), B.n_steps(sb)
    paired = [r for r in rows if is_paired(r)]
    div = None if first is None else _divergence(rows[first], first, kind, A, B, sa, sb, na < nb)
    text_a = list(ga["token_text"]) if ga is not None else []
    text_b = list(gb["token_text"]) if gb is not None else []
    cut = 0 if not same_prompt else (first if first is not None else min(len(text_a), len(text_b)))
    after = _after(rows, 0 if not same_prompt else first + 1) if first is not None or not same_prompt else None
    figures = _paired_figures(paired) if paired else None
    # different contexts: step 0 side by side, labelled as not paired
    first_step = _step0(ga, gb) if not same_prompt and na and nb else None
    return {
        "pair": k,
        "seq_a": sa,
        "seq_b": sb,
        "matched_by": matched_by,
        "prompt": A.prompt_text[sa],
        "prompt_b": B.prompt_text[sb],
        "same_prompt_ids": same_prompt,
        "first_step": first_step,
        "step0_logit_diff": step0_logit_diff(ga, gb) if na and nb else None,
        "same_text": text_a == text_b,
        "generated_len_a": na,
        "generated_len_b": nb,
        "stop_reason_a": A.stop_reason(sa),
        "stop_reason_b": B.stop_reason(sb),
        "paired_steps": n_paired,
        "first_divergence": div,
        "note": note,
        "text": {"common": "".join(text_a[:cut]), "a": "".join(text_a[cut:]), "b": "".join(text_b[cut:])},
        "paired_figures": figures,
        "after_divergence": after,
    }


def _divergence(r: dict, first: int, kind: str | None, A: Side, B: Side, sa: int, sb: int, a_shorter: bool) -> dict:
    """The first divergence (step `first`, its row r) and why it happened."""
    div = {
        "step": first,
        "kind": kind,
        "token_a": None
        if r["token_a"] is None
        else {
            "id": r["token_a"],
            "text": r["text_a"],
            "logprob_under_a": r["logprob_a"],
            "logprob_under_b": r["logprob_a_under_b"],
        },
        "token_b": None
        if r["token_b"] is None
        else {
            "id": r["token_b"],
            "text": r["text_b"],
            "logprob_under_b": r["logprob_b"],
            "logprob_under_a": r["logprob_b_under_a"],
        },
        "kl_ab": r["kl_ab"],
        "js": r["js"],
        "top1_a": r["top1_a"],
        "top1_b": r["top1_b"],
    }
    if kind == "length":
        ended = "A" if a_shorter else "B"
        div["explanation"] = (
            f"identical for the {first} steps both generated; {ended} stopped "
            f"({(A if ended == 'A' else B).stop_reason(sa if ended == 'A' else sb)}), "
            f"the other continued"
        )
    elif r["same_stored"]:
        div["explanation"] = (
            "same stored distribution on both sides at this step: the choice differs by "
            "sampling (seed, temperature, top-k/top-p), not by the model"
        )
    elif r["top1_a"] != r["top1_b"]:
        div["explanation"] = "the two models' top-1 tokens differ at this step"
    else:
        div["explanation"] = "the distributions differ but agree on the top-1: sampling picked differently"
    return div


def _after(rows: list[dict], start: int) -> dict:
    """Each side's means over its own steps from `start` (after the divergence; not paired)."""
    ra = [r for r in rows[start:] if r["token_a"] is not None]
    rb = [r for r in rows[start:] if r["token_b"] is not None]
    return {
        "paired": False,
        "from_step": start,
        "steps_a": len(ra),
        "steps_b": len(rb),
        "mean_logprob_a": mean_of(r["logprob_a"] for r in ra),
        "mean_logprob_b": mean_of(r["logprob_b"] for r in rb),
        "mean_entropy_a": mean_of(r["entropy_a"] for r in ra),
        "mean_entropy_b": mean_of(r["entropy_b"] for r in rb),
        "mean_margin_a": mean_of(r["margin_a"] for r in ra),
        "mean_margin_b": mean_of(r["margin_b"] for r in rb),
    }


def _paired_figures(paired: list[dict]) -> dict:
    """The means of the paired steps' figures (and the full-vocabulary ones under --exact)."""
    js = [-1.0 if r["js"] is None else r["js"] for r in paired]
    imax = int(np.argmax(js))
    # B − A for each side's own token: how much more (or less) likely B finds it than A does
    shift_a = [r["logprob_a_under_b"] - r["logprob_a"] for r in paired if r["logprob_a_under_b"] is not None]
    shift_b = [r["logprob_b"] - r["logprob_b_under_a"] for r in paired if r["logprob_b_under_a"] is not None]
    figures = {
        "steps": len(paired),
        "mean_kl_ab": mean_of(r["kl_ab"] for r in paired),
        "mean_kl_ba": mean_of(r["kl_ba"] for r in paired),
        "mean_js": mean_of(r["js"] for r in paired),
        "max_js": paired[imax]["js"],
        "max_js_step": paired[imax]["step"] if paired[imax]["js"] is not None else None,
        "steps_without_common_tokens": sum(r["n_common"] == 0 for r in paired),
        "top1_agreement": sum(bool(r["top1_agree"]) for r in paired) / len(paired),
        "mean_entropy_delta": mean_of(r["entropy_delta"] for r in paired),
        "mean_margin_delta": mean_of(r["margin_delta"] for r in paired),
        "mean_logprob_shift_a": mean_of(shift_a),
        "mean_logprob_shift_b": mean_of(shift_b),
        "logprob_a_under_b_missing": sum(r["logprob_a_under_b"] is None for r in paired),
        "logprob_b_under_a_missing": sum(r["logprob_b_under_a"] is None for r in paired),
        "mean_tail_a": mean_of(r["tail_a"] for r in paired),
        "mean_tail_b": mean_of(r["tail_b"] for r in paired),
    }
    if any(r.get("exact_kl_ab") is not None for r in paired):  # --exact: full-vocabulary figures
        ex_rows = [r for r in paired if r.get("exact_js") is not None]
        jmax = max(ex_rows, key=lambda r: r["exact_js"])
        figures.update(
            {
                "exact_steps": len(ex_rows),
                "mean_exact_kl_ab": mean_of(r["exact_kl_ab"] for r in ex_rows),
                "mean_exact_kl_ba": mean_of(r["exact_kl_ba"] for r in ex_rows),
                "mean_exact_js": mean_of(r["exact_js"] for r in ex_rows),
                "max_exact_js": jmax["exact_js"],
                "max_exact_js_step": jmax["step"],
            }
        )
    return figures


def _step0(ga, gb) -> dict:
    """Step 0 of two different contexts side by side (not paired)."""
    d = topk_divergence(known_logprobs(ga, 0), known_logprobs(gb, 0))
    return {
        "paired": False,
        "token_a": int(ga["token_id"][0]),
        "text_a": ga["token_text"][0],
        "token_b": int(gb["token_id"][0]),
        "text_b": gb["token_text"][0],
        "top1_a": int(ga["greedy_id"][0]),
        "top1_b": int(gb["greedy_id"][0]),
        "logprob_a": finite(ga["logprob"][0]),
        "logprob_b": finite(gb["logprob"][0]),
        "entropy_a": finite(ga["entropy"][0]),
        "entropy_b": finite(gb["entropy"][0]),
        "kl_ab": finite(d["kl_ab"]),
        "kl_ba": finite(d["kl_ba"]),
        "js": finite(d["js"]),
        "n_common": d["n_common"],
    }
