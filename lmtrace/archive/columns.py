"""Column names of the analysis tables (sweeps, heads) across archive versions.

The query-head column is `q_head`, as the Zarr dimension is: a column named `head` collides with
pandas' `DataFrame.head()` (`df.head == 0` compares a method) and xarray's `Dataset.head()`.
Archives written before the rename call it `head`; every reader maps the old name when it reads.
"""

from __future__ import annotations

import pyarrow as pa

# old column name -> today's
RENAMED = {"head": "q_head"}


def current_names(table: pa.Table) -> pa.Table:
    """`table` with its old column names mapped to today's (a table without them is returned as is)."""
    if not any(name in RENAMED and RENAMED[name] not in table.column_names for name in table.column_names):
        return table
    return table.rename_columns([RENAMED.get(n, n) if RENAMED.get(n) not in table.column_names else n
                                 for n in table.column_names])


def stored_name(schema_names: list[str], name: str) -> str:
    """The column a file stores today's `name` under: `name`, or its old name in an older file."""
    if name in schema_names:
        return name
    return next((old for old, new in RENAMED.items() if new == name and old in schema_names), name)
