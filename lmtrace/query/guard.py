"""`lmtrace query` is read-only over the archives, enforced by DuckDB.

Two layers, both DuckDB's own:
- its parser (`statement_refusal`): only statements that read and answer run (SELECT and the forms
  DuckDB parses as one: FROM ..., WITH, VALUES, DESCRIBE, SHOW, SUMMARIZE, PIVOT; and EXPLAIN).
  COPY, EXPORT, ATTACH, INSTALL, LOAD, SET, PRAGMA, CALL, CREATE, ... are refused before any
  connection is made.
- its configuration (`lock`): after the views are created, external access is turned off and the
  configuration locked, so the query can open only the Parquet files the views read and the files
  its SQL names as strings (`allowed_paths`: a file, or a glob and the files it matches); no
  directory. No extension can be installed or loaded, and no SET can undo any of it.

Writing a result is `--out`'s job (written by lmtrace, never inside the runs directory).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import duckdb

from ..exits.errors import SpecError
from .check import printable

# statements that read and answer (DuckDB's StatementType names). MULTI: a PIVOT (an enum type
# created, then a SELECT), but also whatever statement holds one (`COPY (PIVOT ...) TO ...`): it
# passes only when its first word is one of MULTI_READING
READING = {"SELECT", "EXPLAIN", "MULTI"}
MULTI_READING = {"PIVOT", "UNPIVOT", "SELECT", "FROM", "WITH", "VALUES", "(", "EXPLAIN"}
GLOB_CHARS = "*?["


def _kind(statement) -> str:
    return str(statement.type).rsplit(".", 1)[-1]


def explained(query: str) -> str | None:
    """The statement an EXPLAIN statement explains (`EXPLAIN [ANALYZE] [(options)] STATEMENT`), or None."""
    tokens = duckdb.tokenize(query)
    starts = [start for start, _ in tokens] + [len(query)]
    word = lambda i: query[starts[i] : starts[i + 1]].strip().upper()  # noqa: E731
    i = 1
    if i < len(tokens) and word(i) in ("ANALYZE", "ANALYSE"):
        i += 1
    if i < len(tokens) and word(i).startswith("("):
        depth = 0
        while i < len(tokens):
            depth += word(i).count("(") - word(i).count(")")
            i += 1
            if depth <= 0:
                break
    return query[starts[i] :] if i < len(tokens) else None


def _first_word(query: str) -> str:
    tokens = duckdb.tokenize(query)
    if not tokens:
        return ""
    end = tokens[1][0] if len(tokens) > 1 else len(query)
    return query[tokens[0][0] : end].strip().upper()


def refused_word(sql: str) -> str | None:
    """The first word of the first statement in `sql` that may write (None: every one only reads).
    An EXPLAIN passes only when what it explains does (EXPLAIN ANALYZE runs it)."""
    for st in duckdb.extract_statements(sql):
        kind, query = _kind(st), st.query
        word = _first_word(query) or kind
        if kind == "MULTI" and word not in MULTI_READING:
            return word
        if kind == "EXPLAIN" or word == "EXPLAIN":
            inner = explained(query)
            try:
                inner_word = refused_word(inner) if inner else word
            except duckdb.Error:
                inner_word = word
            if inner_word is not None:
                return inner_word
        elif kind not in READING:
            return word
    return None


def statement_refusal(sql: str) -> str | None:
    """Why the SQL is refused as a writer (None when every statement only reads, or DuckDB cannot parse
    it: running it then gives DuckDB's own parser error)."""
    try:
        word = refused_word(sql)
    except duckdb.Error:
        return None
    if word is None:
        return None
    return (
        f"lmtrace query is read-only: {printable(word)} statements are refused (only SELECT and EXPLAIN "
        f"run); write a result with --out FILE"
    )


def check_read_only(sql: str) -> None:
    refusal = statement_refusal(sql)
    if refusal is not None:
        raise SpecError(refusal)


def inside(path: Path, root: Path) -> bool:
    """Whether `path` (symlinks resolved) is `root` or under it (both resolved)."""
    p, r = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return p == r or r in p.parents


def check_out(out: Path | None, root: Path) -> None:
    """--out inside the runs directory (after symlinks, relative paths) is refused, and so is one that
    cannot be a file (a directory; a folder that does not exist)."""
    if out is None:
        return
    if inside(out, root):
        raise SpecError(
            f"--out {printable(str(out))}: inside the runs directory {root}, which lmtrace query never changes; "
            f"write the result elsewhere"
        )
    if out.is_dir():
        raise SpecError(f"--out {out} is a directory; give a file name")
    if not out.absolute().parent.is_dir():
        raise SpecError(f"--out {out}: the folder {out.absolute().parent} does not exist; create it first")


def named_paths(sql: str, root: Path) -> list[str]:
    """The files the SQL names as string constants, which DuckDB may read: an existing file (as given,
    absolute and with symlinks resolved), or a glob (the pattern and the files it matches now); none
    inside the runs directory `root` (the views read the runs: DuckDB may open no other file there)."""
    out: list[str] = []
    try:
        tokens = duckdb.tokenize(sql)
    except duckdb.Error:
        return out
    starts = [start for start, _ in tokens] + [len(sql)]
    for i, (start, kind) in enumerate(tokens):
        if kind != duckdb.token_type.string_const:
            continue
        text = sql[start : starts[i + 1]].rstrip()
        if not (len(text) >= 2 and text[0] == "'" and text[-1] == "'"):
            continue
        value = os.path.expanduser(text[1:-1].replace("''", "'"))
        if not value or "\0" in value:
            continue
        try:
            if any(c in value for c in GLOB_CHARS):
                matched = [p for p in glob.glob(value, recursive=True) if os.path.isfile(p)]
                if any(inside(Path(p), root) for p in matched):
                    continue
                out += [os.path.abspath(value)] + [os.path.abspath(p) for p in matched]
            elif os.path.isfile(value) and not inside(Path(value), root):
                out += [os.path.abspath(value), os.path.realpath(value)]
        except (OSError, ValueError):
            continue
    return out


def _list(values: list[str]) -> str:
    return "[" + ", ".join("'" + v.replace("'", "''") + "'" for v in dict.fromkeys(values)) + "]"


def lock(con: duckdb.DuckDBPyConnection, read: list[str], sql: str, root: Path, temp_dir: str) -> None:
    """Lock `con` down: DuckDB may open only the files `read` (the views' files) and those the SQL
    names (`named_paths`); nothing else, no extension, and no setting can change afterwards.
    `temp_directory` (where DuckDB spills a large sort) is a private one outside the runs."""
    paths = [os.path.abspath(p) for p in read] + [os.path.realpath(p) for p in read] + named_paths(sql, root)
    con.execute(f"SET temp_directory = {_list([temp_dir])[1:-1]}")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute(f"SET allowed_paths = {_list(paths)}")
    con.execute(f"SET allowed_directories = {_list([temp_dir.rstrip(os.sep) + os.sep])}")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
