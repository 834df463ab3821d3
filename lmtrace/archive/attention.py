"""Attention rows as every reader uses them: a run that kept each head's top-k weights
(`attention.top_k`: arrays `attn_topk_idx` and `attn_topk_prob`, [..., k]) read as dense rows over
the keys, like a run that kept the whole rows (`attn`, [..., key]).

The one rule, for `lmtrace serve`, the report and `lmtrace heads` alike: the kept weights go to
their keys, every other key reads 0; an index outside 0 .. n_keys − 1 (the fill value −1 of a row
with fewer than k keys) is dropped; a kept weight is copied as archived, NaN included (the readers
treat NaN in a dense row as they treat it in `attn`); the rows keep the weights' dtype (a float16
archive stays float16)."""

from __future__ import annotations

import numpy as np


def topk_dense(idx: np.ndarray, prob: np.ndarray, n_keys: int) -> np.ndarray:
    """A top-k capture idx/prob [..., k] as dense rows [..., n_keys] of prob's dtype (see the module docstring)."""
    dense = np.zeros(idx.shape[:-1] + (n_keys,), dtype=prob.dtype)
    ok = (idx >= 0) & (idx < n_keys)
    where = np.nonzero(ok)
    dense[where[:-1] + (idx[ok],)] = prob[ok]
    return dense
