"""Sequences grouped by a column of sequences.parquet (`--by COLUMN` of heads, sweep and stats):
prompt metadata (a prompt file's extra fields) or any other column, such as `stop_reason`.

One naming scheme for every grouped output, whatever the column is called, so a column named like
an output column (`label`, `layer`, `q_head`, ...) never collides with it: the group's value is
always `group_value` (in heads_by_<COLUMN>.parquet with the column's own type from
sequences.parquet; in `--json` as that JSON value: a bool is `true`, a number a number, null for
sequences without a value), and the column's name `group_column` (a column of the file; `--json`
says it once). The terminal writes a value with `group_text`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa

from ..exits.errors import SpecError

GROUP_VALUE = "group_value"  # the group's value, in the column's own type
GROUP_COLUMN = "group_column"  # the name of the sequences.parquet column grouped by
_NAN = float("nan")


@dataclass(frozen=True)
class SequenceGroups:
    """The groups of a run's sequences: `column` of sequences.parquet, of Arrow type `type`;
    `of`: sequence -> its value (None where null)."""

    column: str
    type: pa.DataType
    of: dict[int, object]


def sequence_groups(run, column: str) -> SequenceGroups:
    """The groups of `run` (a reader.Run) by `column`. An unknown column is one line naming the ones
    there are."""
    table = run.sequences()
    if column not in table.column_names or column == "sequence":
        available = [c for c in table.column_names if c != "sequence"]
        raise SpecError(
            f"--by {column!r}: sequences.parquet of run {run.id} has no such column; columns: {', '.join(available)}"
        )
    values = table.column(column)
    if pa.types.is_dictionary(values.type):
        values = values.cast(values.type.value_type)
    # every NaN one object, so that they form one group (as in SQL) where groups are looked up by value
    of = {
        s: _NAN if isinstance(v, float) and math.isnan(v) else v
        for s, v in zip(table.column("sequence").to_pylist(), values.to_pylist())
    }
    return SequenceGroups(column, values.type, of)


def plain_value(value):
    """A group value as a plain Python value (numpy scalars, as pandas hands group keys, unwrapped)."""
    return value.item() if hasattr(value, "item") and not isinstance(value, (str, bytes)) else value


def group_order(value) -> tuple:
    """Sort key of group values: the column's own order (false before true, numbers by value, text
    by code point), then NaN, null last (DuckDB's ORDER BY ... NULLS LAST)."""
    value = plain_value(value)
    if value is None:
        return (2, 0)
    if isinstance(value, float) and math.isnan(value):
        return (1, 0)
    return (0, value)


def group_text(value) -> str:
    """A group value as the terminal shows it, on one line: null as `-`, a bool as true / false (as in
    `--json`), line breaks and tabs as \\n and \\t."""
    value = plain_value(value)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value).replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")


def group_header(column: str, headers: list[str]) -> str:
    """The header of the group column of a terminal table whose other headers are `headers`: the
    column's name, or `COLUMN (group)` where a header of the table has that name."""
    return f"{column} (group)" if column in headers else column
