"""Attention rows of the query position for every captured layer, from one batched product.

The forward runs sdpa, which returns no weights, so each layer's query row is recomputed from the
post-rotary query and the cache-updated keys the kernel saw. For models whose eager kernel is the
plain one (Llama's: softmax(q·kᵀ·scaling + additive mask) in float32), this is the same formula.

Done layer by layer it is ~7 small tensor ops per layer and step, ~3 ms a step for 30 layers on a
2-core CPU: most of it per-op overhead, not arithmetic. The generation loop's KV cache keeps every
full-attention layer's keys in one tensor [layer, batch, kv_head, position, head_dim]
(`lmtrace/capture/kv_cache.py`), so the layers' queries are kept and, after the forward, one grouped
matmul over that tensor, one mask add and one softmax give every layer's row; no key is copied.

A layer falls back to the per-layer computation (the caller's) when the keys its kernel got are not
the stacked cache's view of the whole context (a sliding-window layer, a layer outside the stack)
or its mask differs in shape from the other layers'; tests compare both paths with the model's
eager `output_attentions`.
"""

from __future__ import annotations

import torch


def plain_attention_probs(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
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
    """The queries of one step waiting for their rows, whose keys are in the KV cache's stacks.

    With the model spread over devices there is one stack per device (`KVStacks`): each device's
    rows come from one product there, next to its keys, and are copied once to the device that
    assembles the step. A layer on another device gets its own copy of the mask (accelerate's hooks
    move it): where a stack's layers got different mask tensors, each layer's own is added
    ([n, B, 1, 1, T] instead of one shared [B, 1, 1, T]), so the rows stay exactly the formula."""

    def __init__(self):
        self.kv = None  # the KVStacks of the batch being generated
        self._clear_step()

    def _clear_step(self) -> None:
        self.queries: dict[int, torch.Tensor] = {}  # model layer -> query of the last position [B, H, 1, D]
        self.masks: dict[int, torch.Tensor | None] = {}  # model layer -> the mask its kernel got
        self.scaling: float | None = None
        self.kv_len: int | None = None

    def new_batch(self, kv) -> None:
        """kv: the `KVStacks` of the batch's cache (None: no stacked cache, every layer falls back)."""
        self.kv = kv
        self._clear_step()

    def offer(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float
    ) -> bool:
        """Called for every captured layer's attention with the query position's query [B, H, 1, D];
        True when its row will come from `rows()`."""
        if self.kv is None or not self.kv.holds(layer, key):
            return False
        T = key.shape[2]
        if self.queries:
            first = next(iter(self.masks.values()))
            same_kind = (mask is None) == (first is None) and (mask is None or mask.shape == first.shape)
            if not same_kind or scaling != self.scaling or T != self.kv_len:
                return False
        self.queries[layer] = query
        self.masks[layer] = mask
        self.scaling, self.kv_len = scaling, T
        return True

    def _group_mask(self, layers: list[int]) -> torch.Tensor | None:
        """The mask row of a stack's layers: the shared tensor [B, 1, 1, T], or one per layer [n, B, 1, 1, T]."""
        masks = [self.masks[layer] for layer in layers]
        if masks[0] is None:
            return None
        if all(m is masks[0] for m in masks):
            return masks[0][:, :, -1:]
        return torch.stack([m[:, :, -1:] for m in masks], 0)

    def rows(self, device: torch.device | None = None) -> tuple[list[int], torch.Tensor | None, int | None]:
        """(model layers offered this step, ascending; their probabilities [n, B, H, T] on `device`
        (default: the keys' device, one device only); T), then forgets them."""
        if not self.queries:
            return [], None, None
        layers = sorted(self.queries)
        T = self.kv_len
        parts = []
        for stack, group in self.kv.groups(layers):
            q = torch.stack([self.queries[i] for i in group], 0)  # [n, B, H, 1, D]
            probs = plain_attention_probs(q, stack.keys_of(group, T), self._group_mask(group), self.scaling)
            parts.append((group, probs[:, :, :, 0]))  # [n, B, H, T]
        self._clear_step()
        if len(parts) == 1:
            probs = parts[0][1]
            return layers, probs if device is None else probs.to(device), T
        by_layer = {layer: (probs, n) for group, probs in parts for n, layer in enumerate(group)}
        moved = {id(probs): probs.to(device) for _, probs in parts}  # one copy per device
        return layers, torch.stack([moved[id(by_layer[layer][0])][by_layer[layer][1]] for layer in layers], 0), T
