"""The token view's code, as `lmtrace serve` serves it and the report inlines it: static/headgrid.js,
static/tokenview.js, static/patterns.js (its pictures, drawn on canvases) and static/features.js (the
feature page and the token's feature list) as one script, and
static/tokenview.css then static/patterns.css as one style (both views use them), with the
probability colour scale of `output/prob_colours.py` written into the script, so that the page colours a probability (and a
missing one) exactly as the report's text and `lmtrace show` do, from one definition."""

from __future__ import annotations

import json
from importlib import resources

from ..output.prob_colours import PAGE_STOPS, UNKNOWN

PROB_SCALE_MARK = "null /* PROB_SCALE */"  # where tokenview.js receives the scale


def prob_scale() -> dict:
    """The page's probability scale as the script reads it: {"stops": [[p, [r, g, b]], ...], "missing": colour}."""
    return {"stops": [[p, list(rgb)] for p, rgb in PAGE_STOPS], "missing": UNKNOWN}


def _static(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def token_view_js() -> str:
    """static/headgrid.js (the canvas heatmap, legends and exports), static/tokenview.js with
    `prob_scale()` in place of its PROB_SCALE_MARK, then static/patterns.js and static/features.js: one script."""
    code = _static("tokenview.js")
    if code.count(PROB_SCALE_MARK) != 1:
        raise RuntimeError(f"tokenview.js must hold {PROB_SCALE_MARK!r} once")  # a broken install, not user input
    return (
        _static("headgrid.js")
        + "\n"
        + code.replace(PROB_SCALE_MARK, json.dumps(prob_scale(), separators=(",", ":")))
        + "\n"
        + _static("patterns.js")
        + "\n"
        + _static("features.js")
    )


def token_view_css() -> str:
    return _static("tokenview.css") + "\n" + _static("patterns.css")
