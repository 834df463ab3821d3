"""Seeded token choice and per-token statistics. Pure functions on [batch, vocab] float32 logits.

Order follows transformers: temperature, then top-k, then top-p. A token is drawn by inverse-CDF
sampling over the tokens sorted by descending probability, with one uniform number per
(seed, sequence, step) from a `torch.Generator` re-seeded for that triple. That makes a run
reproducible bit for bit, independent of batch size, and resumable at any step; and because the
draw is explicit, we can say whether top-k/top-p filtering changed the choice: the same draw on the
temperature-only distribution would have picked another token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .topk import topk_last

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, sequence: int, step: int) -> int:
    """A well-mixed 63-bit seed for one (run seed, sequence index, step)."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ sequence) ^ step) >> 1


def uniforms(generator: torch.Generator, seed: int, sequences: list[int], step: int) -> torch.Tensor:
    """[batch] float64 uniforms in [0, 1), one per sequence, re-seeding the single generator each time."""
    out = torch.empty(len(sequences), dtype=torch.float64)
    for i, seq in enumerate(sequences):
        generator.manual_seed(draw_seed(seed, seq, step))
        out[i] = torch.rand((), generator=generator, dtype=torch.float64)
    return out


@dataclass(frozen=True)
class Sampler:
    temperature: float
    top_k: int
    top_p: float

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def filter_sorted(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, V] -> (temperature-scaled logits sorted descending with filtered-out entries -inf, order).

        One sort serves top-k, top-p and the inverse-CDF draw: filtering keeps a prefix of the
        descending order (ties at the k-th value are kept, as transformers does).
        """
        scores, order = torch.sort(logits / self.temperature, dim=-1, descending=True, stable=True)
        if self.top_k > 0 and self.top_k < scores.shape[-1]:
            kth = scores[..., self.top_k - 1 : self.top_k]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            probs = scores.softmax(-1)
            before = probs.cumsum(-1) - probs  # mass strictly above each token
            remove = before >= self.top_p
            remove[..., 0] = False  # keep at least one token
            scores = scores.masked_fill(remove, float("-inf"))
        return scores, order

    def filtered_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] -> [B, V] temperature-scaled logits with filtered-out tokens set to -inf."""
        scores, order = self.filter_sorted(logits)
        return torch.empty_like(scores).scatter_(-1, order, scores)


def _inverse_cdf_sorted(sorted_probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index (in the sorted order) of the first token whose cumulative mass exceeds u * total."""
    cdf = sorted_probs.double().cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True)
    # never land on a zero-probability token at the tail because of rounding
    n_nonzero = (sorted_probs > 0).sum(-1, keepdim=True)
    return torch.minimum(idx, n_nonzero - 1)


STABILITY_CLASSES = ("locked", "stable", "fragile", "tie")


def stability_class(top1_prob: float, margin: float) -> str:
    """locked: top-1 prob >= 0.9; stable: margin >= 1 nat; fragile: margin >= 0.1 nat; tie: below."""
    if top1_prob >= 0.9:
        return "locked"
    if margin >= 1.0:
        return "stable"
    if margin >= 0.1:
        return "fragile"
    return "tie"


@dataclass
class Choice:
    """Per-row results, each a [B] (or [B, k]) tensor on the CPU."""

    token: torch.Tensor
    logprob: torch.Tensor  # at T=1 (the model's distribution)
    sampling_logprob: torch.Tensor  # under the distribution actually sampled from
    rank: torch.Tensor  # 0 = the model's top-1
    entropy: torch.Tensor  # nats, at T=1
    greedy_token: torch.Tensor
    alt_ids: torch.Tensor  # [B, k] top-k at T=1
    alt_logits: torch.Tensor
    alt_logprobs: torch.Tensor
    margin: torch.Tensor  # top-1 minus top-2 logit (= logprob difference), nats
    filter_changed: torch.Tensor  # bool
    eligible: torch.Tensor  # tokens with non-zero sampling probability
    ref_logprobs: torch.Tensor | None = None  # [B, r] T=1 logprobs of caller-given reference ids


def _entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """-Σ p·log p of each row [B, V] -> [B] (a token of probability 0 adds 0, not NaN): p·max(log p,
    float min), computed in place in p's buffer; the clamp, a full pass over [B, V], is left out where
    no log p is -inf (it would change nothing then)."""
    p = logprobs.exp()
    low = torch.finfo(logprobs.dtype).min
    return -p.mul_(logprobs if bool(logprobs.amin() > low) else logprobs.clamp_min(low)).sum(-1)


def choose(
    logits: torch.Tensor,
    sampler: Sampler,
    u: torch.Tensor | None,
    n_alternatives: int,
    forced: torch.Tensor | None = None,
    ref_ids: torch.Tensor | None = None,
) -> Choice:
    """logits: [B, V] float32 for the query position. u: [B] uniforms (ignored when greedy).

    forced: [B] token ids to take instead of choosing (-1 = choose normally): teacher forcing, the
    statistics then describe the forced token. ref_ids: [B, r] ids whose logprobs to report (-1 = none).
    """
    logits = logits.float()
    logprobs = logits.log_softmax(-1)
    top_vals, top_ids = topk_last(logits, max(n_alternatives, 2))  # torch.topk's answer, faster on the CPU
    greedy_token = top_ids[:, 0]
    if sampler.greedy:
        token = greedy_token
        sampling_logprob = torch.zeros(logits.shape[0])
        filter_changed = torch.zeros(logits.shape[0], dtype=torch.bool)
        eligible = torch.ones(logits.shape[0], dtype=torch.int64)
    else:
        filtered_sorted, order = sampler.filter_sorted(logits)
        u = u.to(logits.device)
        idx = _inverse_cdf_sorted(filtered_sorted.softmax(-1), u)
        token = order.gather(-1, idx).squeeze(-1)
        sampling_lp_sorted = filtered_sorted.log_softmax(-1)
        sampling_logprob = sampling_lp_sorted.gather(-1, idx).squeeze(-1)
        unfiltered_sorted = (logits / sampler.temperature).gather(-1, order)
        idx_unfiltered = _inverse_cdf_sorted(unfiltered_sorted.softmax(-1), u)
        filter_changed = (idx_unfiltered != idx).squeeze(-1)
        eligible = torch.isfinite(filtered_sorted).sum(-1)
    if forced is not None:
        forced = forced.to(token.device)
        token = torch.where(forced >= 0, forced, token)
        if not sampler.greedy:
            sampling_lp = torch.empty_like(sampling_lp_sorted).scatter_(-1, order, sampling_lp_sorted)
            sampling_logprob = sampling_lp.gather(-1, token[:, None]).squeeze(-1)
        else:  # under greedy, a forced non-argmax token has probability 0
            sampling_logprob = torch.where(token == greedy_token, 0.0, float("-inf"))
    ref_logprobs = None
    if ref_ids is not None:
        ref_ids = ref_ids.to(logprobs.device)
        ref_logprobs = logprobs.gather(-1, ref_ids.clamp_min(0)).masked_fill(ref_ids < 0, float("nan")).cpu()
    if sampler.greedy and forced is None:  # the argmax: no logit is greater
        rank = torch.zeros(logits.shape[0], dtype=torch.int64)
    else:
        rank = (logits > logits.gather(-1, token[:, None])).sum(-1)
    entropy = _entropy(logprobs)
    top_logprobs = logprobs.gather(-1, top_ids)
    return Choice(
        token=token.cpu(),
        logprob=logprobs.gather(-1, token[:, None]).squeeze(-1).cpu(),
        sampling_logprob=sampling_logprob.cpu(),
        rank=rank.cpu(),
        entropy=entropy.cpu(),
        greedy_token=greedy_token.cpu(),
        alt_ids=top_ids[:, :n_alternatives].cpu(),
        alt_logits=top_vals[:, :n_alternatives].cpu(),
        alt_logprobs=top_logprobs[:, :n_alternatives].cpu(),
        margin=(top_vals[:, 0] - top_vals[:, 1]).cpu(),
        filter_changed=filter_changed.cpu(),
        eligible=eligible.cpu(),
        ref_logprobs=ref_logprobs,
    )
