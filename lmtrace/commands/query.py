"""`lmtrace query "SQL"`: run SQL over views of every run's tables (lmtrace/query) and print or
write the result. Damaged runs are left out, each named in one warning line."""

from __future__ import annotations

import sys
from pathlib import Path

import duckdb

from ..archive.reader import RELIST_TRIES
from ..archive.runs import runs_root
from ..errors import SpecError
from ..query.catalog import VIEWS, Catalog, first_unreadable, read_catalog
from ..query.output import FORMATS, write_result
from ..query.views import connect, named_views

SUFFIX_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def output_format(fmt: str | None, out: Path | None) -> str:
    """The format asked for, else the --out file's suffix, else a table; checked against what fits."""
    if fmt is None:
        if out is None:
            return "table"
        fmt = SUFFIX_FORMATS.get(out.suffix.lower())
        if fmt is None:
            raise SpecError(f"--out {out}: give --format ({', '.join(FORMATS[1:])}), or a file ending in "
                            f"{', '.join(SUFFIX_FORMATS)}")
    if fmt not in FORMATS:
        raise SpecError(f"--format {fmt!r}: unknown; formats: {', '.join(FORMATS)}")
    if fmt == "parquet" and out is None:
        raise SpecError("--format parquet needs --out FILE")
    if fmt == "table" and out is not None:
        raise SpecError("--format table prints to the terminal; write a file with --format csv, json or parquet")
    return fmt


def sql_error(err: duckdb.Error) -> SpecError:
    """DuckDB's message in one line (its first; a missing table also lists the views)."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    if isinstance(err, duckdb.CatalogException) and "Table" in first:
        first += f" (views: {', '.join(VIEWS)})"
    return SpecError(first)


# DuckDB's errors that may come from a file that does not decode (a plain duckdb.Error: e.g. a
# Thrift "Invalid data" in a Parquet footer); the others are the query's own
READ_ERRORS = (duckdb.IOException, duckdb.InvalidInputException)


def damaged_run(catalog: Catalog, err: duckdb.Error, views: list[str]) -> tuple[str, str] | None:
    """(run id, why) of the readable run whose file failed to read: the file the error names, else
    (a read error naming none) the first file of the views that does not decode."""
    message = str(err)
    first = (message.splitlines() or [type(err).__name__])[0]
    for row in catalog.runs:
        if row["path"].rstrip("/") + "/" in message:
            return row["run_id"], first
    if type(err) is duckdb.Error or isinstance(err, READ_ERRORS):
        return first_unreadable(catalog, views)
    return None


def skip_damaged(catalog: Catalog, err: duckdb.Error, views: list[str], warn) -> None:
    """Leave out the run whose file failed to read, warning; any other error is the SQL's."""
    found = damaged_run(catalog, err, views)
    if found is None:
        raise sql_error(err) from None
    run_id, why = found
    catalog.skip(run_id, why)
    warn(f"run {run_id} is damaged ({why}); skipped (`lmtrace verify {run_id}`)")


def warn_line(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def query_command(sql: str, *, runs_dir: str | None = None, fmt: str | None = None, out: Path | None = None) -> None:
    """`lmtrace query`: check the flags, read the catalog, build the views the SQL names, run it and
    print or write its result. A run whose file fails to read is left out and the query run again."""
    if not sql.strip():
        raise SpecError(f"no SQL given: e.g. lmtrace query \"SELECT * FROM runs\" (views: {', '.join(VIEWS)})")
    fmt = output_format(fmt, out)
    views = named_views(sql)
    root = runs_root(runs_dir)
    catalog = read_catalog(root) if views else Catalog(root)  # SQL over no view reads no run
    for run_id, why in catalog.skipped:
        warn_line(f"run {run_id} is damaged ({why}); skipped (`lmtrace verify {run_id}`)")
    relists = 0
    while True:
        con = None
        try:
            con = connect(catalog, views)
            rel = con.sql(sql)
            if rel is not None:  # None: a statement without a result (SET, ...)
                write_result(rel, fmt, out)
            return
        except duckdb.Error as err:  # a bad query, or a file that fails to read (checked by reading it)
            if relists < RELIST_TRIES and catalog.vanished():  # a running writer merged the parts it read
                relists += 1
                continue
            skip_damaged(catalog, err, views, warn_line)
        finally:
            if con is not None:
                con.close()
