"""Attention summarised over the heads of a layer: the mean and the max over query heads of each
key's weight. The report's grid and `lmtrace serve`'s both draw these, so they are computed here once."""

from __future__ import annotations

import numpy as np


def mean_max_over_heads(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows: [layer, q_head, key] attention weights (NaN past a context) -> (mean [layer, key] float32,
    max [layer, key] in rows' dtype). The mean is taken in float32 so a float16 archive adds up exactly."""
    return rows.astype(np.float32).mean(axis=1), rows.max(axis=1)
