"""MoE routing rules: what `mask_experts` re-applies to a router's masked logits, one per router
family, each checked to reproduce the router's own output."""

from __future__ import annotations

import torch

from ...exits.errors import SpecError, UnsupportedArchitectureError


def _route_mixtral(router, logits):
    """MixtralTopKRouter: softmax (float32) -> top-k -> renormalise the k weights."""
    probs = torch.nn.functional.softmax(logits.float(), dim=-1)
    value, index = torch.topk(probs, router.top_k, dim=-1)
    return value / value.sum(dim=-1, keepdim=True), index


def _route_qwen2_moe(router, logits):
    """Qwen2MoeTopKRouter: softmax (float32) -> top-k -> renormalise only if norm_topk_prob; logits' dtype."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    value, index = torch.topk(probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        value = value / value.sum(dim=-1, keepdim=True)
    return value.to(logits.dtype), index


def _route_gpt_oss(router, logits):
    """GptOssTopKRouter: top-k of the logits -> softmax over those k."""
    value, index = torch.topk(logits, router.top_k, dim=-1)
    return torch.nn.functional.softmax(value, dim=1, dtype=value.dtype), index


ROUTING_RULES = {
    "MixtralTopKRouter": _route_mixtral,
    "Qwen2MoeTopKRouter": _route_qwen2_moe,
    "GptOssTopKRouter": _route_gpt_oss,
}


@torch.inference_mode()
def routing_rule(adapter, layer: int, where: str):
    """The routing rule of block `layer`'s router, checked to reproduce the router's own output."""
    router = adapter.routers[layer]
    if router is None:
        with_router = [i for i, r in enumerate(adapter.routers) if r is not None]
        raise SpecError(
            f"{where}: layer {layer} of {type(adapter.model).__name__} is a dense layer without a router; "
            f"layers with experts: {', '.join(map(str, with_router)) or 'none'}"
        )
    name = type(router).__name__
    rule = ROUTING_RULES.get(name)
    if rule is None:
        raise UnsupportedArchitectureError(
            f"{where}: expert masking is not supported for router {name}; supported routers: {', '.join(ROUTING_RULES)}"
        )
    weight = router.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(7, weight.shape[1], generator=g).to(weight.device, weight.dtype)
    logits, weights, chosen = router(h)
    w2, c2 = rule(router, logits)
    if not (torch.equal(c2, chosen) and torch.equal(w2.to(weights.dtype), weights)):
        raise UnsupportedArchitectureError(
            f"{where}: router {name} no longer computes the routing rule lmtrace re-applies after masking "
            f"(installed transformers differs); expert masking is unsupported with this version"
        )
    return rule
