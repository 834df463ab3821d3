"""Attention patterns made ready to draw as images: a head's query x key matrix assembled from the
prompt's rows (`prefill_attn`) and the generated steps' rows (`attn`), and max-pooled down when it
has more cells than a page should receive. The views (`lmtrace serve`, the report) draw these."""

from __future__ import annotations

import math

import numpy as np


def full_pattern(prompt_rows: np.ndarray | None, step_rows: np.ndarray) -> tuple[np.ndarray, int]:
    """One head's attention as a query x key matrix over the whole sequence.

    step_rows: [step, key] (step s's query sits at position P-1+s; keys past its context NaN);
    prompt_rows: [P, P] the prompt's own causal matrix, or None when it was not captured.
    The prompt's last row is the query of step 0, so it comes from `step_rows`. Returns (matrix
    [query, key], the position of the first query row: 0 with the prompt's rows, else P-1); cells past
    a query's context are NaN."""
    n, k = step_rows.shape
    if prompt_rows is None or prompt_rows.shape[0] < 2:
        return step_rows, k - n if n else 0
    p = prompt_rows.shape[0]
    dtype = np.result_type(prompt_rows.dtype, step_rows.dtype)
    out = np.full((p - 1 + n, max(k, p)), np.nan, dtype=dtype)
    upper = np.triu(np.ones((p - 1, p), dtype=bool), 1)
    prompt = np.where(upper, np.nan, prompt_rows[: p - 1, :p]).astype(dtype)
    out[: p - 1, :p] = prompt
    out[p - 1 :, :k] = step_rows
    return out, 0


def pool_max(matrix: np.ndarray, max_cells: int) -> tuple[np.ndarray, int]:
    """`matrix` [..., row, key] max-pooled over square blocks of `stride` x `stride` cells, the smallest
    stride that brings rows x keys to at most `max_cells` (1: the matrix itself). A block of NaN only
    stays NaN. Returns (pooled, stride)."""
    rows, keys = matrix.shape[-2:]
    stride = 1 if rows * keys <= max_cells else math.ceil(math.sqrt(rows * keys / max_cells))
    while math.ceil(rows / stride) * math.ceil(keys / stride) > max_cells:
        stride += 1
    if stride == 1:
        return matrix, 1
    r, k = math.ceil(rows / stride), math.ceil(keys / stride)
    padded = np.full(matrix.shape[:-2] + (r * stride, k * stride), np.nan, dtype=matrix.dtype)
    padded[..., :rows, :keys] = matrix
    blocks = padded.reshape(matrix.shape[:-2] + (r, stride, k, stride))
    filled = np.where(np.isnan(blocks), -np.inf, blocks).max(axis=(-3, -1))
    return np.where(np.isneginf(filled), np.nan, filled).astype(matrix.dtype), stride
