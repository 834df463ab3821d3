"""The divergences a comparison reports, as pure functions of stored distributions.

KL and JS between two next-token distributions known only on their stored top-k (each side's
tail mass kept as one bucket: exact on that partition, a lower bound on the full vocabulary), and
JS between attention rows stored dense or as top-k.

`stored_kl` is the one top-k KL of the project: `compare`'s kl_ab/kl_ba and `intervene`'s
kl_parent_child_topk both call it on what the two archives store at a step (`stored_logprobs`).
Why this partition: a KL over a partition of the vocabulary is a lower bound of the full KL (merging
outcomes never increases it) and refining the partition never lowers it; every bucket needs its mass
on both sides, and from the archives that is known only for a token stored on both sides, or for
the complement of such tokens. So {each token stored on both sides} + {one tail bucket} is the finest
partition the archives allow: the largest lower bound, the closest to the full-vocabulary KL that
`compare --exact` computes from the models."""

from __future__ import annotations

import numpy as np

TAIL_FLOOR = 1e-12  # tail masses below this (float32 rounding of 1 - sum) are set to it, so KL stays finite


def _kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(p‖q) along the last axis in nats; 0·log 0 = 0, and p > 0 where q = 0 gives inf."""
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - np.log(np.where(q > 0, q, 1.0))), 0.0)
        terms = np.where((p > 0) & (q <= 0), np.inf, terms)
    return terms.sum(-1)


def _js(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen–Shannon divergence along the last axis, nats (0 ≤ JS ≤ ln 2)."""
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    m = 0.5 * (p + q)
    return np.maximum(0.5 * _kl(p, m) + 0.5 * _kl(q, m), 0.0)


def stored_logprobs(alt_ids, alt_logprobs, token_id: int, logprob: float) -> dict[int, float]:
    """Token id -> logprob that a run stores at one step: its top-k alternatives (ids ≥ 0) and its chosen
    token (`token_id`, `logprob`: the archived `tokens.parquet` row's, T=1)."""
    known = {int(i): float(v) for i, v in zip(alt_ids, alt_logprobs) if int(i) >= 0}
    known[int(token_id)] = float(logprob)
    return known


def stored_kl(known_p: dict[int, float], known_q: dict[int, float]) -> float | None:
    """KL(P‖Q) in nats from what two runs store at a step (`stored_logprobs`), on the partition
    {each token known on both sides} + {one tail bucket} (`topk_divergence`); None if no token is known
    on both sides."""
    return topk_divergence(known_p, known_q)["kl_ab"]


def topk_divergence(known_a: dict[int, float], known_b: dict[int, float]) -> dict:
    """KL(A‖B), KL(B‖A) and JS between two next-token distributions known only at some token ids.

    `known_x` maps token id -> logprob (the stored top-k alternatives plus the chosen token). The
    partition: one bucket per id known on both sides, plus one tail bucket with the rest of each
    side's mass (floored at TAIL_FLOOR). Exact on that partition; a lower bound on the full vocabulary.
    With no id known on both sides the partition is a single bucket: KL/JS are then None (unknown).
    """
    common = sorted(set(known_a) & set(known_b))
    if not common:
        return {"kl_ab": None, "kl_ba": None, "js": None, "tail_a": 1.0, "tail_b": 1.0, "n_common": 0}
    pa_ = np.exp(np.asarray([known_a[i] for i in common], np.float64))
    pb_ = np.exp(np.asarray([known_b[i] for i in common], np.float64))
    tail_a = max(1.0 - float(pa_.sum()), 0.0)
    tail_b = max(1.0 - float(pb_.sum()), 0.0)
    P = np.append(pa_, max(tail_a, TAIL_FLOOR))
    Q = np.append(pb_, max(tail_b, TAIL_FLOOR))
    return {
        "kl_ab": float(_kl(P, Q)),
        "kl_ba": float(_kl(Q, P)),
        "js": float(_js(P, Q)),
        "tail_a": tail_a,
        "tail_b": tail_b,
        "n_common": len(common),
    }


def attention_js_dense(a: np.ndarray, b: np.ndarray, n_keys: np.ndarray) -> np.ndarray:
    """JS per row between full attention rows [step, ..., key]; keys >= n_keys[step] are ignored.

    Rows are renormalised to sum to 1 first (float16 storage does not sum exactly to 1).
    """
    K = a.shape[-1]
    mask = (np.arange(K)[None, :] < np.asarray(n_keys)[:, None]).reshape((len(n_keys),) + (1,) * (a.ndim - 2) + (K,))
    rows = []
    for x in (a, b):
        x = np.where(mask, np.nan_to_num(np.asarray(x, np.float64)), 0.0)
        total = x.sum(-1, keepdims=True)
        rows.append(np.divide(x, total, out=np.zeros_like(x), where=total > 0))
    return _js(rows[0], rows[1])


def attention_js_sparse(idx_a: np.ndarray, p_a: np.ndarray, idx_b: np.ndarray, p_b: np.ndarray) -> np.ndarray:
    """JS between attention rows of which only some keys are stored ([..., k] key ids, -1 = none).

    Same partition as `topk_divergence`: keys stored on both sides, plus one tail bucket.
    """
    p_a = np.nan_to_num(np.asarray(p_a, np.float64))
    p_b = np.nan_to_num(np.asarray(p_b, np.float64))
    match = (idx_a[..., :, None] == idx_b[..., None, :]) & (idx_a[..., :, None] >= 0) & (idx_b[..., None, :] >= 0)
    pa_c = np.where(match.any(-1), p_a, 0.0)
    pb_c = np.where(match, p_b[..., None, :], 0.0).sum(-1)
    tail_a = np.maximum(np.maximum(1.0 - pa_c.sum(-1), 0.0), TAIL_FLOOR)
    tail_b = np.maximum(np.maximum(1.0 - pb_c.sum(-1), 0.0), TAIL_FLOOR)
    return _js(np.concatenate([pa_c, tail_a[..., None]], -1), np.concatenate([pb_c, tail_b[..., None]], -1))
