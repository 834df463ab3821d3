"""Column names of lmtrace's tables across archive versions.

No column is named after an attribute of pandas' DataFrame or xarray's Dataset: `df.head == 0` or
`df.rank == 0` compares a method, silently. So the query-head column is `q_head`, as the Zarr
dimension is (not `head`), a token's rank under the model is `token_rank` in tokens.parquet and a
head's place in the ranking of `lmtrace heads` is `head_rank` in heads.parquet (not `rank`).
A sweep's metric `rank` keeps its name: it is a value of the `metric` column (and the array
`effect_rank`), never a column.

Archives written before these renames use the old names; every reader maps them per table when
it reads (`current_names`, `stored_name`, and the query views through `RENAMED`). The tables of
`lmtrace compare --out` (per_head's `q_head`, once `head`) are for the user: lmtrace never reads
them back.
"""

from __future__ import annotations

import pyarrow as pa

# table (as the query view is named) -> {old column name: today's}. sweeps: sweep.parquet,
# sweep_mean.parquet and an unfinished sweep's blocks
RENAMED: dict[str, dict[str, str]] = {
    "tokens": {"rank": "token_rank"},
    "heads": {"head": "q_head", "rank": "head_rank"},
    "heads_per_sequence": {"head": "q_head"},
    "sweeps": {"head": "q_head"},
}


def current_names(table: pa.Table, name: str) -> pa.Table:
    """Table `name` with its old column names mapped to today's (a table without them is returned
    as is; an old name is kept where today's is there too)."""
    renamed = RENAMED.get(name, {})
    names = table.column_names
    new = [renamed[n] if n in renamed and renamed[n] not in names else n for n in names]
    return table if new == names else table.rename_columns(new)


def stored_name(schema_names: list[str], column: str, name: str) -> str:
    """The column a file of table `name` stores today's `column` under: `column`, or its old name
    in an older file."""
    if column in schema_names:
        return column
    renamed = RENAMED.get(name, {})
    return next((old for old, new in renamed.items() if new == column and old in schema_names), column)


def stored_names(schema_names: list[str], columns: list[str], name: str) -> list[str]:
    """`stored_name` of each of `columns`."""
    return [stored_name(schema_names, c, name) for c in columns]
