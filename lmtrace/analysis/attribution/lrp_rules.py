"""The relevance-propagation rules, installed on a loaded float32 eager model for one relevance pass.

LRP is computed the efficient way AttnLRP (Achtibat et al., ICML 2024) and its library lxt compute it:
forward the model with each non-linear step rewritten as a linear map whose coefficients are held
constant (detached) at their forward values, then gradient × input of that modified backward pass is
the relevance. Every forward value is unchanged; only the backward pass differs. The rules:

  norms (RMSNorm, LayerNorm)  identity rule: the per-token scale 1/rms (1/std) is a constant, so the
                              norm is the linear map x ↦ x·(y/x) (LayerNorm: centred x; its bias leaks)
  element-wise activations    identity rule: act(x) = x·(act(x)/x) with the ratio constant, so the
  (SiLU, GELU, ReLU, tanh)    relevance passes through unchanged
  gated MLP product           uniform rule: act(gate)·up gives half its relevance to each factor
                              (the gradient entering the down projection is halved)
  softmax attention           CP-LRP (Ali et al., ICML 2022): query and key are detached, so the
                              attention weights are constants and relevance flows through the values
                              only (and, within them, through rotary-free v); exact conservation
  linear layers, residuals    the plain gradient (ε = 0 LRP); biases absorb their share
  final logit soft-capping    identity rule on cap·tanh(z/cap)

`installed` puts them on a model and removes them in a `finally`. Modules with no rule here (a router,
an unknown normaliser) are refused in one line naming the module (`refusal`)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import torch

from ...capture.arch import Adapter
from ...errors import SpecError


class _HalveGradient(torch.autograd.Function):
    """Identity forward, gradient / 2 backward: the uniform rule at the output of a product of two factors."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad / 2


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, 0 where den is 0 (the relevance den·grad is 0 there whatever the ratio), detached."""
    num, den = num.detach(), den.detach()
    return torch.where(den == 0, torch.zeros_like(num), num / torch.where(den == 0, torch.ones_like(den), den))


def _activation_classes() -> tuple[type, ...]:
    from transformers.activations import ACT2CLS

    return tuple({(c[0] if isinstance(c, tuple) else c) for c in ACT2CLS.values()})


def _is_norm(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, torch.nn.LayerNorm) or name.endswith("Norm") or "LayerNorm" in name or "RMSNorm" in name


def _norm_hook(module, args, output):
    """Identity rule: y = x·(y/x) for RMSNorm; y = (x − mean x)·((y − b)/(x − mean x)) + b for LayerNorm."""
    x = args[0]
    if isinstance(module, torch.nn.LayerNorm):
        xc = x - x.mean(-1, keepdim=True)
        bias = module.bias if module.bias is not None else torch.zeros((), dtype=x.dtype, device=x.device)
        return xc * _ratio(output - bias, xc) + bias
    return x * _ratio(output, x)


def _activation_hook(module, args, output):
    x = args[0]
    return x * _ratio(output, x)


def _halve_input(module, args):
    return (_HalveGradient.apply(args[0]), *args[1:])


def _constant_weights(inner):
    """The model's own eager attention with query and key detached: weights constant, values carry relevance."""

    def attention(module, query, key, value, *args, **kwargs):
        return inner(module, query.detach(), key.detach(), value, *args, **kwargs)

    attention.lmtrace_lrp = True
    return attention


def refusal(adapter: Adapter) -> str | None:
    """Why the rules cannot be applied to this model (one line naming the module), or None."""
    model = adapter.model
    if adapter.has_routers or adapter.family.mlp_down is None:
        mlp = adapter.mlp(0)
        return (f"{type(model).__name__}: layer 0's MLP ({type(mlp).__name__}) routes each token to experts; the "
                f"routing has no relevance rule here, so lrp covers the dense families only (docs/explain.md)")
    if model.config._attn_implementation != "eager":
        return (f"{type(model).__name__}: lrp needs the eager attention kernel (loaded with "
                f"{model.config._attn_implementation})")
    norm_types = (torch.nn.LayerNorm,)
    for name, m in model.named_modules():
        if _is_norm(m) and not isinstance(m, norm_types) and not type(m).__name__.endswith("RMSNorm"):
            return (f"{type(model).__name__}: module {name} ({type(m).__name__}) is a normaliser lrp has no rule "
                    f"for (RMSNorm and LayerNorm only)")
    return None


@contextmanager
def installed(adapter: Adapter) -> Iterator[None]:
    """The rules on `adapter.model` (float32, eager attention, one device) for the duration; forward values
    are unchanged. Refuses (SpecError, exit 2) a model the rules do not cover."""
    why = refusal(adapter)
    if why is not None:
        raise SpecError(f"--method lrp: {why}")
    model = adapter.model
    handles = []
    patched: list[tuple[object, object]] = []
    cap = getattr(model.config, "final_logit_softcapping", None)
    acts = _activation_classes()
    try:
        for m in model.modules():
            if _is_norm(m):
                handles.append(m.register_forward_hook(_norm_hook))
            elif isinstance(m, acts):
                handles.append(m.register_forward_hook(_activation_hook))
        if adapter.family.mlp_kind.startswith("gated"):
            for i in range(adapter.n_layers):
                handles.append(adapter.mlp_down(i).register_forward_pre_hook(_halve_input))
        for mod_name in {type(adapter.attn(i)).__module__ for i in range(adapter.n_layers)}:
            module = sys.modules[mod_name]
            inner = getattr(module, "eager_attention_forward", None)
            if inner is None:
                raise SpecError(f"--method lrp: {type(model).__name__}: no eager_attention_forward in {mod_name} "
                                f"to hold the attention weights constant in")
            if not getattr(inner, "lmtrace_lrp", False):
                patched.append((module, inner))
                module.eager_attention_forward = _constant_weights(inner)
        if cap is not None:  # applied by `soft_capped` on the pre-cap logits instead, with the identity rule
            model.config.final_logit_softcapping = None
        yield
    finally:
        for h in handles:
            h.remove()
        for module, inner in patched:
            module.eager_attention_forward = inner
        if cap is not None:
            model.config.final_logit_softcapping = cap


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap·tanh(z/cap) under the identity rule (relevance passes through unchanged); z if no cap."""
    if cap is None:
        return logits
    return logits * _ratio(cap * torch.tanh(logits / cap), logits)
