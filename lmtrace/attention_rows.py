"""Attention rows of the query position for every captured layer, from one batched product.

The forward runs sdpa, which returns no weights, so each layer's query row is recomputed from the
post-rotary query and the cache-updated keys the kernel saw. For models whose eager kernel is the
plain one (Llama's: softmax(q·kᵀ·scaling + additive mask) in float32), this is the same formula.

Done layer by layer it is ~7 small tensor ops per layer and step, ~3 ms a step for 30 layers on a
2-core CPU: most of it per-op overhead, not arithmetic. So the keys are also copied into one
buffer [layer, batch, kv_head, position, head_dim] (one column per layer and step; the prompt's at
the prefill), the layers' queries are kept, and after the forward one grouped matmul, one mask add
and one softmax give every layer's row. The buffer costs memory like half of the KV cache, grown by
doubling as the context grows.

A layer falls back to the per-layer computation (the caller's) when its keys are not simply the
whole context so far (a sliding-window cache evicted some) or it got a different mask from the
other layers; tests compare both paths with the model's eager `output_attentions`.
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
    """Key history of the captured layers of one batch, and the queries waiting for their rows."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.keys: torch.Tensor | None = None  # [L, B, KVH, capacity, D]
        self.filled = [0] * n_layers  # key columns held per layer; -1: the layer left the buffer
        self._clear_step()

    def _clear_step(self) -> None:
        self.queries: dict[int, torch.Tensor] = {}  # layer index -> query of the last position [B, H, D]
        self.mask = None
        self.scaling: float | None = None
        self.kv_len: int | None = None

    def new_batch(self) -> None:
        self.keys = None
        self.filled = [0] * self.n_layers
        self._clear_step()

    def _store_keys(self, li: int, key: torch.Tensor) -> bool:
        """Append this call's new key columns; False when the layer's keys are not the context so far."""
        T = key.shape[2]
        have = self.filled[li]
        if have < 0:
            return False
        new = T - have
        if new < 1 or (have and self.keys is not None and self.keys.shape[1:3] != key.shape[:2]):
            self.filled[li] = -1  # e.g. a sliding-window cache that dropped old keys
            return False
        if self.keys is None or self.keys.shape[3] < T:
            self._grow(key, T)
        self.keys[li, :, :, have:T] = key[:, :, have:T]
        self.filled[li] = T
        return True

    def _grow(self, key: torch.Tensor, T: int) -> None:
        B, kvh, _, D = key.shape
        capacity = max(T + 64, 2 * (self.keys.shape[3] if self.keys is not None else 0))
        grown = torch.empty((self.n_layers, B, kvh, capacity, D), dtype=key.dtype, device=key.device)
        if self.keys is not None:
            held = max(self.filled)
            grown[:, :, :, :held] = self.keys[:, :, :, :held]
        self.keys = grown

    def offer(self, li: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float,
              want_row: bool) -> bool:
        """Called for every captured layer's attention; True when its row will come from `rows()`."""
        if not self._store_keys(li, key):
            return False
        if not want_row:
            return False
        T = key.shape[2]
        if self.queries and (mask is not self.mask or scaling != self.scaling or T != self.kv_len):
            return False
        self.queries[li] = query[:, :, -1]
        self.mask, self.scaling, self.kv_len = mask, scaling, T
        return True

    def rows(self) -> tuple[dict[int, torch.Tensor], int | None]:
        """({layer index: probabilities [B, H, T]}, T) for the layers offered this step, then forgets them."""
        if not self.queries:
            return {}, None
        idx = sorted(self.queries)
        T = self.kv_len
        q = torch.stack([self.queries[i] for i in idx], 0)[:, :, :, None]  # [n, B, H, 1, D]
        contiguous = idx == list(range(idx[0], idx[-1] + 1))
        keys = self.keys[idx[0]: idx[-1] + 1] if contiguous else self.keys[idx]
        mask = None if self.mask is None else self.mask[:, :, -1:]
        probs = plain_attention_probs(q, keys[:, :, :, :T], mask, self.scaling)[:, :, :, 0]  # [n, B, H, T]
        out = {i: probs[n] for n, i in enumerate(idx)}
        self._clear_step()
        return out, T
