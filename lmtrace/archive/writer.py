"""Streaming archive writer: Zarr v3 arrays in step blocks, Parquet part files, manifest, progress.

Crash-safety protocol (see docs/archive.md):
  1. arrays have their final shape from the start (fill = NaN / -1), so a kill never leaves arrays
     of different lengths; blocks of `chunk_steps` steps are written whole (one shard file per block
     and group of `chunk_sequences` sequences, replaced atomically);
  2. Parquet rows of a block go to `<table>.parts/.<name>.tmp` and are renamed to `<name>.parquet`
     once the footer is written, so every visible part is a readable Parquet file;
  3. only after a block's arrays and parts are on disk (`os.sync`) is `progress.json` updated
     (write-to-temp + rename) with the committed step count of the batch;
  4. after each commit the writer merges its own committed parts, levelled (archive/parts.py), so
     the parts stay few; a merged part lists the parts it replaces, and readers skip those;
  5. `status: complete` is written last, after parts are compacted and metadata consolidated.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from ..exits.errors import LmtraceError
from ..exits.faults import kill_point
from . import layout, parquet_io
from .files import atomic_write_json, space_note
from .layout import RunShape
from .parts import PartMerger, live_parts, plain_schema, write_units
from .runs import locked
from .shards import ShardFiles

# prompt_len and generated_len are one zarr chunk over every sequence, which each writer updates by
# read-modify-write of the whole chunk. Every writer of a run (the tasks of a sharded run, a resumed
# task beside running ones) holds this flock (in the run directory) around that update: two that read
# the chunk before either wrote it would each write the other's sequences back as they read them, and
# the first one's lengths would be lost (-1, the fill value) for good, since a resumed batch does not
# write its prompt again.
LENGTHS_LOCK = ".lengths.lock"


def write_vocab(run_dir: Path, texts: list[str], special_ids) -> bool:
    """Write `vocab.parquet` (id, text, is_special) unless the run has it. Returns whether it wrote.

    `texts[i]` is the text of id i alone. Shards of one run may all get here at once: each writes
    its own temporary file and renames it into place, so a reader sees one whole file or none."""
    path = Path(run_dir) / layout.VOCAB
    if path.is_file():
        return False
    ids = np.arange(len(texts), dtype=np.int32)
    special = np.zeros(len(texts), dtype=bool)
    special[[i for i in special_ids if 0 <= i < len(texts)]] = True
    table = pa.table(
        {"id": ids, "text": pa.array(texts, pa.string()), "is_special": special}, schema=layout.vocab_schema()
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with tmp.open("wb") as fh:
        # every text is distinct, so a dictionary only costs: zstd without one was the smallest and
        # fastest (SmolLM2's 49,152 tokens: 369 KB in 8 ms, against 742 KB / 13 ms with the defaults)
        parquet_io.write_table(table, fh, compression="zstd", use_dictionary=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return True


def compressors_for(codec: str, level: int, spec: layout.ArraySpec, checksum: bool = True):
    """The compressors of one array; `auto` is the layout's choice for it (`ArraySpec.auto_codec`).
    `checksum` (format 4): each chunk ends in its crc32c (zarr's `crc32c` codec), so a reader that
    decodes a damaged chunk fails instead of returning its bytes."""
    if codec == "auto":
        codec = spec.auto_codec
    if codec == "zstd":
        out = [ZstdCodec(level=level)]
    elif codec == "blosc":
        out = [BloscCodec(cname="zstd", clevel=min(level, 9), shuffle="shuffle")]
    else:
        out = []
    return out + [Crc32cCodec()] if checksum else (out or None)


# Coordinates, prompt_len and generated_len: zarr's default compressor, then each chunk's crc32c
SMALL_ARRAY_COMPRESSORS = (ZstdCodec(level=0), Crc32cCodec())


def consolidate(run_dir: Path) -> None:
    """Consolidate the run's Zarr metadata (after the last array is created)."""
    with warnings.catch_warnings():  # "consolidated metadata is not part of the v3 spec": known, wanted
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(run_dir / layout.TENSORS))


def create_array(
    group: zarr.Group,
    spec: layout.ArraySpec,
    shape: tuple[int, ...],
    chunk_steps: int,
    compressors,
    chunk_keys: int | None = None,
    chunk_sequences: int | None = None,
) -> zarr.Array:
    """An archive array (or the existing one of that name), chunked as every writer chunks it.

    With `chunk_sequences` (format 3) an array over `sequence` is sharded: one shard file per
    `chunk_sequences` sequences (and block of steps), one inner chunk per sequence in it (docs/archive.md,
    "Files"); without it (format 2) every inner chunk is its own file."""
    if spec.name in group:
        return group[spec.name]
    # One chunk per block of steps and sequence, all layers in it. Per-layer inner chunks made a
    # layer slice cheaper to read, but cost ~7 ms of CPU per step to write on the default capture,
    # a sixth of a decode step (docs/archive.md, "Cost").
    chunks = [1, chunk_steps] + list(shape[2:]) if spec.per_step else [1] + list(shape[1:])
    chunks = [max(1, c) for c in chunks]
    if spec.key_chunked:
        # Attention rows, padded to the longest context of the run, are also split along their
        # keys: a block writes only the key chunks its context reaches (ShardFiles.write) and a
        # chunk never written reads as the fill value (NaN), so the padding costs neither bytes
        # nor compression.
        chunks[-1] = layout.key_chunk_width(chunk_keys, shape[-1])
    shards = None
    if chunk_sequences is not None:
        shards = list(chunks)
        shards[0] = max(1, min(chunk_sequences, shape[0]))
        if spec.key_chunked:  # the whole row in one shard, in whole key chunks
            shards[-1] = -(-shape[-1] // chunks[-1]) * chunks[-1]
    return group.create_array(
        spec.name,
        shape=shape,
        chunks=tuple(chunks),
        shards=tuple(shards) if shards else None,
        dtype=spec.dtype,
        fill_value=spec.fill,
        compressors=compressors,
        dimension_names=spec.dims,
        # every chunk is written once, whole: skip zarr's is-it-all-fill scan (NaN-aware, slow)
        config={"write_empty_chunks": True},
    )


class ArchiveWriter:
    """Owns one run directory while it is written. Not thread-safe: use BackgroundWriter to offload."""

    def __init__(
        self,
        run_dir: Path,
        shape: RunShape,
        *,
        chunk_steps: int,
        codec: str,
        level: int,
        writer_key: str = "shard-0-of-1",
        chunk_keys: int | None = None,
        chunk_sequences: int | None = None,
    ):
        self.dir = run_dir
        self.shape = shape
        self.chunk_steps = chunk_steps
        self.chunk_keys = chunk_keys
        self.group = zarr.open_group(str(run_dir / layout.TENSORS), mode="a", zarr_format=3)
        self.arrays: dict[str, zarr.Array] = {}
        self._progress_path = run_dir / layout.PROGRESS_DIR / f"{writer_key}.json"
        self._progress_path.parent.mkdir(exist_ok=True)
        self.progress = self._load_progress()
        # Arrays whose shard files lmtrace writes itself (format 3); the others (a format-2 run
        # resumed) are written through zarr
        self.shard_files: dict[str, ShardFiles] = {}
        # Called before each chunk file, table part and commit of a block: BackgroundWriter makes it
        # wait while the model's forward runs (BackgroundWriter.forward_running).
        self.pace = lambda: None
        self.merger = PartMerger(run_dir, writer_key)
        self.key_arrays = {spec.name for spec in shape.arrays() if spec.key_chunked}
        for spec in shape.arrays():
            self.arrays[spec.name] = create_array(
                self.group,
                spec,
                shape.shape_of(spec),
                chunk_steps,
                compressors_for(codec, level, spec),
                chunk_keys,
                chunk_sequences,
            )
            direct = ShardFiles.for_array(run_dir / layout.TENSORS / spec.name, self.arrays[spec.name], spec.per_step)
            if direct is not None:
                self.shard_files[spec.name] = direct
        self._coordinates()

    @property
    def sequence_group(self) -> int | None:
        """Sequences per shard file of this run's arrays (None: not sharded, a format-2 run): the
        unit a SLURM shard owns, so that no two processes write one file (rundir.Shard.sequences)."""
        groups = {files.sequences for files in self.shard_files.values()}
        return max(groups) if groups else None

    # ---- set-up ------------------------------------------------------------------------------
    def _load_progress(self) -> dict:
        if self._progress_path.is_file():
            return json.loads(self._progress_path.read_text())
        return {"batches": {}}

    def _coordinates(self) -> None:
        s = self.shape
        coords = {
            "layer": np.asarray(s.layers, dtype=np.int32),
            "q_head": np.arange(s.n_heads, dtype=np.int32),
            "kv_head": np.arange(s.n_kv_heads, dtype=np.int32),
            "kv_head_of_head": np.asarray(s.kv_head_of_head, dtype=np.int32),
            "step": np.arange(s.n_steps, dtype=np.int32),
            "sequence": np.arange(s.n_sequences, dtype=np.int32),
            # token positions (left-aligned: position p is the p-th token of the sequence)
            "key": np.arange(s.max_len, dtype=np.int32),
        }
        if s.prefill_attention or s.qkv:
            for name in ("prompt_pos", "query_pos", "key_pos"):
                coords[name] = np.arange(s.max_prompt, dtype=np.int32)
        dims = {"kv_head_of_head": ("q_head",)}
        if s.resid_layers:
            coords["resid_layer"] = np.asarray(s.resid_layers, dtype=np.int32)
        for name, values in coords.items():
            if name not in self.group:
                arr = self.group.create_array(
                    name,
                    shape=values.shape,
                    dtype=values.dtype,
                    chunks=values.shape or (1,),
                    dimension_names=dims.get(name, (name,)),
                    fill_value=-1,
                    compressors=SMALL_ARRAY_COMPRESSORS,
                )
                arr[...] = values
        for name in ("prompt_len", "generated_len"):
            if name not in self.group:
                self.group.create_array(
                    name,
                    shape=(s.n_sequences,),
                    dtype="int32",
                    chunks=(max(1, min(s.n_sequences, 4096)),),
                    dimension_names=("sequence",),
                    fill_value=-1,
                    compressors=SMALL_ARRAY_COMPRESSORS,
                )
        self.arrays["prompt_len"] = self.group["prompt_len"]
        self.arrays["generated_len"] = self.group["generated_len"]

    # ---- writing -----------------------------------------------------------------------------
    @staticmethod
    def _runs(seqs: list[int]) -> list[tuple[int, int, int]]:
        """Contiguous runs of sequence indices as (row offset, first sequence, count)."""
        runs, start = [], 0
        for i in range(1, len(seqs) + 1):
            if i == len(seqs) or seqs[i] != seqs[i - 1] + 1:
                runs.append((start, seqs[start], i - start))
                start = i
        return runs

    def _put(self, name: str, seqs: list[int], data: np.ndarray, steps: slice | None = None) -> None:
        # A shard file holds whole groups of sequences, and one process owns each group (SLURM
        # array tasks included), so its shard files are only ever written here.
        direct = self.shard_files.get(name)
        if direct is not None and (
            steps is None or (steps.start % self.chunk_steps == 0 and steps.stop - steps.start <= self.chunk_steps)
        ):
            direct.write(seqs, data, None if steps is None else steps.start, self.pace)
            return
        array = self.arrays[name]
        # attention rows cut at the block's context (BlockSink): the keys past it stay fill
        cut = (Ellipsis, slice(0, data.shape[-1])) if name in self.key_arrays else ()
        for off, first, n in self._runs(seqs):
            key = (slice(first, first + n),) if steps is None else (slice(first, first + n), steps)
            self.pace()
            array[key + cut] = data[off : off + n]

    def write_block(
        self, batch: int, seqs: list[int], s0: int, s1: int, arrays: dict[str, np.ndarray], tables: dict[str, pa.Table]
    ) -> None:
        """Write steps [s0, s1) of sequences `seqs` and the block's table rows, then commit."""
        for name, data in arrays.items():
            self._put(name, seqs, data, slice(s0, s1))
        written = []
        for name, table in tables.items():
            if table is not None and table.num_rows:
                self.pace()
                written.append((name, self._write_part(name, layout.block_part_name(batch, s0), table)))
        self.pace()
        self._commit(batch, committed_steps=s1)
        self._merge(written)
        kill_point("block-committed")

    def _merge(self, committed: list[tuple[str, Path]]) -> None:
        """Hand the parts just committed to the merger, which merges a level once it is full."""
        for table, path in committed:
            self.merger.added(table, path)
        self.merger.pace = self.pace
        self.merger.compact()

    def write_prompt(self, seqs: list[int], arrays: dict[str, np.ndarray], prompt_len: np.ndarray) -> None:
        for name, data in arrays.items():
            self._put(name, seqs, data)
        self._put_lengths("prompt_len", seqs, prompt_len)

    def _put_lengths(self, name: str, seqs: list[int], data: np.ndarray) -> None:
        """prompt_len / generated_len of `seqs`: a chunk every writer of the run shares (LENGTHS_LOCK),
        held for the update alone (the pause for the model's forward comes before it)."""
        self.pace()
        array = self.arrays[name]
        with locked(self.dir / LENGTHS_LOCK):
            for off, first, n in self._runs(seqs):
                array[first : first + n] = data[off : off + n]

    def finish_batch(self, batch: int, seqs: list[int], generated_len: np.ndarray, sequences: pa.Table) -> None:
        self._put_lengths("generated_len", seqs, generated_len)
        path = self._write_part("sequences", layout.batch_part_name(batch), sequences)
        self._commit(batch, done=True)
        self._merge([("sequences", path)])

    def rollback(self, batches: list[int]) -> None:
        """Before resuming: drop table parts past each unfinished batch's committed step, and temp files.

        Array chunks past the committed step need no rollback: they are rewritten whole on resume.
        """
        for table in layout.TABLES:
            parts = self.dir / layout.table_parts_dir(table)
            if not parts.is_dir():
                continue
            for batch in batches:
                entry = self.progress["batches"].get(str(batch), {"committed_steps": 0, "done": False})
                if entry["done"]:
                    continue
                for f in parts.glob(f"{layout.batch_part_name(batch)}*"):
                    s0 = layout.part_start_step(f.name)
                    if s0 is None or s0 >= entry["committed_steps"]:
                        f.unlink()
                for f in parts.glob(f".{layout.batch_part_name(batch)}*.tmp"):
                    f.unlink()
        self.merger.adopt(self._committed_part)

    def _committed_part(self, table: str, filename: str) -> bool:
        """Whether a block part (`b<batch>[-s<step>].parquet`) is this writer's and committed."""
        entry = self.progress["batches"].get(str(layout.part_batch(filename)))
        if entry is None:
            return False
        s0 = layout.part_start_step(filename)
        if s0 is None:  # a batch's sequences part: written when the batch is done
            return entry["done"]
        return entry["done"] or s0 < entry["committed_steps"]

    def _write_part(self, table: str, name: str, data: pa.Table) -> Path:
        parts = self.dir / layout.table_parts_dir(table)
        parts.mkdir(exist_ok=True)
        tmp = parts / f".{name}.tmp"
        path = parts / f"{name}.parquet"
        # Parts are read back whole (by compaction or a reader of an unfinished run), never
        # filtered: dictionaries and column statistics would only cost the writer ~2 ms a block.
        try:
            parquet_io.write_table(data, tmp, use_dictionary=False, write_statistics=False)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    def _commit(self, batch: int, committed_steps: int | None = None, done: bool = False) -> None:
        os.sync()  # arrays and parts must be durable before progress says they exist
        entry = self.progress["batches"].setdefault(str(batch), {"committed_steps": 0, "done": False})
        if committed_steps is not None:
            entry["committed_steps"] = committed_steps
        if done:
            entry["done"] = True
        self.progress["updated"] = time.time()
        atomic_write_json(self._progress_path, self.progress)

    def committed(self, batch: int) -> tuple[int, bool]:
        entry = self.progress["batches"].get(str(batch))
        return (entry["committed_steps"], entry["done"]) if entry else (0, False)

    # ---- completion --------------------------------------------------------------------------
    def compact_tables(self) -> dict[str, int]:
        """Merge each table's live parts into `<table>.parquet` and drop the parts: rows in the order
        of their blocks' names (`sequences`: in sequence order), whatever merges happened on the way."""
        rows = {}
        for table in layout.TABLES:
            parts = self.dir / layout.table_parts_dir(table)
            if not parts.is_dir():
                continue
            target = self.dir / layout.table_file(table)
            if target.is_file():
                # The target only ever appears, by rename, once every part is in it: parts still
                # here are what a kill during their deletion left. Compacting them again would
                # replace the full table with the survivors.
                shutil.rmtree(parts)
                rows[table] = pq.read_metadata(target).num_rows
                continue
            files = live_parts(parts)
            if not files:
                continue
            tmp = self.dir / f".{table}.parquet.tmp"
            schema = plain_schema(files[0])
            try:
                with parquet_io.writer(tmp, schema) as out:
                    if table == "sequences":  # one row per sequence: in sequence order, whatever the shards' batches
                        t = pa.concat_tables([parquet_io.read_table(f).cast(schema) for f in files]).sort_by("sequence")
                        out.write_table(t, row_group_size=65536)
                        n = t.num_rows
                    else:
                        n = sum(rows for _, rows in write_units(files, out, schema, group_blocks=False))
                os.replace(tmp, target)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            shutil.rmtree(parts)
            rows[table] = n
        return rows

    def consolidate(self) -> None:
        consolidate(self.dir)


class BackgroundWriter:
    """Runs ArchiveWriter calls on one worker thread so compression and I/O overlap the generation.

    The queue is bounded, so at most `depth` blocks wait in memory: the loop blocks rather than
    letting memory grow. An error in the worker is re-raised in the caller on the next call.

    The worker works only while the generation loop is outside the model's forward: the loop wraps
    each forward in `forward_running()`, and the worker waits at its next pause point (before each
    job, chunk file, table part and commit: `ArchiveWriter.pace`). torch runs the forward on both
    cores of a small CPU, so a writer running alongside takes a core from one of torch's threads
    and the whole forward waits for it. Measured on the embedded model, 256 tokens: the forwards
    after a block was handed over took 12–19 ms more per 16-step block than the others; with the
    pause, ~3 ms (docs/archive.md, "Cost"). Between forwards (token statistics, probes, the sink:
    a few ms a step) only the loop's own thread is busy, and the writer uses the other core. A job
    started just before a forward finishes its current file first; a loop that waits for the
    writer (a full queue, `drain`) is outside the forward, so the writer is never held up for good.
    """

    def __init__(self, writer: ArchiveWriter, depth: int = 2):
        self.writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._outside_forward = threading.Event()
        self._outside_forward.set()
        self._forward = _ForwardRunning(self._outside_forward)
        writer.pace = self._outside_forward.wait
        self._thread = threading.Thread(target=self._run, name="lmtrace-writer", daemon=True)
        self._thread.start()

    def forward_running(self) -> "_ForwardRunning":
        """Context manager for the generation loop: the writer pauses while the model's forward runs."""
        return self._forward

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            fn, args = item
            try:
                if self._error is None:
                    self._outside_forward.wait()
                    fn(*args)
            except BaseException as err:  # re-raised in the main thread by _check
                self._error = err
            finally:
                self._queue.task_done()

    def _check(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, OSError):
                raise LmtraceError(f"writing the archive failed: {space_note(self.writer.dir, err)}") from err
            raise err

    def submit(self, fn, *args) -> None:
        self._check()
        self._queue.put((fn, args))

    def drain(self) -> None:
        self._queue.join()
        self._check()

    def close(self) -> None:
        self._outside_forward.set()
        self._queue.put(None)
        self._thread.join()
        self._check()


class _ForwardRunning:
    """`with`: the writer's pause points wait until the block exits (however it exits)."""

    __slots__ = ("_event",)

    def __init__(self, event: threading.Event):
        self._event = event

    def __enter__(self):
        self._event.clear()

    def __exit__(self, *exc):
        self._event.set()
        return False
