"""A TopK (or BatchTopK) sparse autoencoder trained on stored activations, in lmtrace's own small trainer.

Recipe (Gao et al. 2024, "Scaling and evaluating sparse autoencoders"; Bussmann et al. 2024 for
BatchTopK), sized for a CPU:
- inputs scaled by one constant so that their mean squared norm is d_in (folded into the saved weights,
  as SAELens folds its `expected_average_only_in` factor, so the saved SAE reads raw activations);
- b_dec starts at the mean input, decoder rows are random unit vectors, W_enc starts as W_decᵀ;
- loss: squared reconstruction error over the total variance (so 1 − explained variance of the batch),
  plus 1/32 × the auxiliary loss of the top-k_aux dead latents (not active for `dead_after` tokens,
  100,000 or half the training tokens if fewer)
  reconstructing the remaining error (k_aux = d_in / 2), which keeps latents alive;
- Adam; decoder rows renormalised to unit norm after every step;
- data in blocks of 4,096 rows, the blocks in a new random order every epoch and shuffled inside.
BatchTopK keeps the k × batch largest activations of a batch instead of k per token; at inference it is
a JumpReLU whose threshold is the running mean of the smallest activation kept (saved as `jumprelu`, the
way SAELens saves a BatchTopK SAE for inference).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ...features.sae import Sae, SaeConfig
from .activations import ActivationStore

BLOCK = 4096


@dataclass
class TrainSettings:
    d_sae: int
    k: int
    architecture: str = "topk"  # topk | batchtopk
    epochs: int = 1
    batch: int = 1024
    lr: float = 1e-3
    seed: int = 0
    aux_coefficient: float = 1 / 32
    dead_after: int = 100_000  # tokens without activity after which a latent counts as dead in training (at most
    # half the training tokens, so a small data set still revives its dead latents)


def _order(n: int, gen: torch.Generator) -> torch.Tensor:
    blocks = torch.randperm(math.ceil(n / BLOCK), generator=gen)
    return torch.cat(
        [
            torch.arange(b * BLOCK, min(n, (b + 1) * BLOCK))[
                torch.randperm(min(n, (b + 1) * BLOCK) - b * BLOCK, generator=gen)
            ]
            for b in blocks.tolist()
        ]
    )


def _topk(pre: torch.Tensor, k: int) -> torch.Tensor:
    top = pre.topk(k, dim=-1)
    return torch.zeros_like(pre).scatter_(-1, top.indices, torch.relu(top.values))


def _batch_topk(pre: torch.Tensor, k: int) -> tuple[torch.Tensor, float]:
    acts = torch.relu(pre)
    flat = acts.flatten()
    top = flat.topk(min(k * len(pre), flat.numel()))
    kept = torch.zeros_like(flat).scatter_(0, top.indices, top.values).view_as(acts)
    positive = top.values.detach()[top.values.detach() > 0]
    return kept, float(positive.min()) if len(positive) else 0.0


def _initial_params(d_sae: int, d: int, mean: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The trainable weights at the start: unit-norm random decoder rows, the encoder their transpose, the decoder
    bias the (scaled) input mean."""
    W_dec = torch.randn(d_sae, d, generator=gen)
    W_dec /= W_dec.norm(dim=-1, keepdim=True)
    params = {"W_enc": W_dec.t().clone(), "b_enc": torch.zeros(d_sae), "W_dec": W_dec, "b_dec": mean.clone()}
    for p in params.values():
        p.requires_grad_(True)
    return params


def _loss(x, pre, acts, params, variance, dead, n_dead, k_aux, aux_coefficient) -> tuple[torch.Tensor, torch.Tensor]:
    """(training loss, reconstruction mse over variance) of a batch: the mse plus, when latents are dead, the
    auxiliary loss of the dead latents' top-k reconstructing the error."""
    recon = acts @ params["W_dec"] + params["b_dec"]
    error = x - recon
    mse = (error**2).sum(-1).mean() / variance
    loss = mse
    if n_dead:
        aux_pre = torch.where(dead, pre, torch.tensor(-math.inf))
        aux_acts = _topk(aux_pre, min(k_aux, n_dead))
        aux_recon = aux_acts @ params["W_dec"]
        aux = ((aux_recon - error.detach()) ** 2).sum(-1).mean() / variance
        loss = loss + aux_coefficient * min(n_dead / k_aux, 1.0) * aux
    return loss, mse


def _trained_sae(params, scale: float, settings: TrainSettings, d: int, hook_name: str, model_name, threshold) -> Sae:
    """The trained weights as an `Sae` that reads raw activations (the input scale folded into the weights);
    batchtopk training gives a jumprelu SAE with its running threshold."""
    with torch.no_grad():  # fold the input scale into the weights: the SAE reads raw activations
        W_enc = params["W_enc"] * scale
        W_dec = params["W_dec"] / scale
        b_dec = params["b_dec"] / scale
        b_enc = params["b_enc"].clone()
    arch = "jumprelu" if settings.architecture == "batchtopk" else "topk"
    cfg = SaeConfig(
        architecture=arch,
        d_in=d,
        d_sae=settings.d_sae,
        hook_name=hook_name,
        k=settings.k if arch == "topk" else None,
        model_name=model_name,
    )
    thr = torch.full((settings.d_sae,), float(threshold or 0.0)) if arch == "jumprelu" else None
    return Sae(cfg, W_enc, b_enc, W_dec, b_dec, thr)


def train_sae(
    store: ActivationStore,
    settings: TrainSettings,
    hook_name: str,
    *,
    model_name: str | None = None,
    progress=lambda done, total: None,
) -> tuple[Sae, dict]:
    """Train on store's rows [n, d_in] -> (the SAE for raw activations, a log of the training)."""
    gen = torch.Generator().manual_seed(settings.seed)
    torch.manual_seed(settings.seed)
    n, d = store.n, store.d
    idx = torch.randperm(n, generator=gen)[: min(n, 16384)].sort().values
    sample = torch.from_numpy(store.data[idx.numpy()].astype("float32"))
    scale = math.sqrt(d / float((sample**2).sum(-1).mean()))
    sample = sample * scale
    mean = sample.mean(0)
    variance = float(((sample - mean) ** 2).sum(-1).mean())  # per token, of scaled inputs

    params = _initial_params(settings.d_sae, d, mean, gen)
    opt = torch.optim.Adam(params.values(), lr=settings.lr)
    since_fired = torch.zeros(settings.d_sae, dtype=torch.long)
    k_aux = d // 2
    dead_after = min(settings.dead_after, max(n // 2, settings.batch))
    threshold = None
    steps, seen, t0 = 0, 0, time.time()
    total_steps = settings.epochs * math.ceil(n / settings.batch)
    last = {}
    for _epoch in range(settings.epochs):
        order = _order(n, gen)
        for start in range(0, n, settings.batch):
            rows = order[start : start + settings.batch]
            x = torch.from_numpy(store.data[rows.sort().values.numpy()].astype("float32")) * scale
            pre = (x - params["b_dec"]) @ params["W_enc"] + params["b_enc"]
            if settings.architecture == "batchtopk":
                acts, smallest = _batch_topk(pre, settings.k)
                threshold = smallest if threshold is None else 0.99 * threshold + 0.01 * smallest
            else:
                acts = _topk(pre, settings.k)
            dead = since_fired > dead_after
            n_dead = int(dead.sum())
            loss, mse = _loss(x, pre, acts, params, variance, dead, n_dead, k_aux, settings.aux_coefficient)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                params["W_dec"] /= params["W_dec"].norm(dim=-1, keepdim=True)
                fired = (acts > 0).any(0)
                since_fired += len(x)
                since_fired[fired] = 0
            steps += 1
            seen += len(x)
            last = {"mse_over_variance": float(mse.detach()), "dead_in_training": n_dead / settings.d_sae}
            progress(steps, total_steps)
    sae = _trained_sae(params, scale, settings, d, hook_name, model_name, threshold)
    log = {
        "steps": steps,
        "tokens_seen": seen,
        "epochs": settings.epochs,
        "batch": settings.batch,
        "lr": settings.lr,
        "seed": settings.seed,
        "activation_scale": scale,
        "seconds": round(time.time() - t0, 2),
        **last,
    }
    if threshold is not None:
        log["batchtopk_threshold"] = threshold
    return sae, log
