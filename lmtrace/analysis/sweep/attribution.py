"""Attribution patching (`lmtrace sweep --method attribution`): every cell's effect estimated from one
forward and one backward per sequence (AtP, Kramár et al. 2024, "AtP*").

  estimate   effect(cell) ~ sum over the cell's edited positions and columns of
             d metric / d component  x  (edited value - unedited value),
             the gradient taken on the unedited forward. The edited value is the sweep's own edit:
             zero (-> 0), mean (-> the component's mean, `component_means`), patch (-> the source
             run's value at the same position); `layers` is the block's output replaced by its input
             (zero) or by input + mean contribution (mean). One backward per measured (step, metric).
  metrics    logprob, prob and logit_diff are differentiable; `kl` has zero gradient at the unedited
             forward (its first-order estimate is 0) and `rank` is piecewise constant: both are
             stored as NaN (not estimated).
  positions  `--over positions` hides one key position from every query: the estimate is AtP*'s QK
             fix, the attention pattern of every layer and head recomputed exactly with that key
             removed (softmax over the other keys), dotted with the gradient of the metric w.r.t. the
             pattern; the linear estimate through the pattern does not exist for a masked key.
  GradDrop   (`graddrop=True`) AtP*'s cancellation check: for each layer l the gradient recomputed
             with the gradient through layer l's attention and MLP outputs set to zero; per cell
             (1 / (L - 1)) * sum over l of |estimate_l| (estimate_l = the plain estimate for l at or
             below the cell's layer, which the drop does not reach). L - 1 extra backwards per
             (step, metric).

The components are read with the hooks every edit and patch uses (`capture/component_hooks.py`).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch

from ...capture.component_hooks import edit_component, read_component
from ...features.sites import at_site
from .cells import Cell
from .feature_engine import feature_deltas, source_key
from .metrics import Metric

DIFFERENTIABLE = ("logprob", "prob", "logit_diff")
COMPONENT_KIND = {"head": "head", "attn": "attn", "mlp": "mlp", "neuron": "ffn", "resid": "resid", "layer": "layer"}


@dataclass
class Estimates:
    """values[metric]: [cells, steps] estimated edited value (baseline + estimated effect; NaN for the
    metrics not estimated); graddrop[metric]: [cells, steps] or None; base_logits [n_steps, V] the
    unedited logits of steps 0.. (row s: step s)."""

    values: dict
    graddrop: dict | None
    base_logits: torch.Tensor


class _Drop(torch.autograd.Function):
    """Identity forward; backward zeroes the gradient when state['drop'] is this layer."""

    @staticmethod
    def forward(ctx, x, layer, state):
        ctx.layer, ctx.state = layer, state
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (torch.zeros_like(grad) if ctx.state.get("drop") == ctx.layer else grad), None, None


def _metric_scalar(m: Metric, row: torch.Tensor, token: int) -> torch.Tensor:
    if m.name == "logit_diff":
        a, b = m.tokens
        return row[a] - row[b]
    lp = row.log_softmax(-1)[token]
    return lp if m.name == "logprob" else lp.exp()


def estimate(
    adapter,
    ids: list[list[int]],
    prompt_len: int,
    steps: list[int],
    tokens: list[list[int]],
    cells: list[Cell],
    metrics: list[Metric],
    edit: str,
    *,
    means: dict | None = None,
    sources=None,
    from_step: int = 0,
    graddrop: bool = False,
    features=None,
    value: float | None = None,
) -> list[Estimates]:
    """The attribution estimate of every cell on K sequences of one layout (`ids[q]`: prompt + generated
    tokens; the same prompt length and measured `steps`; step s is read at position prompt_len - 1 + s),
    in one forward and one backward per (step, metric): the K metrics are summed, and a sequence's
    metric depends on its own row only. sources[q]: sequence q's patch source (SourceValues from
    position 0). The edits apply at positions prompt_len - 1 + from_step and later (every position
    without from_step). `--over positions` cells take one sequence at a time (K = 1). Feature cells
    (`features`: the SweepSae): the gradient at the SAE's hook dotted with the edit's change of the
    activation, the decoder direction times the latent's change (`feature_engine.feature_deltas`)."""
    model = adapter.model
    device = next(model.parameters()).device
    last = max(steps)
    T = prompt_len + last
    K = len(ids)
    edit_start = prompt_len - 1 + from_step if from_step else 0
    kinds = sorted(
        {(COMPONENT_KIND[c.component], c.layer) for c in cells if c.component not in ("position", "feature")}
    )
    n_layers = len(adapter.layers)
    saved: dict = {}
    layer_inputs: dict = {}
    state: dict = {}
    with ExitStack() as stack, torch.enable_grad():
        _hook_components(stack, adapter, kinds, saved, layer_inputs, state if graddrop else None)
        if features is not None:
            stack.enter_context(at_site(adapter, features.site, lambda x: saved.__setitem__(source_key(features), x)))
        want_patterns = any(c.component == "position" for c in cells)
        if want_patterns and K != 1:
            raise ValueError("position cells are estimated one sequence at a time")
        x = torch.tensor([row[:T] for row in ids], dtype=torch.long, device=device)
        logits, patterns = _forward(model, x, last, want_patterns, n_layers)
        deltas = _deltas(cells, saved, layer_inputs, edit, means or {}, sources, edit_start, T)
        if features is not None:  # (feature, Site, id) -> its change of the hook's activation
            deltas.update(feature_deltas(features, saved, cells, edit, value, sources, T, edit_start))
        tensors = list(saved) + (["pattern"] if patterns else [])
        inputs = [saved[k] for k in saved] + patterns
        position_delta = _pattern_deltas(patterns, cells, from_step, prompt_len) if patterns else None
        values = {m.key: np.full((K, len(cells), len(steps)), np.nan) for m in metrics}
        drops = {m.key: np.full((K, len(cells), len(steps)), np.nan) for m in metrics} if graddrop else None
        for m in metrics:
            if m.name not in DIFFERENTIABLE:
                continue
            for j, st in enumerate(steps):
                per_seq = [_metric_scalar(m, logits[q, st], tokens[q][st]) for q in range(K)]
                scalar = torch.stack(per_seq).sum()
                grads = torch.autograd.grad(scalar, inputs, retain_graph=True, allow_unused=True)
                for q in range(K):
                    est = _contract(tensors, grads, deltas, position_delta, cells, adapter, q)
                    values[m.key][q, :, j] = float(per_seq[q].detach()) + est
                    if graddrop:
                        drops[m.key][q, :, j] = _graddrop(
                            tensors, inputs, scalar, est, deltas, position_delta, cells, adapter, state, n_layers, q
                        )
    return [
        Estimates(
            {k: v[q] for k, v in values.items()},
            None if drops is None else {k: v[q] for k, v in drops.items()},
            logits[q].detach(),
        )
        for q in range(K)
    ]


def _hook_components(stack: ExitStack, adapter, kinds, saved: dict, layer_inputs: dict, drop_state) -> None:
    """Hooks (removed by `stack`) that make the input embeddings a leaf needing grad and read every component
    in `kinds` into `saved` ((kind, layer) -> tensor; a `layer` cell its block's output, its input into
    `layer_inputs`); with `drop_state` (GradDrop) every layer's attention and MLP output pass through `_Drop`."""
    emb = adapter.model.get_input_embeddings()
    stack.callback(
        emb.register_forward_hook(lambda m, a, o: None if o.requires_grad else o.detach().requires_grad_(True)).remove
    )
    for kind, layer in kinds:
        if kind == "layer":
            block = adapter.layers[layer]
            stack.callback(
                block.register_forward_pre_hook(
                    lambda m, a, k, layer=layer: layer_inputs.__setitem__(layer, a[0] if a else k["hidden_states"]),
                    with_kwargs=True,
                ).remove
            )
            stack.callback(
                read_component(
                    adapter, "resid", layer, lambda x, layer=layer: saved.__setitem__(("layer", layer), x)
                ).remove
            )
        else:
            stack.callback(
                read_component(adapter, kind, layer, lambda x, key=(kind, layer): saved.__setitem__(key, x)).remove
            )
    if drop_state is not None:
        for layer in range(len(adapter.layers)):
            for kind in ("attn", "mlp"):
                stack.callback(
                    edit_component(
                        adapter, kind, layer, lambda x, layer=layer: _Drop.apply(x, layer, drop_state)
                    ).remove
                )


def _forward(model, x: torch.Tensor, last: int, want_patterns: bool, n_layers: int) -> tuple[torch.Tensor, list]:
    """(logits [K, steps 0..last, V] as float, every layer's attention pattern when `want_patterns` else [])
    of the unedited forward over `x`."""
    out = model(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        use_cache=False,
        logits_to_keep=last + 1,
        output_attentions=want_patterns,
    )
    logits = out.logits.float()  # [K, steps 0..last, V]
    patterns: list = []
    if want_patterns:
        patterns = list(out.attentions or [])
        if len(patterns) != n_layers or any(p is None for p in patterns):
            from ...exits.errors import SpecError

            raise SpecError(
                "--over positions --method attribution needs the attention pattern: load the model with eager attention"
            )
    return logits, patterns


def _graddrop(tensors, inputs, scalar, est, deltas, position_delta, cells, adapter, state, n_layers, q) -> np.ndarray:
    """(1 / (L - 1)) * sum over layers l of |the estimate with layer l's attention and MLP output gradients
    dropped|; a drop at or below a cell's layer does not reach it (its estimate_l is the plain one)."""
    layer_of = np.array([-1 if c.component == "position" else c.layer for c in cells])
    total = np.zeros(len(cells))
    for drop in range(n_layers):
        reached = layer_of < drop  # a position cell edits every layer's attention: every drop reaches it
        if not reached.any():
            total += np.abs(est)
            continue
        state["drop"] = drop
        try:
            d = _contract(
                tensors,
                torch.autograd.grad(scalar, inputs, retain_graph=True, allow_unused=True),
                deltas,
                position_delta,
                cells,
                adapter,
                q,
            )
        finally:
            state.pop("drop", None)
        total += np.abs(np.where(reached, d, est))
    return total / max(1, n_layers - 1)


def _deltas(cells, saved, layer_inputs, edit, means, sources, edit_start, T) -> dict:
    """(kind, layer) -> the edit's change of the component, [K, T, width], zero before edit_start (and where a
    patch source is shorter)."""
    from .engine import MEAN_KIND

    out = {}
    for key, value in saved.items():
        kind, layer = key
        if kind == "feature":  # feature cells: feature_engine.feature_deltas
            continue
        x = value.detach()
        if edit == "zero":
            target = torch.zeros_like(x) if kind != "layer" else layer_inputs[layer].detach()
        elif edit == "mean":
            comp = {"ffn": "neuron"}.get(kind, kind)
            mean = means[(MEAN_KIND.get(comp, kind), layer)].to(x.dtype).to(x.device)
            target = mean.expand_as(x) if kind != "layer" else layer_inputs[layer].detach() + mean
        else:
            target = x.clone()
            for q, source in enumerate(sources):
                src = source.values[(kind, layer)].to(x.dtype).to(x.device)  # row i: position source.start + i
                n = min(T, source.start + src.shape[0])
                target[q, source.start : n] = src[: n - source.start]
        d = (target - x).float()
        d[:, :edit_start] = 0
        out[key] = d
    return out


def _pattern_deltas(patterns, cells, from_step, prompt_len) -> dict:
    """AtP*'s QK fix for a hidden key position p: per layer, the exact pattern with key p removed from
    every query's softmax (the others renormalised) minus the unedited pattern, [heads, T, T]. With
    from_step only the queries from its position on are edited. A query that could see only p keeps
    its row (nothing left to attend to)."""
    out = {}
    q0 = prompt_len - 1 + from_step if from_step else 0
    for c in cells:
        if c.component != "position":
            continue
        p = c.position
        per_layer = []
        for A in patterns:
            a = A[0].detach().float()  # [H, T, T]
            keep = a.clone()
            keep[..., p] = 0
            total = keep.sum(-1, keepdim=True)
            new = torch.where(total > 0, keep / total.clamp_min(1e-30), a)
            d = new - a
            d[:, :q0] = 0
            per_layer.append(d)
        out[p] = per_layer
    return out


def _contract(keys, grads, deltas, position_delta, cells, adapter, q: int = 0) -> np.ndarray:
    """Per cell of sequence q: sum over its positions and columns of gradient x delta. keys: the names of
    the first grads (then, with position_delta, one gradient per layer's attention pattern)."""
    n = len(keys) - (1 if position_delta is not None else 0)
    g = dict(zip(keys[:n], grads[:n]))
    pattern_grads = grads[n:]
    per: dict = {}  # (kind, layer) -> [T, columns] contributions
    for key, d in deltas.items():
        grad = g.get(key[:2])  # a feature's delta: (feature, Site, id), its gradient the Site's
        prod = torch.zeros_like(d[q]) if grad is None else grad[q].float() * d[q]
        if key[0] == "head":
            prod = prod.unflatten(-1, (-1, adapter.head_dim)).sum(-1)
        elif key[0] != "ffn":
            prod = prod.sum(-1, keepdim=True)
        per[key] = prod.double().cpu().numpy()
    out = np.zeros(len(cells))
    feature_key = {k[2]: k for k in per if k[0] == "feature"}  # feature id -> its key
    for i, c in enumerate(cells):
        if c.component == "position":
            out[i] = float(
                sum(
                    float((gr[0].float() * d).sum())
                    for gr, d in zip(pattern_grads, position_delta[c.position])
                    if gr is not None
                )
            )
            continue
        prod = per[feature_key[c.neuron]] if c.component == "feature" else per[(COMPONENT_KIND[c.component], c.layer)]
        col = c.head if c.component == "head" else c.neuron if c.component == "neuron" else 0
        column = prod[:, col]
        out[i] = float(
            column.sum() if c.position is None else (column[c.position] if c.position < column.shape[0] else 0.0)
        )
    return out
