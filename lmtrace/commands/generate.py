"""`lmtrace generate`: spec -> model -> tracer with probes -> streamed run archive."""

from __future__ import annotations

import json
import math
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import torch
import yaml

from ..capture import attention
from ..capture.arch import adapter_for, sdpa_refused
from ..archive import layout
from ..archive.layout import RunShape
from ..archive.writer import ArchiveWriter, BackgroundWriter, write_vocab
from ..errors import Interrupted, LmtraceError, ModelLoadError, SpecError
from ..models import LoadedModel, check_run_model, load_model
from ..capture.lens import CANDIDATES as LENS_CANDIDATES
from ..capture.probes import Probes
from ..prompts import load_prompts
from ..archive.runs import RunLog, create_run_dir, host_info, now_iso, package_versions, runs_root, write_manifest
from ..capture.sampling import Sampler, stability_class
from ..spec import RunSpec, resolve_layers, resolve_vector_layers
from ..capture.tracer import ForcedTokens, StepResult, Tracer
from .validate import check_context, model_positions


@dataclass
class Progress:
    """Callbacks the CLI uses to show progress; all optional."""

    start: Callable[[int, int], None] = lambda n_prompts, max_tokens: None
    advance: Callable[[int], None] = lambda tokens: None
    message: Callable[[str], None] = lambda text: None


# ---------------------------------------------------------------------------------------------
def render_prompts(tokenizer, prompts: list[str], chat: bool, system: str | None) -> tuple[list[str], list[list[int]]]:
    """Apply the chat template when asked, then tokenise each prompt on its own (no padding yet)."""
    rendered, ids = [], []
    for text in prompts:
        if chat:
            if getattr(tokenizer, "chat_template", None) is None:
                raise SpecError("prompts.chat: true but the model's tokenizer has no chat template; set chat: false")
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            r = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            rendered.append(r)
            ids.append(tokenizer(r, add_special_tokens=False)["input_ids"])
        else:
            rendered.append(text)
            ids.append(tokenizer(text)["input_ids"])
        if not ids[-1]:
            raise SpecError(f"prompt {len(ids) - 1} tokenises to nothing; give it some text")
    return rendered, ids


def _plain_fast_decode(tokenizer) -> bool:
    """Whether `tokenizer.decode([i])` is exactly its Rust backend's decode of [i]: a fast tokenizer
    whose decoding no subclass overrides and that cleans up no spaces afterwards."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode and not getattr(tokenizer, "clean_up_tokenization_spaces", True))


def vocab_texts(tokenizer) -> list[str]:
    """The text of every id 0 .. len(tokenizer) - 1 alone, exactly what `tokenizer.decode([id])` gives
    (tokens.parquet's `token_text`). For SmolLM2's 49,152 tokens: ~0.04 s in one batched call to
    the Rust backend, ~0.17-0.23 s one id at a time (the fallback for other tokenizers)."""
    import gc

    n = len(tokenizer)
    # The ~50,000 one-id lists are short-lived and hold no cycles, but allocating them set off a
    # full collection of the process's ~380,000 objects (model and libraries loaded) in every
    # other call: 0.22-0.25 s instead of 0.04. The collector is paused while they exist.
    enabled = gc.isenabled()
    gc.disable()
    try:
        if _plain_fast_decode(tokenizer):
            return tokenizer.backend_tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        return [tokenizer.decode([i]) for i in range(n)]
    finally:
        if enabled:
            gc.enable()


def store_vocab(run_dir: Path, tokenizer) -> float | None:
    """vocab.parquet for a run that has none yet (new, resumed from before it existed, another shard
    first). Returns the seconds it took, or None when the run already had it."""
    if (run_dir / layout.VOCAB).is_file():
        return None
    t0 = time.perf_counter()
    write_vocab(run_dir, vocab_texts(tokenizer), tokenizer.all_special_ids)
    return round(time.perf_counter() - t0, 3)


def eos_ids(spec_value, model, tokenizer) -> set[int]:
    if spec_value is not None:
        values = spec_value if isinstance(spec_value, list) else [spec_value]
    else:
        gen_cfg = getattr(model, "generation_config", None)
        values = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        if values is None:
            values = tokenizer.eos_token_id
        values = values if isinstance(values, list) else [values]
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size
    bad = [v for v in values if v is not None and not 0 <= v < vocab]
    if bad:
        raise SpecError(f"generation.eos_token_id: {bad} outside the vocabulary 0..{vocab - 1}")
    return {int(v) for v in values if v is not None}


def lens_manifest(cap) -> dict | None:
    """The manifest's `lens` entry; `computed` is filled in by `lmtrace lens` for a deferred lens."""
    if not (cap.lens_inline or cap.lens_deferred):
        return None
    return {
        "when": cap.lens.when,
        "dtype": cap.lens.dtype,
        "method": {"float32": "float32 logits over the whole vocabulary",
                   "bfloat16": f"bfloat16 ranking, top {LENS_CANDIDATES} per row re-scored in float32 "
                               "(see docs/archive.md)"}[cap.lens.dtype],
        "input": "resid (float32) at every captured layer" if cap.lens_deferred else None,
        "computed": {"by": "lmtrace generate"} if cap.lens_inline else None,
    }


def build_shape(spec: RunSpec, adapter, n_sequences: int, max_prompt: int) -> RunShape:
    cap = spec.capture
    forward_only = cap.forward_only
    layers = resolve_layers(cap.layers, adapter.n_layers)
    return RunShape(
        n_sequences=n_sequences, n_steps=spec.generation.max_new_tokens, max_prompt=max_prompt,
        layers=tuple(layers) if not forward_only else (), resid_layers=tuple(resolve_vector_layers(cap, adapter.n_layers)),
        n_heads=adapter.n_heads, n_kv_heads=adapter.n_kv_heads, head_dim=adapter.head_dim, d_model=adapter.d_model,
        d_ffn=adapter.d_ffn or 0, kv_head_of_head=tuple(adapter.kv_head_of_head()),
        k_attn=cap.attention.top_k, k_ffn=min(cap.ffn.top_k, adapter.d_ffn or 0), k_lens=cap.lens.top_k,
        attention=cap.attention.enabled, prefill_attention=cap.prefill_attention, qkv=cap.qkv,
        ffn=cap.ffn.enabled and adapter.d_ffn is not None, lens=cap.lens_inline, float_dtype=spec.output.float_dtype,
        k_router=adapter.router_top_k if not forward_only else 0, head_dla=cap.head_dla and not forward_only,
    )


# ---------------------------------------------------------------------------------------------
class BlockSink:
    """Collects step results of one batch into blocks of `chunk_steps` steps and submits them.

    Per-layer scalars are kept as [batch, step, layer] buffers and turned into `steps` table rows
    once per block, on the writer's thread.
    """

    def __init__(self, writer: BackgroundWriter, shape: RunShape, batch: int, seq_ids: list[int],
                 prompts: list[list[int]], tokenizer, chunk_steps: int, step_columns: list[str], progress: Progress,
                 start_step: int = 0):
        self.writer = writer
        self.shape = shape
        self.batch = batch
        self.seq_ids = seq_ids
        self.seqs = seq_ids
        self.start_step = start_step  # on resume: steps before it are already archived
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.chunk = chunk_steps
        self.step_columns = step_columns
        self.progress = progress
        self.specs = {s.name: s for s in shape.arrays() if s.per_step}
        # Attention rows ([..., key], padded to the run's longest context) are buffered only as wide
        # as the block's context reaches, rounded up to the array's key chunks: the chunks past it
        # are never written (ArchiveWriter), and the buffers stay as small as the context.
        self.key_chunk = {name: writer.writer.arrays[name].chunks[-1] for name, spec in self.specs.items()
                          if spec.key_chunked}
        self.padded_prompt = max(len(p) for p in prompts)  # the batch's prompts are left-padded to it
        # Block buffers are recycled: the writer hands a block's buffers back once it is written
        # (appended on its thread), and the next block reuses them. They are never filled as a
        # whole (`_new_block`): filling a new block's buffers with NaN took ~5 ms of wall time a
        # block at 512 tokens, while each step writes its own rows anyway (`on_step`).
        # Attention buffers follow the context actually reached, not the run's maximum: a block's
        # buffers are as wide as its context (`block_width`), grown by half when a block needs
        # more, at most as wide as the run's last block. (Sized to the last block up front, a
        # max_new_tokens of 100,000 made every buffer 100,000 keys wide: numpy asks for huge pages
        # on large arrays, so even the few keys written made tens of MB resident per buffer.)
        self._free: list[dict[str, np.ndarray]] = []
        last_s0 = (shape.n_steps - 1) // chunk_steps * chunk_steps
        self.buffer_keys = {name: layout.block_keys(self.padded_prompt, last_s0, chunk_steps, width, shape.max_len)
                            for name, width in self.key_chunk.items()}
        self._widest = dict.fromkeys(self.key_chunk, 0)  # key width of the widest buffers allocated
        self._texts: dict[int, str] = {}
        self.schema = layout.step_schema(step_columns) if step_columns else None
        self.scalar_dtypes = {f.name: np.dtype(f.type.to_pandas_dtype()) for f in self.schema or []}
        for name in ("sequence", "step", "layer"):  # row keys, not per-layer scalars
            self.scalar_dtypes.pop(name, None)
        self._new_block(start_step)

    def _new_block(self, s0: int) -> None:
        self.s0 = s0
        self.n = 0
        B, L = len(self.seq_ids), len(self.shape.layers)
        # the key columns this block's context reaches (its attention rows are cut there)
        self.block_width = {name: layout.block_keys(self.padded_prompt, s0, self.chunk, width, self.shape.max_len)
                            for name, width in self.key_chunk.items()}
        # Not filled as a whole: `on_step` writes every step's rows, and only the keys that the
        # block's first step does not reach yet are filled here (a later step overwrites its own).
        self.buffers = None
        while self._free:  # buffers too narrow for this block's context are dropped
            free = self._free.pop()
            if all(free[name].shape[-1] >= width for name, width in self.block_width.items()):
                self.buffers = free
                break
        if self.buffers is None:
            self.buffers = {}
            for name, spec in self.specs.items():
                rest = self.shape.shape_of(spec)[2:]
                if name in self.key_chunk:
                    rest = (*rest[:-1], self._buffer_width(name))
                self.buffers[name] = np.empty((B, self.chunk, *rest), dtype=spec.dtype)
        self.written: set[str] = set()
        first_context = self.padded_prompt + s0  # keys the block's first step reaches (up to position s0)
        for name, width in self.block_width.items():
            self.buffers[name][..., min(first_context, width): width] = self.specs[name].fill
        self.active = np.zeros((B, self.chunk), dtype=bool)
        self.scalars = {}
        for name, dtype in self.scalar_dtypes.items():  # ids (lens_top1) are filled with -1, floats with NaN
            self.scalars[name] = np.full((B, self.chunk, L), -1 if dtype.kind == "i" else np.nan, dtype=dtype)
        self.token_rows: dict[str, list] = {f.name: [] for f in layout.token_schema()}

    def _buffer_width(self, name: str) -> int:
        """Keys of a new buffer of a `key_chunked` array: this block's width, or half again the
        widest allocated so far (so that a long run reallocates O(log) times), in whole key chunks,
        at most the run's last block's width."""
        chunk = self.key_chunk[name]
        grown = max(self.block_width[name], self._widest[name] * 3 // 2)
        width = min(self.buffer_keys[name], -(-grown // chunk) * chunk)
        self._widest[name] = max(self._widest[name], width)
        return width

    def _text(self, token_id: int) -> str:
        """The token's text alone (decoding one id always gives the same text: cached per sink)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _prompt_rows(self) -> None:
        rows = self.token_rows
        for b, seq in enumerate(self.seq_ids):
            toks = self.prompts[b]
            for pos, tok in enumerate(toks):
                for key, value in (("sequence", seq), ("position", pos), ("step", None), ("is_prompt", True),
                                   ("token_id", tok), ("token_text", self._text(tok))):
                    rows[key].append(value)
                for key in rows:
                    if key not in ("sequence", "position", "step", "is_prompt", "token_id", "token_text"):
                        rows[key].append(None)

    def on_step(self, r: StepResult) -> None:
        if r.step < self.start_step:  # replayed to rebuild the cache; archived before the interruption
            return
        if r.step == 0:
            self._prompt_rows()
            prompt_len = np.asarray([len(p) for p in self.prompts], dtype=np.int32)
            self.writer.submit(self.writer.writer.write_prompt, self.seqs, r.prompt_arrays, prompt_len)
        i = r.step - self.s0
        active = r.active
        self.active[:, i] = active
        all_active = active.all()
        rows_of = slice(None) if all_active else active  # the common case: slices, not boolean indexing
        self.written.update(r.arrays)
        for name, data in r.arrays.items():
            step = self.buffers[name][:, i]
            if name in self.key_chunk:  # a row as wide as this step's context (Probes.collect)
                step = step[..., : data.shape[-1]]
            if not all_active:
                step[~active] = self.specs[name].fill
            step[rows_of] = data[rows_of]
        for name, buf in self.scalars.items():
            buf[rows_of, i] = r.scalars[name][rows_of]
        c = r.choice
        # one numpy view per field, then plain Python numbers: indexing torch tensors element by
        # element costs microseconds each, ~20 of them per token
        tok, logprob, sampling_lp, rank = (c.token.tolist(), c.logprob.tolist(), c.sampling_logprob.tolist(),
                                           c.rank.tolist())
        entropy, greedy, margin = c.entropy.tolist(), c.greedy_token.tolist(), c.margin.tolist()
        changed, eligible, eos = c.filter_changed.tolist(), c.eligible.tolist(), r.eos_now.tolist()
        alt_ids, alt_logits, alt_lp = c.alt_ids.tolist(), c.alt_logits.tolist(), c.alt_logprobs.tolist()
        rows = self.token_rows
        for b in np.flatnonzero(active).tolist():
            values = {
                "sequence": self.seq_ids[b], "position": len(self.prompts[b]) + r.step, "step": r.step,
                "is_prompt": False, "token_id": tok[b], "token_text": self._text(tok[b]),
                "logprob": logprob[b], "prob": math.exp(logprob[b]),
                "sampling_logprob": sampling_lp[b], "sampling_prob": math.exp(sampling_lp[b]),
                "rank": rank[b], "entropy": entropy[b], "greedy_id": greedy[b],
                "margin": margin[b], "stability": stability_class(math.exp(alt_lp[b][0]), margin[b]),
                "filter_changed": changed[b], "eligible": eligible[b], "is_eos": eos[b],
                "alt_ids": alt_ids[b], "alt_logits": alt_logits[b], "alt_logprobs": alt_lp[b],
            }
            for key, value in values.items():
                rows[key].append(value)
        self.n = i + 1
        self.progress.advance(int(active.sum()))
        if (self.s0 + self.n) % self.chunk == 0:  # blocks end on chunk boundaries, also after a resume
            self.flush()

    def flush(self) -> None:
        if self.n == 0:
            return
        s0, s1, n = self.s0, self.s0 + self.n, self.n
        arrays = {name: buf[:, :n, ..., : self.block_width[name]] if name in self.block_width else buf[:, :n]
                  for name, buf in self.buffers.items()}
        for name in self.buffers.keys() - self.written:  # an array no step of the block gave: all fill
            arrays[name][...] = self.specs[name].fill
        scalars = {name: buf[:, :n] for name, buf in self.scalars.items()}
        active = self.active[:, :n]
        self.writer.submit(self._write, s0, s1, arrays, scalars, active, self.token_rows, self.buffers)
        self._new_block(s1)

    def _write(self, s0, s1, arrays, scalars, active, token_rows, buffers) -> None:
        """On the writer's thread: the block's `tokens` and `steps` rows, then the block itself;
        then its buffers are free for another block."""
        tables = {"tokens": pa.table(token_rows, schema=layout.token_schema())}
        if self.step_columns:
            steps, rows = np.nonzero(active.T)  # step-major, like the token rows
            L = len(self.shape.layers)
            columns = {
                "sequence": np.repeat(np.asarray(self.seq_ids, dtype=np.int32)[rows], L),
                "step": np.repeat((steps + s0).astype(np.int32), L),
                "layer": np.tile(np.asarray(self.shape.layers, dtype=np.int32), len(rows)),
            }
            for name in self.scalar_dtypes:
                columns[name] = scalars[name][rows, steps].reshape(-1)
            tables["steps"] = pa.table(columns, schema=self.schema)
        self.writer.writer.write_block(self.batch, self.seqs, s0, s1, arrays, tables)
        self._free.append(buffers)


# ---------------------------------------------------------------------------------------------
class StopFlag:
    """SIGINT/SIGTERM ask the loop to finish the current step, flush and exit as interrupted."""

    def __init__(self):
        self.signal: int | None = None

    def __call__(self) -> bool:
        return self.signal is not None

    @contextmanager
    def installed(self):
        def handler(signum, frame):
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C aborts at once
            self.signal = signum

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)


@dataclass
class Replay:
    """How `intervene` drives the same loop: the parent's exact prompt ids, teacher forcing, edits."""

    prompts: list[str]
    rendered: list[str]
    prompt_ids: list[list[int]]
    teacher: object | None = None  # tracer.Teacher
    edits: object | None = None  # tracer.Edits
    observer: object | None = None  # extra StepSink fed every step (e.g. the effects table)
    manifest_extra: dict = field(default_factory=dict)
    finalize: Callable[[Path], None] | None = None  # writes extra files before the run is completed
    on_model: Callable[[object], None] | None = None  # receives the adapter once the model is loaded
    parent: tuple[str, dict] | None = None  # (run id, manifest) of the replayed run: its model must be unchanged


class _Tee:
    def __init__(self, *sinks):
        self.sinks = sinks

    def on_step(self, result) -> None:
        for sink in self.sinks:
            sink.on_step(result)


@dataclass
class GenerateResult:
    run_id: str
    run_dir: Path
    status: str
    n_sequences: int
    n_tokens: int
    seconds: float
    texts: list[str] = field(default_factory=list)


def _load(model_spec, note) -> tuple[LoadedModel, str | None]:
    """Load the model; a class transformers refuses to run with sdpa (soft-capping, sinks) is loaded with
    eager instead (lmtrace then runs the model's own eager kernel, see `Adapter.eager_kernel_reason`)."""
    try:
        return load_model(model_spec, note=note), None
    except ModelLoadError as err:
        if model_spec.attn_implementation != "sdpa" or not sdpa_refused(str(err)):
            raise
    eager = model_spec.model_copy(update={"attn_implementation": "eager"})
    return load_model(eager, note=note), "the model class refuses sdpa: loaded with eager"


def manifest_base(spec: RunSpec, given_text: str, loaded: LoadedModel, adapter, shape: RunShape, inner_attn: str,
                  run_id: str, prompts: list[str], eager_reason: str | None = None) -> dict:
    model = loaded.model
    return {
        "format_version": layout.FORMAT_VERSION,
        "run_id": run_id,
        "kind": "generate",
        "status": "running",
        "created": now_iso(),
        "spec_given": yaml.safe_load(given_text),
        "spec_resolved": spec.model_dump(mode="json"),
        "model": {
            "reference": loaded.reference, "kind": loaded.kind, "source": loaded.source,
            "weights_sha256": loaded.weights_sha256, "class": type(model).__name__,
            "architecture_family": adapter.family.name, "config": model.config.to_dict(),
            **loaded.extra,
        },
        "tokenizer": {"class": type(loaded.tokenizer).__name__, "vocab_size": len(loaded.tokenizer),
                      "pad_token_id": loaded.tokenizer.pad_token_id, "padding_side": "left",
                      "sha256": loaded.tokenizer_sha256},
        "seed": spec.generation.seed,
        "device": str(loaded.device), "dtype": str(loaded.dtype).replace("torch.", ""),
        "attention": {
            "kernel": inner_attn,
            "kernel_reason": eager_reason,
            "probabilities": (None if not shape.attention else
                              "returned by the model's own eager attention kernel, which the forward ran"
                              if inner_attn == "eager" else
                              "recomputed from the captured post-rotary query and keys with the model's own eager attention "
                              "(row_method says how; see docs/archive.md)"),
            "qkv_rotary": "post-rotary" if shape.qkv else None,
            "layers": {},  # per captured layer: scaling/softcap/sliding_window/sinks the kernel was called with
        },
        "lens": lens_manifest(spec.capture),
        "not_captured": adapter.not_captured(),
        "shape": {"n_sequences": shape.n_sequences, "n_steps": shape.n_steps, "max_prompt": shape.max_prompt,
                  "max_len": shape.max_len, "layers": list(shape.layers), "resid_layers": list(shape.resid_layers),
                  "n_heads": shape.n_heads, "n_kv_heads": shape.n_kv_heads, "head_dim": shape.head_dim,
                  "d_model": shape.d_model, "d_ffn": shape.d_ffn, "kv_head_of_head": list(shape.kv_head_of_head),
                  "k_router": shape.k_router},
        "arrays": {s.name: {"dims": list(s.dims), "dtype": s.dtype} for s in shape.arrays()},
        "packages": package_versions(),
        "host": host_info(),
        "parent": None,
        "timings": {},
        "n_prompts": len(prompts),
    }


@dataclass
class Shard:
    index: int = 0
    count: int = 1

    @property
    def key(self) -> str:
        return f"shard-{self.index}-of-{self.count}"

    def sequences(self, n: int) -> list[int]:
        return list(range(self.index, n, self.count))


def parse_shard(value: str | None) -> tuple[Shard, str | None]:
    """`I/N`, or `auto` from SLURM array variables. Returns the shard and a default run id."""
    import os

    if value is None:
        return Shard(), None
    if value == "auto":
        env = os.environ
        if "SLURM_ARRAY_TASK_ID" not in env:
            raise SpecError("--shard auto needs SLURM_ARRAY_TASK_ID (run it inside a SLURM job array) or use --shard I/N")
        task = int(env["SLURM_ARRAY_TASK_ID"])
        lo = int(env.get("SLURM_ARRAY_TASK_MIN", 0))
        hi = int(env.get("SLURM_ARRAY_TASK_MAX", task))
        count = int(env.get("SLURM_ARRAY_TASK_COUNT", hi - lo + 1))
        if hi - lo + 1 != count:
            raise SpecError(f"--shard auto needs a contiguous array (--array={lo}-{hi}); got {count} tasks in {lo}..{hi}")
        job = env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID")
        return Shard(task - lo, count), (f"slurm-{job}" if job else None)
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise SpecError(f"--shard {value!r}: expected I/N (e.g. 0/4) or auto") from None
    if not (n >= 1 and 0 <= i < n):
        raise SpecError(f"--shard {value}: I must be in 0..N-1 and N >= 1")
    return Shard(i, n), None


_SPEC_IGNORED_ON_RESUME = ("output.run_id", "output.runs_dir")


def _first_difference(a, b, path="") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else str(key)
            if sub in _SPEC_IGNORED_ON_RESUME:
                continue
            diff = _first_difference(a.get(key), b.get(key), sub)
            if diff:
                return diff
        return None
    return None if a == b else path


class RunDir:
    """Opens a run directory for writing: new, joined by another shard, or resumed."""

    def __init__(self, path: Path, shard: Shard):
        self.path = path
        self.shard = shard

    @contextmanager
    def lock(self):
        """An flock on the run's lock file: released by the kernel when a holder dies, so it cannot deadlock."""
        import fcntl

        with open(self.path / layout.LOCK, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def shard_file(self, key: str | None = None) -> Path:
        return self.path / layout.SHARDS_DIR / f"{key or self.shard.key}.json"

    def set_shard_status(self, status: str, **fields) -> None:
        import os
        import socket

        from ..archive.runs import write_status

        self.shard_file().parent.mkdir(exist_ok=True)
        write_status(self.shard_file(), {"shard": self.shard.index, "of": self.shard.count, "status": status,
                                         "pid": os.getpid(), "host": socket.gethostname(), "updated": now_iso(),
                                         **fields})

    def other_shard_statuses(self) -> dict[str, str]:
        out = {}
        for i in range(self.shard.count):
            key = Shard(i, self.shard.count).key
            f = self.shard_file(key)
            if key != self.shard.key and f.is_file():
                out[key] = json.loads(f.read_text()).get("status")
        return out

    def all_shards_complete(self) -> bool:
        for i in range(self.shard.count):
            f = self.shard_file(Shard(i, self.shard.count).key)
            if not f.is_file() or json.loads(f.read_text()).get("status") != "complete":
                return False
        return True


def check_target(root: Path, spec: RunSpec, shard: Shard, resume: bool, owned: bool = False) -> dict | None:
    """Decide, without side effects, whether this invocation starts, joins or resumes a run.

    Returns the existing manifest when resuming (or joining a sharded run), None for a new run.
    Called before the model is loaded (a quick refusal) and again once this process owns the
    writer key (`owned`: the answer can no longer change under it).
    """
    from ..archive.liveness import busy_message, live_writers
    from ..archive.runs import read_manifest

    run_id = spec.output.run_id
    if run_id is None or not (root / run_id / layout.MANIFEST).is_file():
        if resume:
            raise SpecError(f"no run {run_id!r} to resume in {root}; `lmtrace ls` lists runs")
        if run_id is not None and (root / run_id).exists() and shard.count == 1:
            # a process stopped before it wrote its manifest leaves only its lock files: the run id is free
            leftovers = [p.name for p in (root / run_id).iterdir() if p.name not in (layout.LOCK, layout.OWNERS_DIR)]
            if leftovers or not (root / run_id).is_dir():
                raise SpecError(f"{root / run_id} exists but is not an lmtrace run; choose another output.run_id")
        return None
    path = root / run_id
    existing = read_manifest(path)
    if existing.get("kind") != "generate":
        raise SpecError(f"run {run_id} is a {existing.get('kind')} run; only generate runs can be resumed")
    diff = _first_difference(existing["spec_resolved"], spec.model_dump(mode="json"))
    if diff:
        raise SpecError(f"run {run_id} exists with a different spec (differs at {diff}); use another run id, "
                        f"or `lmtrace generate --resume {run_id}` to continue it as it was")
    if existing.get("shards", 1) != shard.count:
        raise SpecError(f"run {run_id} is written by {existing.get('shards', 1)} shard(s); pass --shard I/"
                        f"{existing.get('shards', 1)}")
    if existing.get("status") == "complete":
        raise SpecError(f"run {run_id} is already complete in {root}; nothing to resume")
    shard_file = path / layout.SHARDS_DIR / f"{shard.key}.json"
    if shard_file.is_file() and json.loads(shard_file.read_text()).get("status") == "complete" \
            and not RunDir(path, shard).all_shards_complete():
        # (when every shard is complete but the run is not, the finaliser was killed: rerunning finalises)
        raise SpecError(f"{shard.key} of run {run_id} is already complete; the run waits for its other shards")
    if not owned:  # (once owned, the lock is the answer)
        mine = [w for w in live_writers(path) if w["writer"] == shard.key]
        if mine:
            raise SpecError(busy_message(run_id, shard.key, mine[0]))
    return existing


def _pause_for_tests() -> None:
    from ..archive.liveness import pause_for_tests

    pause_for_tests()


def _open_run_dir(root: Path, spec: RunSpec, shard: Shard, resume: bool, fresh: bool = False):
    """Create or reopen the run directory and take ownership of this writer's key in it.

    Returns (run_id, path, existing manifest or None, OwnerLock). Nothing is written into the
    directory before the lock is held; a directory is never removed (another writer could be
    about to lock it). A second writer of the same key gets exit 2 naming the holder. `fresh`
    (intervene's children): the run id must not exist at all.
    """
    from ..archive.liveness import OwnerLock

    run_id = spec.output.run_id
    if run_id is None or fresh:
        if shard.count > 1:
            raise SpecError("a sharded run needs a shared run id: pass --run-id (with --shard auto it is slurm-<job id>)")
        run_id, path = create_run_dir(root, run_id)  # an exclusive mkdir: nobody else has this id
    else:
        check_target(root, spec, shard, resume)  # refuse what can be refused before creating anything
        path = root / run_id
        try:
            path.mkdir(parents=True, exist_ok=True)  # every shard (or a restart) joins the same directory
        except OSError as err:
            raise SpecError(f"cannot create run directory {path} ({err.strerror})") from None
    owner = OwnerLock(path, shard.key, run_id).acquire()
    try:
        _pause_for_tests()
        existing = None if spec.output.run_id is None or fresh else check_target(root, spec, shard, resume, owned=True)
    except BaseException:
        owner.release()
        raise
    return run_id, path, existing, owner


def _archived_tokens(run_dir: Path, seq_ids: list[int], upto: int) -> dict[int, list[int]]:
    """Generated token ids of steps < upto for these sequences, from the committed table parts."""
    import pyarrow.dataset as ds

    parts = run_dir / layout.table_parts_dir("tokens")
    files = sorted(str(f) for f in parts.glob("*.parquet")) if parts.is_dir() else []
    out = {s: [] for s in seq_ids}
    if not files:
        return out
    t = ds.dataset(files, format="parquet").to_table(columns=["sequence", "step", "is_prompt", "token_id"]).to_pandas()
    t = t[(~t.is_prompt) & t.sequence.isin(seq_ids) & (t.step < upto)].sort_values(["sequence", "step"])
    for seq, g in t.groupby("sequence"):
        out[int(seq)] = g.token_id.tolist()
    return out


def eager_kernel_reason(spec: RunSpec, adapter) -> str | None:
    """Why a capturing run's forward must use the model's eager kernel instead of sdpa (None: sdpa)."""
    if spec.model.attn_implementation == "eager":
        return "model.attn_implementation: eager"
    return adapter.eager_kernel_reason()


def capture_kernel(adapter, eager_reason: str | None):
    """The kernel the lmtrace attention function runs for the forward itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return adapter.eager_attention() if eager_reason is not None else sdpa_attention_forward


def run_generate(spec: RunSpec, given_text: str, *, runs_dir_flag: str | None = None,
                 progress: Progress | None = None, replay: Replay | None = None, shard: Shard | None = None,
                 resume: bool = False) -> GenerateResult:
    """Run a spec (or a replay for intervene) into a new run, a shard of a shared run, or a resumed run."""
    progress = progress or Progress()
    shard = shard or Shard()
    t_start = time.time()
    # bad prompt files fail before any model is loaded
    prompts = replay.prompts if replay is not None else load_prompts(spec.prompts)
    root = runs_root(runs_dir_flag, spec.output.runs_dir)
    progress.message(f"loading model {spec.model.ref}")
    loaded, eager_reason = _load(spec.model, progress.message)
    t_loaded = time.time()
    model, tokenizer = loaded.model, loaded.tokenizer
    if replay is not None and replay.parent is not None:
        check_run_model(replay.parent[1], replay.parent[0], loaded, spec.model.ref)
    adapter = adapter_for(model)
    if replay is not None:
        rendered, prompt_ids = replay.rendered, replay.prompt_ids
        if replay.on_model is not None:
            replay.on_model(adapter)
    else:
        rendered, prompt_ids = render_prompts(tokenizer, prompts, spec.prompts.chat, spec.prompts.system)
    shape = build_shape(spec, adapter, len(prompts), max(len(p) for p in prompt_ids))
    forward_only = spec.capture.forward_only

    inner_name = "none"
    probes = None
    if not forward_only:
        eager_reason = eager_kernel_reason(spec, adapter)
        inner_name = "eager" if eager_reason is not None else "sdpa"
        if shape.attention or shape.qkv or shape.prefill_attention:
            inner = capture_kernel(adapter, eager_reason)
            attention.install(model)
        else:
            inner = None
        probes = Probes(adapter, shape, component_norms=spec.capture.component_norms,
                        margin_contributions=spec.capture.margin_contributions,
                        lens_dtype=spec.capture.lens.dtype, inner_attention=inner)
    else:
        inner_name = model.config._attn_implementation

    g = spec.generation
    eos = eos_ids(g.eos_token_id, model, tokenizer)  # refused before anything is created
    check_context([len(p) for p in prompt_ids], g.max_new_tokens, model_positions(model.config), spec.model.ref)
    step_columns: list[str] = []
    if probes is not None:
        step_columns = ["sequence", "step", "layer", "resid_norm", "delta_norm"]
        if spec.capture.component_norms:
            step_columns += ["attn_norm", "mlp_norm"]
        if shape.lens:
            step_columns += list(layout.LENS_STEP_COLUMNS)
        if spec.capture.margin_contributions:
            step_columns += ["margin_contrib"]

    run_id, run_dir, existing, owner = _open_run_dir(root, spec, shard, resume, fresh=replay is not None)
    try:
        if existing is not None:  # resuming, or joining a sharded run: the steps so far came from this model
            check_run_model(existing, run_id, loaded, spec.model.ref)
        rd = RunDir(run_dir, shard)
        log = RunLog(run_dir / layout.LOG)
        _start_run(spec, given_text, rd, existing, lambda: _new_manifest(
            spec, given_text, loaded, adapter, shape, inner_name, run_id, prompts, eager_reason, t_loaded - t_start,
            probes, shard, replay), root, resume, tokenizer)
        # From here on the manifest exists: every failure is recorded in it (_finish_failed).
        return _write_run(spec, run_id, run_dir, existing, rd, log, shape, probes, step_columns, eos, model,
                          tokenizer, loaded, prompts, rendered, prompt_ids, replay, progress, t_start)
    finally:
        owner.release()


def _new_manifest(spec, given_text, loaded, adapter, shape, inner_name, run_id, prompts, eager_reason, load_s, probes,
                  shard, replay) -> dict:
    manifest = manifest_base(spec, given_text, loaded, adapter, shape, inner_name, run_id, prompts, eager_reason)
    manifest["timings"]["model_load_s"] = round(load_s, 3)
    if probes is not None and shape.attention and inner_name != "eager":
        manifest["attention"]["row_method"] = probes.row_method
    manifest["shards"] = shard.count
    if replay is not None:
        manifest.update(replay.manifest_extra)
    return manifest


def _start_run(spec, given_text, rd: "RunDir", existing, new_manifest, root, resume, tokenizer) -> None:
    """Write the new run's manifest (status running), or mark a resumed / joined run running again,
    then the run's vocab.parquet when it has none yet.

    A failure (or a signal) once the manifest exists is recorded in it before it propagates."""
    run_dir = rd.path
    try:
        with rd.lock():
            if existing is None and not (run_dir / layout.MANIFEST).is_file():
                manifest = new_manifest()
                write_manifest(run_dir, manifest)
                (run_dir / layout.SPEC).write_text(given_text)
            else:
                from ..archive.runs import read_manifest

                if existing is None:  # another shard created the run meanwhile: it must be this one
                    check_target(root, spec, rd.shard, resume, owned=True)
                manifest = read_manifest(run_dir)
                manifest.update(status="running", resumed=now_iso())
                manifest.pop("error", None)
                write_manifest(run_dir, manifest)
            # after the manifest (a directory with anything but it and the locks is not taken for a
            # run a kill interrupted at its start), under the lock (shards do not all decode it)
            vocab_s = store_vocab(run_dir, tokenizer)
            if vocab_s is not None:
                manifest["timings"]["vocab_s"] = vocab_s
                write_manifest(run_dir, manifest)
    except BaseException as err:
        if (run_dir / layout.MANIFEST).is_file() and not isinstance(err, SpecError):
            _finish_failed(None, rd, RunLog(run_dir / layout.LOG), *_outcome(err))
        if isinstance(err, OSError):  # e.g. a resume on a full disk: one line, not an internal error
            from ..archive.writer import space_note

            raise LmtraceError(f"cannot start run {run_dir.name}: {space_note(run_dir, err)}") from None
        raise


def _outcome(err: BaseException) -> tuple[str, str]:
    """(status, message) a failure is recorded with."""
    if isinstance(err, Interrupted):
        return "interrupted", str(err)
    if isinstance(err, OSError):
        from ..archive.writer import space_note

        return "failed", space_note(Path("."), err)
    return "failed", str(err) if isinstance(err, LmtraceError) else f"{type(err).__name__}: {err}"


def _write_run(spec, run_id, run_dir, existing, rd, log, shape, probes, step_columns, eos, model, tokenizer,
               loaded, prompts, rendered, prompt_ids, replay, progress, t_start) -> GenerateResult:
    """Generate and stream into a run whose manifest exists; every failure ends in `failed` (or
    `interrupted`) with the error recorded in the manifest and the shard's status file."""
    from ..archive.liveness import Heartbeat, kill_point

    shard = rd.shard
    g = spec.generation
    my_seqs = shard.sequences(len(prompts))
    stop = StopFlag()
    writer = None
    texts: dict[int, str] = {}
    n_tokens = 0
    status = "failed"
    try:
        with rd.lock():
            writer_core = ArchiveWriter(run_dir, shape, chunk_steps=spec.output.chunk_steps, codec=spec.output.codec,
                                        level=spec.output.level, writer_key=shard.key,
                                        chunk_keys=spec.output.chunk_keys)
        rd.set_shard_status("running")
        log.event("resumed" if existing else "started", run_id=run_id, shard=shard.key, n_prompts=len(prompts))
        tracer = Tracer(model, tokenizer, sampler=Sampler(g.temperature, g.top_k, g.top_p), seed=g.seed,
                        max_new_tokens=g.max_new_tokens, eos_ids=eos, stop_strings=g.stop,
                        n_alternatives=spec.capture.alternatives, probes=probes, pad_id=tokenizer.pad_token_id,
                        device=loaded.device)
        batches = [my_seqs[i: i + g.batch_size] for i in range(0, len(my_seqs), g.batch_size)]
        writer_core.rollback([b[0] for b in batches])
        writer = BackgroundWriter(writer_core)
        progress.start(len(my_seqs), g.max_new_tokens)
        t_gen = time.time()
        with stop.installed(), Heartbeat(run_dir, shard.key):
            for seq_ids in batches:
                batch = seq_ids[0]
                committed, done = writer_core.committed(batch)
                if done:
                    continue
                batch_prompts = [prompt_ids[i] for i in seq_ids]
                sink = BlockSink(writer, shape, batch, seq_ids, batch_prompts, tokenizer,
                                 spec.output.chunk_steps, step_columns, progress, start_step=committed)
                teacher, edits, feed = None, None, sink
                if committed:
                    log.event("resume_batch", batch=batch, from_step=committed)
                    teacher = ForcedTokens(_archived_tokens(run_dir, seq_ids, committed), committed)
                if replay is not None:
                    teacher, edits = replay.teacher, replay.edits
                    feed = _Tee(sink, replay.observer) if replay.observer is not None else sink
                outcome = tracer.run_batch(seq_ids, batch_prompts, feed, should_stop=stop, teacher=teacher, edits=edits,
                                           forward_running=writer.forward_running())
                sink.flush()
                if outcome.interrupted:
                    raise Interrupted(f"interrupted by signal {stop.signal} (batch of sequence {batch}); flushed "
                                      f"steps are kept; resume with `lmtrace generate --resume {run_id}`")
                gen_len = np.asarray([len(x) for x in outcome.generated], dtype=np.int32)
                for b, seq in enumerate(seq_ids):
                    texts[seq] = tokenizer.decode(outcome.generated[b], skip_special_tokens=True)
                n_tokens += int(gen_len.sum())
                seq_table = pa.table({
                    "sequence": seq_ids, "batch": [batch] * len(seq_ids), "prompt": [prompts[i] for i in seq_ids],
                    "prompt_rendered": [rendered[i] for i in seq_ids], "prompt_len": [len(p) for p in batch_prompts],
                    "generated_len": gen_len.tolist(), "stop_reason": outcome.stop_reason,
                    "generated_text": [texts[i] for i in seq_ids],
                }, schema=layout.sequence_schema())
                writer.submit(writer_core.finish_batch, batch, seq_ids, gen_len, seq_table)
                log.event("batch_done", batch=batch, sequences=seq_ids, tokens=int(gen_len.sum()))
            writer.drain()
        t_done = time.time()
        rd.set_shard_status("complete", tokens=n_tokens, generate_s=round(t_done - t_gen, 3))
        with rd.lock():
            if not rd.all_shards_complete():
                status = "shard-complete"
                failed = [k for k, v in rd.other_shard_statuses().items() if v in ("failed", "interrupted")]
                if failed:
                    status = "shard-complete-others-failed:" + ",".join(failed)
                log.event("shard_complete", shard=shard.key, tokens=n_tokens)
            else:
                if replay is not None and replay.finalize is not None:
                    replay.finalize(run_dir)
                from ..archive.runs import read_manifest

                manifest = read_manifest(run_dir)
                if probes is not None and probes.kernel_args:  # what the attention kernel was called with
                    manifest["attention"]["layers"] = {str(k): v for k, v in sorted(probes.kernel_args.items())}
                rows = writer_core.compact_tables()
                kill_point("finalize-compacted")
                writer_core.consolidate()
                manifest["timings"].update(generate_s=round(t_done - t_gen, 3), finalize_s=round(time.time() - t_done, 3),
                                           tokens_per_s=round(n_tokens / max(t_done - t_gen, 1e-9), 3))
                n_generated = int(np.maximum(writer_core.arrays["generated_len"][:], 0).sum())
                from ..archive.integrity import record

                manifest.update(status="complete", completed=now_iso(), n_generated_tokens=n_generated,
                                table_rows=rows, checksums=record(run_dir))
                kill_point("finalize-checksums")
                status = "complete"
                write_manifest(run_dir, manifest)
                log.event("complete", tokens=n_generated)
    except Interrupted as err:
        status = "interrupted"
        _finish_failed(writer, rd, log, "interrupted", str(err))
        raise
    except BaseException as err:
        _finish_failed(writer, rd, log, *_outcome(err))
        if isinstance(err, OSError):  # a full disk while finishing, say: one line naming the path and free space
            raise LmtraceError(f"run {run_id} failed: {_outcome(err)[1]}") from None
        raise
    finally:
        if writer is not None:
            try:
                writer.close()
            except BaseException:
                pass
    ordered = [texts.get(i, "") for i in my_seqs]
    return GenerateResult(run_id, run_dir, status, len(my_seqs), n_tokens, time.time() - t_start, ordered)


def _finish_failed(writer, rd: RunDir, log, status, message) -> None:
    """Flush what can be flushed, then record the outcome; never claims `complete`."""
    from ..archive.runs import read_manifest

    if writer is not None:
        try:
            writer.drain()
        except BaseException as err:  # the original error is what the user needs to see
            message += f" (and flushing failed: {err})"
    from ..archive.runs import write_status

    message = message if len(message) <= 2000 else message[:2000] + "..."  # fits the status files' slack
    # Each record separately: on a full disk the status files are rewritten in place (write_status),
    # and the log, which needs space, may fail alone.
    for record in (lambda: rd.set_shard_status(status, error=message), lambda: _record_manifest(rd, status, message),
                   lambda: log.event(status, error=message, shard=rd.shard.key)):
        try:
            record()
        except (OSError, LmtraceError):
            pass


def _record_manifest(rd: RunDir, status: str, message: str) -> None:
    from ..archive.runs import read_manifest, write_status

    with rd.lock():
        manifest = read_manifest(rd.path)
        if manifest.get("status") != "complete":
            where = f" ({rd.shard.key})" if rd.shard.count > 1 else ""
            manifest.update(status=status, error=message + where, ended=now_iso())
            write_status(rd.path / layout.MANIFEST, manifest)
