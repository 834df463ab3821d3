"""The colours a token's probability is shown in, in the terminal (`lmtrace show`) and on the report's
page: blue for likely tokens through orange for unlikely ones, never red against green, so readers
with any common colour-vision deficiency (protan, deutan, tritan) tell the levels apart.

The terminal uses four steps of the Okabe–Ito palette as text colours; the page a continuous scale
of light backgrounds (ColorBrewer's orange → near-white → blue), dark enough to tell apart and light
enough to read the text on.
"""

from __future__ import annotations

import math

# (lowest probability of the step, text colour), most likely first
TERMINAL_STEPS = ((0.8, "#0072B2"), (0.4, "#56B4E9"), (0.1, "#E69F00"), (0.0, "#D55E00"))
# background stops of the page's continuous scale: probability -> (r, g, b)
PAGE_STOPS = ((0.0, (253, 184, 99)), (0.5, (247, 247, 247)), (1.0, (146, 197, 222)))
UNKNOWN = "#eeeeee"  # a probability that is not a number


def terminal_colour(p: float) -> str:
    """The text colour of a token of probability p in the terminal (one of four steps)."""
    for lowest, colour in TERMINAL_STEPS:
        if p >= lowest:
            return colour
    return TERMINAL_STEPS[-1][1]


def terminal_legend() -> list[tuple[str, str]]:
    """(label, colour) per step, most likely first: `>=0.8`, `>=0.4`, `>=0.1`, `<0.1`."""
    steps = [(f">={lowest:g}", colour) for lowest, colour in TERMINAL_STEPS[:-1]]
    return steps + [(f"<{TERMINAL_STEPS[-2][0]:g}", TERMINAL_STEPS[-1][1])]


def page_colour(p: float) -> str:
    """The background of a token of probability p on the page, linear between `PAGE_STOPS`."""
    if not math.isfinite(p):
        return UNKNOWN
    p = max(0.0, min(1.0, p))
    for (p0, c0), (p1, c1) in zip(PAGE_STOPS, PAGE_STOPS[1:]):
        if p <= p1:
            t = (p - p0) / (p1 - p0)
            return "#" + "".join(f"{round(a + (b - a) * t):02x}" for a, b in zip(c0, c1))
    return "#" + "".join(f"{x:02x}" for x in PAGE_STOPS[-1][1])
