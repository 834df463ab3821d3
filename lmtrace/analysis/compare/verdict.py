"""The verdict of a comparison: one line saying what differs between two runs (divergences,
different prompts, distribution changes beyond float noise, unpaired sequences), and whether
nothing does."""

from __future__ import annotations

from .step_rows import is_paired

FLOAT_NOISE_KL = (
    1e-6  # nats: paired distributions closer than this (both KL directions) are "the same up to float noise"
)


def verdict_line(pairing, pairs, step_rows, first_changed) -> tuple[bool, str]:
    """One line: what differs, for every kind of pair (same prompt or not), and whether the paired next-token
    distributions differ beyond float noise (judged on the stored top-k without the chosen tokens' own entries)."""
    n = len(pairs)
    same_ctx = [p for p in pairs if p["same_prompt_ids"]]
    other_ctx = [p for p in pairs if not p["same_prompt_ids"]]
    diverged = [p for p in same_ctx if p["first_divergence"] is not None]
    paired = [r for r in step_rows if is_paired(r)]
    figures_zero = all(r["same_stored"] for r in paired)  # same stored top-k logprobs, entropy and margin
    kl = [r["kl_stored_max"] for r in paired]
    known = [x for x in kl if x is not None]
    max_kl = max(known, default=0.0)
    noise_only = (
        not figures_zero and len(known) == len(kl) and max_kl < FLOAT_NOISE_KL and all(r["top1_agree"] for r in paired)
    )
    same_lengths = all(p["generated_len_a"] == p["generated_len_b"] for p in pairs)
    unpaired = len(pairing["unpaired_a"]) + len(pairing["unpaired_b"])
    identical = (
        n > 0
        and not other_ctx
        and not diverged
        and figures_zero
        and first_changed is None
        and same_lengths
        and not unpaired
    )
    if identical:
        return True, (
            f"no difference: all {n} paired sequence(s) generated the same tokens and every compared figure is equal"
        )
    parts = []
    if n == 0:
        parts.append("no sequences could be paired")
    if same_ctx:
        parts.append(_same_prompt_part(same_ctx, other_ctx, diverged))
    if other_ctx:
        parts.append(_other_prompt_part(other_ctx))
    if paired:
        part = _distribution_part(first_changed, noise_only, figures_zero, diverged, max_kl)
        if part is not None:
            parts.append(part)
    if unpaired:
        parts.append(f"{unpaired} sequence(s) unpaired")
    return False, "; ".join(parts)


def _clip(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _same_prompt_part(same_ctx, other_ctx, diverged) -> str:
    """The verdict's part on the pairs with the same prompt ids: how many diverge, and the earliest."""
    what = "pair(s)" if not other_ctx else "pair(s) with the same prompt"
    if diverged:
        first = min(diverged, key=lambda p: p["first_divergence"]["step"])
        return (
            f"{len(diverged)} of {len(same_ctx)} {what} diverge (earliest: pair {first['pair']} at step "
            f"{first['first_divergence']['step']})"
        )
    return f"all {len(same_ctx)} {what} generated the same tokens"


def _other_prompt_part(other_ctx) -> str:
    """The verdict's part on the pairs with different prompt ids: whether they generated the same text."""
    differ = [p for p in other_ctx if not p["same_text"]]
    line = f"{len(other_ctx)} pair(s) have different prompt tokens"
    if differ:
        p = differ[0]
        line += (
            f", {len(differ)} of them generated different text (pair {p['pair']}: "
            f"{_clip(p['text']['a'])!r} vs {_clip(p['text']['b'])!r})"
        )
    else:
        line += ", all of them generated the same text"
    return line


def _distribution_part(first_changed, noise_only, figures_zero, diverged, max_kl) -> str | None:
    """The verdict's part on the paired steps' figures (first changed layer, next-token distributions), or None
    when there is nothing to say."""
    if first_changed is not None:
        return f"internal figures change from layer {first_changed} on" + (
            f" (output distributions equal up to float noise: KL < {FLOAT_NOISE_KL:g})"
            if noise_only or figures_zero
            else ""
        )
    if noise_only:
        return (
            f"same next-token distributions up to float noise (max KL over the stored top-k "
            f"{max_kl:.1e} < {FLOAT_NOISE_KL:g} nats)"
        )
    if figures_zero and diverged:
        return (
            "the stored next-token distributions are identical at every paired step: the tokens differ "
            "by sampling, not by the model"
        )
    if not figures_zero:
        return f"next-token distributions differ (max KL over the stored top-k {max_kl:.3g} nats, a lower bound)"
    return None
