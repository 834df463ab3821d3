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
residuals, one product per step over the same rows the inline lens had (lmtrace/deferred_lens.py),
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
        head = adapter.unembed
        self.weight = head.weight.detach()
        self.device = self.weight.device
        bias = getattr(head, "bias", None)
        self.bias = None if bias is None else bias.detach().float()
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
    def of_residuals(self, resid: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """resid [N, d] float32 residual streams (before the final norm) -> as `__call__`. The final
        norm runs in the model's dtype, as in the forward; inline and deferred lenses both call this."""
        return self(self.final_norm(resid.to(self.device, self.model_dtype)).float())

    @torch.inference_mode()
    def __call__(self, normed: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """normed [N, d] (final-normed residuals) -> ids [N, k] int32, probs [N, k] f32, margin [N] f32."""
        x_all = normed.float().to(self.device)
        N = x_all.shape[0]
        ids = np.empty((N, self.k), dtype=np.int32)
        probs = np.empty((N, self.k), dtype=np.float32)
        margin = np.empty(N, dtype=np.float32)
        for r0 in range(0, N, ROWS_PER_MATMUL):
            x = x_all[r0: r0 + ROWS_PER_MATMUL]
            if self.approximate:
                top_ids, top_logits, lse = self._candidates(x)
            else:
                logits = self._exact(x)
                top = logits.topk(self.k, dim=-1)
                top_ids, top_logits, lse = top.indices, top.values, logits.logsumexp(-1)
            rows = slice(r0, r0 + x.shape[0])
            ids[rows] = top_ids.cpu().numpy()
            probs[rows] = (top_logits - lse[:, None]).exp().cpu().numpy()
            margin[rows] = (top_logits[:, 0] - top_logits[:, 1]).cpu().numpy()
        return ids, probs, margin

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
        return cand.gather(-1, top.indices), top.values, lse

