"""Streaming archive writer: Zarr v3 arrays in step blocks, Parquet part files, manifest, progress.
The arrays are created by zarr_arrays.py; the parts are merged, and compacted at the end, by parts.py.

Crash-safety protocol (see docs/archive.md):
  1. arrays have their final shape from the start (fill = NaN / -1), so a kill never leaves arrays
     of different lengths; blocks of `chunk_steps` steps are written whole (one shard file per block
     and group of `chunk_sequences` sequences, replaced atomically);
  2. Parquet rows of a block go to `<table>.parts/.<name>.tmp` and are renamed to `<name>.parquet`
     once the footer is written, so every visible part is a readable Parquet file;
  3. only after a block's arrays and parts are on disk (syncfs of the run's filesystem) is `progress.json` updated
     (write-to-temp + rename) with the committed step count of the batch;
  4. after each commit the writer merges its own committed parts, levelled (archive/parts.py), so
     the parts stay few; a merged part lists the parts it replaces, and readers skip those;
  5. `status: complete` is written last, after parts are compacted and metadata consolidated.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import zarr

from ..exits.errors import LmtraceError
from ..exits.faults import kill_point
from . import layout, parquet_io
from .files import atomic_write_json, flush_filesystem, space_note
from .layout import RunShape
from .parts import PartMerger, compact_tables
from .runs import locked
from .shards import ShardFiles
from .zarr_arrays import compressors_for, consolidate, create_array, create_coordinates

# prompt_len and generated_len are one zarr chunk over every sequence, which each writer updates by
# read-modify-write of the whole chunk. Every writer of a run (the tasks of a sharded run, a resumed
# task beside running ones) holds this flock (in the run directory) around that update: two that read
# the chunk before either wrote it would each write the other's sequences back as they read them, and
# the first one's lengths would be lost (-1, the fill value) for good, since a resumed batch does not
# write its prompt again.
LENGTHS_LOCK = ".lengths.lock"


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
        create_coordinates(self.group, shape)
        self.arrays["prompt_len"] = self.group["prompt_len"]
        self.arrays["generated_len"] = self.group["generated_len"]

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
        flush_filesystem(self.dir)  # arrays and parts must be durable before progress says they exist
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
        """Merge each table's live parts into `<table>.parquet` and drop the parts (parts.compact_tables)."""
        return compact_tables(self.dir)

    def consolidate(self) -> None:
        consolidate(self.dir)


class BackgroundWriter:
    """Runs ArchiveWriter calls on one worker thread so compression and I/O overlap the generation.

    The queue is bounded, so at most `depth` blocks wait in memory: the loop blocks rather than
    letting memory grow. An error in the worker is re-raised in the caller on the next call.

    The worker works only while the generation loop is outside the model's forward: the loop wraps
    each forward in `forward_running()`, and the worker waits at its next pause point (before each
    job, each sequence's chunks of a shard file, each table part and the commit:
    `ArchiveWriter.pace`). torch runs the forward on both cores of a small CPU, so a writer running
    alongside takes a core from one of torch's threads and the whole forward waits for it. A job
    started just before a forward finishes the chunks of its current sequence first (at most ~13 ms
    at batch 32, against ~65 ms when the pause points were whole shard files: the writer then
    overlapped the forwards for ~0.2 s of a 10 s run, and they took ~10 % longer than plain
    generation's; docs/performance.md). A loop that waits for the writer (a full queue, `drain`)
    is outside the forward, so the writer is never held up for good.
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
