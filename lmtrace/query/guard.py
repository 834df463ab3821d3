"""`lmtrace query` is read-only over the archives, enforced by DuckDB.

Two layers, both DuckDB's own:
- its parser (`statement_refusal`): only statements that read and answer run (SELECT and the forms
  DuckDB parses as one: FROM ..., WITH, VALUES, DESCRIBE, SHOW, SUMMARIZE, PIVOT; and EXPLAIN).
  COPY, EXPORT, ATTACH, INSTALL, LOAD, SET, PRAGMA, CALL, CREATE, ... are refused before any
  connection is made.
- its configuration (`lock`): after the views are created, external access is turned off and the
  configuration locked, so the query can open only the Parquet files the views read and the files
  its SQL names as strings (`allowed_paths`); a directory or glob the SQL names is allowed as a
  whole (`allowed_directories`) only outside the runs directory. No extension can be installed or
  loaded, and no SET can undo any of it.

Writing a result is `--out`'s job (written by lmtrace, never inside the runs directory).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import duckdb

from ..errors import SpecError

# statements that read and answer (DuckDB's StatementType names); MULTI: PIVOT (an enum type, then a SELECT)
READING = {"SELECT", "EXPLAIN", "MULTI"}
GLOB_CHARS = "*?["


def statement_refusal(sql: str) -> str | None:
    """Why the SQL is refused as a writer (None when every statement only reads, or DuckDB cannot parse
    it: running it then gives DuckDB's own parser error)."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error:
        return None
    for st in statements:
        kind = str(st.type).rsplit(".", 1)[-1]
        if kind not in READING:
            word = (st.query.strip().split() or [kind])[0].upper()
            return (f"lmtrace query is read-only: {word} statements are refused (only SELECT and EXPLAIN run); "
                    f"write a result with --out FILE")
    return None


def check_read_only(sql: str) -> None:
    refusal = statement_refusal(sql)
    if refusal is not None:
        raise SpecError(refusal)


def inside(path: Path, root: Path) -> bool:
    """Whether `path` (symlinks resolved) is `root` or under it (both resolved)."""
    p, r = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return p == r or r in p.parents


def check_out(out: Path | None, root: Path) -> None:
    """--out inside the runs directory (after symlinks, relative paths) is refused."""
    if out is not None and inside(out, root):
        raise SpecError(f"--out {out}: inside the runs directory {root}, which lmtrace query never changes; "
                        f"write the result elsewhere")


def named_paths(sql: str, root: Path) -> tuple[list[str], list[str]]:
    """The files and directories the SQL names as string constants that DuckDB may read:
    (existing files anywhere, as given and absolute; directories outside the runs directory, and the
    directory part of a glob outside it)."""
    files, dirs = [], []
    try:
        tokens = duckdb.tokenize(sql)
    except duckdb.Error:
        return files, dirs
    starts = [start for start, _ in tokens] + [len(sql)]
    for i, (start, kind) in enumerate(tokens):
        if kind != duckdb.token_type.string_const:
            continue
        text = sql[start:starts[i + 1]].rstrip()
        if not (len(text) >= 2 and text[0] == "'" and text[-1] == "'"):
            continue
        value = os.path.expanduser(text[1:-1].replace("''", "'"))
        if not value or "\0" in value:
            continue
        if any(c in value for c in GLOB_CHARS):
            base = value[:min(value.index(c) for c in GLOB_CHARS if c in value)]
            folder = Path(base if base.endswith(os.sep) else os.path.dirname(base) or ".")
            if folder.is_dir() and not inside(folder, root) and not inside(root, folder):
                dirs.append(str(folder.resolve()) + os.sep)
            elif folder.is_dir():  # a glob over (or above) the runs directory: its existing files only
                files += [os.path.abspath(p) for p in glob.glob(value, recursive=True) if os.path.isfile(p)]
            continue
        p = Path(value)
        try:
            if p.is_file():
                files += [os.path.abspath(p), os.path.realpath(p)]
            elif p.is_dir() and not inside(p, root) and not inside(root, p):
                dirs.append(str(p.resolve()) + os.sep)
        except OSError:
            continue
    return files, dirs


def _list(values: list[str]) -> str:
    return "[" + ", ".join("'" + v.replace("'", "''") + "'" for v in dict.fromkeys(values)) + "]"


def lock(con: duckdb.DuckDBPyConnection, read: list[str], sql: str, root: Path, temp_dir: str) -> None:
    """Lock `con` down: DuckDB may open only the files `read` (the views' files) and those the SQL
    names (`named_paths`); nothing else, no extension, and no setting can change afterwards.
    `temp_directory` (where DuckDB spills a large sort) is a private one outside the runs."""
    files, dirs = named_paths(sql, root)
    paths = [os.path.abspath(p) for p in read] + [os.path.realpath(p) for p in read] + files
    con.execute(f"SET temp_directory = {_list([temp_dir])[1:-1]}")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute(f"SET allowed_paths = {_list(paths)}")
    con.execute(f"SET allowed_directories = {_list(dirs + [temp_dir.rstrip(os.sep) + os.sep])}")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
