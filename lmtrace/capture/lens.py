"""The logit lens: final norm + unembedding of every captured layer's residual, in one product.

Two precisions (`capture.lens.dtype`):

  float32   (default) every logit in float32: exact top-k ids, logits and softmax normaliser.
  bfloat16  a bfloat16 matrix product (float32 accumulation; AMX / AVX-512 BF16 where the CPU has
            them) ranks the vocabulary; the best CANDIDATES per row are then re-scored in float32.
            Stored ids are the top-k of those exact scores, margins are exact float32 logit
            differences, and probabilities are exp(exact logit − normaliser), the normaliser summing
            exact exp(logit) over the candidates and the bfloat16 ones over the rest of the
            vocabulary. Measured on SmolLM2-135M (1,500 rows, all 30 layers): top-10 ids identical
            to float32 in every row; normaliser error ≤ 0.011 (mean 0.0001), i.e. probabilities
            within ~1 % relative. Pure bfloat16 logits, by contrast, were off by up to 0.46 and
            changed the top-1 in 5 % of rows.

When it runs: with `capture.lens.when: inline` the probes call it once per step for all captured
layers; with `deferred` (the default) `lmtrace lens` calls it later on the archived float32
residuals, one product per step over the same rows the inline lens had (lmtrace/analysis/deferred_lens.py),
which gives the same values bit for bit. Computing
the inline lens per block on the archive writer's thread was tried and measured no faster on a
2-core CPU: the ~25 ms of single-core work per step competes with the forward for the same cores
and memory bandwidth (docs/archive.md, "Cost").
"""

from __future__ import annotations

import numpy as np
import torch

CANDIDATES = 64  # per row, re-scored in float32 (bfloat16 mode)
ROWS_PER_MATMUL = 256  # bounds the [rows, vocab] logits buffer (256 × 49,152 × 4 B ≈ 50 MB)


class LogitLens:
    def __init__(self, adapter, k: int, dtype: str):
        head = adapter.resident(adapter.unembed)  # its weights, also where they were offloaded (docs/devices.md)
        self.weight = head["weight"]
        self.device = self.weight.device
        bias = head.get("bias")
        self.bias = None if bias is None else bias.float()
        self.softcap = adapter.final_softcap
        self.k = k
        self.vocab, self.d_in = self.weight.shape  # d_in: after the final norm (OPT's project_out included)
        self.approximate = dtype == "bfloat16"
        self.weight32 = self.weight.float()
        self.final_norm = adapter.final_norm
        self.model_dtype = next(adapter.model.parameters()).dtype
        if self.approximate:
            self.weight_bf16 = self.weight.to(torch.bfloat16)
            self.bias_bf16 = None if self.bias is None else self.bias.to(torch.bfloat16)

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap:
            return torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _exact(self, x: torch.Tensor) -> torch.Tensor:
        return self._cap(torch.nn.functional.linear(x, self.weight32, self.bias))

    @torch.inference_mode()
    def of_residuals(self, resid: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[np.ndarray, ...]:
        """resid [N, d] float32 residual streams (before the final norm) -> as `__call__`. The final
        norm runs in the model's dtype, as in the forward; inline and deferred lenses both call this."""
        return self(self.final_norm(resid.to(self.device, self.model_dtype)).float(), targets)

    @torch.inference_mode()
    def __call__(self, normed: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[np.ndarray, ...]:
        """normed [N, d] (final-normed residuals) -> ids [N, k] int32, probs [N, k] f32, margin [N] f32;
        with targets [N, T] token ids also their ranks [N, T] int32 (tokens with a strictly larger lens
        logit) and probabilities [N, T] f32 (softmax over the whole vocabulary)."""
        x_all = normed.float().to(self.device)
        N = x_all.shape[0]
        ids = np.empty((N, self.k), dtype=np.int32)
        probs = np.empty((N, self.k), dtype=np.float32)
        margin = np.empty(N, dtype=np.float32)
        if targets is not None:
            targets = targets.to(self.device, torch.int64)
            t_rank = np.empty(tuple(targets.shape), dtype=np.int32)
            t_prob = np.empty(tuple(targets.shape), dtype=np.float32)
        for r0 in range(0, N, ROWS_PER_MATMUL):
            x = x_all[r0 : r0 + ROWS_PER_MATMUL]
            rows = slice(r0, r0 + x.shape[0])
            if self.approximate:
                top_ids, top_logits, lse, ranked = self._candidates(x)
            else:
                logits = self._exact(x)
                top = logits.topk(self.k, dim=-1)
                top_ids, top_logits, lse, ranked = top.indices, top.values, logits.logsumexp(-1), logits
            ids[rows] = top_ids.cpu().numpy()
            probs[rows] = (top_logits - lse[:, None]).exp().cpu().numpy()
            margin[rows] = (top_logits[:, 0] - top_logits[:, 1]).cpu().numpy()
            if targets is not None:
                r, p = self._targets(x, ranked, lse, targets[rows])
                t_rank[rows], t_prob[rows] = r, p
        if targets is None:
            return ids, probs, margin
        return ids, probs, margin, t_rank, t_prob

    def _targets(self, x: torch.Tensor, ranked, lse: torch.Tensor, targets: torch.Tensor):
        """Rank and probability of given token ids [n, T] in rows x [n, d]. float32: against the full
        logits. bfloat16: the target's logit is computed exactly in float32 and compared with the exact
        candidates' and the bfloat16 logits of the rest (the target's own bfloat16 value excluded)."""
        if not self.approximate:
            t_logit = ranked.gather(-1, targets)  # [n, T]
            rank = (ranked[:, None, :] > t_logit[:, :, None]).sum(-1)
            return rank.to(torch.int32).cpu().numpy(), (t_logit - lse[:, None]).exp().cpu().numpy()
        cand, exact, rest = ranked
        t_logit = torch.einsum("nd,ntd->nt", x, self.weight32[targets])
        if self.bias is not None:
            t_logit = t_logit + self.bias[targets]
        t_logit = self._cap(t_logit)
        ranks = []
        for j in range(targets.shape[1]):
            # a candidate's logit as the candidates' product gave it (the same value bit for bit)
            match = cand == targets[:, j : j + 1]
            t_logit[:, j] = torch.where(match.any(-1), (exact * match).sum(-1), t_logit[:, j])
            t = t_logit[:, j : j + 1]
            others = rest.scatter(-1, targets[:, j : j + 1], float("-inf"))
            ranks.append((exact > t).sum(-1) + (others > t).sum(-1))
        rank = torch.stack(ranks, -1)
        return rank.to(torch.int32).cpu().numpy(), (t_logit - lse[:, None]).exp().cpu().numpy()

    def _candidates(self, x: torch.Tensor):
        approx = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight_bf16, self.bias_bf16).float()
        approx = self._cap(approx)
        c = min(CANDIDATES, self.vocab)
        cand = approx.topk(c, dim=-1, sorted=False).indices  # [n, c]
        # float32 logits of the candidates: each row against its own c unembedding rows
        exact = torch.einsum("nd,ncd->nc", x, self.weight32[cand])
        if self.bias is not None:
            exact = exact + self.bias[cand]
        exact = self._cap(exact)
        rest = approx.scatter(-1, cand, float("-inf"))  # bfloat16-ranked logits outside the candidates
        lse = torch.logaddexp(exact.logsumexp(-1), rest.logsumexp(-1)) if c < self.vocab else exact.logsumexp(-1)
        top = exact.topk(self.k, dim=-1)
        return cand.gather(-1, top.indices), top.values, lse, (cand, exact, rest)
