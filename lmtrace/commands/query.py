"""`lmtrace query "SQL"`: run SQL over views of every run's tables (lmtrace/query) and print or
write the result. Read-only over the archives (query/guard.py); damaged runs are left out, each
named in one warning line (query/check.py)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import duckdb

from ..archive.reader import RELIST_TRIES
from ..archive.runs import runs_root
from ..archive.sql_views import connect, named_views
from ..archive.table_catalog import VIEWS, Catalog, read_catalog
from ..exits.errors import ArchiveDamaged, SpecError
from ..query.check import damaged_runs, failing_file, first_line, printable
from ..query.guard import check_out, check_read_only, lock
from ..query.output import FORMATS, write_result

SUFFIX_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def output_format(fmt: str | None, out: Path | None) -> str:
    """The format asked for, else the --out file's suffix, else a table; checked against what fits."""
    if fmt is None:
        if out is None:
            return "table"
        fmt = SUFFIX_FORMATS.get(out.suffix.lower())
        if fmt is None:
            raise SpecError(
                f"--out {out}: give --format ({', '.join(FORMATS[1:])}), or a file ending in "
                f"{', '.join(SUFFIX_FORMATS)}"
            )
    if fmt not in FORMATS:
        raise SpecError(f"--format {fmt!r}: unknown; formats: {', '.join(FORMATS)}")
    if fmt == "parquet" and out is None:
        raise SpecError("--format parquet needs --out FILE")
    if fmt == "table" and out is not None:
        raise SpecError("--format table prints to the terminal; write a file with --format csv, json or parquet")
    return fmt


def sql_error(err: duckdb.Error) -> SpecError:
    """DuckDB's message in one line (its first; a missing table also lists the views)."""
    first = first_line(err)
    if isinstance(err, duckdb.CatalogException) and "Table" in first:
        first += f" (views: {', '.join(VIEWS)})"
    if isinstance(err, duckdb.PermissionException):
        first += (
            " (lmtrace query reads the views' files and the files its SQL names as strings outside the runs "
            "directory, and writes nothing: write a result with --out FILE)"
        )
    return SpecError(first)


# DuckDB's errors that may come from a file that does not decode (a plain duckdb.Error: e.g. a
# Thrift "Invalid data" in a Parquet footer); the others are the query's own
READ_ERRORS = (duckdb.IOException, duckdb.InvalidInputException)


def warn_line(text: str) -> None:
    print(f"warning: {printable(text)}", file=sys.stderr)


def skip(catalog: Catalog, run_id: str, why: str) -> None:
    """Leave a damaged run out of the query, in one warning line."""
    catalog.skip(run_id, why)
    warn_line(f"run {run_id} is damaged ({why}); skipped (`lmtrace verify {run_id}`)")


def refuse_named_damaged(sql: str, catalog: Catalog) -> None:
    """A run the SQL names by its id and that was left out as damaged: the answer (printed) lacks what
    was asked for, so the command fails (exit 2) after it, naming the run; a damaged run the SQL does not
    name leaves the other runs' answer standing (exit 0, its warning line)."""
    named = [run_id for run_id, _ in catalog.skipped if run_id in sql]
    if named:
        runs = ", ".join(named)
        raise ArchiveDamaged(
            f"the query names run {runs}, which is damaged and left out of the answer "
            f"(`lmtrace verify {named[0]}` says which file)"
        )


def query_command(sql: str, *, runs_dir: str | None = None, fmt: str | None = None, out: Path | None = None) -> None:
    """`lmtrace query`: check the flags and that the SQL only reads, read the catalog, check the bytes
    of the files the SQL's views read (damaged runs are left out, each in a warning line), build
    the views on a DuckDB connection locked to reading them, run the SQL and print or write its
    result. A run whose file still fails to read is found, left out, and the query run again."""
    if not sql.strip():
        raise SpecError(f'no SQL given: e.g. lmtrace query "SELECT * FROM runs" (views: {", ".join(VIEWS)})')
    fmt = output_format(fmt, out)
    check_read_only(sql)
    root = runs_root(runs_dir)
    check_out(out, root)
    views = named_views(sql)
    catalog = read_catalog(root) if views else Catalog(root)  # SQL over no view reads no run
    for run_id, why in catalog.skipped:
        warn_line(f"run {run_id} is damaged ({why}); skipped (`lmtrace verify {run_id}`)")
    verified: set = set()
    relists = 0
    with tempfile.TemporaryDirectory(prefix="lmtrace-query-") as temp_dir:
        while True:
            for run_id, why in damaged_runs(catalog, views, verified):
                skip(catalog, run_id, why)
            con = None
            try:
                con = connect(catalog, views)
                lock(con, [str(p) for p in catalog.listed], sql, root, temp_dir)
                rel = con.sql(sql)
                if rel is not None:
                    try:
                        write_result(rel, fmt, out)
                    except OSError as err:
                        if out is None:
                            raise
                        raise SpecError(f"cannot write --out {out} ({err.strerror or err})") from None
                refuse_named_damaged(sql, catalog)
                return
            except duckdb.Error as err:  # a bad query, or a file that fails to read (checked by reading it)
                if relists < RELIST_TRIES and catalog.vanished():  # a running writer merged the parts it read
                    relists += 1
                    continue
                found = (
                    failing_file(catalog, views) if type(err) is duckdb.Error or isinstance(err, READ_ERRORS) else None
                )
                if found is None:
                    raise sql_error(err) from None
                skip(catalog, *found)
            finally:
                if con is not None:
                    con.close()
