"""A query's result in the formats `lmtrace query` writes: a terminal table, CSV, JSON lines, Parquet.

Rows stream from DuckDB in Arrow record batches (CSV and Parquet are written by DuckDB itself), so
a large result never becomes Python objects except for JSON, and the table reads only the rows it
shows.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import duckdb
import pyarrow as pa

from ..column_fit import fitting_columns
from ..jsonout import json_line
from .views import ident

FORMATS = ("table", "csv", "json", "parquet")
TABLE_ROWS = 100  # rows a terminal table shows; the others are counted and named


def first_rows(rel: duckdb.DuckDBPyRelation, n: int) -> tuple[pa.Table, bool]:
    """Up to `n` rows of the result, and whether there are more."""
    reader = rel.to_arrow_reader(batch_size=max(n + 1, 1024))
    batches, rows = [], 0
    for batch in reader:
        batches.append(batch)
        rows += batch.num_rows
        if rows > n:
            break
    table = pa.Table.from_batches(batches, schema=reader.schema)
    return table.slice(0, n), rows > n


def cell_text(value) -> str:
    """One cell as the terminal shows it, on one line: floats to 4 significant digits, null as `-`,
    line breaks and tabs as \\n and \\t."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(cell_text(v) for v in value) + "]"
    return str(value).replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")


CELL_MAX = 30  # characters a cell shows before it is cut with …


def shown_columns(names: list[str], cells: list[list[str]], width: int) -> list[int]:
    """The columns (indices, in order) that fit `width` side by side at their widths (header or
    longest cell, at most CELL_MAX), two spaces apart: left out from the right, then a narrower
    one further right takes the room left; the first always stays."""
    widths = [min(max([len(name), *(len(c[i]) for c in cells)]), CELL_MAX) for i, name in enumerate(names)]
    return fitting_columns(widths, width, list(reversed(range(len(names)))), gap=2, keep=1, refill=True)


def print_table(rel: duckdb.DuckDBPyRelation, console=None) -> int:
    """A rich table of the first TABLE_ROWS rows that fits the terminal (80 columns when piped):
    each cell one line, cut with … past CELL_MAX characters; columns that do not fit are left out
    and named in a last line. Returns the rows shown."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    table, more = first_rows(rel, TABLE_ROWS)
    names = table.schema.names
    cells = [[cell_text(v) for v in row] for row in zip(*(c.to_pylist() for c in table.columns))]
    kept = shown_columns(names, cells, console.width)
    t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold", collapse_padding=True)
    for i in kept:
        kind = table.schema.field(i).type
        right = pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)
        t.add_column(escape(names[i]), justify="right" if right else "left", no_wrap=True, overflow="ellipsis",
                     max_width=CELL_MAX)
    for row in cells:
        t.add_row(*(escape(row[i]) for i in kept))
    console.print(t)
    left_out = [n for i, n in enumerate(names) if i not in kept]
    if left_out:
        console.print(escape(f"(columns left out to fit {console.width} characters: {', '.join(left_out)}; "
                             f"select fewer columns, or --format csv/json)"))
    if more:
        console.print(f"(the first {TABLE_ROWS} rows; add a LIMIT, or --format csv/json/parquet for all of them)")
    elif table.num_rows == 0:
        console.print("(no rows)")
    return table.num_rows


def write_json_lines(rel: duckdb.DuckDBPyRelation, fh) -> int:
    """One strict JSON object per row (NaN as null), streamed batch by batch."""
    n = 0
    for batch in rel.to_arrow_reader(batch_size=8192):
        for row in batch.to_pylist():
            fh.write(json_line(row) + "\n")
            n += 1
    return n


def flat_columns(rel: duckdb.DuckDBPyRelation) -> duckdb.DuckDBPyRelation:
    """The relation with list, struct and map columns as text (`[1, 2]`, as DuckDB's CSV writes
    them), which a CSV writer can take."""
    nested = ("[]", "STRUCT", "MAP", "UNION")
    exprs = []
    for name, kind in zip(rel.columns, rel.types):
        quoted = ident(name)
        exprs.append(f"CAST({quoted} AS VARCHAR) AS {quoted}" if any(n in str(kind) for n in nested) else quoted)
    return rel.project(", ".join(exprs))


def write_csv_stream(rel: duckdb.DuckDBPyRelation, fh) -> None:
    """CSV with a header line, streamed batch by batch to a text stream (stdout)."""
    import pyarrow.csv as pacsv

    reader = flat_columns(rel).to_arrow_reader(batch_size=65536)
    fh.flush()
    sink = fh.buffer if hasattr(fh, "buffer") else fh
    options = pacsv.WriteOptions(quoting_style="needed")
    with pacsv.CSVWriter(sink, reader.schema, write_options=options) as writer:
        for batch in reader:
            writer.write_batch(batch)
    sink.flush()


def write_result(rel: duckdb.DuckDBPyRelation, fmt: str, out: Path | None) -> None:
    """The whole result in `fmt`, to `out` or (csv, json) to stdout."""
    if fmt == "table":
        print_table(rel)
    elif fmt == "parquet":
        rel.write_parquet(str(out))
    elif fmt == "csv" and out is not None:
        rel.write_csv(str(out), header=True)
    elif fmt == "csv":
        write_csv_stream(rel, sys.stdout)
    elif out is not None:
        with open(out, "w") as fh:
            write_json_lines(rel, fh)
    else:
        write_json_lines(rel, sys.stdout)
