"""A query's result in the formats `lmtrace query` writes: a terminal table, CSV, JSON lines, Parquet.

Rows stream from DuckDB in Arrow record batches, written by lmtrace (CSV column-wise by Arrow,
Parquet by pyarrow), so a large result never becomes Python objects except for JSON, and the table
reads only the rows it shows.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import duckdb
import pyarrow as pa

from ..archive.sql_views import ident
from ..output.column_fit import fitting_columns
from ..output.jsonout import json_line

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
        t.add_column(
            escape(names[i]),
            justify="right" if right else "left",
            no_wrap=True,
            overflow="ellipsis",
            max_width=CELL_MAX,
        )
    for row in cells:
        t.add_row(*(escape(row[i]) for i in kept))
    console.print(t)
    left_out = [n for i, n in enumerate(names) if i not in kept]
    if left_out:
        console.print(
            escape(
                f"(columns left out to fit {console.width} characters: {', '.join(left_out)}; "
                f"select fewer columns, or --format csv/json)"
            )
        )
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


# types Arrow writes as text exactly as DuckDB does (left to Arrow: faster than DuckDB's cast)
ARROW_TEXT = {
    "VARCHAR",
    "BOOLEAN",
    "TINYINT",
    "SMALLINT",
    "INTEGER",
    "BIGINT",
    "UTINYINT",
    "USMALLINT",
    "UINTEGER",
    "UBIGINT",
}


def text_columns(rel: duckdb.DuckDBPyRelation) -> duckdb.DuckDBPyRelation:
    """The relation with every column as DuckDB's text of it (as its CSV writer spells values:
    `1.5`, `true`, `[1, 2]`, `2026-01-01 00:00:00`), null kept null; text, integers and booleans
    as they are (Arrow's text of them is DuckDB's)."""
    return rel.project(
        ", ".join(
            ident(name) if str(kind).upper() in ARROW_TEXT else f"CAST({ident(name)} AS VARCHAR) AS {ident(name)}"
            for name, kind in zip(rel.columns, rel.types)
        )
    )


# DuckDB types whose text never holds a comma, a quote or a line break (nor is empty): never quoted
PLAIN_TYPES = (
    "BOOLEAN",
    "TINYINT",
    "SMALLINT",
    "INTEGER",
    "BIGINT",
    "HUGEINT",
    "UTINYINT",
    "USMALLINT",
    "UINTEGER",
    "UBIGINT",
    "UHUGEINT",
    "FLOAT",
    "DOUBLE",
    "DECIMAL",
    "DATE",
    "TIME",
    "TIMESTAMP",
    "INTERVAL",
    "UUID",
)


def plain_type(kind) -> bool:
    text = str(kind).upper()
    return any(
        text == t or text.startswith(t + "(") or text.startswith(t + " ") or text.startswith(t + "_")
        for t in PLAIN_TYPES
    )


def csv_field(text: str | None) -> str:
    """One CSV field: quoted (quotes doubled) only when it holds a comma, a quote or a line break,
    or is empty text (null is an empty field), as DuckDB writes CSV."""
    if text is None:
        return ""
    if text == "" or any(c in text for c in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


def _may_need_quotes(column: pa.Array) -> bool:
    """Whether any value of a string array may need quotes: a comma, quote or line break among its
    bytes, or an empty value (or a null), found on the raw buffers."""
    import numpy as np

    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32)[column.offset : column.offset + len(column) + 1]
    if len(column) and (np.diff(offsets) == 0).any():
        return True
    if data_buf is None:
        return False
    data = np.frombuffer(data_buf, dtype=np.uint8)[offsets[0] : offsets[-1]]
    return bool(((data == ord(",")) | (data == ord('"')) | (data == ord("\n")) | (data == ord("\r"))).any())


def _quoted_where_needed(column: pa.Array) -> pa.Array:
    import pyarrow.compute as pc

    if not _may_need_quotes(column):
        return column
    need = pc.equal(pc.utf8_length(column), 0)
    for c in (",", '"', "\n", "\r"):
        need = pc.or_(need, pc.match_substring(column, c))
    if not pc.any(need).as_py():
        return column
    quoted = pc.binary_join_element_wise('"', pc.replace_substring(column, '"', '""'), '"', "")
    return pc.if_else(need, quoted, column)


def csv_lines(batch: pa.RecordBatch, plain: list[bool]) -> pa.Buffer:
    """A batch of text columns as CSV lines (`csv_field` on every cell, computed column-wise by
    Arrow; `plain`: the columns whose text never needs quotes)."""
    import numpy as np
    import pyarrow.compute as pc

    cells = []
    for column, is_plain in zip(batch.columns, plain):
        column = column.cast(pa.string())
        cells.append(pc.fill_null(column if is_plain else _quoted_where_needed(column), ""))
    lines = pc.binary_join_element_wise(*cells, ",") if len(cells) > 1 else cells[0]
    lines = pc.binary_join_element_wise(lines, "\n", "")  # each row ends with a line break
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int32)[lines.offset : lines.offset + len(lines) + 1]
    return lines.buffers()[2][int(offsets[0]) : int(offsets[-1])]


class TextSink:
    """A text stream (with no binary buffer under it) taking the UTF-8 bytes `write_csv` writes."""

    def __init__(self, fh):
        self.fh = fh

    def write(self, data) -> None:
        self.fh.write(bytes(data).decode())

    def flush(self) -> None:
        self.fh.flush()


def write_csv(rel: duckdb.DuckDBPyRelation, sink) -> None:
    """CSV with a header line, streamed batch by batch to a binary stream (`csv_lines`)."""
    plain = [plain_type(kind) for kind in rel.types]
    reader = text_columns(rel).to_arrow_reader(batch_size=65536)
    sink.write((",".join(csv_field(n) for n in reader.schema.names) + "\n").encode())
    for batch in reader:
        if batch.num_rows:
            sink.write(csv_lines(batch, plain))
    sink.flush()


def write_parquet(rel: duckdb.DuckDBPyRelation, out: Path) -> None:
    """The result as a Parquet file, streamed batch by batch."""
    import pyarrow.parquet as pq

    reader = rel.to_arrow_reader(batch_size=65536)
    with pq.ParquetWriter(out, reader.schema) as writer:
        for batch in reader:
            writer.write_batch(batch)


def write_result(rel: duckdb.DuckDBPyRelation, fmt: str, out: Path | None) -> None:
    """The whole result in `fmt`, to `out` or (csv, json) to stdout. lmtrace writes the file, not
    DuckDB (whose connection may open no file for writing: query/guard.py)."""
    if fmt == "table":
        print_table(rel)
    elif fmt == "parquet":
        write_parquet(rel, out)
    elif fmt == "csv" and out is not None:
        with open(out, "wb") as fh:
            write_csv(rel, fh)
    elif fmt == "csv":
        sys.stdout.flush()
        write_csv(rel, sys.stdout.buffer if hasattr(sys.stdout, "buffer") else TextSink(sys.stdout))
    elif out is not None:
        with open(out, "w") as fh:
            write_json_lines(rel, fh)
    else:
        write_json_lines(rel, sys.stdout)
