"""Attribution to an SAE's latents (`explain -m grad_x_input|lrp --sae DIR`): the SAE spliced into the
model at its hook as nodes of the graph, and the method read at them.

At the SAE's site the activation x [n, d_in] is rewritten as

    x = x̂(f) + err        f = encode(x),  x̂(f) = decode(f),  err = x − x̂(f)

with f, err and the decoder's offset c = x̂(0) as leaves of the graph (the "error node" holds the
reconstruction error): x̂(f) = lin(f) + c with lin(f) = x̂(f) − x̂(0) linear in f (the input
normalisation's per-token scale and shift held at their forward values). The value passed on is x itself,
bit for bit (x + (S − S.detach()) with S = lin(f) + c + err), so every forward value is as it was; only
gradients and relevance flow into the leaves, and nothing flows below the site through it.

  grad_x_input  latent (p, i): f_{p,i} · ∂f/∂f_{p,i}      error (p): Σ_d err_{p,d} · ∂f/∂err_{p,d}
  lrp           the same products under lrp's rules: the decode is linear, so a latent's relevance is
                f_{p,i} · W_dec[i] · ĝ_p (the ε = 0 rule), the error node's err_p · ĝ_p, and the offset's
                c_p · ĝ_p goes to the bias relevance. Conservation becomes
                f = Σ latents + Σ error + Σ_i score_i (input positions, through paths that bypass the site)
                    + bias relevance (the model's biases above the site and the SAE's decoder offset)

A result's per-position score is the relevance through the site at that position (its latents plus its
error node); the latents are kept sparsely: per position the `top` latents by |attribution|."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...exits.errors import SpecError
from ...features.sae import Sae
from ...features.sites import Site, at_site
from .registry import MethodResult, StepContext

FEATURE_METHODS = ("grad_x_input", "lrp")  # the methods that attribute to an SAE's latents


@dataclass(frozen=True)
class SaeAtSite:
    """An SAE to attribute to: its short name (in result names), directory, weights' sha256 and site."""

    name: str
    path: Path
    sha256: str
    sae: Sae
    site: Site

    def record(self, top: int) -> dict:
        from ...features.refs import sae_record

        return {**sae_record(self.name, self.path, self.sha256, self.sae, self.site), "top": top}


def result_name(method: str, sae_name: str) -> str:
    """The name an SAE's result is stored under (manifest entry `method`, table rows, arrays)."""
    return f"{method}@{sae_name}"


class Nodes:
    """The leaves one forward's splice created: latents f [n, d_sae], error err [n, d_in], offset c [n, d_in]."""

    def __init__(self):
        self.f: torch.Tensor | None = None
        self.err: torch.Tensor | None = None
        self.offset: torch.Tensor | None = None

    def leaves(self) -> list[torch.Tensor]:
        if self.f is None:
            raise SpecError("--sae: the SAE's site was not reached in the model's forward; nothing to attribute to")
        return [self.f, self.err, self.offset]


@contextmanager
def spliced(adapter, target: SaeAtSite, n: int):
    """The SAE spliced in at its site for every forward while inside (one sequence of n positions); yields the
    `Nodes` of the last forward."""
    nodes = Nodes()
    sae = target.sae

    def splice(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] != n:
            raise SpecError(f"--sae: the site {target.site.hook_name} has {rows.shape[0]} rows for {n} positions")
        xf = rows.detach().float()
        with torch.no_grad():
            acts, norm = sae.encode_with_norm(xf)
            zero = sae.decode(torch.zeros_like(acts), norm)
            err = xf - sae.decode(acts, norm)
        f = acts.clone().requires_grad_(True)
        offset = zero.clone().requires_grad_(True)
        e = err.clone().requires_grad_(True)
        with torch.enable_grad():
            lin = sae.decode(f, norm) - zero  # linear in f: the denormalisation's scale and shift are constants
            s = lin + offset + e
            out = rows.detach() + (s - s.detach()).to(rows.dtype)  # x's value; gradients into the leaves only
        nodes.f, nodes.err, nodes.offset = f, e, offset
        return out.reshape(x.shape)

    with at_site(adapter, target.site, splice):
        yield nodes


def _sparse(attr: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """[n, d_sae] attributions -> (ids [n, k] int32, scores [n, k] float32): per position the `top` latents by
    |attribution| that are non-zero, largest first (stable); −1 / NaN past a position's non-zero count."""
    k = min(top, attr.shape[1])
    order = np.argsort(-np.abs(attr), axis=1, kind="stable")[:, :k]
    vals = np.take_along_axis(attr, order, axis=1)
    keep = vals != 0
    return np.where(keep, order, -1).astype(np.int32), np.where(keep, vals, np.nan).astype(np.float32)


def latent_result(f: torch.Tensor, g_f, err: torch.Tensor, g_err, top: int) -> tuple[np.ndarray, dict]:
    """(per-position score [n] float64, latents {"ids", "scores", "error"}) from the leaves and their gradients."""
    lat = np.zeros(tuple(f.shape)) if g_f is None else (f.detach().double() * g_f.double()).cpu().numpy()
    error = np.zeros(err.shape[0]) if g_err is None else (err.detach().double() * g_err.double()).sum(-1).cpu().numpy()
    ids, scores = _sparse(lat, top)
    per_position = lat.sum(1) + error
    return per_position, {
        "ids": ids,
        "scores": scores,
        "error": error.astype(np.float32),
        "latent_sum": float(lat.sum()),
        "active": int((f.detach() != 0).sum()),
    }


def grad_x_input_to_features(ctx: StepContext, target: SaeAtSite, top: int) -> MethodResult:
    """Gradient × input at the SAE's latents and error node (and at the input embeddings, through the paths
    that bypass the site)."""
    from ...capture.arch import adapter_for

    sc = ctx.scorer
    e = sc.embeddings(ctx.ids).requires_grad_(True)
    with torch.enable_grad(), spliced(adapter_for(sc.model), target, ctx.n) as nodes:
        y = sc.f(ctx, e[None])
        f, err, _ = nodes.leaves()
        g_e, g_f, g_err = torch.autograd.grad(y.sum(), [e, f, err], allow_unused=True)
    per_position, lat = latent_result(f, g_f, err, g_err, top)
    inputs = np.zeros(ctx.n) if g_e is None else (g_e.double() * e.detach().double()).sum(-1).cpu().numpy()
    info = {
        "f_x": float(y.item()),
        "sum_scores": float(per_position.sum()),
        "sum_latents": lat.pop("latent_sum"),
        "sum_error": float(lat["error"].astype(np.float64).sum()),
        "sum_inputs": float(inputs.sum()),
        "active_latents": lat.pop("active"),
    }
    return MethodResult(per_position.astype(np.float32), info, latents={**lat, "inputs": inputs.astype(np.float32)})


def lrp_to_features(ctx: StepContext, target: SaeAtSite, top: int) -> MethodResult:
    """lrp's relevance pass with the SAE spliced in: relevance at the latents, the error node, the inputs (paths
    that bypass the site) and the biases (with the decoder's offset), conserving f."""
    from .lrp import CONSERVATION_TOLERANCE, relevance

    r = relevance(ctx, extra=lambda adapter: spliced(adapter, target, ctx.n))
    (f, g_f), (err, g_err), (offset, g_off) = r["extra"]
    per_position, lat = latent_result(f, g_f, err, g_err, top)
    offset_rel = 0.0 if g_off is None else float((offset.detach().double() * g_off.double()).sum())
    inputs = r["scores"]
    sum_latents, sum_error = lat.pop("latent_sum"), float(lat["error"].astype(np.float64).sum())
    bias = r["bias_relevance"] + offset_rel
    error = r["f"] - (sum_latents + sum_error + float(inputs.sum()) + bias)
    relative = abs(error) / max(1.0, abs(r["f"])) if math.isfinite(error) else math.inf
    info = {
        "f_x": r["f"],
        "sum_scores": float(per_position.sum()),
        "sum_latents": sum_latents,
        "sum_error": sum_error,
        "sum_inputs": float(inputs.sum()),
        "decoder_offset_relevance": offset_rel,
        "bias_relevance": bias,
        "active_latents": lat.pop("active"),
        "conservation_error": error,
        "conservation_error_relative": relative,
        "conserved": relative <= CONSERVATION_TOLERANCE,
        "conservation_tolerance": CONSERVATION_TOLERANCE,
    }
    return MethodResult(per_position.astype(np.float32), info, latents={**lat, "inputs": inputs.astype(np.float32)})


def feature_shortfall(info: dict) -> str | None:
    """None if an lrp-to-features result conserves f, else what failed, in words."""
    if info.get("conserved", True):
        return None
    total = info["f_x"] - info["conservation_error"]
    return (
        f"does not conserve: f = {info['f_x']:.6g} but latents + error node + inputs + bias relevance = "
        f"{total:.6g} (relative error {info['conservation_error_relative']:.2e} > "
        f"{info['conservation_tolerance']:g}) (docs/explain.md, 'Attribution to SAE features')"
    )


def method_of(name: str) -> str:
    """The registered method of a result name (`lrp@res6` -> `lrp`)."""
    return name.partition("@")[0]


def result_shortfall(name: str, info: dict, settings) -> str | None:
    """The own check of a result named `name` (a method's, or an SAE result's conservation): None if passed."""
    from .registry import METHODS

    if "@" in name:
        return feature_shortfall(info)
    return METHODS[name].failed_check(info, settings)


def attribute_to_features(ctx: StepContext, method: str, target: SaeAtSite, top: int) -> MethodResult:
    if method == "grad_x_input":
        return grad_x_input_to_features(ctx, target, top)
    if method == "lrp":
        return lrp_to_features(ctx, target, top)
    raise SpecError(f"--sae: {method} cannot attribute to SAE latents; use one of {', '.join(FEATURE_METHODS)}")
