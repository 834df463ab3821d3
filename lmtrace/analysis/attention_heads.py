"""Attention summarised for the views: over the heads of a layer, the mean and the max over query
heads of each key's weight (the report's grid and `lmtrace serve`'s both draw these); per head, the
key it attends to most (serve's layer x head grid, the report's token view)."""

from __future__ import annotations

import numpy as np


def mean_max_over_heads(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows: [layer, q_head, key] attention weights (NaN past a context) -> (mean [layer, key] float32,
    max [layer, key] in rows' dtype). The mean is taken in float32 so a float16 archive adds up exactly."""
    return rows.astype(np.float32).mean(axis=1), rows.max(axis=1)


def most_attended(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows: [layer, q_head, key] float attention weights -> (the key each head attends to most [layer, q_head],
    its weight). NaN weights count as below every number; a row of NaN gives key 0 and its NaN."""
    # without NaN (a dense row trimmed to its context) argmax is the same answer, without copying the rows
    key = rows.argmax(axis=-1) if not np.isnan(rows).any() else np.nanargmax(np.nan_to_num(rows, nan=-1.0), axis=-1)
    return key, np.take_along_axis(rows, key[..., None], axis=-1)[..., 0]


def most_attended_kept(idx: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`most_attended` of a top-k capture: idx / probs [layer, q_head, k_attn] (the kept keys and weights)
    -> (the kept key of the largest weight, that weight); the key is as archived (−1 for a fill value)."""
    best = np.nanargmax(np.nan_to_num(probs, nan=-1.0), axis=-1)
    return (
        np.take_along_axis(idx, best[..., None], axis=-1)[..., 0],
        np.take_along_axis(probs, best[..., None], axis=-1)[..., 0],
    )
