"""Damaged bytes never reach a query's answer: every file a query's views read is checked first, and
a run whose file fails is left out (named in one warning line).

- A complete run's tables (the top-level `*.parquet`) are hashed against the sha256 checksums
  recorded at completion (archive/integrity.py, what `lmtrace verify` checks): any changed byte.
- Every other file (an unfinished run's committed parts; `analysis/`, `sweeps/`, `explain/`, which
  change by design after completion; a run completed before checksums were recorded) is read whole
  with pyarrow, verifying the Parquet page checksums where the writer stored them (DuckDB reads
  them without checking), so a changed page is found; a file without page checksums is checked
  only for decoding.
- A file that passed is not hashed again while its size and mtime stay the same (`Verified`,
  within one command: the query runs again when a run is left out).

When DuckDB still fails reading, `failing_file` reads each file of the views alone to find which
run's file it was, for certain (never by matching paths in DuckDB's message).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb

from ..archive.integrity import verify
from ..archive.runs import read_manifest
from ..archive.table_catalog import Catalog, TableFile
from ..exits.errors import RunNotFoundError


def printable(text: str) -> str:
    """`text` on one line with no control bytes: each non-printable character as \\xNN / \\uNNNN."""
    out = []
    for c in str(text):
        if c.isprintable():
            out.append(c)
        elif ord(c) < 0x100:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
    return "".join(out)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return printable(next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__))


def _stamp(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ino)


def parquet_problem(path: Path) -> str | None:
    """Why a Parquet file cannot be trusted (read whole, page checksums verified where stored), or
    None; a file gone meanwhile (a running writer merged its parts) is no problem here."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        for i in range(pf.num_row_groups):
            pf.read_row_group(i)
    except FileNotFoundError:
        return None
    except (OSError, pa.ArrowException, ValueError) as err:
        msg = first_line(err)
        if "crc" in msg.lower() or "checksum" in msg.lower():
            return "is changed (a Parquet page fails its checksum)"
        return f"does not decode ({msg})"
    return None


def run_problem(run_dir: Path, files: list[TableFile], verified: set) -> str | None:
    """The first problem of one run's files a query reads (e.g. `tokens.parquet is changed`), or None."""
    todo = [f.path for f in files if _stamp(f.path) not in verified]
    if not todo:
        return None
    try:
        manifest = read_manifest(run_dir)
    except RunNotFoundError as err:
        return printable(str(err))
    hashed: list[Path] = []
    if manifest.get("status") == "complete" and manifest.get("checksums"):
        hashed = [p for p in todo if p.parent == run_dir]  # the tables checksums.json covers
    if hashed:
        problems, _, _ = verify(run_dir, manifest, prefix=tuple(p.name for p in hashed))
        if problems:
            return printable(str(problems[0]))
    for p in todo:
        if p in hashed:
            continue
        why = parquet_problem(p)
        if why is not None:
            return f"{printable(str(p.relative_to(run_dir)))} {why}"
    verified.update(s for s in map(_stamp, todo) if s is not None)
    return None


def damaged_runs(catalog: Catalog, views: list[str], verified: set) -> list[tuple[str, str]]:
    """(run id, why) of every readable run whose files of `views` fail their check, in run order."""
    by_run: dict[str, list[TableFile]] = {}
    for view in views:
        if view == "runs":
            continue
        for f in catalog.files(view):
            by_run.setdefault(f.run_id, []).append(f)
    rows = [r for r in catalog.runs if r["run_id"] in by_run]
    if not rows:
        return []
    with ThreadPoolExecutor(max_workers=min(len(rows), os.cpu_count() or 1, 16)) as pool:
        found = list(pool.map(lambda r: run_problem(Path(r["path"]), by_run[r["run_id"]], verified), rows))
    return [(r["run_id"], why) for r, why in zip(rows, found) if why is not None]


def failing_file(catalog: Catalog, views: list[str]) -> tuple[str, str] | None:
    """(run id, why) of the first file of `views` that DuckDB cannot read whole on its own (its own
    connection, nothing but this file), or None: the failure was the query's, not a file's."""
    con = duckdb.connect(":memory:")
    try:
        for view in views:
            if view == "runs":
                continue
            for f in catalog.files(view):
                try:
                    literal = "'" + str(f.path).replace("'", "''") + "'"
                    for _ in con.sql(f"SELECT * FROM read_parquet({literal})").to_arrow_reader(batch_size=65536):
                        pass
                except duckdb.Error as err:
                    if not f.path.exists():
                        continue  # merged meanwhile: the caller lists the files again
                    run_dir = next(Path(r["path"]) for r in catalog.runs if r["run_id"] == f.run_id)
                    rel = f.path.relative_to(run_dir) if f.path.is_relative_to(run_dir) else f.path.name
                    return f.run_id, f"{printable(str(rel))} does not decode ({first_line(err)})"
    finally:
        con.close()
    return None
