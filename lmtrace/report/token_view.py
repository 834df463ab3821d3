"""The report's token view: `lmtrace serve`'s token view (serve/static/tokenview.js) drawn from data
the page inlines instead of fetched from a server.

What is inlined is the answer serve's routes give, computed by the same functions
(`serve.queries.sequence_tokens`, `serve.token_extras.selected_token`, `serve.token_extras.head_pattern`),
keyed by the route's path under /api/runs/RUN/, attention weights rounded to `WEIGHT_DECIMALS`
decimals and other floats to `DIGITS` significant digits: per shown sequence its token strip, the selected-token answer of each step shown (at most
`MAX_VIEW_STEPS`, a regular stride past that, always with the initial step), and the pattern over
steps of every head of the selected layers (`--layer`), from which a head's row at a step is read.
"""

from __future__ import annotations

import json
import math

from ..serve.queries import sequence_tokens, steps_ready
from ..serve.token_extras import head_pattern, selected_token
from .run_data import RunData
from .sections import Section
from .selection import Selection, thin

MAX_VIEW_STEPS = 128  # selected-token answers inlined per sequence (each ~20-60 kB for a 30-layer model)
DIGITS = 4  # significant digits of an inlined float (logits, probabilities, scores)
WEIGHT_DECIMALS = 4  # decimals of an inlined attention weight (the view shows at most 4)
DATA_ID = "lmtrace-tokenview"


def rounded(x, digits: int = DIGITS, decimals: int | None = None):
    """`x` (a JSON-ready tree) with every float rounded to `digits` significant digits, and to
    `decimals` decimal places when given (attention weights: a weight under 0.00005 is written 0)."""
    if isinstance(x, float):
        if not math.isfinite(x):
            return x
        return round(x, decimals) if decimals is not None else float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: rounded(v, digits, decimals) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v, digits, decimals) for v in x]
    return x


def step_answer(run, seq: int, step: int) -> dict:
    """serve's selected-token answer, rounded: attention weights (in [0, 1]) to `WEIGHT_DECIMALS`
    decimals, every other float to `DIGITS` significant digits."""
    answer = selected_token(run, seq, step)
    return {k: rounded(v, decimals=WEIGHT_DECIMALS) if k in ("attention", "over_heads") else rounded(v)
            for k, v in answer.items()}


def view_steps(steps: list[int], initial: int, limit: int = MAX_VIEW_STEPS) -> list[int]:
    """The steps whose selected-token answer is inlined: `steps`, thinned to `limit`, and `initial`."""
    return sorted(set(thin(steps, limit)) | {initial})


def token_view_section(data: RunData, sel: Selection) -> Section:
    sec = Section("tokens", "Token view")
    run = data.run
    answers: dict[str, dict] = {}
    parts = ["<p class='legend'>Click a generated token (or use ← → in a strip) for what the model did at that "
             "step: the layer × head attention grid (click a cell for that head's row and its pattern over "
             "the steps), the mean / max over heads, the alternatives, the logit-lens column, and per-head "
             "direct logit attribution and attributions where the run has them. The same view as "
             "<code>lmtrace serve</code>, from the numbers this page embeds.</p>"]
    for seq in sel.sequences:
        ready = steps_ready(run, seq)
        shown = [s for s in sel.steps[seq] if s < ready]
        if not shown:
            continue
        initial = min(sel.attention_step.get(seq, shown[-1]), ready - 1)
        steps = view_steps(shown, initial)
        if len(steps) < len(shown):
            sec.notes.append(f"sequence {seq}: the token view embeds {len(steps)} of the {len(shown)} steps shown "
                             f"(every {-(-len(shown) // MAX_VIEW_STEPS)}th); narrow --steps for every step, or "
                             f"`lmtrace serve` for all of them")
        answers[f"sequences/{seq}"] = sequence_tokens(run, seq)
        for s in steps:
            answers[f"sequences/{seq}/steps/{s}"] = step_answer(run, seq, s)
        if {"attn", "attn_topk_idx"} & data.arrays:
            for layer in sel.layers:
                for head in range(data.n_heads):
                    answers[f"sequences/{seq}/attention/{layer}/{head}"] = rounded(head_pattern(run, seq, layer, head),
                                                                                        decimals=WEIGHT_DECIMALS)
        parts.append(f"<h3>sequence {seq}</h3><div class='tokenview' id='tv-{seq}' data-seq='{seq}' "
                     f"data-step='{initial}'></div>")
    if not answers:
        sec.notes.append("no sequence shown has a readable step")
        return sec
    layers = ", ".join(map(str, sel.layers)) or "none"
    missing = {
        "step": "this report embeds the steps shown (see the notes above the view); `lmtrace report --steps` "
                "chooses others, `lmtrace serve` shows every step",
        "head": f"this report embeds the heads of layers {layers} (--layer L chooses others); "
                f"`lmtrace serve` shows every head",
    }
    payload = json.dumps({"answers": answers, "missing": missing}, separators=(",", ":"), allow_nan=False)
    # the JSON is data in a non-executed script element; every "<" is written as \u003c (the same string
    # to JSON.parse) so no text in it can close the element or open a comment
    payload = payload.replace("<", "\\u003c")
    parts.append(f"<script type='application/json' id='{DATA_ID}'>{payload}</script>")
    sec.html = "".join(parts)
    sec.notes.append(f"embedded: attention weights to {WEIGHT_DECIMALS} decimals, other numbers to {DIGITS} "
                     f"significant digits; the patterns over steps of the heads of layers {layers} (--layer)")
    return sec
