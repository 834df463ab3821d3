"""`lmtrace ls`: the runs under the runs directory, one line per run.

On a terminal the table fits the terminal's width: columns are left out, lowest priority first
(`PRIORITY`), down to run id, status, kind and edits, whose edits cells are then cut (…); the
model is shown by its last path component, `created` to the minute, and an unfinished run's
status with its progress (`running 40/100 ~3m left`); a last line names what was left out.
Piped, every run is one whole line of tab-separated cells under a header line (every column,
nothing cut, the progress last: `cut -f1`, `column -t -s $'\\t'`). `--json` gives the full rows,
`-q` the run ids alone.
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

from ..archive.runs import human_bytes, list_runs, runs_root
from ..archive.summary import progress_label, summary_or_damaged
from ..exits.errors import SpecError
from ..output.column_fit import fitting_columns, table_width
from ..output.jsonout import json_line

KINDS = ("generate", "intervene")
COLUMNS = (
    "run id",
    "kind",
    "status",
    "model",
    "prompts",
    "tokens",
    "lens",
    "parent",
    "edits",
    "size",
    "created",
    "progress",
)
# what a narrow terminal keeps, most important first: columns are left out from the end of this list, down to
# the first `ALWAYS`; then the edits cells are cut (…)
# (a terminal shows an unfinished run's progress in its status cell, not in a column of its own)
PRIORITY = ("run id", "status", "kind", "edits", "model", "parent", "tokens", "created", "size", "prompts", "lens")
ALWAYS = 4
PROGRESS_IN_STATUS = ("progress",)  # the terminal's status cell holds it
GAP = 2  # spaces between columns
STATUS_STYLE = {"complete": "green", "running": "yellow", "interrupted": "magenta", "failed": "red", "damaged": "red"}


def _cells(r: dict, *, short: bool) -> dict[str, str]:
    """One run's cells; `short` (terminal): the model's last path component, `created` to the minute."""
    dash = lambda v: "-" if v is None else str(v)  # noqa: E731
    model, created = dash(r["model"]), dash(r["created"])
    progress = progress_label(r)
    status = dash(r["status"])
    if short:
        model = model.rstrip("/").rsplit("/", 1)[-1] or model
        created = created[:16].replace("T", " ")
        if progress:  # `running 40/100 ~3m left (1/4 shards)`: narrow enough for 80 columns
            shards = f" ({r['shards_complete']} shards)" if r.get("shards_complete") else ""
            status = f"{status.split(' ')[0]} {progress}{shards}"
    return {
        "run id": str(r["run_id"]),
        "kind": dash(r["kind"]),
        "status": status,
        "model": model,
        "prompts": dash(r["prompts"]),
        "tokens": dash(r["tokens"]),
        "lens": dash(r["lens"]),
        "parent": dash(r["parent_id"]),
        "edits": dash(r["edits"]),
        "size": human_bytes(r["size_bytes"]),
        "created": created,
        "progress": dash(progress),
    }


def fit_columns(natural: dict[str, int], width: int) -> dict[str, int]:
    """Column -> width for a terminal `width` cells wide, in `COLUMNS` order: columns are left out by `PRIORITY`
    while more than `ALWAYS` remain, then the edits column is cut. Every other cell is whole: the run id alone
    may exceed a very narrow terminal."""
    shown = [c for c in COLUMNS if c in PRIORITY]
    kept = fitting_columns(
        [natural[c] for c in shown], width, [shown.index(c) for c in reversed(PRIORITY)], gap=GAP, keep=ALWAYS
    )
    widths = {shown[i]: natural[shown[i]] for i in kept}
    excess = table_width(list(widths.values()), GAP) - width
    if excess > 0:  # only the `ALWAYS` columns are left
        widths["edits"] -= min(excess, max(0, widths["edits"] - len("edits")))
    return widths


def _terminal_table(rows: list[dict], root, console: Console) -> None:
    cells = [_cells(r, short=True) for r in rows]
    natural = {c: max([len(c)] + [cell_len(x[c]) for x in cells]) for c in COLUMNS}
    widths = fit_columns(natural, console.width)
    title = f"runs in {root}"
    if cell_len(title) > console.width:
        title = "runs in …" + str(root)[-(console.width - 9) :]
    console.print(Text(title, style="bold"), no_wrap=True, crop=True)

    def line(values: dict[str, str], styles: dict[str, str]) -> Text:
        out = Text()
        for i, (column, w) in enumerate(widths.items()):
            cell = Text(values[column], style=styles.get(column, ""))
            cell.truncate(w, overflow="ellipsis", pad=True)
            out.append_text(cell)
            if i < len(widths) - 1:
                out.append(" " * GAP)
        out.rstrip()
        return out

    console.print(line({c: c for c in widths}, {c: "bold" for c in widths}), no_wrap=True, crop=True)
    for x in cells:
        console.print(line(x, {"status": STATUS_STYLE.get(x["status"].split(" ")[0], "")}), no_wrap=True, crop=True)
    hidden = [c for c in COLUMNS if c not in widths and c not in PROGRESS_IN_STATUS]
    if hidden:
        console.print(
            Text(
                f"not shown at {console.width} columns: {', '.join(hidden)} (a wider terminal, "
                f"`lmtrace ls | cat` or --json shows every column)",
                style="dim",
            )
        )


def list_table(runs_dir: str | None, json_out: bool, kind: str | None = None, quiet: bool = False) -> None:
    """`lmtrace ls`: a table fitted to the terminal, tab-separated lines when piped, JSON, or ids (`quiet`)."""
    root = runs_root(runs_dir)
    if kind is not None and kind not in KINDS:
        raise SpecError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    rows = [summary_or_damaged(p) for p in list_runs(root)]
    if kind is not None:
        rows = [r for r in rows if r["kind"] == kind]
    if json_out:
        print(json_line(rows))
        return
    if quiet:
        for r in rows:
            print(r["run_id"])
        return
    console = Console()
    if not rows:
        console.print(f"no runs in {root}", markup=False, highlight=False, soft_wrap=True)
    elif console.is_terminal:
        _terminal_table(rows, root, console)
    else:  # whole lines: tabs never occur in the cells (ids, paths, labels, numbers)
        print("\t".join(COLUMNS))
        for r in rows:
            print("\t".join(_cells(r, short=False).values()))
