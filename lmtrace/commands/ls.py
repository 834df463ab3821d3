"""`lmtrace ls`: the runs under the runs directory as a table (or JSON lines)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..archive.runs import human_bytes, list_runs, runs_root
from ..archive.summary import summary_or_damaged
from ..errors import SpecError
from ..jsonout import json_line


def _console() -> Console:
    """The terminal's width on a terminal; when piped, lines are not wrapped or cut at 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=400)


KINDS = ("generate", "intervene")


def list_table(runs_dir: str | None, json_out: bool, kind: str | None = None) -> None:
    root = runs_root(runs_dir)
    if kind is not None and kind not in KINDS:
        raise SpecError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    rows = [summary_or_damaged(p) for p in list_runs(root)]
    if kind is not None:
        rows = [r for r in rows if r["kind"] == kind]
    if json_out:
        print(json_line(rows))
        return
    console = _console()
    if not rows:
        console.print(f"no runs in {root}", markup=False, highlight=False)
        return
    table = Table(title=escape(f"runs in {root}"))
    table.add_column("run id", no_wrap=True, min_width=max(len(r["run_id"]) for r in rows))
    for col in ("kind", "status", "model", "prompts", "tokens", "lens", "parent", "edits", "size", "created"):
        table.add_column(col, overflow="fold")
    colours = {"complete": "green", "running": "yellow", "interrupted": "magenta", "failed": "red", "damaged": "red"}
    dash = lambda v: "-" if v is None else str(v)  # noqa: E731
    for r in rows:
        table.add_row(Text(r["run_id"]), dash(r["kind"]), Text(str(r["status"]), style=colours.get(r["status"], "")),
                      Text(str(r["model"])), str(r["prompts"]), dash(r["tokens"]), dash(r["lens"]),
                      Text(dash(r["parent_id"])), Text(dash(r["edits"])), human_bytes(r["size_bytes"]),
                      Text(str(r["created"])))
    console.print(table)
