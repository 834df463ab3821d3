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

A transcoder (`Target.d_out`) is trained the same way on rows holding its input and the output it is to
produce side by side ([x | y], d_in + d_out): the input and the output each scaled by their own constant
(both folded into the saved weights), pre = (x − mean input) @ W_enc + b_enc (b_dec is d_out wide, never
subtracted from the input; the mean is folded into the saved b_enc), W_enc starting as random unit-norm
columns, b_dec at the mean output, the loss the squared error of the output over the output's variance, the
dead latents' auxiliary loss reconstructing the output's error (k_aux = d_out / 2). Trained BatchTopK, it is
saved as SAELens's `jumprelu_transcoder` with the BatchTopK threshold (SAELens has no TopK transcoder).
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


@dataclass
class Target:
    """What the trained latents write: the input itself (an SAE) or, for a transcoder, another site whose
    values follow the input's in each stored row (`d_out` wide, at `hook_name_out`)."""

    hook_name_out: str | None = None
    d_out: int | None = None

    @property
    def transcoder(self) -> bool:
        return self.d_out is not None


def _initial_params(
    d_sae: int, d_in: int, mean: torch.Tensor, gen: torch.Generator, transcoder: bool
) -> dict[str, torch.Tensor]:
    """The trainable weights at the start: unit-norm random decoder rows, the encoder their transpose (a
    transcoder's: its own random unit-norm columns, d_in wide), the decoder bias the (scaled) mean output."""
    W_dec = torch.randn(d_sae, len(mean), generator=gen)
    W_dec /= W_dec.norm(dim=-1, keepdim=True)
    if transcoder:
        W_enc = torch.randn(d_in, d_sae, generator=gen)
        W_enc /= W_enc.norm(dim=0, keepdim=True)
    else:
        W_enc = W_dec.t().clone()
    params = {"W_enc": W_enc, "b_enc": torch.zeros(d_sae), "W_dec": W_dec, "b_dec": mean.clone()}
    for p in params.values():
        p.requires_grad_(True)
    return params


def _loss(y, pre, acts, params, variance, dead, n_dead, k_aux, aux_coefficient) -> tuple[torch.Tensor, torch.Tensor]:
    """(training loss, reconstruction mse over variance) of a batch whose target is y (an SAE: its input): the
    mse plus, when latents are dead, the auxiliary loss of the dead latents' top-k reconstructing the error."""
    recon = acts @ params["W_dec"] + params["b_dec"]
    error = y - recon
    mse = (error**2).sum(-1).mean() / variance
    loss = mse
    if n_dead:
        aux_pre = torch.where(dead, pre, torch.tensor(-math.inf))
        aux_acts = _topk(aux_pre, min(k_aux, n_dead))
        aux_recon = aux_acts @ params["W_dec"]
        aux = ((aux_recon - error.detach()) ** 2).sum(-1).mean() / variance
        loss = loss + aux_coefficient * min(n_dead / k_aux, 1.0) * aux
    return loss, mse


def _trained_sae(params, scales, settings: TrainSettings, d_in: int, hook_name: str, model_name, threshold, target):
    """The trained weights as an `Sae` that reads raw activations (the input and output scales folded into the
    weights); batchtopk training gives a jumprelu SAE (a transcoder: jumprelu_transcoder) with its running
    threshold."""
    scale_in, scale_out = scales
    with torch.no_grad():  # fold the scales into the weights: the SAE reads and writes raw activations
        W_enc = params["W_enc"] * scale_in
        W_dec = params["W_dec"] / scale_out
        b_dec = params["b_dec"] / scale_out
        b_enc = params["b_enc"].clone()
    arch = "jumprelu" if settings.architecture == "batchtopk" else "topk"
    if target.transcoder:
        arch = f"{arch}_transcoder"
    cfg = SaeConfig(
        architecture=arch,
        d_in=d_in,
        d_sae=settings.d_sae,
        hook_name=hook_name,
        k=settings.k if arch == "topk" else None,
        model_name=model_name,
        apply_b_dec_to_input=not target.transcoder,
        d_out=target.d_out,
        hook_name_out=target.hook_name_out,
    )
    thr = torch.full((settings.d_sae,), float(threshold or 0.0)) if arch.startswith("jumprelu") else None
    return Sae(cfg, W_enc, b_enc, W_dec, b_dec, thr)


def _scales(
    store: ActivationStore, d_in: int, gen: torch.Generator
) -> tuple[float, float, torch.Tensor, float, torch.Tensor]:
    """(input scale, output scale, the scaled output's mean, its variance per token, the scaled input's mean)
    from a sample of up to 16,384 rows; an SAE's output is its input."""
    idx = torch.randperm(store.n, generator=gen)[: min(store.n, 16384)].sort().values
    sample = torch.from_numpy(store.data[idx.numpy()].astype("float32"))
    x, y = sample[:, :d_in], sample[:, d_in:]
    scale_in = math.sqrt(d_in / float((x**2).sum(-1).mean()))
    if y.shape[1] == 0:
        y, scale_out = x, scale_in
    else:
        scale_out = math.sqrt(y.shape[1] / float((y**2).sum(-1).mean()))
    y = y * scale_out
    mean = y.mean(0)
    return scale_in, scale_out, mean, float(((y - mean) ** 2).sum(-1).mean()), (x * scale_in).mean(0)


def _forward(batch, d_in: int, scales, centre, params, transcoder: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of stored rows -> (the scaled target, the pre-activations): an SAE's target is its input, which
    it reads less b_dec; a transcoder's is the output beside its input, which it reads centred."""
    x = batch[:, :d_in] * scales[0]
    if transcoder:
        return batch[:, d_in:] * scales[1], (x - centre) @ params["W_enc"] + params["b_enc"]
    return x, (x - params["b_dec"]) @ params["W_enc"] + params["b_enc"]


def train_sae(
    store: ActivationStore,
    settings: TrainSettings,
    hook_name: str,
    *,
    model_name: str | None = None,
    target: Target | None = None,
    progress=lambda done, total: None,
) -> tuple[Sae, dict]:
    """Train on store's rows [n, d_in] (a transcoder, `target`: [n, d_in + d_out], input then output) -> (the
    SAE for raw activations, a log of the training)."""
    target = target or Target()
    if target.transcoder and settings.architecture != "batchtopk":
        raise ValueError("a transcoder is trained BatchTopK (SAELens has no TopK transcoder to save it as)")
    gen = torch.Generator().manual_seed(settings.seed)
    torch.manual_seed(settings.seed)
    n = store.n
    d_in = store.d - (target.d_out or 0)
    scale_in, scale_out, mean, variance, centre = _scales(store, d_in, gen)

    params = _initial_params(settings.d_sae, d_in, mean, gen, target.transcoder)
    opt = torch.optim.Adam(params.values(), lr=settings.lr)
    since_fired = torch.zeros(settings.d_sae, dtype=torch.long)
    k_aux = len(mean) // 2
    dead_after = min(settings.dead_after, max(n // 2, settings.batch))
    threshold = None
    steps, seen, t0 = 0, 0, time.time()
    total_steps = settings.epochs * math.ceil(n / settings.batch)
    last = {}
    for _epoch in range(settings.epochs):
        order = _order(n, gen)
        for start in range(0, n, settings.batch):
            rows = order[start : start + settings.batch]
            batch = torch.from_numpy(store.data[rows.sort().values.numpy()].astype("float32"))
            y, pre = _forward(batch, d_in, (scale_in, scale_out), centre, params, target.transcoder)
            if settings.architecture == "batchtopk":
                acts, smallest = _batch_topk(pre, settings.k)
                threshold = smallest if threshold is None else 0.99 * threshold + 0.01 * smallest
            else:
                acts = _topk(pre, settings.k)
            dead = since_fired > dead_after
            n_dead = int(dead.sum())
            loss, mse = _loss(y, pre, acts, params, variance, dead, n_dead, k_aux, settings.aux_coefficient)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                params["W_dec"] /= params["W_dec"].norm(dim=-1, keepdim=True)
                fired = (acts > 0).any(0)
                since_fired += len(y)
                since_fired[fired] = 0
            steps += 1
            seen += len(y)
            last = {"mse_over_variance": float(mse.detach()), "dead_in_training": n_dead / settings.d_sae}
            progress(steps, total_steps)
    if target.transcoder:  # the input centring folded into b_enc: pre = x @ W_enc + b_enc reads uncentred input
        with torch.no_grad():
            params["b_enc"] -= centre @ params["W_enc"]
    sae = _trained_sae(params, (scale_in, scale_out), settings, d_in, hook_name, model_name, threshold, target)
    log = {
        "steps": steps,
        "tokens_seen": seen,
        "epochs": settings.epochs,
        "batch": settings.batch,
        "lr": settings.lr,
        "seed": settings.seed,
        "activation_scale": scale_in,
        "seconds": round(time.time() - t0, 2),
        **last,
    }
    if target.transcoder:
        log["output_scale"] = scale_out
    if threshold is not None:
        log["batchtopk_threshold"] = threshold
    return sae, log
