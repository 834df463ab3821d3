"""`--json` output: one compact line of strict JSON per result, for every command.

Strict: NaN and ±inf become null (bare NaN is not JSON), numpy scalars and arrays become Python
numbers and lists, anything else unknown (paths, datetimes) its string."""

from __future__ import annotations

import json
import math


def strict(x):
    """A copy of `x` that `json.dumps(..., allow_nan=False)` accepts."""
    if isinstance(x, dict):
        return {str(k): strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):  # numpy arrays and scalars
        return strict(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def json_line(obj) -> str:
    """One line, no spaces after separators, strict."""
    return json.dumps(strict(obj), separators=(",", ":"), allow_nan=False, default=str)
