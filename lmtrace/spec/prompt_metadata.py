"""A prompt file's other columns, typed, for `sequences.parquet` (one row per prompt).

Every column but the prompt column is kept, with one type per column:

  .parquet  the file's own Arrow types; nested ones (struct, list, map) as JSON text
  .jsonl    from the JSON values: ints -> int64, ints and floats -> float64, bools -> bool,
            strings -> string, objects / lists -> their JSON text; other mixes are refused
  .csv      from the text: every value an integer -> int64, else a number -> float64, else
            true/false (any case) -> bool, else string; an empty cell is null

A value missing from a row (a key a JSON object lacks, a plain-string line, an empty cell) is
null; a column with no value at all is a string column of nulls. A name that is one of
lmtrace's own sequences.parquet columns (RESERVED) is stored as `meta_<name>`.
"""

from __future__ import annotations

import json
import re

import pyarrow as pa

from ..exits.errors import SpecError

# sequences.parquet's own columns, and the columns `serve` joins onto it
RESERVED = (
    "sequence",
    "batch",
    "prompt",
    "prompt_rendered",
    "prompt_len",
    "generated_len",
    "stop_reason",
    "generated_text",
    "min_prob",
    "max_entropy",
)
PREFIX = "meta_"

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(nan|inf|infinity)", re.IGNORECASE)
_INT64 = (-(2**63), 2**63 - 1)


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    return "json"  # an object or a list


def _json_column(name: str, values: list, lines: list[int], where: str) -> pa.Array:
    kinds: dict[str, int] = {}  # kind -> the first line holding it
    for value, line in zip(values, lines):
        if value is not None:
            kinds.setdefault(_json_kind(value), line)
    if "json" in kinds:  # nested values anywhere: the whole column is JSON text
        return pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pa.string())
    if kinds.keys() == {"int", "float"}:
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    if len(kinds) > 1:
        (first, at), (second, line) = sorted(kinds.items(), key=lambda kv: kv[1])[:2]
        raise SpecError(
            f"{where}:{line}: column {name!r} holds a {second} here but a {first} on line {at}; "
            f"give each column of the prompt file one type"
        )
    kind = next(iter(kinds), "string")
    if kind == "int" and any(v is not None and not _INT64[0] <= v <= _INT64[1] for v in values):
        raise SpecError(f"{where}: column {name!r} holds an integer outside 64 bits; store it as a string")
    return pa.array(values, {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "string": pa.string()}[kind])


def _csv_column(values: list[str]) -> pa.Array:
    cells = [v.strip() if v is not None else "" for v in values]
    present = [c for c in cells if c]
    if present and all(_INT.fullmatch(c) and _INT64[0] <= int(c) <= _INT64[1] for c in present):
        return pa.array([int(c) if c else None for c in cells], pa.int64())
    if present and all(_FLOAT.fullmatch(c) for c in present):
        return pa.array([float(c) if c else None for c in cells], pa.float64())
    if present and all(c.lower() in ("true", "false") for c in present):
        return pa.array([c.lower() == "true" if c else None for c in cells], pa.bool_())
    return pa.array([v if v else None for v in values], pa.string())


def _plain(column: pa.ChunkedArray) -> pa.ChunkedArray | pa.Array:
    """A Parquet column as stored: dictionaries decoded, nested values as JSON text."""
    t = column.type
    if pa.types.is_dictionary(t):
        column = column.cast(t.value_type)
        t = t.value_type
    if pa.types.is_nested(t):
        return pa.array(
            [None if v is None else json.dumps(v, ensure_ascii=False, default=str) for v in column.to_pylist()],
            pa.string(),
        )
    return column


def _named(columns: dict[str, object], where: str) -> pa.Table | None:
    """The metadata table, reserved names prefixed; None without any column."""
    if not columns:
        return None
    out = {}
    for name, values in columns.items():
        stored = PREFIX + name if name in RESERVED else name
        if stored in columns and stored != name:
            raise SpecError(
                f"{where}: column {name!r} would be stored as {stored!r}, which the file also has; rename one of them"
            )
        out[stored] = values
    return pa.table(out)


def from_json_rows(rows: list[dict | None], lines: list[int], prompt_column: str | None, where: str) -> pa.Table | None:
    """The other keys of .jsonl objects (None: a plain-string line), in order of first appearance."""
    names: dict[str, None] = {}
    for row in rows:
        for key in row or ():
            if key != prompt_column:
                names.setdefault(key, None)
    return _named(
        {name: _json_column(name, [(row or {}).get(name) for row in rows], lines, where) for name in names}, where
    )


def from_csv_rows(fieldnames: list[str], rows: list[dict], prompt_column: str, where: str) -> pa.Table | None:
    if len(set(fieldnames)) != len(fieldnames):
        dup = next(n for n in fieldnames if fieldnames.count(n) > 1)
        raise SpecError(f"{where}: the header names column {dup!r} twice; give each column its own name")
    columns = {}
    for i, name in enumerate(fieldnames, 1):
        if name == prompt_column:
            continue
        columns[name or f"column_{i}"] = _csv_column([row.get(name) for row in rows])
    return _named(columns, where)


def from_arrow(table: pa.Table, prompt_column: str, where: str) -> pa.Table | None:
    return _named({name: _plain(table.column(name)) for name in table.column_names if name != prompt_column}, where)


def schema_of(metadata: pa.Table | None) -> dict[str, str]:
    """{column: type} as the manifest records it (a resumed or joining shard must read the same)."""
    return {} if metadata is None else {f.name: str(f.type) for f in metadata.schema}
