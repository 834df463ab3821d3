"""DuckDB views over a catalog of runs: one per table (`catalog.VIEWS`), each with a `run_id` column.

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

from ..archive import layout
from ..archive.columns import RENAMED
from .catalog import VIEWS, Catalog

# A view with no file in any run still exists, empty, with the documented columns where the
# archive layout defines them (others have only their key columns)
EMPTY_COLUMNS = {"tokens": layout.token_schema, "sequences": layout.sequence_schema}

RUN_COLUMNS = pa.schema([
    ("run_id", pa.string()), ("kind", pa.string()), ("status", pa.string()), ("model", pa.string()),
    ("parent", pa.string()), ("edits", pa.string()), ("n_prompts", pa.int64()), ("n_generated_tokens", pa.int64()),
    ("lens", pa.string()), ("shards_complete", pa.string()), ("seed", pa.int64()), ("created", pa.string()),
    ("completed", pa.string()), ("path", pa.string()),
])
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


def runs_table(catalog: Catalog) -> pa.Table:
    """The `runs` view's rows: one per readable run."""
    rows = []
    for r in catalog.runs:
        row = {c: r.get(RUN_FIELDS.get(c, c)) for c in RUN_COLUMNS.names}
        rows.append({k: (str(v) if v is not None and RUN_COLUMNS.field(k).type == pa.string() else v)
                     for k, v in row.items()})
    return pa.Table.from_pylist(rows, schema=RUN_COLUMNS)


def _key_columns(view: str) -> list[str]:
    return ["run_id", "sweep_id"] if view == "sweeps" else ["run_id"]


def create_view(con: duckdb.DuckDBPyConnection, catalog: Catalog, view: str) -> None:
    """(Re)create `view` on `con` over the catalog's runs."""
    if view == "runs":
        con.register("_runs_rows", runs_table(catalog))
        con.execute("CREATE OR REPLACE VIEW runs AS SELECT * FROM _runs_rows")
        return
    keys = _key_columns(view)
    files = catalog.files(view)
    if not files:
        schema = EMPTY_COLUMNS[view]() if view in EMPTY_COLUMNS else pa.schema([])
        empty = pa.schema([(k, pa.string()) for k in keys] + list(schema)).empty_table()
        con.register(f"_{view}_empty", empty)
        con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT * FROM _{view}_empty")
        return
    owners = pa.table({"filename": [str(f.path) for f in files], "run_id": [f.run_id for f in files],
                       "sweep_id": [f.sweep_id for f in files]})
    con.register(f"_{view}_files", owners.select(["filename", *keys]))
    listed = "[" + ", ".join(_quote(str(f.path)) for f in files) + "]"
    # binding a view reads every file's footer: the renamed-columns step (one more binding) only
    # where older archives named a column otherwise
    read = view if view not in RENAMED else f"_{view}_read"
    con.execute(
        f"CREATE OR REPLACE VIEW {read} AS SELECT {', '.join('f.' + k for k in keys)}, t.* EXCLUDE (filename) "
        f"FROM read_parquet({listed}, union_by_name = true, filename = true) t "
        f"JOIN _{view}_files f ON t.filename = f.filename")
    if read != view:
        columns = [row[0] for row in con.execute(f"DESCRIBE {read}").fetchall()]
        con.execute(f"CREATE OR REPLACE VIEW {view} AS SELECT {', '.join(current_columns(columns, view))} FROM {read}")


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

