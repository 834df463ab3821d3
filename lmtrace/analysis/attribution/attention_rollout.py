"""Attention rollout (Abnar & Zuidema 2020) from the archived attention, no model:
R = Â_{L−1} ⋯ Â_0 with Â_l = rownorm(mean_h A_{l,h} + I); score_i = R[n−1, i]. The step's full
causal attention is rebuilt from `prefill_attn` (prompt rows) and the per-step `attn` rows."""

from __future__ import annotations

import numpy as np

from ...archive.reader import Run
from ...exits.errors import ArchiveError
from .registry import MethodResult, StepContext, register


def rollout(attn: np.ndarray, exclude: tuple[int, ...] = ()) -> np.ndarray:
    """Attention rollout of full attention matrices.

    attn [layer, head, n, n] (row = query, column = key, rows sum to 1) ->
    R = Â_{L−1} · … · Â_1 · Â_0 with Â_l = rownorm(mean_h attn[l, h] + I); R[q, k] is the share
    of position k in the output of position q. `exclude`: key positions (e.g. the attention sink, 0)
    whose columns are zeroed in every Ā_l before the identity is added and rows renormalised, so
    they get no share (R[q, k] = 0 for q ≠ k) and the rest is spread over the other positions.
    """
    attn = np.asarray(attn, dtype=np.float64)
    L, _, n, _ = attn.shape
    drop = [k for k in exclude if k < n]
    R = np.eye(n)
    for layer in range(L):
        a = attn[layer].mean(0)
        a[:, drop] = 0.0
        a = a + np.eye(n)
        a = a / a.sum(-1, keepdims=True)
        R = a @ R
    return R


def _model_layer_count(manifest: dict) -> int | None:
    cfg = manifest.get("model", {}).get("config", {}) or {}
    n = cfg.get("num_hidden_layers") or (cfg.get("text_config") or {}).get("num_hidden_layers") or cfg.get("n_layer")
    return int(n) if n is not None else None


def rollout_requirements(run: Run) -> list[str]:
    """What attention_rollout needs from the archive and this run lacks (empty = available)."""
    names = set(run.array_names())
    missing = []
    if "attn" not in names:
        if "attn_topk_idx" in names:
            missing.append(
                "full attention rows (the run kept only the top-k keys per row: set capture.attention.top_k: null)"
            )
        else:
            missing.append(
                "attention rows (`attn`: set capture.attention.enabled: true, capture.attention.top_k: null)"
            )
    n_layers = _model_layer_count(run.manifest)
    if "attn" in names and n_layers is not None and list(run.layers) != list(range(n_layers)):
        missing.append(
            f"attention of every layer (captured layers {run.layers} of {n_layers}: set capture.layers: all)"
        )
    if "prefill_attn" not in names:
        missing.append("the prompt's full attention matrices (`prefill_attn`: set capture.prefill_attention: true)")
    return missing


def archived_attention(run: Run, sequence: int, step: int) -> np.ndarray:
    """[layer, head, n, n] full causal attention of the context of `step` (n = prompt_len + step), from
    `prefill_attn` (prompt query rows) and the per-step `attn` rows (query position P−1+t at step t)."""
    P = int(run.prompt_len()[sequence])
    n = P + step
    pre = np.asarray(run.array("prefill_attn")[sequence, :, :, :P, :P], dtype=np.float32)  # [L, H, P, P]
    if np.isnan(pre[..., np.tril(np.ones((P, P), dtype=bool))]).any():
        raise ArchiveError(f"run {run.id}: the archived prompt attention of sequence {sequence} is incomplete (NaN)")
    L, H = pre.shape[:2]
    out = np.zeros((L, H, n, n), dtype=np.float32)
    out[:, :, :P, :P] = np.nan_to_num(pre, nan=0.0)
    if step > 0:
        rows = np.asarray(run.array("attn")[sequence, 1 : step + 1, :, :, :n], dtype=np.float32)  # [step, L, H, n]
        for t in range(1, step + 1):  # step t: query position P-1+t over keys 0..P-1+t
            row = rows[t - 1, :, :, : P + t]
            if np.isnan(row).any():
                raise ArchiveError(
                    f"run {run.id}: the archived attention row of sequence {sequence} step {t} is "
                    f"incomplete (NaN): that step was not captured or not committed"
                )
            out[:, :, P - 1 + t, : P + t] = row
    return out


@register(
    "attention_rollout",
    needs_model=False,
    requirements=rollout_requirements,
    settings=lambda s: {
        "head_fusion": "mean",
        "residual": "add identity, renormalise rows",
        "source": "archived prefill_attn + attn rows",
        "excluded_positions": list(s.rollout_excluded),
    },
    description="attention rollout over every layer from the archived attention (no model needed)",
)
def attention_rollout(ctx: StepContext) -> MethodResult:
    R = rollout(archived_attention(ctx.run, ctx.sequence, ctx.step), ctx.settings.rollout_excluded)
    scores = R[-1]
    return MethodResult(scores.astype(np.float32), {"sum_scores": float(scores.sum())})
