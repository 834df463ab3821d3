"""The report's token view: `lmtrace serve`'s token view (serve/static/tokenview.js) drawn from data
the page inlines instead of fetched from a server.

What is inlined is the answer serve's routes give, computed by the same functions
(`viewdata.queries.sequence_tokens`, `viewdata.token_extras.selected_token`,
`viewdata.token_extras.step_over_heads`, `viewdata.token_extras.head_pattern`), keyed by the route's path under /api/runs/RUN/, attention weights
rounded to `WEIGHT_DECIMALS` decimals and other floats to `DIGITS` significant digits: per shown
sequence its token strip, the selected-token answer and the attention over heads of each step shown
(at most `MAX_VIEW_STEPS`, a regular stride past that, always with the initial step), and the pattern over
steps of every head of the selected layers (`--layer`), from which a head's row at a step is read (the
view's `data-layers` lists those layers: the grid hatches the others' rows);
all within about `BUDGET_BYTES` per page (fewer steps, then fewer layers' heads, each said in a note).
"""

from __future__ import annotations

import json
import math

from ..viewdata.queries import sequence_tokens, steps_ready
from ..viewdata.token_extras import head_pattern, selected_token, step_over_heads
from .run_data import RunData
from .sections import Section
from .selection import Selection, thin

MAX_VIEW_STEPS = 128  # selected-token answers inlined per sequence at most
# bytes of inlined JSON per page, shared by the sequences shown: a step's answers grow with the context
# (its mean and max over heads: 2 x layers x keys weights), ~30 kB at 40 keys and ~200 kB at 500 for a
# 30-layer model, so long sequences get fewer steps (a stride, with a note)
BUDGET_BYTES = 10_000_000
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


def step_answers(run, seq: int, step: int) -> dict[str, dict]:
    """serve's answers for one selected token, by route path: its selected-token answer and its
    attention over heads, rounded: attention weights (in [0, 1]) to `WEIGHT_DECIMALS` decimals, every
    other float to `DIGITS` significant digits."""
    answer = selected_token(run, seq, step)
    path = f"sequences/{seq}/steps/{step}"
    return {
        path: {k: rounded(v, decimals=WEIGHT_DECIMALS) if k == "attention" else rounded(v) for k, v in answer.items()},
        f"{path}/over_heads": rounded(step_over_heads(run, seq, step), decimals=WEIGHT_DECIMALS),
    }


def view_steps(steps: list[int], initial: int, limit: int = MAX_VIEW_STEPS) -> list[int]:
    """The steps whose selected-token answer is inlined: `steps`, thinned to `limit`, and `initial`."""
    return sorted(set(thin(steps, max(1, limit))) | {initial})


def _size(answer) -> int:
    return len(json.dumps(answer, separators=(",", ":"), allow_nan=False))


def _sequence_answers(
    data: RunData, sel: Selection, seq: int, budget: int, notes: list[str]
) -> tuple[dict[str, dict], int | None, list[int]]:
    """One sequence's inlined answers within about `budget` bytes: (answers, first selected step, layers
    whose heads' patterns are embedded). Two thirds of the budget go to the steps: as many as the first
    selected step's answers (the longest context by default) fit, at most MAX_VIEW_STEPS; the rest to
    the heads' patterns, whole layers of `sel.layers` in order while they fit."""
    run = data.run
    ready = steps_ready(run, seq)
    shown = [s for s in sel.steps[seq] if s < ready]
    if not shown:
        return {}, None, []
    initial = min(sel.attention_step.get(seq, shown[-1]), ready - 1)
    answers = {f"sequences/{seq}": sequence_tokens(run, seq)}
    first = step_answers(run, seq, initial)
    fits = max(1, (2 * budget // 3) // max(1, sum(_size(a) for a in first.values())))
    steps = view_steps(shown, initial, min(MAX_VIEW_STEPS, fits))
    if len(steps) < len(shown):
        notes.append(
            f"sequence {seq}: the token view embeds {len(steps)} of the {len(shown)} steps shown (a regular "
            f"stride); narrow --steps or --sequence for every step, or `lmtrace serve` for all of them"
        )
    for s in steps:
        answers.update(first if s == initial else step_answers(run, seq, s))
    used = sum(_size(a) for a in answers.values())
    layers = []
    if {"attn", "attn_topk_idx"} & data.arrays:
        for layer in sel.layers:
            heads = {
                f"sequences/{seq}/attention/{layer}/{h}": rounded(
                    head_pattern(run, seq, layer, h), decimals=WEIGHT_DECIMALS
                )
                for h in range(data.n_heads)
            }
            size = sum(_size(a) for a in heads.values())
            if used + size > budget:
                break
            answers.update(heads)
            used += size
            layers.append(layer)
        if layers != sel.layers:
            notes.append(
                f"sequence {seq}: the token view embeds the heads' rows and patterns over steps of layers "
                f"{', '.join(map(str, layers)) or 'none'} of {', '.join(map(str, sel.layers))} (its size "
                f"budget); fewer --steps or --sequence make room, `lmtrace serve` shows every head"
            )
    return answers, initial, layers


def token_view_section(data: RunData, sel: Selection) -> Section:
    sec = Section("tokens", "Token view")
    answers: dict[str, dict] = {}
    heads: dict[int, list[int]] = {}
    parts = [
        (
            "<p class='legend'>Click a generated token (or use ← → in the view last clicked) for what the model "
            "did at that step: the layer × head attention grid (hover a cell for its key; click it, or walk the "
            "heads with Shift + arrows and press Enter, for that head's row and its pattern over the steps; "
            "hatched rows: layers whose heads this page does not embed), the mean / max over heads, the alternatives, the logit-lens column, and per-head "
            "direct logit attribution and attributions where the run has them. The same view as "
            "<code>lmtrace serve</code>, from the numbers this page embeds.</p>"
        )
    ]
    budget = BUDGET_BYTES // max(1, len(sel.sequences))
    for seq in sel.sequences:
        own, initial, heads[seq] = _sequence_answers(data, sel, seq, budget, sec.notes)
        if not own:
            continue
        answers.update(own)
        parts.append(
            f"<h3>sequence {seq}</h3><div class='tokenview' id='tv-{seq}' data-seq='{seq}' "
            f"data-step='{initial}' data-layers='{','.join(map(str, heads[seq]))}'></div>"
        )
    if not answers:
        sec.notes.append("no sequence shown has a readable step")
        return sec
    missing = {
        "step": "this report embeds the steps shown (see the notes above the view); `lmtrace report --steps` "
        "chooses others, `lmtrace serve` shows every step",
        "head": "this report embeds the heads of the layers chosen with --layer (see the notes above the view); "
        "`lmtrace serve` shows every head",
    }
    payload = json.dumps({"answers": answers, "missing": missing}, separators=(",", ":"), allow_nan=False)
    # the JSON is data in a non-executed script element; every "<" is written as \u003c (the same string
    # to JSON.parse) so no text in it can close the element or open a comment
    payload = payload.replace("<", "\\u003c")
    parts.append(f"<script type='application/json' id='{DATA_ID}'>{payload}</script>")
    sec.html = "".join(parts)
    layers = sorted({layer for ls in heads.values() for layer in ls})
    sec.notes.append(
        f"embedded: attention weights to {WEIGHT_DECIMALS} decimals, other numbers to {DIGITS} "
        f"significant digits; the heads' rows and patterns over steps of layers "
        f"{', '.join(map(str, layers)) or 'none'} (--layer)"
    )
    return sec
