"""Logit-lens statistics from the lens's ranks and probabilities of the chosen token: the runner-up,
the lens's targets, and the settle layer (from which layer on the chosen token stays the lens's
top-1). Pure numpy; used by the inline lens (capture/probes.py) and the deferred one (`lmtrace lens`)
so both archive the same columns."""

from __future__ import annotations

import numpy as np


def runner_up(token: np.ndarray, alt_ids: np.ndarray) -> np.ndarray:
    """[...] chosen ids, [..., ≥2] the model's most likely ids at T=1, best first -> [...] the runner-up:
    the most likely token other than the chosen one."""
    return np.where(alt_ids[..., 0] == token, alt_ids[..., 1], alt_ids[..., 0])


def settle_layer(target_rank: np.ndarray, layers) -> np.ndarray:
    """[..., L] lens rank of the chosen token at the captured layers -> [...] the first captured
    layer (model index) from which the chosen token is the lens's top-1 at every captured layer up to
    the last; -1 when it is not top-1 at the last captured layer."""
    top1 = target_rank == 0
    stays = np.flip(np.logical_and.accumulate(np.flip(top1, -1), -1), -1)  # top-1 here and at every later layer
    first = stays.argmax(-1)
    return np.where(stays.any(-1), np.asarray(layers, dtype=np.int32)[first], -1).astype(np.int32)


def lens_targets(token: np.ndarray, alt_ids: np.ndarray) -> np.ndarray:
    """[B] chosen ids, [B, ≥2] alternatives -> [B, 2] int64 (chosen, runner-up), the lens's targets."""
    token = np.asarray(token, dtype=np.int64)
    return np.stack([token, runner_up(token, np.asarray(alt_ids, dtype=np.int64))], -1)


def lens_target_columns(rank: np.ndarray, prob: np.ndarray, layers) -> dict[str, np.ndarray]:
    """rank, prob [..., L, 2] (chosen, runner-up) -> the steps.parquet columns, each [..., L]."""
    settle = settle_layer(rank[..., 0], layers)
    return {
        "lens_target_rank": rank[..., 0],
        "lens_target_prob": prob[..., 0],
        "lens_runner_up_rank": rank[..., 1],
        "lens_runner_up_prob": prob[..., 1],
        "settle_layer": np.broadcast_to(settle[..., None], rank.shape[:-1]).astype(np.int32),
    }
