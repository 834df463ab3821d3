"""Attention rows of the query position for every captured layer, from one batched product.

The forward runs sdpa, which returns no weights, so each layer's query row is recomputed from the
post-rotary query and the cache-updated keys the kernel saw. For models whose eager kernel is the
plain one (Llama's: softmax(q·kᵀ·scaling + additive mask) in float32), this is the same formula.

Done layer by layer it is ~7 small tensor ops per layer and step, ~3 ms a step for 30 layers on a
2-core CPU: most of it per-op overhead, not arithmetic. The generation loop's KV cache keeps every
full-attention layer's keys in one tensor [layer, batch, kv_head, position, head_dim]
(`lmtrace/kv_cache.py`), so the layers' queries are kept and, after the forward, one grouped
matmul over that tensor, one mask add and one softmax give every layer's row; no key is copied.

A layer falls back to the per-layer computation (the caller's) when the keys its kernel got are not
the stacked cache's view of the whole context (a sliding-window layer, a layer outside the stack)
or it got a different mask from the other layers; tests compare both paths with the model's eager
`output_attentions`.
"""

from __future__ import annotations

import torch


def plain_attention_probs(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                          scaling: float) -> torch.Tensor:
    """softmax(q·kᵀ·scaling + mask) in float32, as Llama's eager kernel, GQA by grouping query heads.

    query [..., B, H, r, D], key [..., B, KVH, T, D], mask [B, 1, r, T] additive -> probs [..., B, H, r, T].
    """
    *lead, B, H, r, D = query.shape
    kvh, T = key.shape[-3], key.shape[-2]
    grouped = query.reshape(*lead, B, kvh, (H // kvh) * r, D)
    scores = torch.matmul(grouped, key.transpose(-2, -1)).reshape(*lead, B, H, r, T) * scaling
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)


class BatchedRows:
    """The queries of one step waiting for their rows, whose keys are in the KV cache's stack."""

    def __init__(self):
        self.kv = None  # the KVStack of the batch being generated
        self._clear_step()

    def _clear_step(self) -> None:
        self.queries: dict[int, torch.Tensor] = {}  # model layer -> query of the last position [B, H, 1, D]
        self.mask = None
        self.scaling: float | None = None
        self.kv_len: int | None = None

    def new_batch(self, kv) -> None:
        """kv: the `KVStack` of the batch's cache (None: no stacked cache, every layer falls back)."""
        self.kv = kv
        self._clear_step()

    def offer(self, layer: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
              scaling: float) -> bool:
        """Called for every captured layer's attention with the query position's query [B, H, 1, D];
        True when its row will come from `rows()`."""
        if self.kv is None or not self.kv.holds(layer, key):
            return False
        T = key.shape[2]
        if self.queries and (mask is not self.mask or scaling != self.scaling or T != self.kv_len):
            return False
        self.queries[layer] = query
        self.mask, self.scaling, self.kv_len = mask, scaling, T
        return True

    def rows(self) -> tuple[list[int], torch.Tensor | None, int | None]:
        """(model layers offered this step, ascending; their probabilities [n, B, H, T]; T), then forgets them."""
        if not self.queries:
            return [], None, None
        layers = sorted(self.queries)
        T = self.kv_len
        q = torch.stack([self.queries[i] for i in layers], 0)  # [n, B, H, 1, D]
        mask = None if self.mask is None else self.mask[:, :, -1:]
        probs = plain_attention_probs(q, self.kv.keys_of(layers, T), mask, self.scaling)[:, :, :, 0]  # [n, B, H, T]
        self._clear_step()
        return layers, probs, T
