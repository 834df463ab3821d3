"""Table part files of a run being written: which are live, their merging while the run runs, and
their compaction into `<table>.parquet` when it completes.

A run's tables are written a block at a time, one part file per block (`<table>.parts/b…-s….parquet`,
writer.ArchiveWriter). So that the number of files grows with the bytes stored and not with
batches × blocks, each writer (shard) merges its own committed parts as it goes, levelled: every
`FANOUT` parts of one level become one part of the next level (`m<level>_<writer>_<n>.parquet`),
until a part reaches `FINAL_BYTES` and stays as it is (docs/archive.md, "Part files").

A merged part lists, in its Parquet key-value metadata, the parts it replaces (`lmtrace.covers`,
transitively) and the blocks its rows came from (`lmtrace.units`: [name, rows] in row order, rows
ordered by block name as the blocks' own files sort). A merge writes a hidden temporary file,
fsyncs it, renames it into place, fsyncs the directory, and only then deletes the parts it covers:
a kill at any moment leaves either the old parts, or the merged part beside some of the parts it
covers; `live_parts` skips those, and the writer deletes them when it resumes (`PartMerger.adopt`).
Only committed parts are merged, so a resume's rollback never needs to take rows out of one.
"""

from __future__ import annotations

import heapq
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..exits.faults import kill_point
from . import layout, parquet_io

# Levelled merging: every row is rewritten once per level it climbs, so a run of P block parts
# rewrites its table bytes about log_FANOUT(P) times (at most log_FANOUT(FINAL_BYTES / part size)),
# and a writer keeps fewer than FANOUT parts per level below FINAL_BYTES.
FANOUT = 8
FINAL_BYTES = 64 << 20  # a merged part this large is never merged again (until the run completes)
ROW_GROUP_ROWS = 65536  # rows per row group of a merged part (at most, of the compacted table)

UNITS_KEY = b"lmtrace.units"
COVERS_KEY = b"lmtrace.covers"
MERGED_PREFIX = "m"


def merged_name(level: int, writer_key: str, n: int) -> str:
    return f"{MERGED_PREFIX}{level}_{writer_key}_{n:06d}.parquet"


def parse_merged(filename: str) -> tuple[int, str, int] | None:
    """(level, writer key, number) of a merged part's file name; None for a block part."""
    if not filename.startswith(MERGED_PREFIX) or not filename.endswith(".parquet"):
        return None
    level, writer_key, n = filename[len(MERGED_PREFIX) : -len(".parquet")].split("_")
    return int(level), writer_key, int(n)


def _key_value(path: Path, key: bytes) -> list:
    meta = pq.read_metadata(path).metadata or {}
    return json.loads(meta[key]) if key in meta else []


def covered_by(path: Path) -> list[str]:
    """File names of the parts a merged part replaces (none for a block part)."""
    return _key_value(path, COVERS_KEY) if parse_merged(path.name) else []


def units_of(path: Path) -> list[tuple[str, int]]:
    """[(block name, rows)] of a part file in row order: a block part is one block."""
    if parse_merged(path.name):
        return [(name, rows) for name, rows in _key_value(path, UNITS_KEY)]
    return [(path.name.split(".")[0], pq.read_metadata(path).num_rows)]


def live_parts(parts_dir: Path) -> list[Path]:
    """The part files holding each committed row of a table exactly once, sorted by name: every
    visible part but those a merged part already covers (left by a kill during a merge)."""
    for _ in range(20):  # a writer merging meanwhile may delete a part between the listing and its read
        files = sorted(parts_dir.glob("[!.]*.parquet")) if parts_dir.is_dir() else []
        try:
            covered = {name for f in files for name in covered_by(f)}
        except FileNotFoundError:
            continue
        return [f for f in files if f.name not in covered]
    raise FileNotFoundError(f"the parts of {parts_dir} kept changing while being listed")


def _units_stream(path: Path, schema: pa.Schema) -> Iterator[tuple[str, pa.Table]]:
    """The blocks of one part file, in its row order, read a row group at a time."""
    reader = parquet_io.parquet_file(path)
    units = units_of(path)
    pending = schema.empty_table()
    groups = iter(range(reader.num_row_groups))
    for name, rows in units:
        while pending.num_rows < rows:
            pending = pa.concat_tables([pending, _row_group(reader, path, next(groups)).cast(schema)])
        yield name, pending.slice(0, rows)
        pending = pending.slice(rows)


def _row_group(reader: pq.ParquetFile, path: Path, i: int) -> pa.Table:
    """Row group `i` of a part, its pages checked: a damaged part is never merged into a fresh one."""
    try:
        return reader.read_row_group(i)
    except parquet_io.READ_ERRORS as err:
        raise parquet_io.damage_of([path], err) from None


def plain_schema(path: Path) -> pa.Schema:
    """A part's schema without the merge's own metadata (what a block part and the compacted file have)."""
    schema = pq.read_schema(path)
    meta = {k: v for k, v in (schema.metadata or {}).items() if k not in (UNITS_KEY, COVERS_KEY)}
    # none rather than empty: the Arrow schema stored in the compacted file is then the block parts' own
    return schema.with_metadata(meta) if meta else schema.remove_metadata()


def write_units(
    files: list[Path], out: pq.ParquetWriter, schema: pa.Schema, group_blocks: bool
) -> list[tuple[str, int]]:
    """Write the blocks of `files` in block-name order (each file's blocks are in that order already:
    a streaming merge) to `out`; [(block name, rows)] written. `group_blocks`: row groups of about
    ROW_GROUP_ROWS rows (a merged part: read whole); else one row group per block, as the compacted
    table has them (a reader of one sequence reads only its batch's row groups)."""
    streams = [_units_stream(f, schema) for f in files]
    written: list[tuple[str, int]] = []
    batch: list[pa.Table] = []
    rows = 0
    for name, table in heapq.merge(*streams, key=lambda unit: unit[0]):
        written.append((name, table.num_rows))
        batch.append(table)
        rows += table.num_rows
        if rows >= ROW_GROUP_ROWS or not group_blocks:
            out.write_table(pa.concat_tables(batch), row_group_size=ROW_GROUP_ROWS)
            batch, rows = [], 0
    if batch:
        out.write_table(pa.concat_tables(batch), row_group_size=ROW_GROUP_ROWS)
    return written


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def merge_parts(parts_dir: Path, sources: list[Path], target: str) -> Path:
    """Replace `sources` (parts of one writer) by one merged part named `target`; see the module doc
    for why a kill between any two steps neither loses nor duplicates a row."""
    schema = plain_schema(sources[0])
    covers = sorted({s.name for s in sources} | {name for s in sources for name in covered_by(s)})
    tmp = parts_dir / f".{target}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        # the covered names go into the footer, written after the rows: known before the first row
        with parquet_io.writer(tmp, schema, use_dictionary=False, write_statistics=False) as out:
            units = write_units(sources, out, schema, group_blocks=True)
            out.add_key_value_metadata(
                {
                    UNITS_KEY: json.dumps(units, separators=(",", ":")),
                    COVERS_KEY: json.dumps(covers, separators=(",", ":")),
                }
            )
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        kill_point("merge-written")
        path = parts_dir / target
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(parts_dir)  # the merged part is durable before a part it covers is gone
    kill_point("merge-renamed")
    for source in sources:
        source.unlink()
        kill_point("merge-removing")
    return path


class PartMerger:
    """One writer's merging of its own committed parts, per table (called on the writer's thread)."""

    def __init__(self, run_dir: Path, writer_key: str, fanout: int = FANOUT, final_bytes: int = FINAL_BYTES):
        self.dir = run_dir
        self.key = writer_key
        self.fanout = fanout
        self.final_bytes = final_bytes
        self.levels: dict[str, dict[int, list[Path]]] = {}  # table -> level -> this writer's parts
        self.next_n = 0
        self.pace = lambda: None

    def added(self, table: str, path: Path) -> None:
        """A committed block part of this writer (once: merging one twice would duplicate its rows)."""
        level0 = self.levels.setdefault(table, {}).setdefault(0, [])
        if path not in level0:
            level0.append(path)

    def _keep(self, table: str, path: Path, level: int) -> None:
        if level == 0 or path.stat().st_size < self.final_bytes:
            self.levels.setdefault(table, {}).setdefault(level, []).append(path)

    def adopt(self, committed_blocks) -> None:
        """On (re)opening a run: take over this writer's parts already there. Parts that a merged part
        of this writer covers (a kill during its merge) and its merges' temporary files are deleted;
        `committed_blocks(table, name)` says whether a block part is this writer's and committed."""
        for table in layout.TABLES:
            parts = self.dir / layout.table_parts_dir(table)
            if not parts.is_dir():
                continue
            for tmp in parts.glob(f".{MERGED_PREFIX}*_{self.key}_*.tmp"):
                tmp.unlink()
            mine = [(f, parse_merged(f.name)) for f in sorted(parts.glob(f"{MERGED_PREFIX}*_{self.key}_*.parquet"))]
            mine = [(f, parsed) for f, parsed in mine if parsed is not None and parsed[1] == self.key]
            covered = {name for f, _ in mine for name in covered_by(f)}
            for f, (level, _, n) in mine:
                self.next_n = max(self.next_n, n + 1)
                if f.name in covered:
                    f.unlink()
                else:
                    self._keep(table, f, level)
            for f in sorted(parts.glob("[!.]*.parquet")):
                if parse_merged(f.name) is not None:
                    continue
                if f.name in covered:
                    f.unlink()
                elif committed_blocks(table, f.name):
                    self.added(table, f)

    def compact(self) -> None:
        """Merge every level of every table that has `fanout` parts (after a commit: all committed)."""
        for table, levels in self.levels.items():
            level = 0
            while level in levels:
                while len(levels[level]) >= self.fanout:
                    sources, levels[level] = levels[level][: self.fanout], levels[level][self.fanout :]
                    self.pace()
                    target = merged_name(level + 1, self.key, self.next_n)
                    self.next_n += 1
                    self._keep(table, merge_parts(sources[0].parent, sources, target), level + 1)
                level += 1


def compact_tables(run_dir: Path) -> dict[str, int]:
    """Merge each table's live parts into `<table>.parquet` and drop the parts: rows in the order
    of their blocks' names (`sequences`: in sequence order), whatever merges happened on the way."""
    rows = {}
    for table in layout.TABLES:
        parts = run_dir / layout.table_parts_dir(table)
        if not parts.is_dir():
            continue
        target = run_dir / layout.table_file(table)
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
        tmp = run_dir / f".{table}.parquet.tmp"
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
