"""The relevance-propagation rules, installed on a loaded float32 eager model for one relevance pass.

LRP is computed the efficient way AttnLRP (Achtibat et al., ICML 2024) and its library lxt compute it:
forward the model with each non-linear step rewritten as a linear map whose coefficients are held
constant (detached) at their forward values, then gradient × input of that modified backward pass is
the relevance. Every forward value is unchanged; only the backward pass differs. The rules:

  normalisers                 identity rule: the per-token scale 1/rms (1/std) is a constant, so the
  (RMS and LayerNorm forms)   norm is the linear map x ↦ x·(y/x) (LayerNorm form: centred x, plus its
                              offset b, a constant whose relevance is reported with the biases')
  element-wise activations    identity rule: act(x) = x·(act(x)/x) with the ratio constant, so the
  (SiLU, GELU, ReLU, tanh)    relevance passes through unchanged
  gated MLP product           uniform rule: act(gate)·up gives half its relevance to each factor
                              (the gradient entering the down projection is halved)
  softmax attention           CP-LRP (Ali et al., ICML 2022): query and key are detached, so the
                              attention weights are constants and relevance flows through the values
                              only (and, within them, through rotary-free v); exact conservation
  linear layers, residuals    the plain gradient (ε = 0 LRP); biases absorb their share
  final logit soft-capping    identity rule on cap·tanh(z/cap)

Components are recognised by what they do, never by their class name. The attention modules and the MLP
down projections (for the gated product) are where the architecture adapter (`capture/arch.py`) says.
Every other leaf module that relevance flows through (its input depends on the input embeddings and so
does its output) is classified on the step's own activations, inside the relevance pass (`_Probe`):
linear, embedding and dropout modules and the activation classes of torch/transformers are known by type;
any other module is called again (hooks bypassed, no gradient) on variations of its actual input and is

  element-wise   f(x with every other element doubled) leaves the untouched elements' outputs as they were,
                 and f(x shifted by one element) is f(x) shifted by one element: the identity rule
  a normaliser   f(x) = s_t · g ⊙ z(x_t) + b with z(x) = x (RMS form, b = f(0) = 0) or x − mean(x)
                 (LayerNorm form, b = f(0)), g read from f on a large probe vector, and the per-token
                 scale s_t = 1/√(mean z(x_t)² + ε) for one ε ≥ 0: the norm rule
  affine         f(2x) − f(0) = 2 (f(x) − f(0)): the gradient (its offset is absorbed like a bias)

and a module that is none of these (or has several inputs or outputs that carry relevance) is refused in one
line naming it (`SpecError`, exit 2). A non-linearity that is no module of its own (a normaliser written
inline in a block's `forward`) cannot be probed: it shows in the conservation check every result carries
(`lrp.CONSERVATION_TOLERANCE`).

`installed` puts the rules on a model and removes them in a `finally`; `refusal` says (before any pass) why
a model cannot be explained at all (a router, a non-eager attention kernel)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import torch

from ...capture.arch import Adapter
from ...exits.errors import SpecError

PROBE_TOLERANCE = 1e-3  # relative: how closely a module's outputs must follow a form to be classified by it
EXACT_TOLERANCE = 1e-5  # relative: element-wise modules reproduce the same values (up to vectorisation order)
NORM_PROBE_SCALE = 100.0  # the probe vector's rms: large enough that ε ≤ 1 changes f by ≤ 5e-5 relative


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


def _linear_classes() -> tuple[type, ...]:
    """Module types whose forward is linear (or affine) by definition: the gradient is their rule."""
    from transformers.pytorch_utils import Conv1D

    return (torch.nn.Linear, torch.nn.Embedding, torch.nn.Dropout, torch.nn.Identity, Conv1D)


def _carries(t) -> bool:
    """A floating tensor that depends on the input embeddings (relevance flows through it)."""
    return torch.is_tensor(t) and t.requires_grad and torch.is_floating_point(t)


def _close(a: torch.Tensor, b: torch.Tensor, scale: float, tol: float) -> bool:
    return bool(
        torch.isfinite(a).all() and torch.isfinite(b).all() and (a - b).abs().max().item() <= tol * scale + 1e-30
    )


def _scale(*xs: torch.Tensor) -> float:
    return max(float(x.abs().max()) if x.numel() else 0.0 for x in xs)


def _elementwise(f, x: torch.Tensor, y: torch.Tensor) -> bool:
    """f acts on each element alone, by one function: doubling every other element leaves the others' outputs
    unchanged, and shifting the elements by one (across dims and tokens) shifts the outputs by one."""
    if y.shape != x.shape or x.numel() < 2:
        return False
    odd = (torch.arange(x.numel(), device=x.device) % 2 == 1).reshape(x.shape)
    y_half = f(torch.where(odd, 2 * x, x))
    if y_half.shape != y.shape or not _close(y_half[~odd], y[~odd], _scale(y), EXACT_TOLERANCE):
        return False
    y_roll = f(x.flatten().roll(1).reshape(x.shape))
    return _close(y_roll.flatten(), y.flatten().roll(1), _scale(y), EXACT_TOLERANCE)


def _norm_form(f, x: torch.Tensor, y: torch.Tensor) -> str | None:
    """'rms' or 'layer' if f(x) = s_t · g ⊙ z(x_t) + b over the last dim with s_t = 1/√(mean z(x_t)² + ε)
    for one ε ≥ 0, checked on x itself (float64); None otherwise. (Where ε dwarfs mean z², the module is
    close to the diagonal map x ↦ x·g/√ε, for which the norm rule and the gradient agree.)"""
    if y.shape != x.shape or x.shape[-1] < 2:
        return None
    d = x.shape[-1]
    X, Y = x.double().reshape(-1, d), y.double().reshape(-1, d)
    b = f(torch.zeros_like(x)).double().reshape(-1, d)
    alt = torch.ones(d, dtype=x.dtype, device=x.device)
    alt[1::2] = -1
    probe = f((NORM_PROBE_SCALE * alt).expand_as(x).contiguous()).double().reshape(-1, d)
    scale = _scale(Y)
    for form in ("rms", "layer"):
        if form == "rms" and not _close(b, torch.zeros_like(b), scale, PROBE_TOLERANCE):
            continue
        b0 = b[:1] if form == "layer" else torch.zeros_like(b[:1])
        if form == "layer" and not _close(b, b0.expand_as(b), scale, PROBE_TOLERANCE):
            continue  # the offset is one vector, whatever the token
        z = (lambda v: v - v.mean(-1, keepdim=True)) if form == "layer" else (lambda v: v)
        pz = z(NORM_PROBE_SCALE * alt.double())
        g = (probe[0] - b0[0]) * pz.pow(2).mean().sqrt() / pz  # pz has no zero entry (|mean| < 1 of ±1)
        Z = z(X)
        basis = Z * g
        den = basis.pow(2).sum(-1)
        keep = den > 0
        if not keep.any():
            continue
        s = torch.where(keep, ((Y - b0) * basis).sum(-1) / torch.where(keep, den, 1.0), 0.0)
        if not _close(s[:, None] * basis + b0, Y, scale, PROBE_TOLERANCE) or not (s[keep] > 0).all():
            continue
        ms = Z[keep].pow(2).mean(-1)
        v = 1.0 / s[keep].pow(2)  # = ms + ε for a normaliser
        eps = (v - ms).median()
        if eps >= -PROBE_TOLERANCE * ms.min() and ((v - ms - eps).abs() <= PROBE_TOLERANCE * v).all():
            return form
    return None


def _affine(f, x: torch.Tensor, y: torch.Tensor) -> bool:
    """f(2x) − f(0) = 2 (f(x) − f(0)) on x itself."""
    y2, y0 = f(2 * x), f(torch.zeros_like(x))
    if y2.shape != y.shape or y0.shape != y.shape:
        return False
    return _close(y2 - y0, 2 * (y - y0), _scale(y2 - y0), PROBE_TOLERANCE)


class _Probe:
    """Forward hooks on every leaf module: classify those relevance flows through (on the pass's own
    activations) and apply their rule; refuse one with no rule. `offsets` collects the constant offsets the
    LayerNorm-form rule adds (leaf tensors: their gradient gives the relevance they absorb)."""

    def __init__(self, model: torch.nn.Module):
        self.names = {m: name for name, m in model.named_modules()}
        self.acts = _activation_classes()
        self.linear = _linear_classes()
        self.offsets: list[torch.Tensor] = []
        self.kinds: dict[str, str] = {}  # module name -> what it was classified as (the last call's)

    def modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [m for m in model.modules() if next(m.children(), None) is None and not isinstance(m, self.linear)]

    def hook(self, module, args, kwargs, output):
        inputs = [(i, a) for i, a in enumerate(args) if _carries(a)]
        inputs += [(k, v) for k, v in kwargs.items() if _carries(v)]
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        if not inputs or not any(_carries(o) for o in outputs):
            return None  # relevance does not flow through this call (rotary tables, position ids, ...)
        if not torch.is_tensor(output):
            return self.refuse(module, "returns several tensors that carry relevance")
        if len(inputs) > 1:
            return self.refuse(module, f"takes {len(inputs)} inputs that carry relevance (a product or mix of them)")
        slot, x = inputs[0]
        if isinstance(module, self.acts):
            return self.identity(module, "activation", x, output)

        def f(v):  # the module on another value of its relevance-carrying input, hooks bypassed
            if isinstance(slot, int):
                return module.forward(*args[:slot], v, *args[slot + 1 :], **kwargs)
            return module.forward(*args, **{**kwargs, slot: v})

        kind = self.classify(f, x.detach(), output.detach())
        if kind == "element-wise" or kind == "normaliser (RMS form)":
            return self.identity(module, kind, x, output)
        if kind == "normaliser (LayerNorm form)":
            with torch.no_grad():
                b = f(torch.zeros_like(x.detach())).reshape(-1, x.shape[-1])[0]
            return self.centred(module, x, output, b)
        if kind == "affine":
            self.kinds[self.names.get(module, "?")] = kind
            return None
        return self.refuse(
            module,
            "is neither affine, element-wise nor a normaliser (x·g/rms(x) or "
            "(x − mean)/std·g + b) on this step's activations",
        )

    @staticmethod
    @torch.no_grad()
    def classify(f, x: torch.Tensor, y: torch.Tensor) -> str | None:
        """What the module f does on its actual input x (output y), tried in this order; None: none of these."""
        if _elementwise(f, x, y):
            return "element-wise"
        form = _norm_form(f, x, y)
        if form is not None:
            return {"rms": "normaliser (RMS form)", "layer": "normaliser (LayerNorm form)"}[form]
        return "affine" if _affine(f, x, y) else None

    def identity(self, module, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.kinds[self.names.get(module, "?")] = kind
        return x * _ratio(y, x)

    def centred(self, module, x: torch.Tensor, y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """y = (x − mean x)·((y − b)/(x − mean x)) + b, b a leaf tensor (its relevance is the offset's)."""
        self.kinds[self.names.get(module, "?")] = "normaliser (LayerNorm form)"
        offset = b.detach().clone().requires_grad_(True)
        self.offsets.append(offset)
        xc = x - x.mean(-1, keepdim=True)
        return xc * _ratio(y - offset, xc) + offset

    def refuse(self, module, why: str):
        name = self.names.get(module, "?")
        raise SpecError(
            f"--method lrp: module {name} ({type(module).__name__}) {why}; lrp has no rule for it, "
            f"so it cannot explain this model (docs/explain.md, 'Layer-wise relevance propagation')"
        )


def _constant_weights(inner):
    """The model's own eager attention with query and key detached: weights constant, values carry relevance."""

    def attention(module, query, key, value, *args, **kwargs):
        return inner(module, query.detach(), key.detach(), value, *args, **kwargs)

    attention.lmtrace_lrp = True
    return attention


def refusal(adapter: Adapter) -> str | None:
    """Why the rules cannot be applied to this model at all (one line naming the module), or None. Modules
    with no rule are found during the pass, on its activations (`_Probe`)."""
    model = adapter.model
    if adapter.has_routers or adapter.family.mlp_down is None:
        mlp = adapter.mlp(0)
        return (
            f"{type(model).__name__}: layer 0's MLP ({type(mlp).__name__}) routes each token to experts; the "
            f"routing has no relevance rule here, so lrp covers the dense families only (docs/explain.md)"
        )
    if model.config._attn_implementation != "eager":
        return (
            f"{type(model).__name__}: lrp needs the eager attention kernel (loaded with "
            f"{model.config._attn_implementation})"
        )
    return None


def _halve_input(module, args):
    return (_HalveGradient.apply(args[0]), *args[1:])


@contextmanager
def installed(adapter: Adapter) -> Iterator[_Probe]:
    """The rules on `adapter.model` (float32, eager attention, one device) for the duration; forward values
    are unchanged. Yields the probe (its `offsets`: the LayerNorm-form offsets, whose gradient after the pass
    is the relevance they absorb). Refuses (SpecError, exit 2) a model the rules do not cover, before the
    pass or, for a module with no rule, during it."""
    why = refusal(adapter)
    if why is not None:
        raise SpecError(f"--method lrp: {why}")
    model = adapter.model
    handles = []
    patched: list[tuple[object, object]] = []
    cap = getattr(model.config, "final_logit_softcapping", None)
    probe = _Probe(model)
    try:
        for m in probe.modules(model):
            handles.append(m.register_forward_hook(probe.hook, with_kwargs=True))
        if adapter.family.mlp_kind.startswith("gated"):
            for i in range(adapter.n_layers):
                handles.append(adapter.mlp_down(i).register_forward_pre_hook(_halve_input))
        for mod_name in {type(adapter.attn(i)).__module__ for i in range(adapter.n_layers)}:
            module = sys.modules[mod_name]
            inner = getattr(module, "eager_attention_forward", None)
            if inner is None:
                raise SpecError(
                    f"--method lrp: {type(model).__name__}: no eager_attention_forward in {mod_name} "
                    f"to hold the attention weights constant in"
                )
            if not getattr(inner, "lmtrace_lrp", False):
                patched.append((module, inner))
                module.eager_attention_forward = _constant_weights(inner)
        if cap is not None:  # applied by `soft_capped` on the pre-cap logits instead, with the identity rule
            model.config.final_logit_softcapping = None
        yield probe
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
