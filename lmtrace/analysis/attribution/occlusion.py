"""Occlusion: score_i = f(x) − f(x with position i removed from the attention mask), one forward per
position (positions keep their indices; only the key is hidden)."""

from __future__ import annotations

import numpy as np
import torch

from .registry import MethodResult, StepContext, register


@register(
    "occlusion",
    needs_model=True,
    settings=lambda s: {
        "target": s.target,
        "quantity": s.quantity,
        "mask": "attention_mask[position] = 0",
        "batch_size": s.batch_size,
    },
    description="f(x) − f(x with the position removed from the attention mask), one forward per position",
)
def occlusion(ctx: StepContext) -> MethodResult:
    sc, s = ctx.scorer, ctx.settings
    e = sc.embeddings(ctx.ids)
    n = ctx.n
    with torch.no_grad():
        fx = float(sc.f(ctx, e[None]).item())
        out = np.empty(n, dtype=np.float64)
        for lo in range(0, n, s.batch_size):
            pos = torch.arange(lo, min(lo + s.batch_size, n), device=sc.device)
            mask = torch.ones((len(pos), n), dtype=torch.long, device=sc.device)
            mask[torch.arange(len(pos)), pos] = 0
            out[lo : lo + len(pos)] = sc.f(ctx, e[None].expand(len(pos), n, e.shape[-1]), mask).double().cpu().numpy()
    scores = fx - out
    return MethodResult(scores.astype(np.float32), {"f_x": fx, "sum_scores": float(scores.sum())})
