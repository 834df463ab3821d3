"""`lmtrace sweep RUN`: ablate or patch every head, block, layer, neuron or position in turn, in one process.

What a sweep computes (docs/sweep.md has the full text):
  cells     one per component (and position, where positions are swept): `heads` -> (layer, head),
            `attn` / `mlp` / `layers` -> layer, `neurons:L` -> neuron of layer L, `positions` -> a
            token position hidden from every query, `resid:A-B` -> (layer, position) of the residual
            stream after the layer (patching only).
  edits     `zero` / `mean` are exactly `lmtrace intervene`'s ablations (`interventions.EditSet` with
            the same entry kinds and `component_means` for the means); `patch` replaces the
            component's value with the source run's value at the same position.
  semantics rescore: every sequence is the parent's prompt followed by its generated tokens
            (teacher-forced); the edit applies at every position the forward computes (intervene's
            `steps: all`), or at the one swept position. One full forward per batch of cells
            computes every measured step at once (step s is read at position prompt_len - 1 + s).
            `from_step` S (intervene's --from-step): the edits apply to the positions of steps >= S
            only; the unedited prefix before them is computed once per sequence and its KV cache
            is shared by every batch row, so each forward computes only the edited suffix.
  metrics   per (cell, sequence, step): logprob / prob / rank of the parent's chosen token, KL(baseline
            || edited) over the full vocabulary, and logit_diff between two given tokens; `effect` =
            value - baseline (the unedited forward, computed once and checked against the archived
            logprobs).

Speed: the model is loaded once; one cell per batch row (the sequence repeated); the layers below
the lowest edited layer of a batch are not computed: they return the unedited forward's outputs,
saved once per sequence (a start-up self-check compares the logits of this shortcut with the full
forward and turns it off if they differ).

Output: RUN/sweeps/<id>/ with sweep.parquet (long table), sweep_mean.parquet (mean over steps),
effects.zarr (mean effect per metric with named dims) and sweep.json, recorded in the run's
manifest under `sweeps`. Work is done in blocks (one batch of cells of one sequence) written as
Parquet parts under sweeps/.partial-<id>/: a killed or interrupted sweep continues from its
committed blocks, and shards (`--shard I/N`) share one partial directory; the last to finish
assembles the result.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import Interrupted, LmtraceError, SpecError
from ..archive.runs import locked
from ..interrupts import StopFlag
from ..capture.interventions import EditSet, component_means, parse_entries, parse_range_list

SWEEPS_DIR = "sweeps"
METRICS = ("logprob", "prob", "kl", "rank", "logit_diff")
DEFAULT_METRICS = ("logprob", "prob", "kl", "rank")
OVER_SIMPLE = {"heads": "head", "attn": "attn", "mlp": "mlp", "layers": "layer", "positions": "position"}
ENTRY_KIND = {"head": "ablate_head", "attn": "ablate_attention", "mlp": "ablate_mlp", "layer": "ablate_layer",
              "neuron": "ablate_neurons"}
MEAN_KIND = {"head": "head", "attn": "attn", "mlp": "mlp", "layer": "layer", "neuron": "ffn"}


class SweepError(LmtraceError):
    """The model does not reproduce the parent's archived log-probs: the baseline cannot be trusted."""


# ---------------------------------------------------------------------------------------------
# The sweep spec: the same object from flags or from YAML
class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    over: str  # heads | attn | mlp | layers | neurons:L | positions | resid:A-B
    edit: Literal["zero", "mean", "patch"] = "zero"
    source: str | None = None  # patch: the source run
    metrics: list[str] = Field(default_factory=lambda: list(DEFAULT_METRICS))
    steps: str = "all"
    sequences: str = "all"
    positions: str | None = None  # None: every position at once (resid/positions: every prompt position, one by one)
    batch: int = Field(32, ge=1)
    # edits apply from this step on (intervene's --from-step): the unedited prefix is computed once per sequence
    from_step: int | None = Field(None, ge=0)


def load_sweep_spec(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: sweep spec not found") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: malformed YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping (over, edit, source, metrics, steps, sequences, positions, batch, "
                        f"from_step)")
    return data


def build_sweep_spec(data: dict, where: str) -> SweepSpec:
    try:
        return SweepSpec(**data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise SpecError(f"{where}: {loc}: {first['msg']}") from None


# ---------------------------------------------------------------------------------------------
# Cells
@dataclass(frozen=True)
class Cell:
    component: str  # head | attn | mlp | layer | neuron | resid | position
    layer: int | None = None
    head: int | None = None
    neuron: int | None = None
    position: int | None = None  # None: every position

    def start_layer(self) -> int:
        return 0 if self.layer is None else self.layer


@dataclass
class Metric:
    name: str
    tokens: tuple[int, int] | None = None  # logit_diff: (A, B)


def _token_id(text: str, tokenizer, vocab: int, where: str) -> int:
    text = text.strip()
    if text.lstrip("-").isdigit():
        tid = int(text)
        if not 0 <= tid < vocab:
            raise SpecError(f"{where}: token id {tid} is outside the vocabulary 0..{vocab - 1}")
        return tid
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise SpecError(f"{where}: {text!r} is {len(ids)} tokens {ids}, not one; give a single token's text or its id")
    return int(ids[0])


def _split_pair(text: str) -> list[str]:
    """'" Paris"," Rome"' -> ['" Paris"', '" Rome"'] (a comma inside quotes does not split)."""
    parts, cur, quote = [], "", None
    for ch in text:
        if quote:
            cur += ch
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
            cur += ch
        elif ch == ",":
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def parse_metrics(names: list[str], tokenizer, vocab: int) -> list[Metric]:
    out = []
    for name in names:
        base, _, arg = name.partition(":")
        if base not in METRICS:
            raise SpecError(f"metric {name!r}: unknown; metrics: logprob, prob, kl, rank, logit_diff:A,B")
        if base == "logit_diff":
            parts = _split_pair(arg) if arg else []
            if len(parts) != 2:
                raise SpecError(f"metric {name!r}: logit_diff takes two tokens, e.g. logit_diff:\" Paris\",\" Rome\" "
                                f"or logit_diff:7042,11389")
            a, b = (_token_id(p, tokenizer, vocab, f"metric {name!r}") for p in parts)
            out.append(Metric("logit_diff", (a, b)))
        elif arg:
            raise SpecError(f"metric {name!r}: {base} takes no argument")
        else:
            out.append(Metric(base))
    if not out:
        raise SpecError("no metric given; metrics: logprob, prob, kl, rank, logit_diff:A,B")
    return out


def _positions(text: str | None, what: str) -> list[int] | None:
    if text is None or text == "all":
        return None
    return sorted(set(parse_range_list(text, what)))


def build_cells(spec: SweepSpec, n_layers: int, n_heads: int, d_ffn: int, prompt_len: int,
                edited: range | None = None) -> list[Cell]:
    """The swept cells, validated against the model; sorted by layer (batches then skip more layers).

    `edited`: the positions an edit can reach when it starts at a later step (`from_step`); `resid`
    goes over them by default instead of the prompt positions."""
    over, edit = spec.over.strip(), spec.edit
    positions = _positions(spec.positions, "positions")
    if positions is not None:
        bad = [p for p in positions if p < 0]
        if bad:
            raise SpecError(f"positions: {bad} are negative")

    def layer_ok(layer: int) -> int:
        if not 0 <= layer < n_layers:
            raise SpecError(f"--over {over}: layer {layer} is out of range: the model has layers 0..{n_layers - 1}")
        return layer

    cells: list[Cell] = []
    if over in OVER_SIMPLE:
        comp = OVER_SIMPLE[over]
        if comp == "position":
            if edit != "zero":
                raise SpecError("--over positions hides one position at a time from every query (intervene's "
                                "mask_positions); it takes --edit zero. To patch positions use --over resid:A-B")
            for p in positions if positions is not None else range(prompt_len):
                cells.append(Cell("position", position=p))
        else:
            if comp == "layer" and edit == "patch":
                raise SpecError("--over layers --edit patch would replace the whole residual stream; patch it at "
                                "single positions with --over resid:A-B")
            base = ([Cell("head", layer, h) for layer in range(n_layers) for h in range(n_heads)] if comp == "head"
                    else [Cell(comp, layer) for layer in range(n_layers)])
            cells = base if positions is None else [
                Cell(c.component, c.layer, c.head, c.neuron, p) for c in base for p in positions]
    elif over.startswith("neurons:"):
        try:
            layer = int(over.split(":", 1)[1])
        except ValueError:
            raise SpecError(f"--over {over!r}: expected neurons:LAYER, e.g. neurons:7") from None
        layer_ok(layer)
        if not d_ffn:
            raise SpecError(f"--over {over}: this model has no single MLP down-projection (d_ffn unknown)")
        if edit == "patch":
            raise SpecError("--over neurons: takes --edit zero or mean")
        base = [Cell("neuron", layer, neuron=n) for n in range(d_ffn)]
        cells = base if positions is None else [Cell("neuron", layer, neuron=c.neuron, position=p)
                                                for c in base for p in positions]
    elif over.startswith("resid:"):
        if edit != "patch":
            raise SpecError("--over resid:A-B patches the residual stream at one position at a time; it takes "
                            "--edit patch --source RUN_B")
        layers = parse_range_list(over.split(":", 1)[1], f"--over {over}")
        if not layers:
            raise SpecError(f"--over {over!r}: expected resid:A-B, e.g. resid:0-29")
        for layer in layers:
            layer_ok(layer)
        default = edited if edited is not None else range(prompt_len)
        for layer in sorted(set(layers)):
            for p in positions if positions is not None else default:
                cells.append(Cell("resid", layer, position=p))
    else:
        raise SpecError(f"--over {over!r}: expected heads, attn, mlp, layers, neurons:LAYER, positions or resid:A-B")
    if not cells:
        raise SpecError(f"--over {over}: the sweep is empty (no positions?)")
    return sorted(cells, key=lambda c: (c.start_layer(), c.head or 0, c.neuron or 0, -1 if c.position is None else c.position))


def _cell_dict(c: Cell) -> dict:
    return {"component": c.component, "layer": c.layer, "head": c.head, "neuron": c.neuron, "position": c.position}


# ---------------------------------------------------------------------------------------------
# Forward with many edits: one row per cell
class _PrefixSkip:
    """Layers below `start` return the unedited forward's outputs (saved for batch size 1) expanded to the batch."""

    def __init__(self, layers):
        self.layers = layers
        self.saved: dict[int, object] = {}

    @contextmanager
    def recording(self):
        handles = [layer.register_forward_hook((lambda i: lambda m, a, o: self.saved.__setitem__(i, o))(i))
                   for i, layer in enumerate(self.layers)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextmanager
    def skipping(self, start: int, rows: int):
        replaced = []

        def make(i):
            out = self.saved[i]

            def forward(*args, **kwargs):
                if isinstance(out, tuple):
                    return (out[0].expand(rows, *out[0].shape[1:]), *out[1:])
                return out.expand(rows, *out.shape[1:])
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


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_first(output, value):
    return (value, *output[1:]) if isinstance(output, tuple) else value


class _Patches:
    """Patch edits: row b's component gets the source's value at its position(s).

    source[(kind, layer)] -> [T_src, width] tensor from the source's own unedited forward
    (kind: head = o_proj input, attn / mlp = block output, resid = layer output). The forward
    computes positions `offset`.. (after a shared prefix, `from_step`); only those are patched."""

    def __init__(self, adapter, cells: list[Cell], source: dict, offset: int = 0):
        self.adapter, self.cells, self.source, self.offset = adapter, cells, source, offset

    def _rows(self, kind: str, layer: int):
        return [(b, c) for b, c in enumerate(self.cells) if c.component == kind and c.layer == layer]

    def _apply(self, x: torch.Tensor, rows, src: torch.Tensor, cols: dict[int, slice]) -> torch.Tensor:
        lo = self.offset  # x[:, i] is position lo + i
        end = min(lo + x.shape[1], src.shape[0])  # positions both sequences have
        x = x.clone()
        for b, c in rows:
            sl = cols.get(b, slice(None))
            if c.position is None:
                if end > lo:
                    x[b, : end - lo, sl] = src[lo:end, sl].to(x.dtype)
            elif lo <= c.position < end:
                x[b, c.position - lo, sl] = src[c.position, sl].to(x.dtype)
        return x

    @contextmanager
    def attached(self):
        from ..capture.taps import tap

        a = self.adapter
        handles = []
        try:
            for kind, layer in sorted({(c.component, c.layer) for c in self.cells}):
                rows = self._rows(kind, layer)
                src = self.source[(kind, layer)]
                if kind == "head":
                    d = a.head_dim
                    cols = {b: slice(c.head * d, (c.head + 1) * d) for b, c in rows}
                    handles.append(a.o_proj(layer).register_forward_pre_hook(
                        lambda m, args, rows=rows, src=src, cols=cols: (self._apply(args[0], rows, src, cols), *args[1:]),
                        prepend=True))
                else:
                    module = {"attn": a.attn, "mlp": a.mlp, "resid": lambda i: a.layers[i]}[kind](layer)
                    handles.append(tap(module, lambda m, args, kw, out, rows=rows, src=src: _replace_first(
                        out, self._apply(_first(out), rows, src, {})), prepend=True))
            yield
        finally:
            for h in handles:
                h.remove()


@torch.inference_mode()
def capture_source(adapter, ids: list[int], wanted: set[tuple[str, int]], keep: int = 1) -> tuple[dict, torch.Tensor]:
    """The source sequence's unedited values at every position: (kind, layer) -> [T, width]; and its logits
    [keep, V] at the last `keep` positions."""
    out: dict = {}
    handles = []
    a = adapter
    try:
        for kind, layer in wanted:
            key = (kind, layer)
            if kind == "head":
                handles.append(a.o_proj(layer).register_forward_pre_hook(
                    lambda m, args, key=key: out.__setitem__(key, args[0][0].detach().clone())))
            else:
                module = {"attn": a.attn, "mlp": a.mlp, "resid": lambda i: a.layers[i]}[kind](layer)
                handles.append(module.register_forward_hook(
                    lambda m, args, o, key=key: out.__setitem__(key, _first(o)[0].detach().clone())))
        device = next(a.model.parameters()).device
        x = torch.tensor([ids], dtype=torch.long, device=device)
        logits = a.model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False, logits_to_keep=keep).logits
    finally:
        for h in handles:
            h.remove()
    return out, logits[0].float()


@dataclass
class SequenceInput:
    """One sequence as the engine runs it: what each forward computes and which steps its logits are."""

    ids: torch.Tensor  # [1, T]: prompt + generated tokens up to the last measured step's query position
    first_step: int  # logits row i is step first_step + i
    n_logits: int
    start: int = 0  # the first position a forward computes: 0, or prompt_len - 1 + from_step
    prefix: object | None = None  # the unedited KV cache of positions < start (a DynamicCache, batch 1)


class Engine:
    """Runs one sequence's batches of cells: the baseline once, then one forward per batch.

    With `from_step` S > 0 the edits apply to the positions of steps >= S only (intervene's
    `--from-step`: step s computes position prompt_len - 1 + s): the positions before are the
    unedited prefix, run once per sequence; every batch continues its KV cache (expanded to the
    batch's rows, `kv_cache.expand_prefix`) and computes only the edited suffix."""

    def __init__(self, adapter, edit: str, means: dict | None, metrics: list[Metric], from_step: int = 0):
        self.adapter = adapter
        self.model = adapter.model
        self.device = next(self.model.parameters()).device
        self.edit = edit
        self.means = means or {}
        self.metrics = metrics
        self.from_step = from_step
        self.skip = _PrefixSkip(adapter.layers)
        self.skip_ok = True

    @torch.inference_mode()
    def sequence(self, ids: list[int], prompt_len: int, last_step: int) -> SequenceInput:
        """The input for steps up to `last_step`; with from_step, the unedited prefix is computed here, once."""
        x = torch.tensor([ids[: prompt_len + last_step]], dtype=torch.long, device=self.device)
        if not self.from_step:
            return SequenceInput(x, 0, last_step + 1)
        from transformers import DynamicCache

        start = prompt_len - 1 + self.from_step
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=x[:, :start], attention_mask=torch.ones_like(x[:, :start]),
                   position_ids=torch.arange(start, device=self.device)[None], cache=cache, use_cache=True,
                   logits_to_keep=1)
        return SequenceInput(x, self.from_step, last_step - self.from_step + 1, start, cache)

    def _forward(self, seq: SequenceInput, rows: int, start: int = 0, edits=None, patches=None):
        """Logits [rows, n_logits, V] (float32) of the last n_logits positions; `start`: the lowest edited layer."""
        from ..capture.kv_cache import expand_prefix

        T = seq.ids.shape[1]
        x = seq.ids[:, seq.start:].expand(rows, -1)
        mask = torch.ones((rows, T), dtype=torch.long, device=self.device)  # the prefix's positions too
        positions = torch.arange(seq.start, T, device=self.device)[None].expand(rows, -1)
        cache = {"cache": expand_prefix(seq.prefix, rows), "use_cache": True} if seq.prefix is not None else {
            "use_cache": False}
        with ExitStack() as stack:
            if start > 0 and self.skip_ok:
                stack.enter_context(self.skip.skipping(start, rows))
            if edits is not None:
                stack.enter_context(edits.attached())
                # every computed position belongs to a step >= from_step: all are edited
                edits.begin(self.from_step, list(range(rows)), positions, seq.prefix is None)
                mask = edits.edit_mask(mask, [0] * rows, list(range(rows)), self.from_step)
            if patches is not None:
                stack.enter_context(patches.attached())
            out = self.model(input_ids=x, attention_mask=mask, position_ids=positions, logits_to_keep=seq.n_logits,
                             **cache)
        return out.logits.float()

    @torch.inference_mode()
    def baseline(self, seq: SequenceInput) -> torch.Tensor:
        """Unedited logits [n_logits, V]; saves every layer's output for the prefix shortcut and checks it."""
        with self.skip.recording():
            base = self._forward(seq, 1)[0]
        if self.skip_ok:
            half = max(1, len(self.adapter.layers) // 2)
            short = self._forward(seq, 1, start=half)[0]
            if not torch.allclose(short, base, atol=1e-5, rtol=0):
                self.skip_ok = False  # the family does something between layers: compute every layer
        return base

    def entries_for(self, cells: list[Cell]) -> EditSet:
        data, resources = [], {}
        for b, c in enumerate(cells):
            if c.component == "position":
                data.append({"kind": "mask_positions", "mask": [c.position], "sequences": [b],
                             **({"steps": {"from": self.from_step}} if self.from_step else {})})
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
                    mean = mean[c.head * d: (c.head + 1) * d]
                resources[b] = mean
        entries = parse_entries(data, "sweep")
        return EditSet(entries, self.adapter, {b: 0 for b in range(len(cells))}, resources)

    @torch.inference_mode()
    def run_cells(self, seq: SequenceInput, cells: list[Cell], source: dict | None) -> torch.Tensor:
        start = min(c.start_layer() for c in cells)
        if self.edit == "patch":
            return self._forward(seq, len(cells), start, patches=_Patches(self.adapter, cells, source, seq.start))
        return self._forward(seq, len(cells), start, edits=self.entries_for(cells))

    def measure(self, logits: torch.Tensor, base: torch.Tensor, steps: list[int], tokens: list[int],
                first_step: int = 0) -> dict[str, np.ndarray]:
        """logits [R, n, V], base [n, V] (row i = step first_step + i); tokens by step -> metric -> [R, len(steps)]."""
        idx = torch.tensor(steps) - first_step
        lg = logits[:, idx]
        lp = lg.log_softmax(-1)
        base_lp = base[idx].log_softmax(-1)
        tok = torch.tensor([tokens[s] for s in steps])[None, :, None].expand(lg.shape[0], -1, 1)
        out = {}
        for m in self.metrics:
            if m.name == "logprob":
                v = lp.gather(-1, tok)[..., 0]
            elif m.name == "prob":
                v = lp.gather(-1, tok)[..., 0].exp()
            elif m.name == "rank":
                v = (lg > lg.gather(-1, tok)).sum(-1).float()
            elif m.name == "kl":
                v = (base_lp.exp()[None] * (base_lp[None] - lp)).sum(-1).clamp_min(0)
            else:
                a, b = m.tokens
                v = lg[..., a] - lg[..., b]
            out[self.key(m)] = v.double().numpy()
        return out

    @staticmethod
    def key(m: Metric) -> str:
        return m.name if m.tokens is None else f"logit_diff:{m.tokens[0]},{m.tokens[1]}"


# ---------------------------------------------------------------------------------------------
# Planning, blocks, output
def block_schema() -> pa.Schema:
    return pa.schema([("component", pa.string()), ("layer", pa.int32()), ("head", pa.int32()),
                      ("neuron", pa.int32()), ("position", pa.int32()), ("sequence", pa.int32()),
                      ("step", pa.int32()), ("metric", pa.string()), ("value", pa.float64()),
                      ("baseline", pa.float64()), ("effect", pa.float64())])


def _block_table(cells: list[Cell], seq: int, steps: list[int], values: dict, baseline: dict) -> pa.Table:
    S = len(steps)
    cols: dict[str, list] = {f.name: [] for f in block_schema()}
    for name, v in values.items():
        b = baseline[name]  # [S]
        for r, c in enumerate(cells):
            n = S
            cols["component"] += [c.component] * n
            cols["layer"] += [c.layer] * n
            cols["head"] += [c.head] * n
            cols["neuron"] += [c.neuron] * n
            cols["position"] += [c.position] * n
            cols["sequence"] += [seq] * n
            cols["step"] += steps
            cols["metric"] += [name] * n
            cols["value"] += v[r].tolist()
            cols["baseline"] += b.tolist()
            cols["effect"] += (v[r] - b).tolist()
    return pa.table(cols, schema=block_schema())


def _atomic_parquet(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


@dataclass
class SweepResult:
    sweep_id: str
    path: Path | None  # the finished sweep directory (None: this shard finished, others still running)
    status: str  # complete | shard-complete
    summary: dict
    seconds: float


# Zarr dimension names where the table's column name would collide with xarray (`Dataset.head()`),
# as in tensors.zarr
ZARR_DIM = {"head": "q_head"}


def _reduce_over_coords(table, metric: str, cells: list[Cell]):
    """Mean effect per cell over sequences and steps -> (dims, coords, array)."""
    import pandas as pd

    df = table.to_pandas()
    df = df[df.metric == metric]
    names = [n for n in ("layer", "head", "neuron", "position") if any(getattr(c, n) is not None for c in cells)]
    if not names:
        names = ["position"]
    g = df.groupby(names, dropna=False).effect.mean()
    coords = {n: sorted({getattr(c, n) for c in cells if getattr(c, n) is not None}) for n in names}
    arr = np.full(tuple(len(coords[n]) for n in names), np.nan, dtype=np.float32)
    index = {n: {v: i for i, v in enumerate(coords[n])} for n in names}
    for key, value in g.items():
        key = key if isinstance(key, tuple) else (key,)
        if any(pd.isna(k) for k in key):
            continue
        arr[tuple(index[n][int(k)] for n, k in zip(names, key))] = value
    return names, coords, arr


def _write_final(final: Path, tmp: Path, table: pa.Table, cells: list[Cell], metric_keys: list[str], info: dict) -> None:
    import zarr

    tmp.mkdir()
    pq.write_table(table, tmp / "sweep.parquet")
    df = table.to_pandas()
    keys = ["component", "layer", "head", "neuron", "position", "sequence", "metric"]
    mean = df.groupby(keys, dropna=False)[["value", "baseline", "effect"]].mean().reset_index()
    mean["n_steps"] = df.groupby(keys, dropna=False).step.count().values
    pq.write_table(pa.Table.from_pandas(mean, preserve_index=False), tmp / "sweep_mean.parquet")
    group = zarr.open_group(str(tmp / "effects.zarr"), mode="w", zarr_format=3)
    arrays = {}
    for metric in metric_keys:
        names, coords, arr = _reduce_over_coords(table, metric, cells)
        dims = [ZARR_DIM.get(n, n) for n in names]
        for n, dim in zip(names, dims):
            if dim not in group:
                c = np.asarray(coords[n], dtype=np.int32)
                ca = group.create_array(dim, shape=c.shape, dtype="int32", chunks=c.shape, dimension_names=(dim,))
                ca[...] = c
        name = "effect_" + metric.split(":")[0]
        a = group.create_array(name, shape=arr.shape, dtype="float32", chunks=arr.shape, dimension_names=tuple(dims),
                               fill_value=np.nan)
        a[...] = arr
        a.attrs.update({"metric": metric, "meaning": "mean over sequences and steps of value - baseline"})
        arrays[metric] = {"array": f"effects.zarr/{name}", "dims": dims}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(tmp / "effects.zarr"))
    info = {**info, "arrays": arrays}
    (tmp / "sweep.json").write_text(json.dumps(info, indent=2, default=str))
    os.replace(tmp, final)


def ranking(table: pa.Table, metric: str, top: int) -> list[dict]:
    df = table.to_pandas()
    df = df[df.metric == metric]
    keys = ["component", "layer", "head", "neuron", "position"]
    g = df.groupby(keys, dropna=False)[["value", "baseline", "effect"]].mean().reset_index()
    g = g.reindex(g.effect.abs().sort_values(ascending=False).index).head(top)
    out = []
    for _, r in g.iterrows():
        out.append({k: (None if isinstance(r[k], float) and np.isnan(r[k]) else
                        int(r[k]) if k in ("layer", "head", "neuron", "position") else r[k]) for k in keys}
                   | {"value": float(r.value), "baseline": float(r.baseline), "effect": float(r.effect)})
    return out


# ---------------------------------------------------------------------------------------------
def run_sweep(parent_ref: str, spec: SweepSpec, *, runs_dir: str | None = None, sweep_id: str | None = None,
              shard: tuple[int, int] = (0, 1), resume: bool = False, top: int = 20,
              note=lambda text: None) -> SweepResult:
    from ..archive.reader import open_run
    from ..capture.arch import adapter_for
    from ..archive.writer import atomic_write_json
    from ..parent import ParentView
    from ..models import load_run_model, load_tokenizer
    from ..archive.runs import host_info, new_run_id, now_iso, package_versions, read_manifest
    from ..spec import build_spec

    t0 = time.time()
    parent = open_run(parent_ref, runs_dir, require_complete=True)
    view = ParentView.read(parent)
    n_seq = len(view.prompt_ids)
    shape, cfg = parent.shape, parent.manifest["model"]["config"]
    n_layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    seqs = list(range(n_seq)) if spec.sequences == "all" else sorted(set(parse_range_list(spec.sequences, "--sequences")))
    bad = [s for s in seqs if not 0 <= s < n_seq]
    if bad:
        raise SpecError(f"--sequences: {bad} out of range: run {parent.id} has sequences 0..{n_seq - 1}")
    if not seqs:
        raise SpecError("--sequences: the sweep is empty (no sequences)")
    from_step = spec.from_step or 0
    seq_steps = {s: measured_steps(spec.steps, from_step, len(view.generated[s]), s, parent.id) for s in seqs}
    prompt_len = min(len(view.prompt_ids[s]) for s in seqs)
    longest = max(len(view.prompt_ids[s]) + max(seq_steps[s]) for s in seqs)  # the longest measured context
    edited = range(prompt_len - 1 + from_step, longest) if from_step else None
    cells = build_cells(spec, n_layers, shape["n_heads"], shape.get("d_ffn") or 0, prompt_len, edited)
    first_edited = min(len(view.prompt_ids[s]) - 1 + from_step for s in seqs)
    for c in cells:
        if c.position is None:
            continue
        if c.position >= longest:
            raise SpecError(f"positions: {c.position} is past every measured context (longest {longest} tokens)")
        if from_step and c.component != "position" and c.position < first_edited:
            raise SpecError(f"positions: {c.position} is in the unedited prefix of every sequence: with --from-step "
                            f"{from_step} edits apply at positions {first_edited} and later (step s is computed at "
                            f"position prompt length - 1 + s)")
    tokenizer = load_tokenizer(build_spec(parent.manifest["spec_resolved"], f"spec of run {parent.id}").model)
    vocab = len(tokenizer)
    metrics = parse_metrics(spec.metrics, tokenizer, vocab)
    source_run, source_view = None, None
    if spec.edit == "patch":
        if spec.source is None:
            raise SpecError("--edit patch needs --source RUN_B (the run whose activations are patched in)")
        source_run = open_run(spec.source, parent.path.parent, require_complete=True)
        _check_source(parent, source_run)
        source_view = ParentView.read(source_run)
        for s in seqs:
            if s >= len(source_view.prompt_ids):
                raise SpecError(f"source run {source_run.id} has {len(source_view.prompt_ids)} sequences; sequence {s} "
                                f"of run {parent.id} has no partner (sequences are paired by index)")
            a, b = len(view.prompt_ids[s]), len(source_view.prompt_ids[s])
            if a != b:
                raise SpecError(f"sequence {s}: the prompt of run {parent.id} is {a} tokens, the source run "
                                f"{source_run.id}'s is {b}; patching pairs positions, so the prompts must have the "
                                f"same token length")
    elif spec.source is not None:
        raise SpecError("--source is for --edit patch")

    # the plan: blocks of cells, per sequence; a shard takes every N-th block
    blocks = [(s, j, cells[i: i + spec.batch]) for s in seqs for j, i in enumerate(range(0, len(cells), spec.batch))]
    given = {"parent": parent.id, "source": source_run.id if source_run else None, **spec.model_dump(mode="json")}
    root = parent.path / SWEEPS_DIR
    index, count = shard
    if resume and sweep_id is None:
        raise SpecError("--resume needs --run-id ID: the id of the unfinished sweep (sweeps/.partial-ID)")
    if count > 1 and sweep_id is None:
        raise SpecError("a sharded sweep needs a shared id: pass --run-id (with --shard auto it is slurm-<job id>)")
    sweep_id = sweep_id or new_run_id()
    final = root / sweep_id
    partial = root / f".partial-{sweep_id}"
    if final.exists():
        raise SpecError(f"sweep {sweep_id} of run {parent.id} already exists ({final}); choose another --run-id")
    if partial.exists():
        plan = json.loads((partial / "plan.json").read_text())
        if plan["spec"] != given or plan["shards"] != count:
            raise SpecError(f"sweep {sweep_id} exists unfinished with different settings; use another --run-id, or "
                            f"the same settings to continue it")
    elif resume:
        raise SpecError(f"no unfinished sweep {sweep_id} of run {parent.id} to resume")

    # the model: loaded once
    loaded = load_run_model(parent.manifest, parent.id, purpose="the sweep", note=note)
    adapter = adapter_for(loaded.model)
    loaded.model.eval()
    means = None
    if spec.edit == "mean":
        wanted = {(MEAN_KIND[c.component], c.layer) for c in cells}
        note(f"mean values: one forward over each of the parent's {n_seq} sequences")
        means = component_means(adapter, [view.prompt_ids[s] + view.generated[s] for s in range(n_seq)], wanted)
    engine = Engine(adapter, spec.edit, means, metrics, from_step)
    metric_keys = [Engine.key(m) for m in metrics]

    # only now is anything written
    root.mkdir(exist_ok=True)
    with locked(root / ".lock"):
        if not partial.exists():
            tmp = root / f".plan-{sweep_id}.{os.getpid()}"
            tmp.mkdir()
            atomic_write_json(tmp / "plan.json", {"spec": given, "shards": count, "n_blocks": len(blocks),
                                                  "n_cells": len(cells), "created": now_iso()})
            (tmp / "blocks").mkdir()
            os.replace(tmp, partial)
    stop = StopFlag()  # SIGTERM / SIGINT: finish the current block, then stop (exit 3)
    baseline_check = {}
    source_baseline: dict[str, dict] = {}  # patch: the source's own unedited logit_diff per measured step
    t_model = time.time()
    n_done = 0
    mine = [blk for k, blk in enumerate(blocks) if k % count == index]
    with stop.installed():
        current = None
        for s, j, block_cells in mine:
            path = partial / "blocks" / f"s{s:05d}-b{j:06d}.parquet"
            if path.exists():
                continue
            if current is None or current[0] != s:
                P, steps = len(view.prompt_ids[s]), seq_steps[s]
                seq_in = engine.sequence(view.prompt_ids[s] + view.generated[s], P, max(steps))
                base = engine.baseline(seq_in)
                base_lp = base.log_softmax(-1)
                tokens, first = view.generated[s], seq_in.first_step
                diff = max(abs(float(base_lp[st - first, tokens[st]]) - view.logprob[s][st]) for st in steps)
                tol = 1e-3 if parent.manifest.get("dtype") == "float32" else 5e-2
                if diff > tol:
                    raise SweepError(f"sequence {s}: the unedited forward's log-probs differ from the archived ones by "
                                     f"{diff:.2e} (> {tol}); the model or its settings do not reproduce run {parent.id}")
                baseline_check[s] = diff
                base_metrics = {k: v[0] for k, v in engine.measure(base[None], base, steps, tokens, first).items()}
                source = None
                if spec.edit == "patch":
                    wanted = {(c.component, c.layer) for c in cells}
                    sids = source_view.prompt_ids[s] + source_view.generated[s]
                    T = seq_in.ids.shape[1]
                    source, src_logits = capture_source(adapter, sids[:T], wanted, max(steps) + 1)
                    if len(sids) >= T:  # the source's logits at the same positions: steps 0..max(steps)
                        source_baseline[str(s)] = {
                            Engine.key(m): [float(src_logits[st, m.tokens[0]] - src_logits[st, m.tokens[1]]) for st in steps]
                            for m in metrics if m.tokens}
                current = (s, seq_in, steps, tokens, base, base_metrics, source)
            _, seq_in, steps, tokens, base, base_metrics, source = current
            logits = engine.run_cells(seq_in, block_cells, source)
            values = engine.measure(logits, base, steps, tokens, seq_in.first_step)
            _atomic_parquet(_block_table(block_cells, s, steps, values, base_metrics), path)
            n_done += 1
            note(f"block {n_done}/{len(mine)} ({len(block_cells)} cells of sequence {s})")
            if stop.signal is not None:
                raise Interrupted(f"interrupted by signal {stop.signal}; {n_done} block(s) committed; continue with the "
                                  f"same command and --run-id {sweep_id} --resume")
    t_done = time.time()
    status_file = partial / f"shard-{index}-of-{count}.json"
    atomic_write_json(status_file, {"status": "complete", "blocks": n_done, "baseline_max_abs_diff": baseline_check,
                                    "source_baseline": source_baseline,
                                    "seconds": round(t_done - t0, 3), "prefix_skip": engine.skip_ok})
    with locked(root / ".lock"):
        files = sorted((partial / "blocks").glob("*.parquet"))
        if len(files) < len(blocks) or final.exists():
            return SweepResult(sweep_id, None, "shard-complete", {"sweep_id": sweep_id, "blocks": n_done}, t_done - t0)
        table = pa.concat_tables([pq.read_table(f) for f in files])
        shards = [json.loads(f.read_text()) for f in sorted(partial.glob("shard-*.json"))]
        primary = metric_keys[0]
        info = {
            "kind": "sweep", "id": sweep_id, "parent": {"run_id": parent.id, "path": str(parent.path.resolve())},
            "source": ({"run_id": source_run.id, "path": str(source_run.path.resolve())} if source_run else None),
            "spec": given, "metrics": metric_keys, "n_cells": len(cells), "sequences": seqs,
            "steps": {str(s): seq_steps[s] for s in seqs}, "semantics": "rescore (teacher-forced parent tokens)" + (
                f"; edits from step {from_step} on, the unedited prefix's KV cache shared by every row"
                if from_step else ""),
            "model": {"reference": loaded.reference, "weights_sha256": loaded.weights_sha256,
                      "dtype": str(loaded.dtype).replace("torch.", ""), "device": str(loaded.device),
                      "attn_implementation": loaded.model.config._attn_implementation},
            "packages": package_versions(), "host": host_info(), "created": now_iso(),
            "baseline_max_abs_diff": max([v for sh in shards for v in sh["baseline_max_abs_diff"].values()] or [0.0]),
            "prefix_skip": all(sh.get("prefix_skip", True) for sh in shards),
            "source_baseline": ({k: v for sh in shards for k, v in sh.get("source_baseline", {}).items()}
                                if source_run else None),
            "timings": {"model_load_s": round(t_model - t0, 3), "sweep_s": round(t_done - t_model, 3),
                        "shards": len(shards)},
            "top": ranking(table, primary, top),
        }
        _write_final(final, root / f".final-{sweep_id}", table, cells, metric_keys, info)
        shutil.rmtree(partial, ignore_errors=True)
        entry = {"id": sweep_id, "path": f"{SWEEPS_DIR}/{sweep_id}", "over": spec.over, "edit": spec.edit,
                 "source": info["source"]["run_id"] if source_run else None, "metrics": metric_keys,
                 "n_cells": len(cells), "created": info["created"]}
        from ..archive import layout

        with locked(parent.path / layout.LOCK):
            manifest = read_manifest(parent.path)
            manifest.setdefault("sweeps", []).append(entry)
            atomic_write_json(parent.path / layout.MANIFEST, manifest)
    summary = {"sweep_id": sweep_id, "run_id": parent.id, "path": str(final), "n_cells": len(cells),
               "metric": primary, "baseline_max_abs_diff": info["baseline_max_abs_diff"],
               "seconds": round(time.time() - t0, 3), "sweep_s": info["timings"]["sweep_s"], "top": info["top"]}
    return SweepResult(sweep_id, final, "complete", summary, time.time() - t0)


def measured_steps(text: str, from_step: int, n: int, seq: int, run_id: str) -> list[int]:
    """The steps measured in a sequence of n generated tokens; with from_step, only steps >= from_step exist."""
    from ..steps import parse_steps

    if n == 0:
        raise SpecError(f"sequence {seq} of run {run_id} generated no tokens: nothing to measure")
    if from_step >= n:
        raise SpecError(f"--from-step {from_step}: sequence {seq} of run {run_id} has steps 0..{n - 1}, none is edited; "
                        f"choose a smaller step or other --sequences")
    steps = parse_steps(text, n)
    if text.strip() == "all":
        return [st for st in steps if st >= from_step]
    early = [st for st in steps if st < from_step]
    if early:
        raise SpecError(f"--steps: step(s) {early} come before --from-step {from_step}; their forward is the unedited "
                        f"prefix, so measure steps {from_step} and later")
    return steps


def _check_source(parent, source) -> None:
    pm, sm = parent.manifest, source.manifest
    for what, a, b in (("model weights", pm["model"].get("weights_sha256") or pm["model"]["reference"],
                        sm["model"].get("weights_sha256") or sm["model"]["reference"]),
                       ("tokenizer", (pm.get("tokenizer") or {}).get("sha256"), (sm.get("tokenizer") or {}).get("sha256")),
                       ("dtype", pm.get("dtype"), sm.get("dtype"))):
        if a != b:
            raise SpecError(f"source run {source.id} differs from run {parent.id} in {what}; patching needs a source "
                            f"run of the same model, tokenizer and dtype")


def read_sweep(run, sweep_id: str | None = None) -> pa.Table:
    """A sweep's long table (the latest sweep of the run when no id is given)."""
    from ..errors import ArchiveError

    path = Path(run.path if hasattr(run, "path") else run)
    entries = json.loads((path / "manifest.json").read_text()).get("sweeps") or []
    if not entries:
        raise ArchiveError(f"{path} has no sweeps yet; run `lmtrace sweep`")
    entry = entries[-1] if sweep_id is None else next((e for e in entries if e["id"] == sweep_id), None)
    if entry is None:
        raise ArchiveError(f"{path} has no sweep {sweep_id}")
    return pq.read_table(path / entry["path"] / "sweep.parquet")
