"""The sweep's forward engine: a pack of sequences of one layout, one cell per batch row per sequence.

edits      `zero` / `mean` are exactly `lmtrace intervene`'s ablations (`interventions.EditSet`
           with the same entry kinds), one entry per batch row; `patch` replaces a component's
           value with the source run's at the same position (`_Patches`, values from
           `capture_source`); both read and replace components with the hooks intervene's
           edits use (`capture/component_hooks.py`).
semantics  rescore: the sequence is the parent's prompt followed by its generated tokens
           (teacher-forced); one forward computes every measured step at once (step s is read at
           position prompt_len - 1 + s).
pack       K sequences of the same prompt length, measured steps and prefix run in one forward:
           row q * cells + b is sequence q with cell b (`SequenceInput`, `Engine.pack`).
prefix KV  the positions no edit changes (before `from_step`'s, or those a patch source shares)
           are computed once per pack and their KV cache is continued by every batch row, so each
           forward computes only the rest.
shortcut   the layers below a batch's lowest edited layer are not computed: they return the
           unedited forward's outputs, saved once per pack (`_PrefixSkip`); a self-check on the
           first baseline compares the shortcut's logits with the full forward's and turns it off
           if they differ. A batch of cells spread over many layers runs in `layer_groups`.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from ...capture.component_hooks import edit_component, read_component
from ...capture.interventions import EditSet, parse_entries
from ...capture.kv_cache import repeat_prefix, repeat_rows
from .cells import Cell
from .feature_engine import FeatureEdits, site_reader
from .metrics import Metric, measure

ENTRY_KIND = {
    "head": "ablate_head",
    "attn": "ablate_attention",
    "mlp": "ablate_mlp",
    "layer": "ablate_layer",
    "neuron": "ablate_neurons",
}
# the `component_means` kind whose mean value a `mean` ablation of the cell's component writes
MEAN_KIND = {"head": "head", "attn": "attn", "mlp": "mlp", "layer": "layer", "neuron": "ffn"}


class _PrefixSkip:
    """Layers below `start` return the unedited forward's outputs (saved by the baseline of the
    sequences, one row each) repeated for every row of the batch."""

    def __init__(self, layers):
        self.layers = layers
        self.saved: dict[int, object] = {}

    @contextmanager
    def recording(self):
        self.saved = {}
        handles = [
            layer.register_forward_hook((lambda i: lambda m, a, o: self.saved.__setitem__(i, o))(i))  # noqa: B023 (i bound)
            for i, layer in enumerate(self.layers)
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def skipping(self, start: int, saved: dict, each: int):
        replaced = []

        def make(i):
            out = saved[i]

            def forward(*args, **kwargs):
                if isinstance(out, tuple):
                    return (repeat_rows(out[0], each), *out[1:])
                return repeat_rows(out, each)

            return forward

        try:
            for i in range(start):
                layer = self.layers[i]
                if "forward" in layer.__dict__:  # someone else wrapped it: do not interfere
                    break
                layer.forward = make(i)
                replaced.append(layer)
            yield
        finally:
            for layer in replaced:
                del layer.__dict__["forward"]


@dataclass
class SourceValues:
    """A patch source's unedited values: values[(kind, layer)] -> [n, width], row i = position start + i
    (kind: head = o_proj input, attn / mlp = block output, resid = layer output)."""

    values: dict
    start: int = 0


class _Patches:
    """Patch edits: row b's component gets its source's value at its position(s).

    The forward computes positions `offset`.. (after a prefix no edit changes: `from_step`'s, or the
    positions the source shares); only those are patched. cells[b] and sources[b]: row b's cell and
    the SourceValues of its sequence's source."""

    def __init__(self, adapter, cells: list[Cell], sources: list[SourceValues], offset: int = 0):
        self.adapter, self.cells, self.sources, self.offset = adapter, cells, sources, offset

    def _rows(self, kind: str, layer: int):
        return [(b, c) for b, c in enumerate(self.cells) if c.component == kind and c.layer == layer]

    def _apply(self, x: torch.Tensor, rows, key: tuple[str, int], cols: dict[int, slice]) -> torch.Tensor:
        lo = self.offset  # x[:, i] is position lo + i
        x = x.clone()
        for b, c in rows:
            source = self.sources[b]
            src, s0 = source.values[key], source.start  # src[i] is position s0 + i
            end = min(lo + x.shape[1], s0 + src.shape[0])  # positions both sequences have
            sl = cols.get(b, slice(None))
            if c.position is None:
                if end > lo:
                    x[b, : end - lo, sl] = src[lo - s0 : end - s0, sl].to(x.dtype)
            elif lo <= c.position < end:
                x[b, c.position - lo, sl] = src[c.position - s0, sl].to(x.dtype)
        return x

    @contextmanager
    def attached(self):
        a = self.adapter
        handles = []
        try:
            for kind, layer in sorted({(c.component, c.layer) for c in self.cells}):
                rows, key = self._rows(kind, layer), (kind, layer)
                if kind == "head":
                    d = a.head_dim
                    cols = {b: slice(c.head * d, (c.head + 1) * d) for b, c in rows}
                else:
                    cols = {}
                handles.append(
                    edit_component(
                        a, kind, layer, lambda x, rows=rows, key=key, cols=cols: self._apply(x, rows, key, cols)
                    )
                )
            yield
        finally:
            for h in handles:
                h.remove()


@torch.inference_mode()
def capture_source(
    adapter, ids: list[list[int]], wanted: set[tuple[str, int]], keep: int = 1, prefix=None, start: int = 0
) -> tuple[list[SourceValues], torch.Tensor]:
    """The unedited values of K source sequences of equal length, one forward: per sequence the values at
    positions `start`..; and their logits [K, keep, V] at the last `keep` positions. With `prefix` (the
    K-row KV cache of positions < start, which each source shares with its patched sequence) only the
    positions from `start` on are computed."""
    out: dict = {}
    handles = []
    a = adapter
    try:
        for kind, layer in wanted:
            if kind == "feature":  # ("feature", the SAE's Site): its hook's activation
                handles.append(
                    site_reader(a, layer, lambda x, key=(kind, layer): out.__setitem__(key, x.detach().clone()))
                )
                continue
            handles.append(
                read_component(a, kind, layer, lambda x, key=(kind, layer): out.__setitem__(key, x.detach().clone()))
            )
        device = next(a.model.parameters()).device
        x = torch.tensor(ids, dtype=torch.long, device=device)
        if prefix is None:
            start = 0
            kw = {"attention_mask": torch.ones_like(x), "use_cache": False}
        else:
            kw = {
                "attention_mask": torch.ones_like(x),
                "use_cache": True,
                "cache": repeat_prefix(prefix, 1),
                "position_ids": torch.arange(start, x.shape[1], device=device)[None].expand(len(ids), -1),
            }
        logits = a.model(input_ids=x[:, start:], logits_to_keep=keep, **kw).logits
    finally:
        for h in handles:
            h.remove()
    return [SourceValues({k: v[q] for k, v in out.items()}, start) for q in range(len(ids))], logits.float()


# The fixed cost of one forward through one layer, in token positions of compute: on a CPU a forward
# streams every weight from memory once, whatever its rows (measured on the embedded model, float32,
# 2 threads: 65 ms for 1 to 50 positions, then ~2.3 ms per position), and calls every module once.
# A group of cells is worth its own forward only when the layers it skips save more than that.
FORWARD_OVERHEAD_POSITIONS = 32


def layer_groups(starts: list[int], n_layers: int, positions: int) -> list[tuple[int, int]]:
    """Split cells whose lowest edited layers are `starts` (ascending) into contiguous groups [i, j),
    one forward each, starting at its first cell's layer: a row whose edit begins at layer 20 needs
    only layers 20.. computed, but one forward computes every row from the group's lowest layer.
    Minimises sum over groups of (layers computed) x (rows x positions + FORWARD_OVERHEAD_POSITIONS),
    by dynamic programming over the split points."""
    n = len(starts)
    best = [0.0] + [float("inf")] * n  # best[j]: the cost of cells [0, j)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (n_layers - starts[i]) * ((j - i) * positions + FORWARD_OVERHEAD_POSITIONS)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    out, j = [], n
    while j > 0:
        out.append((cut[j], j))
        j = cut[j]
    return out[::-1]


@dataclass
class SequenceInput:
    """K sequences of equal length as the engine runs them together (a pack; K is often 1): what each
    forward computes and which steps its logits are. Row q of every tensor is sequence q."""

    ids: torch.Tensor  # [K, T]: prompt + generated tokens up to the last measured step's query position
    first_step: int  # logits row i is step first_step + i
    n_logits: int
    start: int = 0  # the first position a forward computes (positions before it: `prefix`)
    prefix: object | None = None  # the KV cache of positions < start (a DynamicCache of K rows)
    layer_outputs: dict = field(default_factory=dict)  # layer -> the baseline's output [K, ...] (_PrefixSkip)

    @property
    def size(self) -> int:
        return self.ids.shape[0]

    def select(self, rows: list[int]) -> SequenceInput:
        """The pack of some of these sequences (in the order given)."""
        from ...capture.kv_cache import select_prefix

        if rows == list(range(self.size)):
            return self
        index = torch.tensor(rows, device=self.ids.device)

        def pick(out):
            return (out[0].index_select(0, index), *out[1:]) if isinstance(out, tuple) else out.index_select(0, index)

        return SequenceInput(
            self.ids.index_select(0, index),
            self.first_step,
            self.n_logits,
            self.start,
            None if self.prefix is None else select_prefix(self.prefix, rows),
            {i: pick(o) for i, o in self.layer_outputs.items()},
        )


class Engine:
    """Runs packs of sequences (`pack`): the baseline once per pack, then the batches of cells
    (`run_cells`), each in one forward per layer group.

    With `from_step` S > 0 the edits apply to the positions of steps >= S only (intervene's
    `--from-step`: step s computes position prompt_len - 1 + s): the positions before are the
    unedited prefix, run once per pack; every batch continues its KV cache (repeated for the
    batch's rows, `kv_cache.repeat_prefix`) and computes only the edited suffix."""

    def __init__(
        self,
        adapter,
        edit: str,
        means: dict | None,
        metrics: list[Metric],
        from_step: int = 0,
        features=None,
        value: float | None = None,
    ):
        self.adapter = adapter
        self.model = adapter.model
        self.device = next(self.model.parameters()).device
        self.edit = edit
        self.means = means or {}
        self.metrics = metrics
        self.from_step = from_step
        self.skip = _PrefixSkip(adapter.layers)
        self.skip_ok = True
        self.skip_checked = False  # the shortcut's self-check runs on the first sequence's baseline
        self.features, self.value = features, value  # --over features: the SweepSae, --edit clamp's value
        if features is not None:
            from .feature_engine import check_site_shape

            check_site_shape(adapter, features)

    def prefix_end(self, prompt_len: int, first_measured: int = 0, shared: int = 0) -> int:
        """The first position a forward computes for a sequence. The positions before it are the ones no
        edit changes, computed once into a prefix KV cache every batch row continues: those before
        `from_step`'s (not edited), and the first `shared` positions (a patch source whose tokens agree
        with this sequence's there: a causal model gives both the same values, so patching them changes
        nothing). The prefix stops at the first measured step's position: its logits are computed by
        every batch."""
        unedited = prompt_len - 1 + self.from_step if self.from_step else 0
        return max(0, min(max(unedited, shared), prompt_len - 1 + first_measured))

    @torch.inference_mode()
    def pack(self, ids: list[list[int]], prompt_len: int, last_step: int, start: int) -> SequenceInput:
        """The input of K sequences of one layout (the same prompt length, measured steps and `prefix_end`);
        their prefix is computed here, once, in one forward."""
        T = prompt_len + last_step
        x = torch.tensor([row[:T] for row in ids], dtype=torch.long, device=self.device)
        if start <= 0:
            return SequenceInput(x, 0, last_step + 1)
        from transformers import DynamicCache

        first_step = max(0, start - (prompt_len - 1))
        cache = DynamicCache(config=self.model.config)
        self.model(
            input_ids=x[:, :start],
            attention_mask=torch.ones_like(x[:, :start]),
            position_ids=torch.arange(start, device=self.device)[None].expand(len(ids), -1),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return SequenceInput(x, first_step, last_step - first_step + 1, start, cache)

    def _forward(self, seq: SequenceInput, each: int, start: int = 0, edits=None, patches=None):
        """Logits [K * each, n_logits, V] (float32) of the last n_logits positions, `each` rows per
        sequence (row q * each + b: sequence q); `start`: the lowest edited layer."""
        rows = seq.size * each
        T = seq.ids.shape[1]
        x = repeat_rows(seq.ids[:, seq.start :], each)
        mask = torch.ones((rows, T), dtype=torch.long, device=self.device)  # the prefix's positions too
        positions = torch.arange(seq.start, T, device=self.device)[None].expand(rows, -1)
        cache = (
            {"cache": repeat_prefix(seq.prefix, each), "use_cache": True}
            if seq.prefix is not None
            else {"use_cache": False}
        )
        with ExitStack() as stack:
            head = self.model.get_output_embeddings()
            if head is not None:
                # transformers hands the output head a strided slice of the kept positions; torch then
                # multiplies [rows, 1, d] as a batched matmul against a copy of the weight per row
                # (measured: 60 % of a patching sweep's time): a contiguous input is one matrix product
                stack.callback(head.register_forward_pre_hook(lambda m, args: (args[0].contiguous(), *args[1:])).remove)
            if start > 0 and self.skip_ok:
                stack.enter_context(self.skip.skipping(start, seq.layer_outputs, each))
            if edits is not None:
                stack.enter_context(edits.attached())
                # every computed position belongs to a step >= from_step: all are edited
                edits.begin(self.from_step, list(range(rows)), positions, seq.prefix is None)
                mask = edits.edit_mask(mask, [0] * rows, list(range(rows)), self.from_step)
            if patches is not None:
                stack.enter_context(patches.attached())
            out = self.model(
                input_ids=x, attention_mask=mask, position_ids=positions, logits_to_keep=seq.n_logits, **cache
            )
        return out.logits.float()

    @torch.inference_mode()
    def baseline(self, seq: SequenceInput) -> torch.Tensor:
        """Unedited logits [K, n_logits, V]; saves every layer's output for the prefix shortcut (checked
        against the full forward on the first pack)."""
        with self.skip.recording():
            base = self._forward(seq, 1)
        seq.layer_outputs = self.skip.saved
        if not self.skip_checked:
            self.skip_checked = True
            half = max(1, len(self.adapter.layers) // 2)
            short = self._forward(seq, 1, start=half)
            if not torch.allclose(short, base, atol=1e-5, rtol=0):
                self.skip_ok = False  # the family does something between layers: compute every layer
        return base

    def entries_for(self, cells: list[Cell]) -> EditSet:
        data, resources = [], {}
        for b, c in enumerate(cells):
            if c.component == "position":
                data.append(
                    {
                        "kind": "mask_positions",
                        "mask": [c.position],
                        "sequences": [b],
                        **({"steps": {"from": self.from_step}} if self.from_step else {}),
                    }
                )
                continue
            e = {"kind": ENTRY_KIND[c.component], "layer": c.layer, "mode": self.edit, "sequences": [b]}
            if self.from_step:
                e["steps"] = {"from": self.from_step}
            if c.component == "head":
                e["head"] = c.head
            if c.component == "neuron":
                e["neurons"] = [c.neuron]
            if c.position is not None:
                e["positions"] = [c.position]
            data.append(e)
            if self.edit == "mean":
                mean = self.means[(MEAN_KIND[c.component], c.layer)]
                if c.component == "head":
                    d = self.adapter.head_dim
                    mean = mean[c.head * d : (c.head + 1) * d]
                resources[b] = mean
        entries = parse_entries(data, "sweep")
        return EditSet(entries, self.adapter, {b: 0 for b in range(len(cells))}, resources)

    @torch.inference_mode()
    def run_cells(self, seq: SequenceInput, cells: list[Cell], sources: list[SourceValues] | None) -> torch.Tensor:
        """Logits [K * len(cells), n_logits, V] (row q * len(cells) + b: sequence q, cell b) of one batch of
        cells (sorted by their lowest edited layer) on each of the pack's K sequences; sources[q]: the
        patch source of sequence q. Computed in the groups `layer_groups` chooses: each group's forward
        starts at its own lowest edited layer, the layers below it are the baseline's saved outputs."""
        groups = (
            layer_groups(
                [c.start_layer() for c in cells], len(self.adapter.layers), seq.size * (seq.ids.shape[1] - seq.start)
            )
            if self.skip_ok
            else [(0, len(cells))]
        )
        parts = [self._run_group(seq, cells[i:j], sources).unflatten(0, (seq.size, j - i)) for i, j in groups]
        return torch.cat(parts, 1).flatten(0, 1)

    def _run_group(self, seq: SequenceInput, cells: list[Cell], sources: list[SourceValues] | None) -> torch.Tensor:
        start = min(c.start_layer() for c in cells)
        row_cells = [c for _ in range(seq.size) for c in cells]
        if cells[0].component == "feature":
            row_sources = None if sources is None else [src for src in sources for _ in cells]
            edits = FeatureEdits(self.adapter, self.features, row_cells, self.edit, self.value, row_sources, seq.start)
            return self._forward(seq, len(cells), start, patches=edits)
        if self.edit == "patch":
            row_sources = [src for src in sources for _ in cells]
            return self._forward(
                seq, len(cells), start, patches=_Patches(self.adapter, row_cells, row_sources, seq.start)
            )
        return self._forward(seq, len(cells), start, edits=self.entries_for(row_cells))

    def measure(
        self, logits: torch.Tensor, base: torch.Tensor, steps: list[int], tokens: list[int], first_step: int = 0
    ) -> dict[str, np.ndarray]:
        """The sweep's metrics of R edited rows against the baseline (`metrics.measure`)."""
        return measure(self.metrics, logits, base, steps, tokens, first_step)
