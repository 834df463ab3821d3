"""The block sink: the generation loop's step results, gathered into blocks of steps for the writer.

The tracer calls `on_step` once per step; every `chunk_steps` steps a block of arrays and table
rows goes to the background writer (writer.BackgroundWriter), which writes and commits it."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from ..capture.sampling import stability_class
from ..capture.tracer import StepResult
from ..output.progress import Progress
from . import layout
from .layout import RunShape
from .writer import BackgroundWriter


class BlockSink:
    """Collects step results of one batch into blocks of `chunk_steps` steps and submits them.

    Per-layer scalars are kept as [batch, step, layer] buffers and turned into `steps` table rows
    once per block, on the writer's thread.
    """

    def __init__(
        self,
        writer: BackgroundWriter,
        shape: RunShape,
        batch: int,
        seq_ids: list[int],
        prompts: list[list[int]],
        tokenizer,
        chunk_steps: int,
        step_columns: list[str],
        progress: Progress,
        start_step: int = 0,
    ):
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
        self.key_chunk = {
            name: writer.writer.arrays[name].chunks[-1] for name, spec in self.specs.items() if spec.key_chunked
        }
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
        self.buffer_keys = {
            name: layout.block_keys(self.padded_prompt, last_s0, chunk_steps, width, shape.max_len)
            for name, width in self.key_chunk.items()
        }
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
        self.block_width = {
            name: layout.block_keys(self.padded_prompt, s0, self.chunk, width, self.shape.max_len)
            for name, width in self.key_chunk.items()
        }
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
            self.buffers[name][..., min(first_context, width) : width] = self.specs[name].fill
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
                for key, value in (
                    ("sequence", seq),
                    ("position", pos),
                    ("step", None),
                    ("is_prompt", True),
                    ("token_id", tok),
                    ("token_text", self._text(tok)),
                ):
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
        tok, logprob, sampling_lp, rank = (
            c.token.tolist(),
            c.logprob.tolist(),
            c.sampling_logprob.tolist(),
            c.rank.tolist(),
        )
        entropy, greedy, margin = c.entropy.tolist(), c.greedy_token.tolist(), c.margin.tolist()
        changed, eligible, eos = c.filter_changed.tolist(), c.eligible.tolist(), r.eos_now.tolist()
        alt_ids, alt_logits, alt_lp = c.alt_ids.tolist(), c.alt_logits.tolist(), c.alt_logprobs.tolist()
        rows = self.token_rows
        for b in np.flatnonzero(active).tolist():
            values = {
                "sequence": self.seq_ids[b],
                "position": len(self.prompts[b]) + r.step,
                "step": r.step,
                "is_prompt": False,
                "token_id": tok[b],
                "token_text": self._text(tok[b]),
                "logprob": logprob[b],
                "prob": math.exp(logprob[b]),
                "sampling_logprob": sampling_lp[b],
                "sampling_prob": math.exp(sampling_lp[b]),
                "token_rank": rank[b],
                "entropy": entropy[b],
                "greedy_id": greedy[b],
                "margin": margin[b],
                "stability": stability_class(math.exp(alt_lp[b][0]), margin[b]),
                "filter_changed": changed[b],
                "eligible": eligible[b],
                "is_eos": eos[b],
                "alt_ids": alt_ids[b],
                "alt_logits": alt_logits[b],
                "alt_logprobs": alt_lp[b],
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
        arrays = {
            name: buf[:, :n, ..., : self.block_width[name]] if name in self.block_width else buf[:, :n]
            for name, buf in self.buffers.items()
        }
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
