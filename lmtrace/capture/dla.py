"""Direct logit attribution (DLA) with every norm after the residual stream's parts frozen at its actual scale.

For each step the model's final logit of a target token t is
    logit_t = a_t · norm(x) + b_t
where x is the final residual (the final norm's input) at the query position, a_t the unembedding
row of t (with any linear map between the norm and the unembedding folded in: OPT's project_out)
and b_t the unembedding's bias (and the folded maps' biases). The final norm is
    RMSNorm:   norm(x) = x / σ ⊙ w,             σ = sqrt(mean(x²) + eps)
    LayerNorm: norm(x) = P x / σ ⊙ w + β,       σ = sqrt(mean((P x)²) + eps), P x = x − mean(x)
Freezing σ at the value it has for the actual x (TransformerLens' convention) makes the logit
linear in x, and x is a sum of parts, x = embedding + Σ_layers (what the attention and the MLP add):
    logit_t = Σ_parts  part · u_t  +  c_t,   u_t = P(w ⊙ a_t) / σ,   c_t = β · a_t + b_t
(P is the identity for an RMSNorm). Each query head's part of an attention output is its slice of
the output projection applied to its slice of the projection's input; the projection's bias is
the rest of the attention output. These identities are exact up to float rounding.

Blocks that normalise the attention and MLP outputs before the residual add (Gemma 2/3 and OLMo2:
`post_attention_layernorm` on the attention output, `post_feedforward_layernorm` on the MLP output,
both RMSNorms) add o ⊙ w_o / σ_o, σ_o the RMS of that output o (its own eps, in float32 as those
norms compute it). With σ_o frozen at its actual value this is linear in o too, so a head's part is
its o_proj slice times w_o / σ_o, and the heads' parts still sum to the layer's attention part.

Targets: the chosen token, and the difference chosen − runner-up (the most likely token at T=1
other than the chosen one, as the lens's runner-up: lmtrace/capture/lens.py `runner_up`). The
margin contributions (steps.parquet `margin_contrib`) use the same frozen final norm for the final
top-1 − top-2 difference (`FrozenFinalNorm`).
"""

from __future__ import annotations

import torch

from ..exits.errors import SpecError
from .arch import Adapter, dotted_attr
from .devices import execution_device

TARGETS = ("diff", "logit")  # [..., 2]: logit(chosen) − logit(runner-up), logit(chosen)
# the block's norms of the attention and MLP outputs, applied before the residual add (Gemma 2/3, OLMo2;
# Llama's `post_attention_layernorm` is the MLP's input norm, so a block counts only with both names)
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


def unsupported_reason(adapter: Adapter) -> str | None:
    """Why direct logit attribution cannot be exact for this model (None: it can)."""
    name = type(adapter.model).__name__
    if getattr(adapter.layers[0], "do_layer_norm_before", True) is False:  # OPT-350m style
        return f"{name}: post-LN blocks (do_layer_norm_before=false) normalise the residual stream after every add"
    if adapter.final_softcap:
        return (
            f"{name}: final logit soft-capping (final_logit_softcapping={adapter.final_softcap}) is not linear "
            "in the residual stream"
        )
    reason = final_modules_reason(adapter)
    if reason is not None:
        return f"{name}: {reason}"
    post = post_norms(adapter)
    for layer, pair in enumerate(post or ()):
        for path, m in zip(POST_NORMS, pair):
            if _norm_kind(m) != "rms":
                return (
                    f"{name}: layer {layer}'s {path} ({type(m).__name__}) is not an RMSNorm, so its output is "
                    "not a scale of its input"
                )
    o = adapter.o_proj(0)
    if _head_weight(o, adapter) is None:
        return f"{name}: the attention output projection ({type(o).__name__}) is not a linear map over the heads"
    return None


def require_supported(adapter: Adapter) -> None:
    reason = unsupported_reason(adapter)
    if reason is not None:
        raise SpecError(f"capture.head_dla is not possible for this model: {reason} (set capture.head_dla: false)")


def final_modules_reason(adapter: Adapter) -> str | None:
    """Why the final modules are not an (optional) LayerNorm/RMSNorm followed by linear maps (None: they are)."""
    mods = _final_modules(adapter)
    linears = mods[1:] if mods and _norm_kind(mods[0]) is not None else mods
    if all(isinstance(m, torch.nn.Linear) for m in linears):
        return None
    return (
        f"the final modules ({', '.join(type(m).__name__ for m in mods)}) are not one LayerNorm/RMSNorm "
        "followed by linear maps"
    )


def post_norms(adapter: Adapter) -> list[tuple[torch.nn.Module, torch.nn.Module]] | None:
    """Each block's (attention-output norm, MLP-output norm), or None where the blocks add their outputs as they are."""
    if not any(hasattr(block, POST_NORMS[1]) for block in adapter.layers):
        return None
    return [tuple(getattr(block, path, None) for path in POST_NORMS) for block in adapter.layers]


def _final_modules(adapter: Adapter) -> list[torch.nn.Module]:
    return [m for m in (dotted_attr(adapter.base, p) for p in adapter.family.final_norm) if m is not None]


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


def _rms_gain(norm: torch.nn.Module) -> torch.Tensor:
    """[d] float32: an RMSNorm's effective gain whatever its parametrisation (Gemma's is 1 + weight):
    norm(1) · σ(1), computed by the module itself (also where accelerate offloaded its weight)."""
    d = norm.weight.shape[-1]
    with torch.no_grad():
        ones = torch.ones(d, dtype=torch.float32, device=execution_device(norm))
        return norm(ones).float() * (1.0 + _eps(norm)) ** 0.5


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


class FrozenFinalNorm:
    """The final modules (a LayerNorm/RMSNorm, where the model has one, then linear maps) and the
    unembedding, as the linear map they are with the norm's scale frozen at the actual final residual."""

    def __init__(self, adapter: Adapter, setting: str):
        reason = final_modules_reason(adapter)
        if reason is not None:
            raise SpecError(
                f"{setting} is not possible for this model: {type(adapter.model).__name__}: {reason} "
                f"(set {setting}: false)"
            )
        mods = _final_modules(adapter)
        self.kind = _norm_kind(mods[0]) if mods else None  # "layer", "rms" or None (no final norm)
        norm, self.linears = (mods[0], mods[1:]) if self.kind else (None, mods)
        # the module whose input is the final residual: the norm, else the first linear map, else the unembedding
        self.entry = mods[0] if mods else adapter.unembed
        head = adapter.resident(adapter.unembed)  # also where accelerate offloaded it (docs/devices.md)
        self.unembed, self.unembed_bias = head["weight"], head.get("bias")
        self.linear_params = [adapter.resident(m) for m in self.linears]
        self.gain = self.beta = None
        self.eps = 0.0
        if self.kind == "layer":
            params = adapter.resident(norm)
            self.eps = float(norm.eps)
            self.gain = params["weight"].float() if "weight" in params else None
            self.beta = params["bias"].float() if "bias" in params else None
        elif self.kind == "rms":
            self.eps = _eps(norm)
            self.gain = _rms_gain(norm)

    def directions(self, x_final: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x_final [B, d] float32 (the final residual), tokens [B, k] ids -> u [B, k, d] and c [B, k]:
        logit(tokens[b, j]) = part · u[b, j] summed over the parts of x_final, plus c[b, j]."""
        w = self.unembed
        tokens = tokens.to(w.device)
        a = w[tokens].float()  # [B, k, d_in]
        const = (
            torch.zeros(a.shape[:2], device=a.device)
            if self.unembed_bias is None
            else self.unembed_bias.float()[tokens]
        )
        for params in reversed(self.linear_params):  # logits = a · (W y + b) = (a W) · y + a · b
            weight = params["weight"].float().to(a.device)
            if params.get("bias") is not None:
                const = const + a @ params["bias"].float().to(a.device)
            a = a @ weight
        if self.beta is not None:
            const = const + a @ self.beta.to(a.device)
        x = x_final.float().to(a.device)
        if self.kind is None:
            return a, const
        if self.kind == "layer":
            x = x - x.mean(-1, keepdim=True)
        sigma = (x.pow(2).mean(-1) + self.eps).sqrt()  # [B]
        u = a / sigma[:, None, None]
        if self.gain is not None:
            u = u * self.gain.to(a.device)
        if self.kind == "layer":  # P is symmetric: P c · v = c · P v
            u = u - u.mean(-1, keepdim=True)
        return u, const


class FrozenNormDLA:
    """Per-step directions u_t and constants c_t for one model, and the attribution of its parts."""

    def __init__(self, adapter: Adapter):
        require_supported(adapter)
        self.final = FrozenFinalNorm(adapter, "capture.head_dla")
        self.n_heads, self.head_dim = adapter.n_heads, adapter.head_dim
        self.w_o = [_head_weight(adapter.o_proj(i), adapter) for i in range(adapter.n_layers)]
        post = post_norms(adapter)
        device = execution_device(adapter.unembed)  # where the probes assemble a step
        # [n_layers, 2, d] gains and [n_layers, 2] eps of the attention- and MLP-output norms (None: no such norms)
        self.post_gain = (
            None
            if post is None
            else torch.stack([torch.stack([_rms_gain(m).to(device) for m in pair]) for pair in post])
        )
        self.post_eps = (
            None if post is None else torch.tensor([[_eps(m) for m in pair] for pair in post], device=device)
        )

    def directions(self, x_final: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x_final [B, d] float32, targets [B, 2] (chosen, runner-up) -> u [B, 2, d] and c [B, 2],
        both over TARGETS (difference, chosen logit)."""
        u, const = self.final.directions(x_final, targets)
        return (torch.stack([u[:, 0] - u[:, 1], u[:, 0]], 1), torch.stack([const[:, 0] - const[:, 1], const[:, 0]], 1))

    def residual_parts(self, layers: list[int], outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """outputs [2L, B, d] float32 (the attention outputs of `layers`, then their MLP outputs) -> what
        each adds to the residual stream [2L, B, d], and the attention outputs' frozen post-norm factor
        w_o / σ_o [L, B, d] (None where the block adds its outputs as they are)."""
        if self.post_gain is None:
            return outputs, None
        L = len(layers)
        gain = self.post_gain[layers].to(outputs.device).transpose(0, 1).reshape(2 * L, -1)  # attention, then MLP
        eps = self.post_eps[layers].to(outputs.device).T.reshape(2 * L)
        sigma = (outputs.pow(2).mean(-1) + eps[:, None]).sqrt()  # [2L, B]: each norm's input, as it computes it
        factor = gain[:, None, :] / sigma[:, :, None]
        return outputs * factor, factor[:L]

    def heads(
        self, layers: list[int], z: torch.Tensor, u: torch.Tensor, attn_factor: torch.Tensor | None = None
    ) -> torch.Tensor:
        """z [L, B, heads × head_dim] (the output projections' inputs), u [B, 2, d], attn_factor [L, B, d]
        or None (`residual_parts`) -> [L, B, 2, heads]: z_h · (W_O,h^T (u ⊙ factor)), i.e. each head's
        output as the residual stream receives it, projected on u."""
        L, B = z.shape[0], z.shape[1]
        # u W_O for every layer: [L, B, 2, heads × head_dim] (one small matmul per layer, no stacked copy of W_O)
        v = torch.stack(
            [
                (u if attn_factor is None else u * attn_factor[n][:, None, :]) @ self.w_o[layer].to(u.dtype)
                for n, layer in enumerate(layers)
            ],
            0,
        )
        per = z.float()[:, :, None, :] * v
        return per.reshape(L, B, 2, self.n_heads, self.head_dim).sum(-1)
