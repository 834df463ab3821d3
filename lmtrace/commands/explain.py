"""`lmtrace explain`: attribute archived generated tokens to their context positions, after the fact.

Generate first, explain later: a run (even a forward-only `capture: none` one) archives every
token; `explain` rebuilds the exact context of the requested steps from `tokens.parquet`
(prompt ids + generated ids of earlier steps), reloads the run's model in float32 with eager
attention, and scores every context position for one target quantity of the token chosen at
that step. Definitions (docs/explain.md has the full text):

  target f   chosen | runner-up | contrast (= chosen − runner-up), of the `logit` or `logprob`
             at the last context position; runner-up = the most likely archived alternative that is
             not the chosen token.
  grad_x_input          score_i = Σ_d ∂f/∂e_{i,d} · e_{i,d}     (e = input embeddings)
  integrated_gradients  score_i = Σ_d (e−b)_{i,d} · Σ_k w_k ∂f/∂e_{i,d}(b + α_k (e−b)); b = zero or
                        pad-token embedding at every position; midpoint or trapezoid rule;
                        completeness error = |Σ_i score_i − (f(e) − f(b))|
  occlusion             score_i = f(x) − f(x with position i removed from the attention mask)
  attention_rollout     R = Â_{L−1} ⋯ Â_0 with Â_l = rownorm(mean_h A_{l,h} + I); score_i = R[n−1, i]
                        (archived attention only, no model)

Methods live in the METHODS registry (`@register`); results go to `explain/` in the run directory
and an entry per method to `manifest["explain"]`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..archive import layout
from ..archive.reader import IncompleteRunWarning, Run
from ..errors import ArchiveError, LmtraceError, SpecError
from ..steps import parse_steps
from ..jsonout import json_line, strict
from ..capture.interventions import (CHAT_SPANS, EditSet, MaskExperts, MaskPositions, Steer, load_steer_vector,
                                     mean_ablation_values, parse_entries, routing_rule)
from ..archive.runs import find_run, locked, new_run_id, now_iso, read_manifest, runs_root

EXPLAIN_DIR = "explain"
SCORES_PARTS = "scores.parts"  # explain/scores.parts/<explain_id>.parquet: one Parquet dataset for all invocations
TARGETS = ("chosen", "runner-up", "contrast")
QUANTITIES = ("logit", "logprob")
BASELINES = ("mean", "scaled-mean", "pad", "zero")
IG_RULES = ("adaptive", "midpoint")
IG_DTYPES = ("float32", "float64")


# ---------------------------------------------------------------------------------------------
# Settings, targets, registry
@dataclass(frozen=True)
class Settings:
    target: str = "chosen"
    quantity: str = "logit"
    baseline: str = "mean"
    ig_steps: int = 16
    ig_rule: str = "adaptive"
    batch_size: int = 8
    ig_tolerance: float = 0.01
    ig_max_points: int = 1024
    ig_keep: str = "sink"  # integrated gradients: positions whose baseline is their own embedding ("none", "sink",
    #                        "special" = position 0 and every special token of the context, "0,3", or a mix)
    ig_dtype: str = "float32"  # integrated gradients: precision of the path's forwards and gradients
    rollout_exclude: str = ""  # attention rollout: "sink" (position 0) or positions "0,3" left out

    @property
    def rollout_excluded(self) -> tuple[int, ...]:
        """Key positions attention rollout leaves out (`--rollout-exclude`): sink = position 0."""
        return _positions(self.rollout_exclude, "--rollout-exclude")

    @property
    def ig_kept(self) -> tuple[int, ...]:
        """Positions integrated gradients keeps at their own embedding in the baseline (`--ig-keep`), besides the
        special tokens that `special` adds per context (`ig_keep_special`)."""
        if str(self.ig_keep).strip() == "none":
            return ()
        return _positions(self.ig_keep, "--ig-keep", words={"special": (0,)})

    @property
    def ig_keep_special(self) -> bool:
        """`--ig-keep special`: also keep every position whose token is one of the tokenizer's special tokens."""
        return "special" in str(self.ig_keep).replace(" ", "").split(",")

    def check(self) -> "Settings":
        if self.ig_rule == "trapezoid":
            raise SpecError("--ig-rule trapezoid: removed, it evaluates the gradient at the baseline (α = 0), where "
                            "RMSNorm/LayerNorm models are singular for the zero baseline; use adaptive (default) or midpoint")
        self.rollout_excluded  # noqa: B018 (refuses a bad --rollout-exclude before anything runs)
        self.ig_kept  # noqa: B018
        for name, value, allowed in (("--target", self.target, TARGETS), ("--quantity", self.quantity, QUANTITIES),
                                     ("--baseline", self.baseline, BASELINES), ("--ig-rule", self.ig_rule, IG_RULES),
                                     ("--ig-dtype", self.ig_dtype, IG_DTYPES)):
            if value not in allowed:
                raise SpecError(f"{name} {value!r}: expected one of {', '.join(allowed)}")
        if self.ig_steps < 1:
            raise SpecError(f"--ig-steps {self.ig_steps}: must be at least 1")
        if self.batch_size < 1:
            raise SpecError(f"--batch-size {self.batch_size}: must be at least 1")
        if not (math.isfinite(self.ig_tolerance) and 0 < self.ig_tolerance < 1):
            raise SpecError(f"--ig-tolerance {self.ig_tolerance}: must be a fraction between 0 and 1 (e.g. 0.01 = 1 %)")
        if self.ig_max_points < 4:
            raise SpecError(f"--ig-max-points {self.ig_max_points}: must be at least 4")
        return self


def _positions(text: str, option: str, words: dict[str, tuple[int, ...]] | None = None) -> tuple[int, ...]:
    """'sink' (= position 0) and/or positions like '0,3' (and the option's own `words`) -> sorted unique positions."""
    words = {"sink": (0,), **(words or {})}
    out = set()
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        if part in words:
            out.update(words[part])
            continue
        try:
            value = int(part)
        except ValueError:
            value = -1
        if value < 0:
            raise SpecError(f"{option} {text!r}: expected {' or '.join(f'`{w}`' for w in words)} or positions like 0,3")
        out.add(value)
    return tuple(sorted(out))


@dataclass
class StepContext:
    """Everything one method needs to explain one (sequence, step)."""

    run: Run
    sequence: int
    step: int
    prompt_len: int
    ids: list[int]  # the context: prompt ids + generated ids of steps < step
    chosen_id: int  # the token chosen at `step`
    runner_up_id: int  # the most likely archived alternative other than the chosen token
    archived_logprob: float
    settings: Settings
    scorer: "Scorer | None" = None

    @property
    def n(self) -> int:
        return len(self.ids)


@dataclass
class MethodResult:
    scores: np.ndarray  # [n] float32, one per context position
    info: dict = field(default_factory=dict)  # scalars recorded in the manifest (f values, errors, ...)


@dataclass(frozen=True)
class Method:
    name: str
    fn: Callable[[StepContext], MethodResult]
    needs_model: bool
    description: str
    settings: Callable[[Settings], dict]  # the settings that define its result (recorded in the manifest)
    requirements: Callable[[Run], list[str]] | None = None  # archived data it needs: list of what is missing


METHODS: dict[str, Method] = {}


def register(name: str, *, needs_model: bool, description: str, settings: Callable[[Settings], dict] | None = None,
             requirements: Callable[[Run], list[str]] | None = None):
    """Add an attribution method: `fn(ctx: StepContext) -> MethodResult` with one score per context position."""

    def wrap(fn):
        METHODS[name] = Method(name, fn, needs_model, description,
                               settings or (lambda s: {"target": s.target, "quantity": s.quantity}), requirements)
        return fn

    return wrap


def target_values(logits: torch.Tensor, chosen: int, runner_up: int, target: str, quantity: str) -> torch.Tensor:
    """[B, vocab] logits of the last position -> [B] target quantity f."""
    values = logits.double() if logits.dtype == torch.float64 else logits.float()
    if quantity == "logprob":
        values = values.log_softmax(-1)
    if target == "chosen":
        return values[:, chosen]
    if target == "runner-up":
        return values[:, runner_up]
    return values[:, chosen] - values[:, runner_up]


# ---------------------------------------------------------------------------------------------
# The model side: forwards from input embeddings
class Scorer:
    """A float32 model and the target function f(embeddings) of one step's last position."""

    def __init__(self, model: torch.nn.Module, device: torch.device, tokenizer=None):
        self.model = model
        self.device = device
        self.embed = model.get_input_embeddings()
        self.tokenizer = tokenizer
        self.pad_id = getattr(tokenizer, "pad_token_id", None)
        self.edits: "ContextEdits | None" = None  # an intervention child's edits, installed by explain_run

    def embeddings(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.embed(torch.tensor([ids], device=self.device))[0].float().detach()

    def logits(self, embeds: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [B, n, d] (mask [B, n], 1 = attend) -> last-position logits [B, vocab]."""
        B, n, _ = embeds.shape
        if mask is None:
            mask = torch.ones((B, n), dtype=torch.long, device=self.device)
        if self.edits is not None:
            self.edits.begin_forward(B, n, self.device)
            mask = self.edits.mask(mask)
        positions = torch.arange(n, device=self.device)[None].expand(B, n)
        out = self.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=False,
                         logits_to_keep=1)
        return out.logits[:, -1]

    def f(self, ctx: StepContext, embeds: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        s = ctx.settings
        return target_values(self.logits(embeds, mask), ctx.chosen_id, ctx.runner_up_id, s.target, s.quantity)


# ---------------------------------------------------------------------------------------------
# Methods
@register("grad_x_input", needs_model=True,
          description="gradient × input: Σ_d ∂f/∂e_{i,d} · e_{i,d} over the input embedding of each position")
def grad_x_input(ctx: StepContext) -> MethodResult:
    sc = ctx.scorer
    e = sc.embeddings(ctx.ids).requires_grad_(True)
    with torch.enable_grad():
        y = sc.f(ctx, e[None])
        (grad,) = torch.autograd.grad(y.sum(), e)
    scores = (grad * e.detach()).sum(-1)
    return MethodResult(scores.cpu().numpy().astype(np.float32),
                        {"f_x": float(y.item()), "sum_scores": float(scores.sum().item())})


def _ig_settings(s: Settings) -> dict:
    return {"target": s.target, "quantity": s.quantity, "baseline": s.baseline, "ig_steps": s.ig_steps,
            "ig_rule": s.ig_rule, "ig_tolerance": s.ig_tolerance, "ig_max_points": s.ig_max_points,
            "ig_keep": list(s.ig_kept), "ig_keep_special": s.ig_keep_special, "ig_dtype": s.ig_dtype,
            "path": "straight line b + α(e − b), α ∈ [0, 1]", "batch_size": s.batch_size}


GAUSS2 = (0.5 - 0.5 / math.sqrt(3.0), 0.5 + 0.5 / math.sqrt(3.0))  # Gauss–Legendre nodes on [0, 1], weights ½ each
IG_SCALE_FLOOR = 0.01  # relative errors are taken against max(|f(x) − f(b)|, this), so a near-zero change is judged absolutely


def ig_alphas(steps: int, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-grid points α_k in (0, 1) and weights w_k (Σ w_k = 1): `midpoint` α_k = (k + ½)/m.
    No rule evaluates a gradient at α = 0 (the baseline)."""
    if rule != "midpoint":
        raise SpecError(f"--ig-rule {rule!r}: fixed grids are midpoint only")
    return (np.arange(steps) + 0.5) / steps, np.full(steps, 1.0 / steps)


def baseline_embeddings(ctx: StepContext, e: torch.Tensor) -> torch.Tensor:
    """[n, d] baseline b: zero, the pad token's embedding, or the mean embedding row, at every position except the
    kept ones (`--ig-keep`, default the first), which keep their own embedding.

    Why keep the first position: in pre-norm LMs it is the attention sink, with a massive residual activation
    (norm ~2e4 on SmolLM2-135M) whatever its token. A baseline of one repeated vector makes later positions sinks
    too; the path then switches those massive activations off, which shows as cliffs in f (docs/explain.md)."""
    b = _uniform_baseline(ctx, e)
    kept = kept_positions(ctx)
    if kept:
        b[kept] = e[kept]
    return b


def kept_positions(ctx: StepContext) -> list[int]:
    """The context positions whose baseline is their own embedding: `--ig-keep` positions and, with `special`, every
    position holding a special token of the tokenizer (a chat template's <|im_start|>, <|im_end|>, ...)."""
    kept = {i for i in ctx.settings.ig_kept if i < ctx.n}
    if ctx.settings.ig_keep_special:
        special = set(getattr(ctx.scorer.tokenizer, "all_special_ids", None) or ())
        kept.update(i for i, t in enumerate(ctx.ids) if t in special)
    return sorted(kept)


def _uniform_baseline(ctx: StepContext, e: torch.Tensor) -> torch.Tensor:
    if ctx.settings.baseline == "zero":
        return torch.zeros_like(e)
    if ctx.settings.baseline in ("mean", "scaled-mean"):
        with torch.no_grad():
            w = ctx.scorer.embed.weight
            mean = w.double().mean(0).to(e.dtype).to(e.device)
            if ctx.settings.baseline == "mean":
                return mean.expand_as(e).clone()
            # the mean direction at each position's own norm: the path keeps the norm away from 0
            return mean[None] * (e.norm(dim=-1, keepdim=True) / mean.norm().clamp_min(1e-12))
    pad = ctx.scorer.pad_id
    if pad is None:
        raise SpecError("--baseline pad: the model's tokenizer has no pad token; use --baseline mean or zero")
    return ctx.scorer.embeddings([pad])[0].to(e.dtype).expand_as(e).clone()


class _IGPath:
    """f and per-position attribution densities along the straight path b + α(e − b).

    `density(α)` is [k, n]: a_i(α) = Σ_d (e − b)_{i,d} ∂f/∂x_{i,d}(b + α(e − b)), so ∫₀¹ Σ_i a_i dα = f(e) − f(b)."""

    def __init__(self, ctx: StepContext, e: torch.Tensor, b: torch.Tensor):
        self.ctx, self.sc, self.e, self.b, self.diff = ctx, ctx.scorer, e, b, e - b
        self.batch = ctx.settings.batch_size
        self.points = 0  # gradient evaluations
        self.forwards = 0  # gradient-free evaluations

    def _x(self, alphas: np.ndarray) -> torch.Tensor:
        a = torch.tensor(alphas, dtype=self.e.dtype, device=self.e.device)
        return self.b[None] + a[:, None, None] * self.diff[None]

    def f(self, alphas) -> np.ndarray:
        alphas = np.asarray(alphas, dtype=np.float64)
        out = np.empty(len(alphas))
        with torch.no_grad():
            for lo in range(0, len(alphas), self.batch):
                out[lo:lo + self.batch] = self.sc.f(self.ctx, self._x(alphas[lo:lo + self.batch])).double().cpu().numpy()
        self.forwards += len(alphas)
        return out

    def density(self, alphas) -> np.ndarray:
        alphas = np.asarray(alphas, dtype=np.float64)
        if (alphas <= 0).any():
            raise LmtraceError("integrated gradients: a gradient at α = 0 was requested (internal error)")
        out = np.empty((len(alphas), self.e.shape[0]))
        for lo in range(0, len(alphas), self.batch):
            x = self._x(alphas[lo:lo + self.batch]).requires_grad_(True)
            with torch.enable_grad():
                y = self.sc.f(self.ctx, x)
                (g,) = torch.autograd.grad(y.sum(), x)  # rows are independent: row k gets ∂f/∂x_k
            out[lo:lo + len(x)] = (g * self.diff[None]).sum(-1).double().cpu().numpy()
        self.points += len(alphas)
        return out


def _ig_fixed(path: _IGPath, s: Settings) -> tuple[np.ndarray, dict]:
    alphas, weights = ig_alphas(s.ig_steps, s.ig_rule)
    dens = path.density(alphas)
    return (weights[:, None] * dens).sum(0), {"intervals": s.ig_steps}


def _ig_adaptive(path: _IGPath, s: Settings, scale: float) -> tuple[np.ndarray, dict]:
    """Adaptive 2-point Gauss–Legendre over [0, 1]: every interval [l, r] has an attribution A (per position) and a
    check, f(r) − f(l), from two exact forwards. Intervals whose |Σ_i A_i − (f(r) − f(l))| is largest are bisected
    until the sum of those per-interval errors is at most tolerance × scale, or the gradient budget is spent.

    The initial partition is `ig_steps` uniform intervals, refined where a grid of 8·ig_steps cheap forwards shows
    steep change (an interval of that grid carrying more than 1/ig_steps of the path's total variation)."""
    m = s.ig_steps
    fine = np.linspace(0.0, 1.0, 8 * m + 1)
    f_fine = path.f(fine)
    breaks = set(np.linspace(0.0, 1.0, m + 1).tolist())
    jumps = np.abs(np.diff(f_fine))
    tv = float(np.nansum(jumps)) if np.isfinite(jumps).any() else 0.0
    steep = np.flatnonzero(~np.isfinite(jumps) | (jumps > tv / m)) if tv > 0 else np.flatnonzero(~np.isfinite(jumps))
    for k in steep:
        breaks.update((float(fine[k]), float(fine[k + 1])))
    f_known = dict(zip(fine.tolist(), f_fine.tolist()))
    edges = sorted(breaks)

    def f_of(alphas):
        missing = [a for a in alphas if a not in f_known]
        if missing:
            f_known.update(zip(missing, path.f(missing).tolist()))
        return [f_known[a] for a in alphas]

    def evaluate(bounds: list[tuple[float, float]]) -> list[dict]:
        nodes = [l + (r - l) * g for l, r in bounds for g in GAUSS2]
        dens = path.density(nodes) if nodes else np.empty((0, path.e.shape[0]))
        f_of([a for lr in bounds for a in lr])
        out = []
        for j, (l, r) in enumerate(bounds):
            attr = 0.5 * (r - l) * (dens[2 * j] + dens[2 * j + 1])
            change = f_known[r] - f_known[l]
            err = abs(float(attr.sum()) - change)
            out.append({"l": l, "r": r, "attr": attr, "err": err if math.isfinite(err) else math.inf})
        return out

    intervals = evaluate(list(zip(edges[:-1], edges[1:])))
    target = s.ig_tolerance * scale
    min_width = 1e-12
    while True:
        bound = sum(iv["err"] for iv in intervals)
        if bound <= target:
            break
        budget = s.ig_max_points - path.points
        splittable = [iv for iv in intervals if iv["r"] - iv["l"] > min_width and iv["err"] > 0]
        if budget < 4 or not splittable:
            break
        # bisect the worst intervals: at most a batch's worth of gradient points per round
        k = max(1, min(len(splittable), budget // 4, max(1, s.batch_size // 4)))
        worst = sorted(splittable, key=lambda iv: -iv["err"])[:k]
        new_bounds = []
        for iv in worst:
            mid = 0.5 * (iv["l"] + iv["r"])
            new_bounds += [(iv["l"], mid), (mid, iv["r"])]
        drop = {id(iv) for iv in worst}
        intervals = [iv for iv in intervals if id(iv) not in drop] + evaluate(new_bounds)
    intervals.sort(key=lambda iv: iv["l"])
    total = np.sum([iv["attr"] for iv in intervals], axis=0)
    widths = [iv["r"] - iv["l"] for iv in intervals]
    return total, {"intervals": len(intervals), "error_bound": sum(iv["err"] for iv in intervals),
                   "min_interval": min(widths), "path_total_variation": tv}


@contextmanager
def _model_dtype(model: torch.nn.Module, dtype: torch.dtype):
    """The float32 model cast to `dtype` for the duration (float32 -> float64 -> float32 is exact)."""
    if dtype == torch.float32:
        yield
        return
    model.to(dtype)
    try:
        yield
    finally:
        model.to(torch.float32)


@register("integrated_gradients", needs_model=True, settings=_ig_settings,
          description="integrated gradients along the straight path from a baseline (mean, pad or zero embedding), "
                      "adaptive until completeness holds to --ig-tolerance")
def integrated_gradients(ctx: StepContext) -> MethodResult:
    sc, s = ctx.scorer, ctx.settings
    dtype = getattr(torch, s.ig_dtype)
    with _model_dtype(sc.model, dtype):
        e = sc.embeddings(ctx.ids).to(dtype)
        b = baseline_embeddings(ctx, e)
        path = _IGPath(ctx, e, b)
        fb, fx = path.f([0.0, 1.0]).tolist()  # exact forwards at the baseline and the input
        scale = max(abs(fx - fb), IG_SCALE_FLOOR) if math.isfinite(fx - fb) else math.inf
        if s.ig_rule == "adaptive":
            total, extra = _ig_adaptive(path, s, scale)
        else:
            total, extra = _ig_fixed(path, s)
    scores = total.astype(np.float64)
    total_attr = float(scores.sum())
    finite = bool(np.isfinite(scores).all() and math.isfinite(fx) and math.isfinite(fb))
    err = abs(total_attr - (fx - fb)) if finite else math.inf
    rel = err / scale if finite else math.inf
    bound = extra.get("error_bound", err)
    converged = finite and rel <= s.ig_tolerance and bound <= s.ig_tolerance * scale * (1 + 1e-9)
    info = {"f_x": fx, "f_baseline": fb, "sum_scores": total_attr, "completeness_error": err,
            "completeness_error_relative": rel, "error_bound_relative": bound / scale if finite else math.inf,
            "converged": converged, "nonfinite": not finite,
            "ig_tolerance": s.ig_tolerance, "gradient_points": path.points, "forwards": path.forwards + 2,
            "kept_positions": kept_positions(ctx), **extra}
    return MethodResult(scores.astype(np.float32), info)


@register("occlusion", needs_model=True, settings=lambda s: {"target": s.target, "quantity": s.quantity,
                                                             "mask": "attention_mask[position] = 0",
                                                             "batch_size": s.batch_size},
          description="f(x) − f(x with the position removed from the attention mask), one forward per position")
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
            out[lo:lo + len(pos)] = sc.f(ctx, e[None].expand(len(pos), n, e.shape[-1]), mask).double().cpu().numpy()
    scores = fx - out
    return MethodResult(scores.astype(np.float32), {"f_x": fx, "sum_scores": float(scores.sum())})


# ---- attention rollout ------------------------------------------------------------------------
def rollout(attn: np.ndarray, exclude: tuple[int, ...] = ()) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema 2020) of full attention matrices.

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
            missing.append("full attention rows (the run kept only the top-k keys per row: set "
                           "capture.attention.top_k: null)")
        else:
            missing.append("attention rows (`attn`: set capture.attention.enabled: true, capture.attention.top_k: null)")
    n_layers = _model_layer_count(run.manifest)
    if "attn" in names and n_layers is not None and list(run.layers) != list(range(n_layers)):
        missing.append(f"attention of every layer (captured layers {run.layers} of {n_layers}: set capture.layers: all)")
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
        rows = np.asarray(run.array("attn")[sequence, 1:step + 1, :, :, :n], dtype=np.float32)  # [step, L, H, n]
        for t in range(1, step + 1):  # step t: query position P-1+t over keys 0..P-1+t
            row = rows[t - 1, :, :, : P + t]
            if np.isnan(row).any():
                raise ArchiveError(f"run {run.id}: the archived attention row of sequence {sequence} step {t} is "
                                   f"incomplete (NaN): that step was not captured or not committed")
            out[:, :, P - 1 + t, : P + t] = row
    return out


@register("attention_rollout", needs_model=False, requirements=rollout_requirements,
          settings=lambda s: {"head_fusion": "mean", "residual": "add identity, renormalise rows",
                              "source": "archived prefill_attn + attn rows",
                              "excluded_positions": list(s.rollout_excluded)},
          description="attention rollout over every layer from the archived attention (no model needed)")
def attention_rollout(ctx: StepContext) -> MethodResult:
    R = rollout(archived_attention(ctx.run, ctx.sequence, ctx.step), ctx.settings.rollout_excluded)
    scores = R[-1]
    return MethodResult(scores.astype(np.float32), {"sum_scores": float(scores.sum())})


# ---------------------------------------------------------------------------------------------
# Parsing and validation
def parse_methods(methods: list[str] | str) -> list[str]:
    if isinstance(methods, str):
        methods = [methods]
    names: list[str] = []
    aliases = {"gxi": "grad_x_input", "ig": "integrated_gradients", "rollout": "attention_rollout"}
    for item in methods:
        for name in str(item).split(","):
            name = name.strip().replace("-", "_")
            if not name:
                continue
            name = aliases.get(name, name)
            if name not in METHODS:
                raise SpecError(f"--method {name!r}: unknown; available: {', '.join(METHODS)}")
            if name not in names:
                names.append(name)
    if not names:
        raise SpecError("--method: give at least one method")
    return names


def _open(run_ref: str | Path, runs_dir: str | None) -> tuple[Run, list[str]]:
    notes = []
    path = find_run(str(run_ref), runs_root(runs_dir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IncompleteRunWarning)
        run = Run(path)
    for w in caught:
        if issubclass(w.category, IncompleteRunWarning):
            notes.append(str(w.message))
    return run, notes


def _sequence_tokens(run: Run, sequence: int):
    t = run.tokens().to_pandas()
    n_seq = int(run.manifest.get("n_prompts") or run.shape.get("n_sequences") or 0)
    if not 0 <= sequence < max(n_seq, 1) or not (t.sequence == sequence).any():
        raise SpecError(f"--sequence {sequence} out of range: run {run.id} has {n_seq} sequence(s) (0..{n_seq - 1})")
    t = t[t.sequence == sequence]
    prompt = t[t.is_prompt].sort_values("position")
    gen = t[~t.is_prompt].sort_values("step")
    return prompt, gen


def _runner_up(chosen: int, alt_ids) -> int:
    for a in list(alt_ids if alt_ids is not None else []):
        if int(a) != chosen:
            return int(a)
    raise ArchiveError("no archived alternative other than the chosen token: cannot define the runner-up")


# ---------------------------------------------------------------------------------------------
# Model loading
def load_scorer(run: Run, device: str | None, methods: list[str], note=lambda text: None) -> tuple[Scorer, dict]:
    """The run's model in float32 with eager attention (gradients and masks behave the same everywhere)."""
    from ..models import load_run_model

    needing = ", ".join(m for m in methods if METHODS[m].needs_model)
    loaded = load_run_model(run.manifest, run.id, purpose=f"method(s) {needing} (attention_rollout does not need them)",
                            overrides={"dtype": "float32", "attn_implementation": "eager", "device": device}, note=note)
    info = {"reference": loaded.reference, "source": loaded.source, "weights_sha256": loaded.weights_sha256,
            "dtype": "float32", "attn_implementation": "eager", "device": str(loaded.device)}
    return Scorer(loaded.model, loaded.device, loaded.tokenizer), info


# ---------------------------------------------------------------------------------------------
# Intervention children: the child's recorded edits, replayed with intervene's own hooks
NOT_REPLAYABLE = {
    "patch_residual": "it overwrote the query position's residual at each step with another run's archived vector; "
                      "one forward over the whole context cannot reproduce those per-step patches",
    "patch_head": "it overwrote a head's value at each step's query position with a replay of another run; "
                  "one forward over the whole context cannot reproduce those per-step patches",
}
REPLAY_TOLERANCE = 1e-4  # |recomputed − archived| chosen-token logprob of a float32 child, nats


class ContextEdits(EditSet):
    """intervene's `EditSet` (the same hooks, the same edit code) applied to one full, unpadded forward of a
    step's context instead of a KV-cached step.

    In the child's own loop the prompt positions were computed at step 0 (the prefill) and position P−1+t at
    step t, and an edit active at step t edited the positions computed at that step. Here every position gets
    the step it was computed at, so an entry edits exactly the positions it edited in the child: `_selected`
    returns [B, n] with row p active iff the entry was active at step(p) (and selects that position)."""

    def __init__(self, entries: list, adapter, sequence: int, prompt_len: int, resources: dict):
        super().__init__(entries, adapter, {sequence: prompt_len}, resources)
        self.sequence = sequence
        self.P = prompt_len
        self.step_of = torch.zeros(0, dtype=torch.long)

    def begin_forward(self, batch: int, n: int, device) -> None:
        pos = torch.arange(n)
        self.step_of = torch.where(pos < self.P, 0, pos - self.P + 1)
        self.begin(int(self.step_of[-1]), [self.sequence] * batch, pos[None].expand(batch, n).to(device), False)

    def _selected(self, entry) -> torch.Tensor | None:
        if entry.sequences != "all" and self.sequence not in entry.sequences:
            return None
        active = torch.tensor([entry.active_at(int(t)) for t in self.step_of.tolist()], dtype=torch.bool)
        if entry.positions != "all":
            active &= torch.isin(torch.arange(len(active)), torch.tensor(entry.positions, dtype=torch.long))
        if not active.any():
            return None
        return active[None].expand(self.positions.shape).to(self.positions.device)

    def mask(self, mask: torch.Tensor) -> torch.Tensor:
        """[B, n] attention mask -> the mask with mask_positions' hidden keys removed (as at this step)."""
        return self.edit_mask(mask, [0] * mask.shape[0], [self.sequence] * mask.shape[0], self.step)

    def check_step(self, step: int, run_id: str) -> None:
        """mask_positions is replayed with one [B, n] key mask: exact only if the entry's activity is the same at
        every step 0..step (the queries computed earlier then hid the same keys, causality doing the rest)."""
        for i, e in enumerate(self.entries):
            if isinstance(e, MaskPositions) and len({e.active_at(t) for t in range(step + 1)}) > 1:
                raise SpecError(f"run {run_id}: interventions[{i}] (mask_positions) is active at some of steps "
                                f"0..{step} but not all; explain replays it with one attention mask over the whole "
                                f"context, which cannot reproduce that: explain a step before it starts or after "
                                f"it is active throughout")


def child_edits(run: Run, scorer: "Scorer", sequence: int, prompt_len: int) -> ContextEdits | None:
    """The edits an intervention child was generated under, ready to install on the explain model
    (None for an ordinary run). Refuses (exit 2) edit kinds that cannot be replayed under gradients."""
    from ..capture.arch import adapter_for
    from ..archive.reader import open_run
    from ..parent import ParentView, chat_span_ranges, tokenizer_of

    m = run.manifest
    if m.get("kind") != "intervene" or not m.get("interventions"):
        return None
    entries = parse_entries(m["interventions"], f"run {run.id}")
    for i, e in enumerate(entries):
        if e.kind in NOT_REPLAYABLE:
            raise SpecError(f"run {run.id} is an intervention child with interventions[{i}] ({e.kind}), which explain "
                            f"cannot replay: {NOT_REPLAYABLE[e.kind]}. Explain its parent, or a child without {e.kind}")
    parent_info = m.get("parent") or {}
    parent_path = Path(parent_info["path"]) if parent_info.get("path") else None
    state: dict = {}

    def parent() -> Run:
        if "run" not in state:
            ref = parent_path if parent_path is not None and parent_path.is_dir() else parent_info.get("run_id")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", IncompleteRunWarning)
                    state["run"] = open_run(ref, run.path.parent)
            except LmtraceError as err:
                raise ArchiveError(f"run {run.id}: its edits need its parent run {parent_info.get('run_id')} "
                                   f"(mean values, chat spans or steering runs), which cannot be opened: {err}") from None
        return state["run"]

    def view() -> "ParentView":
        if "view" not in state:
            state["view"] = ParentView.read(parent())
        return state["view"]

    adapter = adapter_for(scorer.model)
    resources: dict[int, object] = mean_ablation_values(
        entries, adapter, lambda: [view().prompt_ids[s] + view().generated[s] for s in range(len(view().prompt_ids))])
    for i, e in enumerate(entries):
        where = f"run {run.id} interventions[{i}] ({e.kind})"
        if i in resources:  # a mean value
            continue
        if isinstance(e, Steer):
            resources[i] = load_steer_vector(e, int(run.shape["d_model"]), lambda ref: open_run(ref, parent().path.parent))
        elif isinstance(e, MaskPositions) and e.span in CHAT_SPANS:
            resources[i] = chat_span_ranges(parent(), view(), e.span, where, tokenizer_of(parent()))
        elif isinstance(e, MaskExperts):
            resources[i] = routing_rule(adapter, e.layer, where)
    return ContextEdits(entries, adapter, sequence, prompt_len, resources)


# ---------------------------------------------------------------------------------------------
# Running and recording
@dataclass
class StepExplanation:
    method: str
    sequence: int
    step: int
    chosen_id: int
    runner_up_id: int
    positions: np.ndarray
    token_ids: list[int]
    token_texts: list[str]
    is_prompt: list[bool]
    scores: np.ndarray
    info: dict
    target_text: str = ""
    runner_up_text: str = ""


@dataclass
class ExplainResult:
    explain_id: str
    run_id: str
    run_dir: Path
    path: Path
    entries: list[dict]
    explanations: list[StepExplanation]
    settings: Settings
    notes: list[str] = field(default_factory=list)


def scores_schema() -> pa.Schema:
    i32 = pa.int32()
    return pa.schema([
        ("explain_id", pa.string()), ("method", pa.string()), ("sequence", i32), ("step", i32),
        ("target", pa.string()), ("quantity", pa.string()), ("target_token_id", i32), ("runner_up_token_id", i32),
        ("position", i32), ("token_id", i32), ("token_text", pa.string()), ("is_prompt", pa.bool_()),
        ("score", pa.float32()),
    ])


def explain_run(run_ref: str | Path, steps: str | list[int], *, sequence: int = 0,
                methods: list[str] | str = ("grad_x_input",), settings: Settings | None = None,
                device: str | None = None, runs_dir: str | None = None, note=lambda text: None) -> ExplainResult:
    """Explain generated steps of an archived run; write the results into the run and return them."""
    settings = (settings or Settings()).check()
    names = parse_methods(list(methods) if not isinstance(methods, str) else methods)
    notes: list[str] = []

    def note_(text: str) -> None:  # kept for the result (terminal and --json), and passed on
        notes.append(text)
        note(text)

    def progress(text: str) -> None:
        note(text)

    run, open_notes = _open(run_ref, runs_dir)
    for text in open_notes:
        note_(text)
    from ..archive.liveness import OwnerLock, pause_for_tests

    # One explain writer of a run at a time: a second exits 2 naming the holder's pid.
    owner = OwnerLock(run.path, "explain", run.id).acquire()
    try:
        pause_for_tests()
        return _explain_owned(run, notes, note_, progress, steps, sequence, settings, names, device)
    finally:
        owner.release()


def _explain_owned(run: Run, notes: list[str], note_, progress, steps, sequence: int, settings: Settings,
                   names: list[str], device: str | None) -> ExplainResult:
    """explain_run's work once this process owns the run's explain writer key."""
    prompt, gen = _sequence_tokens(run, sequence)
    step_list = parse_steps(",".join(map(str, steps)) if isinstance(steps, (list, tuple)) else steps, len(gen))
    for name in names:  # archived-data requirements are checked before any weights are loaded
        req = METHODS[name].requirements
        missing = req(run) if req is not None else []
        if missing:
            raise ArchiveError(f"method {name} needs archived data run {run.id} did not capture: "
                               + "; ".join(missing) + ". Rerun generate with those capture settings")
    is_child = run.manifest.get("kind") == "intervene" and bool(run.manifest.get("interventions"))
    if is_child:  # refuse edit kinds that cannot be replayed before loading any weights
        for i, e in enumerate(parse_entries(run.manifest["interventions"], f"run {run.id}")):
            if e.kind in NOT_REPLAYABLE:
                raise SpecError(f"run {run.id} is an intervention child with interventions[{i}] ({e.kind}), which "
                                f"explain cannot replay: {NOT_REPLAYABLE[e.kind]}. Explain its parent instead")
    scorer, model_info = None, None
    if any(METHODS[m].needs_model for m in names):
        progress(f"loading model {run.manifest.get('model', {}).get('reference')} (float32, eager attention)")
        scorer, model_info = load_scorer(run, device, names, progress)

    prompt_ids = [int(x) for x in prompt.token_id]
    prompt_texts = list(prompt.token_text)
    gen_ids = [int(x) for x in gen.token_id]
    gen_texts = list(gen.token_text)
    explanations: list[StepExplanation] = []
    edits = child_edits(run, scorer, sequence, len(prompt_ids)) if (is_child and scorer is not None) else None
    if edits is not None:
        model_info = {**model_info, "interventions_replayed": run.manifest["interventions"]}
    run_dtype = str(run.manifest.get("dtype") or (run.manifest.get("model") or {}).get("dtype") or "")
    with (edits.attached() if edits is not None else _nullcontext()):
        if scorer is not None:
            scorer.edits = edits
        try:
            for step in step_list:
                row = gen.iloc[step]
                if int(row.step) != step:
                    raise ArchiveError(f"run {run.id}: sequence {sequence} has no archived token for step {step}")
                if edits is not None:
                    edits.check_step(step, run.id)
                chosen = int(row.token_id)
                ctx = StepContext(run=run, sequence=sequence, step=step, prompt_len=len(prompt_ids),
                                  ids=prompt_ids + gen_ids[:step], chosen_id=chosen,
                                  runner_up_id=_runner_up(chosen, row.alt_ids), archived_logprob=float(row.logprob),
                                  settings=settings, scorer=scorer)
                check = {}
                if scorer is not None:  # the rebuilt context (and replayed edits) must reproduce what the run saw
                    with torch.no_grad():
                        lp = scorer.logits(scorer.embeddings(ctx.ids)[None]).float().log_softmax(-1)[0, chosen].item()
                    check = {"recomputed_logprob": lp, "archived_logprob": ctx.archived_logprob}
                    diff = abs(lp - ctx.archived_logprob) if math.isfinite(ctx.archived_logprob) else math.inf
                    if edits is not None:
                        check["interventions_replayed"] = True
                        if run_dtype == "float32" and not diff <= REPLAY_TOLERANCE:
                            raise LmtraceError(
                                f"run {run.id} step {step}: with the child's {len(edits.entries)} intervention(s) "
                                f"replayed, the chosen token's logprob is {lp:.6f} but the child archived "
                                f"{ctx.archived_logprob:.6f} (|difference| {diff:.2e} > {REPLAY_TOLERANCE:g}): the "
                                f"replay does not reproduce the child, so its attributions would describe another "
                                f"model; nothing was written")
                    if diff > 0.05 or (edits is not None and diff > REPLAY_TOLERANCE):
                        note_(f"step {step}: the float32 model{' with the replayed edits' if edits else ''} gives the "
                              f"chosen token logprob {lp:.4f}, the run archived {ctx.archived_logprob:.4f} (run dtype "
                              f"{run_dtype or 'unknown'}); the attributions describe the float32 model")
                for name in names:
                    progress(f"sequence {sequence} step {step}: {name}")
                    res = METHODS[name].fn(ctx)
                    if res.scores.shape != (ctx.n,):
                        raise LmtraceError(f"method {name} returned {res.scores.shape} scores for a context of {ctx.n}")
                    info = {**res.info, **(check if METHODS[name].needs_model else {})}
                    if res.info.get("converged") is False:
                        note_(f"sequence {sequence} step {step}: {name} did not converge: "
                              f"{ig_shortfall(res.info, settings.ig_tolerance)}: treat these scores as approximate "
                              f"(docs/explain.md, 'When a result did not converge')")
                    explanations.append(StepExplanation(
                        name, sequence, step, chosen, ctx.runner_up_id, np.arange(ctx.n), ctx.ids,
                        prompt_texts + gen_texts[:step], [True] * len(prompt_ids) + [False] * step, res.scores, info,
                        target_text=str(row.token_text),
                        runner_up_text=scorer.tokenizer.decode([ctx.runner_up_id]) if scorer is not None else ""))
        finally:
            if scorer is not None:
                scorer.edits = None

    explain_id = new_run_id()
    entries = _write(run, explain_id, names, step_list, sequence, settings, explanations, model_info)
    return ExplainResult(explain_id, run.id, run.path, run.path / EXPLAIN_DIR / explain_id, entries, explanations,
                         settings, notes)


def _pct(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2%}"


def ig_shortfall(info: dict, tolerance: float) -> str:
    """Which convergence condition an integrated-gradients result missed, in words (docs/explain.md).

    Converged needs finite values, the completeness error ≤ tolerance and, for the adaptive rule, the per-interval
    error bound ≤ tolerance (all relative to |f(x) − f(baseline)|). The completeness error alone can be small by
    cancellation between intervals whose own checks fail, so a result can miss on the bound only."""
    tol, rel, bound = f"{tolerance:.0%}", info.get("completeness_error_relative"), info.get("error_bound_relative")
    after = f"after {info.get('gradient_points')} gradient points"
    if info.get("nonfinite"):
        return f"non-finite values on the path {after}"
    if rel is not None and rel > tolerance:
        return f"completeness error {_pct(rel)} > {tol} of |f(x) − f(baseline)| {after}"
    return (f"completeness error {_pct(rel)} ≤ {tol}, but the per-interval error bound {_pct(bound)} > {tol} {after} "
            f"(the intervals' own checks fail; their errors cancel in the total)")


@contextmanager
def _nullcontext():
    yield


def _write(run: Run, explain_id: str, names: list[str], steps: list[int], sequence: int, settings: Settings,
           explanations: list[StepExplanation], model_info: dict | None) -> list[dict]:
    """explain/<id>/{scores.zarr, explain.json} + explain/scores.parts/<id>.parquet, then the manifest entries."""
    root = run.path / EXPLAIN_DIR
    root.mkdir(exist_ok=True)
    tmp = root / f".{explain_id}.tmp"  # explain ids are unique; mkdir honours the umask (mkdtemp would not)
    tmp.mkdir()
    try:
        entries = _write_files(run, tmp, explain_id, names, steps, sequence, settings, explanations, model_info)
        os.replace(tmp, root / explain_id)  # the directory appears complete or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    parts = root / SCORES_PARTS
    parts.mkdir(exist_ok=True)
    part_tmp = parts / f".{explain_id}.tmp"
    pq.write_table(_table(explain_id, settings, explanations), part_tmp)
    os.replace(part_tmp, parts / f"{explain_id}.parquet")
    record_entries(run.path, entries)
    return entries


def _write_files(run: Run, tmp: Path, explain_id: str, names: list[str], steps: list[int], sequence: int,
                 settings: Settings, explanations: list[StepExplanation], model_info: dict | None) -> list[dict]:
    import zarr

    created = now_iso()
    rel = f"{EXPLAIN_DIR}/{explain_id}"
    table_rel = f"{EXPLAIN_DIR}/{SCORES_PARTS}/{explain_id}.parquet"
    # arrays: one per method, [step, position], NaN beyond each step's context
    max_n = max(len(e.scores) for e in explanations)
    group = zarr.open_group(str(tmp / "scores.zarr"), mode="w", zarr_format=3)
    st = group.create_array("step", shape=(len(steps),), dtype="int32", chunks=(max(1, len(steps)),),
                            dimension_names=("step",), fill_value=-1)
    st[...] = np.asarray(steps, dtype=np.int32)
    pos = group.create_array("position", shape=(max_n,), dtype="int32", chunks=(max_n,),
                             dimension_names=("position",), fill_value=-1)
    pos[...] = np.arange(max_n, dtype=np.int32)
    for name in names:
        data = np.full((len(steps), max_n), np.nan, dtype=np.float32)
        for e in explanations:
            if e.method == name:
                data[steps.index(e.step), : len(e.scores)] = e.scores
        arr = group.create_array(name, shape=data.shape, dtype="float32", chunks=data.shape,
                                 dimension_names=("step", "position"), fill_value=np.nan)
        arr[...] = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(tmp / "scores.zarr"))
    entries = []
    for name in names:
        m = METHODS[name]
        entries.append({
            "id": explain_id, "method": name, "settings": m.settings(settings), "sequence": sequence, "steps": steps,
            "target": settings.target if m.needs_model else None,
            "quantity": settings.quantity if m.needs_model else None, "created": created,
            "path": rel, "table": table_rel, "array": f"{rel}/scores.zarr/{name}",
            "model": model_info if m.needs_model else None,
            "results": [{"step": e.step, "target_token_id": e.chosen_id, "runner_up_token_id": e.runner_up_id,
                         **{k: strict(v) for k, v in e.info.items()}} for e in explanations if e.method == name],
        })
        flags = [e.info["converged"] for e in explanations if e.method == name and "converged" in e.info]
        if flags:  # integrated gradients: did every step meet completeness within --ig-tolerance?
            entries[-1]["converged"] = all(flags)
    _atomic_json(tmp / "explain.json", strict({"id": explain_id, "run_id": run.id, "created": created,
                                                    "entries": entries}))
    return entries


def _table(explain_id: str, settings: Settings, explanations: list[StepExplanation]) -> pa.Table:
    """The long table: one row per (method, step, context position)."""
    cols: dict[str, list] = {f.name: [] for f in scores_schema()}
    for e in explanations:
        n = len(e.scores)
        cols["explain_id"] += [explain_id] * n
        cols["method"] += [e.method] * n
        cols["sequence"] += [e.sequence] * n
        cols["step"] += [e.step] * n
        cols["target"] += [settings.target if METHODS[e.method].needs_model else None] * n
        cols["quantity"] += [settings.quantity if METHODS[e.method].needs_model else None] * n
        cols["target_token_id"] += [e.chosen_id] * n
        cols["runner_up_token_id"] += [e.runner_up_id] * n
        cols["position"] += e.positions.tolist()
        cols["token_id"] += list(e.token_ids)
        cols["token_text"] += list(e.token_texts)
        cols["is_prompt"] += list(e.is_prompt)
        cols["score"] += e.scores.tolist()
    return pa.table(cols, schema=scores_schema())


def _atomic_json(path: Path, obj) -> None:
    """Write-to-unique-temp + fsync + rename (a unique name: concurrent writers never share a temp file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600: keep the file's existing mode, else the usual umask-derived one
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=2, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def record_entries(run_dir: Path, entries: list[dict]) -> None:
    """Append entries to manifest["explain"]: under a lock file, re-reading the manifest just before an atomic write.
    Nothing else in the manifest (status included) is changed."""
    (run_dir / EXPLAIN_DIR).mkdir(exist_ok=True)
    with locked(run_dir / layout.LOCK):  # the same flock generate takes to rewrite the manifest
        manifest = read_manifest(run_dir)
        manifest.setdefault("explain", []).extend(entries)
        _atomic_json(run_dir / layout.MANIFEST, manifest)


def read_explanations(run: Run | str | Path) -> pa.Table:
    """Every explain invocation's scores of a run as one table (explain/scores.parts/*.parquet)."""
    path = run.path if isinstance(run, Run) else Path(run)
    files = sorted((path / EXPLAIN_DIR / SCORES_PARTS).glob("*.parquet"))
    if not files:
        raise ArchiveError(f"{path} has no explanations yet; run `lmtrace explain`")
    return pa.concat_tables([pq.read_table(f).cast(scores_schema()) for f in files])


# ---------------------------------------------------------------------------------------------
# Terminal display
def _show_token(text: str) -> str:
    return text.replace("\n", "⏎").replace("\t", "⇥") or "∅"


def _background(score: float, scale: float) -> str:
    """White for 0, towards green for positive and red for negative relevance (|score| / scale)."""
    x = 0.0 if scale <= 0 or not math.isfinite(score) else max(-1.0, min(1.0, score / scale))
    fade = int(round(255 * (1 - abs(x) * 0.85)))
    if x >= 0:
        return f"black on rgb({fade},255,{fade})"
    return f"black on rgb(255,{fade},{fade})"


def render(result: ExplainResult, console=None, top: int = 10) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    s = result.settings
    console.print(f"[bold]explain {result.explain_id}[/bold] of run {result.run_id} -> {result.path}")
    for e in result.explanations:
        m = METHODS[e.method]
        what = (f"{s.target} ({s.quantity})" if m.needs_model else "rollout share of the last position")
        console.rule(f"sequence {e.sequence} step {e.step}: {e.method}")
        head = Text("target token ")
        head.append(repr(e.target_text), style="bold")
        head.append(f" (id {e.chosen_id})")
        if m.needs_model:
            head.append("; runner-up ")
            head.append(repr(e.runner_up_text), style="bold")
            head.append(f" (id {e.runner_up_id})")
        head.append(f"; scoring {what}")
        console.print(head)
        facts = []
        for key in ("f_x", "f_baseline", "sum_scores", "completeness_error", "recomputed_logprob", "archived_logprob"):
            if key in e.info and e.info[key] is not None:
                facts.append(f"{key}={e.info[key]:.4g}")
        if facts:
            console.print(Text("  ".join(facts), style="dim"))
        if "converged" in e.info:
            rel = e.info.get("completeness_error_relative")
            if e.info["converged"]:
                console.print(Text(f"converged: completeness error {_pct(rel)} ≤ {s.ig_tolerance:.0%} of "
                                   f"|f(x) − f(baseline)| ({e.info.get('gradient_points')} gradient points)", style="dim"))
            else:
                console.print(Text(f"NOT CONVERGED: {ig_shortfall(e.info, s.ig_tolerance)}; see docs/explain.md, "
                                   f"'When a result did not converge'", style="bold yellow"))
        finite = np.abs(e.scores[np.isfinite(e.scores)])
        scale = float(finite.max()) if finite.size else 0.0
        text = Text()
        for i, (tok, sc) in enumerate(zip(e.token_texts, e.scores)):
            style = _background(float(sc), scale)
            if not e.is_prompt[i]:
                style += " underline"
            text.append(_show_token(tok), style=style)
        text.append(" → ", style="dim")
        text.append(_show_token(e.target_text), style="bold reverse")
        console.print(text)
        order = np.argsort(-np.nan_to_num(np.abs(e.scores), nan=-1.0), kind="stable")[:top]
        table = Table(title=f"top {len(order)} positions by |score|", show_edge=False, title_justify="left")
        for col, just in (("#", "right"), ("position", "right"), ("token", "left"), ("score", "right"),
                          ("share", "right")):
            table.add_column(col, justify=just)
        denom = float(np.nansum(np.abs(e.scores))) or 1.0
        for rank, i in enumerate(order):
            sc = float(e.scores[i])
            table.add_row(str(rank + 1), str(int(i)) + ("" if e.is_prompt[i] else "*"), repr(e.token_texts[i]),
                          Text(f"{sc:+.4g}", style="green" if sc >= 0 else "red"), f"{abs(sc) / denom:.0%}")
        console.print(table)
    console.print(Text("background: green = supports the target, red = opposes it; underlined / * = generated token",
                       style="dim"))


def summary(result: ExplainResult, top: int = 10) -> dict:
    out = {"explain_id": result.explain_id, "run_id": result.run_id, "path": str(result.path),
           "entries": result.entries, "notes": result.notes, "converged": converged(result), "top": []}
    for e in result.explanations:
        order = np.argsort(-np.nan_to_num(np.abs(e.scores), nan=-1.0), kind="stable")[:top]
        item = {"method": e.method, "sequence": e.sequence, "step": e.step,
                "positions": [{"position": int(i), "token": e.token_texts[i], "score": float(e.scores[i])}
                              for i in order]}
        for key in ("converged", "completeness_error", "completeness_error_relative", "error_bound_relative"):
            if key in e.info:
                item[key] = e.info[key]
        out["top"].append(item)
    return strict(out)


def converged(result: ExplainResult) -> bool | None:
    """False if any integrated-gradients step missed --ig-tolerance (or met NaN/inf); None without IG."""
    flags = [e.info["converged"] for e in result.explanations if "converged" in e.info]
    return all(flags) if flags else None


def explain_command(run_ref: str, steps: str, *, sequence: int, methods: list[str], settings: Settings,
                    device: str | None, runs_dir: str | None, json_out: bool, quiet: bool, top: int,
                    strict: bool = False) -> ExplainResult:
    """What `lmtrace explain` does: explain, then print a rich view (or a JSON summary)."""
    import sys

    def note(text: str) -> None:
        if not (quiet or json_out):
            print(text, file=sys.stderr)

    result = explain_run(run_ref, steps, sequence=sequence, methods=methods, settings=settings, device=device,
                         runs_dir=runs_dir, note=note)
    if json_out:
        print(json_line(summary(result, top)))
    elif not quiet:
        render(result, top=top)
    if strict and converged(result) is False:
        bad = [f"step {e.step}" for e in result.explanations if e.info.get("converged") is False]
        raise NotConvergedError(f"--strict: integrated gradients did not converge to --ig-tolerance "
                                f"{settings.ig_tolerance:g} at {', '.join(bad)} (results written to {result.path}, "
                                f"flagged converged: false)")
    return result


class NotConvergedError(LmtraceError):
    """`--strict` and an attribution that missed its tolerance: exit 1."""
