"""The KV cache of the generation loop: transformers' DynamicCache, appending in place.

transformers' `DynamicLayer.update` appends a step's keys and values with `torch.cat`, which copies
the whole cache of the layer every step: O(context) bytes per layer and step, ~6 MB a step for
SmolLM2 at 128 tokens of context and ~15 MB at 320, a growing share of a decode step on a CPU.

`StackedCache` keeps the keys (and the values) of every full-attention layer in one tensor
[layer, batch, kv_head, capacity, head_dim] (one such pair per device when the model is spread
over several, `KVStacks`). On a CPU the tracer allocates it for the run up front
(prompt + max_new_tokens positions, at most 4096 new ones; pages never written cost no memory);
it grows by half whenever it is full. A step writes only its new column; each layer gets a view
of its first T positions, so the attention kernel sees exactly the values DynamicCache would give
it (tests compare the logits bit for bit).

Because all layers' keys are in one tensor, the probes read every layer's keys for the attention
rows from it without copying them (`lmtrace/capture/attention_rows.py`).

Sliding-window, linear-attention and other layer kinds keep transformers' own classes; so does a
layer whose keys do not fit the stack (another head count, head size or dtype).
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class KVStack:
    """Keys and values of the stacked layers of one device: two tensors [layer, batch, kv_head,
    capacity, head_dim]. Methods take model layer indices; `layers` says which ones the stack holds."""

    def __init__(self, layers: list[int], capacity_hint: int = 0, device: torch.device | None = None):
        self.layers = list(layers)
        self.n_layers = len(self.layers)
        self.slot = {layer: i for i, layer in enumerate(self.layers)}
        self.capacity_hint = capacity_hint
        self.device = device  # where the layers' keys are made (None: wherever the first ones are)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = [0] * self.n_layers  # positions held per slot
        # the key view of all its positions each layer last got from `append` (what its kernel is
        # handed): `holds` is then one identity test, called per layer and step
        self._views: list[torch.Tensor | None] = [None] * self.n_layers

    def fits(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether a layer with these first keys and values can live in the stack."""
        if key.dim() != 4 or value.shape[:-1] != key.shape[:-1]:
            return False
        if self.device is not None and key.device != self.device:
            return False
        if self.keys is None:
            return True
        k, v = self.keys, self.values
        return (
            key.shape[:2] == k.shape[1:3]
            and key.shape[-1] == k.shape[-1]
            and value.shape[-1] == v.shape[-1]
            and key.dtype == k.dtype
            and value.dtype == v.dtype
            and key.device == k.device
        )

    def _allocate(self, key: torch.Tensor, value: torch.Tensor, needed: int) -> None:
        old = self.capacity
        capacity = max(needed, self.capacity_hint, old + old // 2)
        B, kvh = key.shape[:2]
        keys = key.new_empty((self.n_layers, B, kvh, capacity, key.shape[-1]))
        values = value.new_empty((self.n_layers, B, kvh, capacity, value.shape[-1]))
        held = max(self.length)
        if self.keys is not None and held:
            keys[:, :, :, :held] = self.keys[:, :, :, :held]
            values[:, :, :, :held] = self.values[:, :, :, :held]
        self.keys, self.values = keys, values
        self._views = [None] * self.n_layers  # views of the old tensors

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[3]

    def append(
        self, layer: int, start: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key`/`value` [B, kvh, n, D] at positions start.. of `layer`; the layer's views [B, kvh, T, D]."""
        end = start + key.shape[2]
        if end > self.capacity:
            self._allocate(key, value, end)
        i = self.slot[layer]
        self.keys[i, :, :, start:end] = key
        self.values[i, :, :, start:end] = value
        self.length[i] = end
        key_view = self._views[i] = self.keys[i, :, :, :end]
        return key_view, self.values[i, :, :, :end]

    def holds(self, layer: int, key: torch.Tensor) -> bool:
        """Whether `key` is this stack's view of all of `layer`'s positions (what the kernel got)."""
        i = self.slot.get(layer)
        return i is not None and key is self._views[i]

    def _pick(self, layers: list[int]):
        """Index of `layers` (ascending model layer indices) in the layer dim: contiguous slots as a
        slice, so that indexing gives a view, not a copy."""
        slots = [self.slot[layer] for layer in layers]
        return slice(slots[0], slots[-1] + 1) if slots == list(range(slots[0], slots[-1] + 1)) else slots

    def keys_of(self, layers: list[int], length: int) -> torch.Tensor:
        """Keys of `layers`, first `length` positions: [n, B, kvh, T, D]."""
        return self.keys[self._pick(layers), :, :, :length]

    def column(self, layers: list[int], position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `layers` at one position: [n, B, kvh, D] each."""
        pick = self._pick(layers)
        return self.keys[pick, :, :, position], self.values[pick, :, :, position]


class KVStacks:
    """One `KVStack` per device: each layer's keys stay on the device that runs its attention (a
    model spread over GPUs), so the rows computed from them are computed there too. A model on one
    device has one stack holding every layer."""

    def __init__(self, groups: list[tuple[torch.device | None, list[int]]], capacity_hint):
        """groups: (device, its layers) per stack; capacity_hint(device) -> positions to allocate up front."""
        self.stacks = [KVStack(layers, capacity_hint(device), device) for device, layers in groups]
        self.of_layer = {layer: stack for stack in self.stacks for layer in stack.layers}

    def holds(self, layer: int, key: torch.Tensor) -> bool:
        stack = self.of_layer.get(layer)
        return stack is not None and stack.holds(layer, key)

    def groups(self, layers: list[int]) -> list[tuple[KVStack, list[int]]]:
        """`layers` split by the stack holding them (each part ascending), stacks in model order."""
        parts: dict[int, list[int]] = {}
        for layer in layers:
            parts.setdefault(id(self.of_layer[layer]), []).append(layer)
        return [(self.of_layer[part[0]], part) for part in parts.values()]

    def column(
        self, layers: list[int], position: int, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `layers` at one position, [n, B, kvh, D] each, on `device` (one copy per stack)."""
        groups = self.groups(layers)
        if len(groups) == 1:
            k, v = groups[0][0].column(layers, position)
            return (k, v) if device is None else (k.to(device), v.to(device))
        parts = [(part, *stack.column(part, position)) for stack, part in groups]
        order = [layer for part, _, _ in parts for layer in part]
        # per-stack columns moved to `device` once each, then put in the order of `layers`
        keys = torch.cat([k.to(device) for _, k, _ in parts], 0)
        values = torch.cat([v.to(device) for _, _, v in parts], 0)
        if order != layers:
            index = torch.tensor([order.index(layer) for layer in layers], device=device)
            keys, values = keys[index], values[index]
        return keys, values


def _device_groups(
    layer_devices: list[torch.device] | None, n_layers: int
) -> list[tuple[torch.device | None, list[int]]]:
    """One group per device, in model order; one group of every layer when the devices are unknown
    (or are not one per cache layer: each layer then joins the stack only if its keys fit)."""
    if layer_devices is None or len(layer_devices) != n_layers:
        return [(None, list(range(n_layers)))]
    by_device: dict[torch.device, list[int]] = {}
    for layer, device in enumerate(layer_devices):
        by_device.setdefault(device, []).append(layer)
    return list(by_device.items())


class StackedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views into a `KVStack` (or its own, if they do not fit)."""

    def __init__(self, stack: KVStack, index: int):
        super().__init__()
        self.stack, self.index = stack, index
        self.stacked = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.stacked = self.stack.fits(key_states, value_states)
        if not self.stacked:
            return super().update(key_states, value_states, *args, **kwargs)
        start = self.keys.shape[-2] if self.keys.numel() else 0  # `crop` shortens the views
        self.keys, self.values = self.stack.append(self.index, start, key_states, value_states)
        return self.keys, self.values

    # Beam search reorders the batch in place; the stack has no such operation (lmtrace never does it).
    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("lmtrace's KV cache does not support reordering the batch (beam search)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("lmtrace's KV cache does not support reordering the batch (beam search)")


class StackedCache(DynamicCache):
    """DynamicCache (per layer kinds from the model config) with the full-attention layers stacked,
    one stack per device (`layer_devices`: each layer's attention device; None: one device)."""

    def __init__(
        self,
        config,
        capacity_hint: int = 0,
        layer_devices: list[torch.device] | None = None,
        groups: list[tuple[torch.device | None, list[int]]] | None = None,
    ):
        """groups (rather than layer_devices) sets the stacks directly: tests split one device's layers
        over several stacks to run the multi-device code on a CPU."""
        super().__init__(config=config)
        hint = capacity_hint if callable(capacity_hint) else (lambda device: capacity_hint)
        if groups is None:
            groups = _device_groups(layer_devices, len(self.layers))
        self.stack = KVStacks(groups, hint)
        self.layers = [
            StackedLayer(self.stack.of_layer[i], i) if type(layer) is DynamicLayer else layer
            for i, layer in enumerate(self.layers)
        ]

    @classmethod
    def for_generation(
        cls,
        config,
        prompt_len: int,
        max_new_tokens: int,
        device: torch.device,
        layer_devices: list[torch.device] | None = None,
    ) -> "StackedCache":
        """The cache of one batch: on a CPU the run's positions up front, where pages never written
        cost nothing; capped at 4096 new ones, so that a huge max_new_tokens does not ask the kernel
        for more address space than it grants. Beyond it (and on accelerators) it grows by half."""
        up_front = prompt_len + min(max_new_tokens, 4096)

        def hint(stack_device: torch.device | None) -> int:
            return up_front if (stack_device or device).type == "cpu" else 0

        return cls(config, capacity_hint=hint, layer_devices=layer_devices)


def repeat_rows(t: torch.Tensor, each: int) -> torch.Tensor:
    """[K, ...] -> [K * each, ...], row q * each + b = row q (an expanded view when K is 1)."""
    return t.expand(each, *t.shape[1:]) if t.shape[0] == 1 else t.repeat_interleave(each, 0)


def repeat_prefix(cache: DynamicCache, each: int) -> DynamicCache:
    """A cache of K x `each` rows continuing the K-row prefix `cache`: row q * each + b continues row q.

    `lmtrace sweep` computes the prefix no edit changes once and runs many edited continuations of
    it, one per batch row. Each layer's keys and values become `repeat_rows` of the prefix's (views,
    no recomputation, when K is 1); the continuation's forward appends with `torch.cat` into new
    tensors, so `cache` itself is never written and serves every batch. Layer kinds that hold
    something else (linear-attention states) are copied and repeated with their own
    `batch_repeat_interleave`; `StackedLayer`, which appends in place, refuses (the prefix would be
    overwritten), so the prefix is computed with a plain DynamicCache.
    """
    out = copy.copy(cache)
    out.layers = [_repeat_layer(layer, each) for layer in cache.layers]
    return out


def packable(cache: DynamicCache) -> bool:
    """Whether the rows of this prefix can be selected and repeated (`select_prefix`): plain key/value layers."""
    return all(isinstance(layer, DynamicLayer) and not isinstance(layer, StackedLayer) for layer in cache.layers)


def select_prefix(cache: DynamicCache, rows: list[int]) -> DynamicCache:
    """The prefix of some of a K-row cache's rows (a `packable` one), in the order given."""
    index = torch.tensor(rows)
    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        if layer.is_initialized and layer.keys.numel():
            new.keys = layer.keys.index_select(0, index.to(layer.keys.device))
            new.values = layer.values.index_select(0, index.to(layer.values.device))
        out.layers.append(new)
    return out


def _repeat_layer(layer, each: int):
    if isinstance(layer, DynamicLayer) and not isinstance(layer, StackedLayer):
        new = copy.copy(layer)
        if layer.is_initialized and layer.keys.numel():
            new.keys, new.values = repeat_rows(layer.keys, each), repeat_rows(layer.values, each)
        return new
    new = copy.deepcopy(layer)
    new.batch_repeat_interleave(each)
    return new
