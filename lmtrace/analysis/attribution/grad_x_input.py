"""Gradient × input: score_i = Σ_d ∂f/∂e_{i,d} · e_{i,d} over the input embedding of each position."""

from __future__ import annotations

import numpy as np
import torch

from .registry import MethodResult, StepContext, register


@register(
    "grad_x_input",
    needs_model=True,
    description="gradient × input: Σ_d ∂f/∂e_{i,d} · e_{i,d} over the input embedding of each position",
)
def grad_x_input(ctx: StepContext) -> MethodResult:
    sc = ctx.scorer
    e = sc.embeddings(ctx.ids).requires_grad_(True)
    with torch.enable_grad():
        y = sc.f(ctx, e[None])
        (grad,) = torch.autograd.grad(y.sum(), e)
    scores = (grad * e.detach()).sum(-1)
    return MethodResult(
        scores.cpu().numpy().astype(np.float32), {"f_x": float(y.item()), "sum_scores": float(scores.sum().item())}
    )
