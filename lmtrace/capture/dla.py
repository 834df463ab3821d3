"""Direct logit attribution (DLA) with the final norm frozen at its actual scale.

For each step the model's final logit of a target token t is
    logit_t = a_t · norm(x) + b_t
where x is the final residual (the final norm's input) at the query position, a_t the unembedding
row of t (with any linear map between the norm and the unembedding folded in: OPT's project_out)
and b_t the unembedding's bias (and the folded maps' biases). The final norm is
    RMSNorm:   norm(x) = x / σ ⊙ w,             σ = sqrt(mean(x²) + eps)
    LayerNorm: norm(x) = P x / σ ⊙ w + β,       σ = sqrt(mean((P x)²) + eps), P x = x − mean(x)
Freezing σ at the value it has for the actual x (TransformerLens' convention) makes the logit
linear in x, and x is a sum of parts, x = embedding + Σ_layers (attention output + MLP output):
    logit_t = Σ_parts  part · u_t  +  c_t,   u_t = P(w ⊙ a_t) / σ,   c_t = β · a_t + b_t
(P is the identity for an RMSNorm). Each query head's part of an attention output is its slice of
the output projection applied to its slice of the projection's input; the projection's bias is
the rest of the attention output. These identities are exact up to float rounding.

Targets: the chosen token, and the difference chosen − runner-up (the most likely token at T=1
other than the chosen one, as the lens's runner-up: lmtrace/capture/lens.py `runner_up`).
"""

from __future__ import annotations

import torch

from ..errors import SpecError
from .arch import Adapter, _get

TARGETS = ("diff", "logit")  # [..., 2]: logit(chosen) − logit(runner-up), logit(chosen)


def unsupported_reason(adapter: Adapter) -> str | None:
    """Why direct logit attribution cannot be exact for this model (None: it can)."""
    name = type(adapter.model).__name__
    block = adapter.layers[0]
    if hasattr(block, "post_feedforward_layernorm"):  # Gemma 2/3, OLMo2
        return (f"{name}: the block normalises the attention and MLP outputs (post_feedforward_layernorm) before "
                "the residual add, so a head's output does not reach the residual stream linearly")
    if getattr(block, "do_layer_norm_before", True) is False:  # OPT-350m style
        return f"{name}: post-LN blocks (do_layer_norm_before=false) normalise the residual stream after every add"
    if adapter.final_softcap:
        return f"{name}: final logit soft-capping (final_logit_softcapping) is not linear in the residual stream"
    mods = [m for m in (_get(adapter.base, p) for p in adapter.family.final_norm) if m is not None]
    if not mods or _norm_kind(mods[0]) is None or not all(isinstance(m, torch.nn.Linear) for m in mods[1:]):
        return (f"{name}: the final modules ({', '.join(type(m).__name__ for m in mods) or 'none'}) are not one "
                "LayerNorm/RMSNorm followed by linear maps")
    o = adapter.o_proj(0)
    if _head_weight(o, adapter) is None:
        return f"{name}: the attention output projection ({type(o).__name__}) is not a linear map over the heads"
    return None


def require_supported(adapter: Adapter) -> None:
    reason = unsupported_reason(adapter)
    if reason is not None:
        raise SpecError(f"capture.head_dla is not possible for this model: {reason} (set capture.head_dla: false)")


def _norm_kind(m: torch.nn.Module) -> str | None:
    if isinstance(m, torch.nn.LayerNorm):
        return "layer"
    if type(m).__name__.endswith("RMSNorm") and _eps(m) is not None:
        return "rms"
    return None


def _eps(m: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(m, name, None)
        if isinstance(value, float):
            return value
    return None


def _head_weight(o: torch.nn.Module, adapter: Adapter) -> torch.Tensor | None:
    """The output projection as [d_model, heads × head_dim] (a view; GPT-2's Conv1D stores [in, out])."""
    w = getattr(o, "weight", None)
    width = adapter.n_heads * adapter.head_dim
    if w is None or w.dim() != 2:
        return None
    if isinstance(o, torch.nn.Linear) and tuple(w.shape) == (adapter.d_model, width):
        return w
    if type(o).__name__ == "Conv1D" and tuple(w.shape) == (width, adapter.d_model):
        return w.t()
    return None


class FrozenNormDLA:
    """Per-step directions u_t and constants c_t for one model, and the attribution of its parts."""

    def __init__(self, adapter: Adapter):
        require_supported(adapter)
        mods = [m for m in (_get(adapter.base, p) for p in adapter.family.final_norm) if m is not None]
        norm, self.linears = mods[0], mods[1:]
        self.norm_module = norm
        self.kind = _norm_kind(norm)
        self.eps = float(norm.eps) if self.kind == "layer" else _eps(norm)
        d = adapter.d_model
        with torch.no_grad():
            if self.kind == "layer":
                self.gain = (norm.weight.detach().float() if norm.weight is not None
                             else torch.ones(d, device=adapter.unembed.weight.device))
                self.beta = None if norm.bias is None else norm.bias.detach().float()
            else:  # w_eff whatever the RMSNorm's parametrisation (Gemma's is 1 + weight): norm(1) · σ(1)
                ones = torch.ones(d, dtype=torch.float32, device=norm.weight.device)
                self.gain = norm(ones).float() * (1.0 + self.eps) ** 0.5
                self.beta = None
        head = adapter.unembed
        self.unembed = head.weight
        self.unembed_bias = getattr(head, "bias", None)
        self.n_heads, self.head_dim = adapter.n_heads, adapter.head_dim
        self.w_o = [_head_weight(adapter.o_proj(i), adapter) for i in range(adapter.n_layers)]

    def directions(self, x_final: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x_final [B, d] float32, targets [B, 2] (chosen, runner-up) -> u [B, 2, d] and c [B, 2],
        both over TARGETS (difference, chosen logit)."""
        w = self.unembed
        targets = targets.to(w.device)
        a = w[targets].float()  # [B, 2, d_in]: chosen, runner-up rows
        const = (torch.zeros(a.shape[:2], device=a.device) if self.unembed_bias is None
                 else self.unembed_bias.float()[targets])
        for m in reversed(self.linears):  # logits = a · (W y + b) = (a W) · y + a · b
            if m.bias is not None:
                const = const + a @ m.bias.float()
            a = a @ m.weight.float()
        if self.beta is not None:
            const = const + a @ self.beta
        x = x_final.float()
        if self.kind == "layer":
            x = x - x.mean(-1, keepdim=True)
        sigma = (x.pow(2).mean(-1) + self.eps).sqrt()  # [B]
        u = a * self.gain / sigma[:, None, None]
        if self.kind == "layer":  # P is symmetric: P c · v = c · P v
            u = u - u.mean(-1, keepdim=True)
        diff = torch.stack([u[:, 0] - u[:, 1], u[:, 0]], 1)
        return diff, torch.stack([const[:, 0] - const[:, 1], const[:, 0]], 1)

    def heads(self, layers: list[int], z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """z [L, B, heads × head_dim] (the output projections' inputs), u [B, 2, d] -> [L, B, 2, heads]:
        z_h · (W_O,h^T u), i.e. each head's output written to the residual stream, projected on u."""
        L, B = z.shape[0], z.shape[1]
        # u W_O for every layer: [L, B, 2, heads × head_dim] (one small matmul per layer, no stacked copy of W_O)
        v = torch.stack([u @ self.w_o[layer].to(u.dtype) for layer in layers], 0)
        per = z.float()[:, :, None, :] * v
        return per.reshape(L, B, 2, self.n_heads, self.head_dim).sum(-1)
