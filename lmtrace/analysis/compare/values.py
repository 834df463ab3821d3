"""Small numeric helpers of the comparison's figures: finite-or-null floats and means that skip
missing values."""

from __future__ import annotations

import math

import numpy as np


def finite(x) -> float | None:
    """A finite float or None (for JSON and nullable columns)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def mean_of(x) -> float | None:
    """The mean of the finite values among x (None and NaN skipped); None when there is none."""
    x = np.asarray([v for v in x if v is not None], np.float64)
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else None


def abs_mean(x: np.ndarray) -> float | None:
    """The mean absolute value of the finite entries of x; None when there is none."""
    x = np.abs(np.asarray(x, np.float64))
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else None
