"""DuckDB views over a catalog of runs (`lmtrace query`; `lmtrace stats` over one run): one per table
(`table_catalog.VIEWS`), each with a `run_id` column.

A view is built only when the SQL names it (building one reads the Parquet footers of its files),
as a single `read_parquet` over the list of its committed files with `union_by_name`, so runs whose
columns differ (prompt metadata, a lens not computed yet, an older format) are read together and a
column a run lacks reads as NULL. The file -> run (and sweep) map is a small table joined on the
file name: DuckDB reads only the columns and row groups a query needs, and no row passes through
Python.
"""

from __future__ import annotations

import re

import duckdb
import pyarrow as pa

from . import layout
from .columns import RENAMED
from .table_catalog import VIEWS, Catalog

# A view with no file in any run still exists, empty, with the documented columns where the
# archive layout defines them (others have only their key columns)
EMPTY_COLUMNS = {"tokens": layout.token_schema, "sequences": layout.sequence_schema}

RUN_COLUMNS = pa.schema(
    [
        ("run_id", pa.string()),
        ("kind", pa.string()),
        ("status", pa.string()),
        ("model", pa.string()),
        ("parent", pa.string()),
        ("edits", pa.string()),
        ("n_prompts", pa.int64()),
        ("n_generated_tokens", pa.int64()),
        ("lens", pa.string()),
        ("shards_complete", pa.string()),
        ("seed", pa.int64()),
        ("created", pa.string()),
        ("completed", pa.string()),
        ("path", pa.string()),
    ]
)
# the runs view's column -> the run_summary field it shows
RUN_FIELDS = {"parent": "parent_id", "n_prompts": "prompts", "n_generated_tokens": "tokens"}


def named_views(sql: str) -> list[str]:
    """The views the SQL refers to (DuckDB's own parser; a word match where it cannot tell)."""
    try:
        names = {n.lower() for n in duckdb.get_table_names(sql)}
    except duckdb.Error:
        names = {w.lower() for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", sql)}
    return [v for v in VIEWS if v in names]


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def shards_complete(r: dict) -> str:
    """`done/total` shards: a sharded run's count, `1/1` for a complete run of one shard (`0/1` before)."""
    if r.get("shards_complete"):
        return r["shards_complete"]
    return "1/1" if r.get("status") == "complete" else "0/1"


def runs_table(catalog: Catalog) -> pa.Table:
    """The `runs` view's rows: one per readable run."""
    rows = []
    for r in catalog.runs:
        row = {c: r.get(RUN_FIELDS.get(c, c)) for c in RUN_COLUMNS.names}
        row["shards_complete"] = shards_complete(r)
        rows.append(
            {k: (str(v) if v is not None and RUN_COLUMNS.field(k).type == pa.string() else v) for k, v in row.items()}
        )
    return pa.Table.from_pylist(rows, schema=RUN_COLUMNS)


def _key_columns(view: str) -> list[str]:
    return ["run_id", "sweep_id"] if view == "sweeps" else ["run_id"]


def create_view(con: duckdb.DuckDBPyConnection, catalog: Catalog, view: str) -> None:
    """(Re)create `view` on `con` over the catalog's runs."""
    if view == "runs":
        con.register("_runs_rows", runs_table(catalog))
        con.execute("CREATE OR REPLACE VIEW runs AS SELECT * FROM _runs_rows")
        return
    if view == "features":
        from .feature_rows import features_table

        con.register("_features_rows", features_table(catalog))
        con.execute("CREATE OR REPLACE VIEW features AS SELECT * FROM _features_rows")
        return
    keys = _key_columns(view)
    files = catalog.files(view)
    if view == "heads_by" and files:
        create_heads_by(con, files)
        return
    if not files:
        schema = EMPTY_COLUMNS[view]() if view in EMPTY_COLUMNS else pa.schema([])
        if view == "heads_by":
            keys = [*keys, GROUP_COLUMN, GROUP_VALUE]
        empty = pa.schema([(k, pa.string()) for k in keys] + list(schema)).empty_table()
        con.register(f"_{view}_empty", empty)
        con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM _{view}_empty")
        return
    owners = pa.table(
        {
            "filename": [str(f.path) for f in files],
            "run_id": [f.run_id for f in files],
            "sweep_id": [f.sweep_id for f in files],
        }
    )
    con.register(f"_{view}_files", owners.select(["filename", *keys]))
    listed = "[" + ", ".join(_quote(str(f.path)) for f in files) + "]"
    # binding a view reads every file's footer: the renamed-columns step (one more binding) only
    # where older archives named a column otherwise
    read = view if view not in RENAMED else f"_{view}_read"
    con.execute(
        f"CREATE OR REPLACE VIEW {read} AS SELECT {', '.join('f.' + k for k in keys)}, t.* EXCLUDE (filename) "
        f"FROM read_parquet({listed}, union_by_name = true, filename = true) t "
        f"JOIN _{view}_files f ON t.filename = f.filename"
    )
    if read != view:
        columns = [row[0] for row in con.execute(f"DESCRIBE {read}").fetchall()]
        con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT {', '.join(current_columns(columns, view))} FROM {read}")


# heads_by_<COLUMN>.parquet names its group with these two columns; files written before name the
# group's column itself (its first column, the value as text)
GROUP_COLUMN, GROUP_VALUE = "group_column", "group_value"


def create_heads_by(con: duckdb.DuckDBPyConnection, files: list) -> None:
    """The `heads_by` view: run_id, group_column (the sequences.parquet column grouped by), group_value
    (its value as text, null for sequences without one), then the file's other columns
    (n_sequences, the head's scores). Files of both layouts are read together by name."""
    import pyarrow.parquet as pq

    layouts: dict[str | None, list] = {}  # None: group_column/group_value; else the group's own column
    for f in files:
        names = pq.read_schema(f.path).names
        key = None if GROUP_COLUMN in names and GROUP_VALUE in names else names[0]
        layouts.setdefault(key, []).append(f)
    owners = pa.table({"filename": [str(f.path) for f in files], "run_id": [f.run_id for f in files]})
    con.register("_heads_by_files", owners)
    selects = []
    for column, group in layouts.items():
        listed = "[" + ", ".join(_quote(str(f.path)) for f in group) + "]"
        if column is None:
            head = f"t.{GROUP_COLUMN}, CAST(t.{GROUP_VALUE} AS VARCHAR) AS {GROUP_VALUE}"
            drop = f"filename, {GROUP_COLUMN}, {GROUP_VALUE}"
        else:
            head = f"{_quote(column)} AS {GROUP_COLUMN}, CAST(t.{ident(column)} AS VARCHAR) AS {GROUP_VALUE}"
            drop = f"filename, {ident(column)}"
        selects.append(
            f"SELECT f.run_id, {head}, t.* EXCLUDE ({drop}) "
            f"FROM read_parquet({listed}, union_by_name = true, filename = true) t "
            f"JOIN _heads_by_files f ON t.filename = f.filename"
        )
    con.execute("CREATE OR REPLACE VIEW heads_by AS " + " UNION ALL BY NAME ".join(selects))


def ident(name: str) -> str:
    """A name as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def current_columns(columns: list[str], view: str) -> list[str]:
    """SELECT expressions that show a view's old column names under today's (archive/columns.py): an
    older archive's `rank` of tokens as `token_rank`, merged with newer files' `token_rank` when runs
    of both are read."""
    renamed = RENAMED.get(view, {})
    out = []
    for name in columns:
        if name in renamed:  # an old name: shown under today's, or merged into it when both are there
            if renamed[name] not in columns:
                out.append(f"{ident(name)} AS {ident(renamed[name])}")
            continue
        olds = [ident(old) for old, new in renamed.items() if new == name and old in columns]
        out.append(f"coalesce({ident(name)}, {', '.join(olds)}) AS {ident(name)}" if olds else ident(name))
    return out


def connect(catalog: Catalog, views: list[str]) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with `views` created over the catalog."""
    con = duckdb.connect(":memory:")
    for view in views:
        create_view(con, catalog, view)
    return con
