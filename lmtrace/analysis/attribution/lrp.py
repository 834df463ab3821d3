"""Layer-wise relevance propagation (`-m lrp`): AttnLRP's rules with CP-LRP attention (`lrp_rules`), one
forward and one backward pass per step.

  score_i = Σ_d e_{i,d} · ĝ_{i,d}      ĝ = the gradient of f under the rules' modified backward pass

Conservation: f = Σ_i score_i + bias_relevance, where bias_relevance = Σ_b b · ĝ_b over every bias
parameter (linear, lm_head), every LayerNorm-form offset and every learned position embedding (GPT-2, OPT),
the terms the rules let absorb relevance. `conservation_error` = f − (Σ_i score_i + bias_relevance) is
recorded per step; the rules make it zero up to float32 rounding. It is the method's own check: a result
whose relative error exceeds CONSERVATION_TOLERANCE has `conserved: false` (`conservation_shortfall` says
so in words), which explain notes and `--strict` turns into exit 1.

Components (archived beside the scores, [layer] / [layer, head]): the relevance entering each layer's
attention output and MLP output (Σ over positions and dims of output · ĝ), per head on the output
projection's input split by head, and the output projection's bias share, so that
attention[l] = Σ_h heads[l, h] + attention_bias[l]."""

from __future__ import annotations

import math
from contextlib import ExitStack

import numpy as np
import torch

from ...archive.reader import Run
from ...capture.arch import adapter_for
from ...capture.devices import is_spread
from ...exits.errors import SpecError
from .lrp_rules import installed, soft_capped
from .registry import MethodResult, StepContext, register
from .settings import Settings
from .targets import target_values

CONSERVATION_TOLERANCE = 1e-4  # |f − (Σ scores + bias relevance)| / max(1, |f|) a result must meet: its own check
RULES = {
    "norms": "identity (1/rms, 1/std constant)",
    "activations": "identity",
    "gated_product": "uniform (half to each factor)",
    "attention": "CP-LRP (attention weights constant)",
    "linear": "gradient (epsilon 0); biases absorb their share",
    "final_softcap": "identity",
}


def check(run: Run, settings: Settings) -> None:
    """Refusals that need no weights: the logprob quantity and mixture-of-experts families."""
    if settings.quantity != "logit":
        raise SpecError(
            "--method lrp explains logits: its conservation f = Σ relevance + biases holds for a logit "
            "or a difference of logits, not a log-probability; use --quantity logit "
            "(--target contrast explains chosen − runner-up)"
        )
    model = run.manifest.get("model") or {}
    if model.get("architecture_family") == "moe":
        raise SpecError(
            f"--method lrp: run {run.id}'s model {model.get('class')} routes tokens to experts (its MLP "
            f"is a mixture of experts); the routing has no relevance rule, so lrp covers the dense "
            f"families only (docs/explain.md)"
        )


def _leak_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Every bias parameter and every learned position embedding (any embedding but the input one)."""
    token_embed = model.get_input_embeddings()
    out = [p for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] == "bias"]
    out += [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding) and m is not token_embed]
    return out


def relevance(ctx: StepContext, extra=None) -> dict:
    """One relevance pass of the step: {"scores" [n], "components" {...}, f, bias relevance} (float64 sums).

    `extra(adapter)`: a context manager, installed between the rules and the pass's own hooks, that yields an object whose
    `leaves()` (after the forward) are more tensors to read relevance at (an SAE's nodes, `feature_nodes`);
    their (leaf, gradient) pairs are returned as "extra"."""
    sc, s = ctx.scorer, ctx.settings
    adapter = adapter_for(sc.model)
    if is_spread(sc.model):
        raise SpecError("--method lrp: the model is spread over devices; load it on one device (--device)")
    if not torch.is_floating_point(sc.embed.weight):
        raise SpecError(
            f"--method lrp: the model's weights are {sc.embed.weight.dtype}, gradients are unavailable; "
            f"explain needs a float model"
        )
    L = adapter.n_layers
    saved: dict[str, list] = {"attn": [None] * L, "mlp": [None] * L, "heads": [None] * L}

    def keep(store, i, pre=False):
        if pre:
            return lambda m, args: store.__setitem__(i, args[0])
        return lambda m, args, out: store.__setitem__(i, out[0] if isinstance(out, tuple) else out)

    leak = _leak_parameters(sc.model)
    e = sc.embeddings(ctx.ids).requires_grad_(True)
    with ExitStack() as stack:
        probe = stack.enter_context(installed(adapter))
        # after the rules (an SAE's nodes at a gated MLP's down projection replace its halved input), before the
        # pass's own hooks (which then read the spliced tensors)
        nodes = stack.enter_context(extra(adapter)) if extra is not None else None
        for p in leak:
            stack.callback(p.requires_grad_, p.requires_grad)
            p.requires_grad_(True)
        for i in range(L):
            for handle in (
                adapter.attn(i).register_forward_hook(keep(saved["attn"], i)),
                adapter.mlp(i).register_forward_hook(keep(saved["mlp"], i)),
                adapter.o_proj(i).register_forward_pre_hook(keep(saved["heads"], i, pre=True)),
            ):
                stack.callback(handle.remove)
        with torch.enable_grad():
            logits = soft_capped(sc.logits(e[None]), adapter.final_softcap)
            y = target_values(logits, ctx.chosen_id, ctx.runner_up_id, s.target, "logit")
            offsets = list(probe.offsets)  # the LayerNorm-form rule's constant offsets, one per call
            more = nodes.leaves() if nodes is not None else []
            grads = torch.autograd.grad(
                y.sum(), [e, *saved["attn"], *saved["mlp"], *saved["heads"], *leak, *offsets, *more], allow_unused=True
            )
    out = _collect(adapter, e, grads[: len(grads) - len(more)], leak, offsets, saved)
    return {**out, "f": float(y.item()), "extra": list(zip(more, grads[len(grads) - len(more) :]))}


def _rel(x, g) -> float:
    return 0.0 if g is None else float((x.detach().double() * g.double()).sum())


def _collect(adapter, e, grads, leak, offsets, saved) -> dict:
    """Scores per position, bias relevance and the components from the pass's gradients."""
    L, H, hd = adapter.n_layers, adapter.n_heads, adapter.head_dim
    g_e, rest = grads[0], grads[1:]
    g_attn, g_mlp, g_heads = rest[:L], rest[L : 2 * L], rest[2 * L : 3 * L]
    g_leak, g_offsets = rest[3 * L : 3 * L + len(leak)], rest[3 * L + len(leak) :]
    scores = (
        torch.zeros(e.shape[0], dtype=torch.float64) if g_e is None else (e.detach().double() * g_e.double()).sum(-1)
    )
    bias_rel = sum(_rel(p, g) for p, g in zip(leak, g_leak)) + sum(_rel(b, g) for b, g in zip(offsets, g_offsets))
    heads = np.zeros((L, H))
    attn_bias = np.zeros(L)
    for i in range(L):
        if g_heads[i] is not None:
            heads[i] = (
                (saved["heads"][i].detach().double() * g_heads[i].double()).reshape(-1, H, hd).sum((0, 2)).cpu().numpy()
            )
        b = getattr(adapter.o_proj(i), "bias", None)
        if b is not None and g_attn[i] is not None:
            attn_bias[i] = float((b.detach().double() * g_attn[i].double().reshape(-1, b.shape[0]).sum(0)).sum())
    components = {
        "attention": np.array([_rel(saved["attn"][i], g_attn[i]) for i in range(L)]),
        "mlp": np.array([_rel(saved["mlp"][i], g_mlp[i]) for i in range(L)]),
        "heads": heads,
        "attention_bias": attn_bias,
    }
    return {"scores": scores.cpu().numpy(), "components": components, "bias_relevance": bias_rel}


@register(
    "lrp",
    needs_model=True,
    check=check,
    shortfall=lambda info, s: conservation_shortfall(info),
    settings=lambda s: {"target": s.target, "quantity": s.quantity, "rules": RULES},
    description="layer-wise relevance propagation (AttnLRP rules, CP-LRP attention): one backward pass, "
    "conserving f, with relevance per layer's attention/MLP and per head",
)
def lrp(ctx: StepContext) -> MethodResult:
    r = relevance(ctx)
    total = float(r["scores"].sum())
    error = r["f"] - (total + r["bias_relevance"])
    relative = abs(error) / max(1.0, abs(r["f"])) if math.isfinite(error) else math.inf
    info = {
        "f_x": r["f"],
        "sum_scores": total,
        "bias_relevance": r["bias_relevance"],
        "conservation_error": error,
        "conservation_error_relative": relative,
        "conserved": relative <= CONSERVATION_TOLERANCE,
        "conservation_tolerance": CONSERVATION_TOLERANCE,
    }
    return MethodResult(
        r["scores"].astype(np.float32), info, components={k: v.astype(np.float32) for k, v in r["components"].items()}
    )


def conservation_shortfall(info: dict) -> str | None:
    """None if an lrp result conserves f to CONSERVATION_TOLERANCE, else what failed, in words."""
    if info.get("conserved", True):
        return None
    total = info["sum_scores"] + info["bias_relevance"]
    return (
        f"does not conserve: f = {info['f_x']:.6g} but Σ scores + bias relevance = {total:.6g} (relative "
        f"error {info['conservation_error_relative']:.2e} > {CONSERVATION_TOLERANCE:g}): a step of the model "
        f"has no relevance rule, so the scores do not add up to f; do not read them as its decomposition "
        f"(docs/explain.md, 'When lrp does not conserve')"
    )
