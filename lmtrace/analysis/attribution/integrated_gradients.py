"""Integrated gradients: score_i = Σ_d (e−b)_{i,d} · ∫₀¹ ∂f/∂e_{i,d}(b + α(e−b)) dα along the straight
path from a baseline b (mean / scaled-mean / pad / zero embedding, kept positions at their own
embedding) to the input e; the integral by a fixed midpoint grid or by adaptive Gauss–Legendre
refinement until completeness, |Σ_i score_i − (f(e) − f(b))|, holds to the tolerance
(docs/explain.md); `ig_shortfall` says in words which convergence condition a result missed."""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import torch

from ...exits.errors import LmtraceError, SpecError
from .registry import MethodResult, StepContext, register
from .settings import Settings

GAUSS2 = (0.5 - 0.5 / math.sqrt(3.0), 0.5 + 0.5 / math.sqrt(3.0))  # Gauss–Legendre nodes on [0, 1], weights ½ each
IG_SCALE_FLOOR = (
    0.01  # relative errors are taken against max(|f(x) − f(b)|, this), so a near-zero change is judged absolutely
)


def ig_settings(s: Settings) -> dict:
    """The settings that define an integrated-gradients result (recorded in the manifest)."""
    return {
        "target": s.target,
        "quantity": s.quantity,
        "baseline": s.baseline,
        "ig_steps": s.ig_steps,
        "ig_rule": s.ig_rule,
        "ig_tolerance": s.ig_tolerance,
        "ig_max_points": s.ig_max_points,
        "ig_keep": list(s.ig_kept),
        "ig_keep_special": s.ig_keep_special,
        "ig_dtype": s.ig_dtype,
        "path": "straight line b + α(e − b), α ∈ [0, 1]",
        "batch_size": s.batch_size,
    }


def ig_alphas(steps: int, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-grid points α_k in (0, 1) and weights w_k (Σ w_k = 1): `midpoint` α_k = (k + ½)/m.
    No rule evaluates a gradient at α = 0 (the baseline)."""
    if rule != "midpoint":
        raise SpecError(f"--ig-rule {rule!r}: fixed grids are midpoint only")
    return (np.arange(steps) + 0.5) / steps, np.full(steps, 1.0 / steps)


# ---- the baseline -------------------------------------------------------------------------------
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
            # through the embedding module, like the inputs e: a raw weight row would miss a scale the module
            # applies (Gemma's √d_model) and put the baseline on another scale than e and the pad baseline
            mean = ctx.scorer.mean_embedding(e.dtype).to(e.device)
            if ctx.settings.baseline == "mean":
                return mean.expand_as(e).clone()
            # the mean direction at each position's own norm: the path keeps the norm away from 0
            return mean[None] * (e.norm(dim=-1, keepdim=True) / mean.norm().clamp_min(1e-12))
    pad = ctx.scorer.pad_id
    if pad is None:
        raise SpecError("--baseline pad: the model's tokenizer has no pad token; use --baseline mean or zero")
    return ctx.scorer.embeddings([pad])[0].to(e.dtype).expand_as(e).clone()


# ---- the path and its quadrature ------------------------------------------------------------------
class IGPath:
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
                out[lo : lo + self.batch] = (
                    self.sc.f(self.ctx, self._x(alphas[lo : lo + self.batch])).double().cpu().numpy()
                )
        self.forwards += len(alphas)
        return out

    def density(self, alphas) -> np.ndarray:
        alphas = np.asarray(alphas, dtype=np.float64)
        if (alphas <= 0).any():
            raise LmtraceError("integrated gradients: a gradient at α = 0 was requested (internal error)")
        out = np.empty((len(alphas), self.e.shape[0]))
        for lo in range(0, len(alphas), self.batch):
            x = self._x(alphas[lo : lo + self.batch]).requires_grad_(True)
            with torch.enable_grad():
                y = self.sc.f(self.ctx, x)
                (g,) = torch.autograd.grad(y.sum(), x)  # rows are independent: row k gets ∂f/∂x_k
            out[lo : lo + len(x)] = (g * self.diff[None]).sum(-1).double().cpu().numpy()
        self.points += len(alphas)
        return out


def _ig_fixed(path: IGPath, s: Settings) -> tuple[np.ndarray, dict]:
    alphas, weights = ig_alphas(s.ig_steps, s.ig_rule)
    dens = path.density(alphas)
    return (weights[:, None] * dens).sum(0), {"intervals": s.ig_steps}


def _ig_adaptive(path: IGPath, s: Settings, scale: float) -> tuple[np.ndarray, dict]:
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
        nodes = [lo + (hi - lo) * g for lo, hi in bounds for g in GAUSS2]
        dens = path.density(nodes) if nodes else np.empty((0, path.e.shape[0]))
        f_of([a for lr in bounds for a in lr])
        out = []
        for j, (lo, hi) in enumerate(bounds):
            attr = 0.5 * (hi - lo) * (dens[2 * j] + dens[2 * j + 1])
            change = f_known[hi] - f_known[lo]
            err = abs(float(attr.sum()) - change)
            out.append({"l": lo, "r": hi, "attr": attr, "err": err if math.isfinite(err) else math.inf})
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
    return total, {
        "intervals": len(intervals),
        "error_bound": sum(iv["err"] for iv in intervals),
        "min_interval": min(widths),
        "path_total_variation": tv,
    }


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


# ---- the method -------------------------------------------------------------------------------------
@register(
    "integrated_gradients",
    needs_model=True,
    settings=ig_settings,
    shortfall=lambda info, s: (
        None
        if info.get("converged", True)
        else f"did not converge: {ig_shortfall(info, s.ig_tolerance)}: treat these scores as "
        f"approximate (docs/explain.md, 'When a result did not converge')"
    ),
    description="integrated gradients along the straight path from a baseline (mean, pad or zero embedding), "
    "adaptive until completeness holds to --ig-tolerance",
)
def integrated_gradients(ctx: StepContext) -> MethodResult:
    sc, s = ctx.scorer, ctx.settings
    dtype = getattr(torch, s.ig_dtype)
    with _model_dtype(sc.model, dtype):
        e = sc.embeddings(ctx.ids).to(dtype)
        b = baseline_embeddings(ctx, e)
        path = IGPath(ctx, e, b)
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
    info = {
        "f_x": fx,
        "f_baseline": fb,
        "sum_scores": total_attr,
        "completeness_error": err,
        "completeness_error_relative": rel,
        "error_bound_relative": bound / scale if finite else math.inf,
        "converged": converged,
        "nonfinite": not finite,
        "ig_tolerance": s.ig_tolerance,
        "gradient_points": path.points,
        "forwards": path.forwards + 2,
        "kept_positions": kept_positions(ctx),
        **extra,
    }
    return MethodResult(scores.astype(np.float32), info)


def percent(x) -> str:
    """A fraction as a percentage with two decimals; n/a for None or a non-finite value."""
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
        return f"completeness error {percent(rel)} > {tol} of |f(x) − f(baseline)| {after}"
    return (
        f"completeness error {percent(rel)} ≤ {tol}, but the per-interval error bound {percent(bound)} > {tol} "
        f"{after} (the intervals' own checks fail; their errors cancel in the total)"
    )
