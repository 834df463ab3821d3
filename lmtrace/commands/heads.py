"""`lmtrace heads RUN`: score and label every attention head (analysis/heads.py), write the tables
(archive/heads.py) and print a ranked table or JSON. No model is loaded."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..analysis.heads import LABELS, RANK_ORDER, SCORES, compute_heads, grouped_rows
from ..archive.files import atomic_write_parquet
from ..archive.groups import GROUP_VALUE, group_header, group_text, sequence_groups
from ..archive.heads import ANALYSIS_DIR, HEADS_FILE, PER_SEQUENCE_FILE, by_file, write_heads
from ..archive.reader import IncompleteRunWarning, Run, open_run
from ..exits.errors import SpecError
from ..exits.interrupts import work_recorded
from ..output.jsonout import json_line


def parse_labels(given: list[str] | None) -> list[str] | None:
    """`--label` values (repeatable, or comma-separated) -> the labels asked for, or None for all."""
    names = [n.strip() for item in given or [] for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in LABELS]
    if unknown:
        raise SpecError(f"--label {unknown[0]!r}: unknown; labels: {', '.join(LABELS)}")
    if given and not names:
        raise SpecError(f"--label: no label given; labels: {', '.join(LABELS)}")
    return list(dict.fromkeys(names)) or None


def heads_command(
    ref: str,
    *,
    runs_dir: str | None = None,
    out: Path | None = None,
    per_sequence: bool = False,
    json_out: bool = False,
    top: int = 20,
    labels: list[str] | None = None,
    quiet: bool = False,
    by: str | None = None,
) -> dict:
    """`lmtrace heads`: compute, write analysis/heads.parquet (every head), print a ranked table (or
    JSON) of every head or of those with the `labels` asked for; `quiet`: print nothing."""
    if top < 1:
        raise SpecError(f"--top must be ≥ 1 (got {top})")
    wanted = parse_labels(labels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)  # said in the notes, in one line
        run = open_run(ref, runs_dir)
    groups = sequence_groups(run, by) if by is not None else None
    result = compute_heads(run, per_sequence=per_sequence, groups=groups)
    folder = Path(out) if out is not None else run.path / ANALYSIS_DIR
    try:
        write_heads(folder, result["table"], result["per_sequence"])
        if by is not None:
            atomic_write_parquet(result["by_group"], folder / by_file(by))
    except OSError as err:
        raise SpecError(f"cannot write {folder} ({err.strerror}); pass another --out") from None
    work_recorded()  # (what is left is printing: a signal now leaves the exit code at 0)
    for note in [] if quiet else result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    table = result["table"]
    shown = [r for r in table.to_pylist() if wanted is None or r["label"] in wanted]  # in rank order
    summary = {
        "run_id": run.id,
        "path": str(folder / HEADS_FILE),
        "per_sequence_path": str(folder / PER_SEQUENCE_FILE) if result["per_sequence"] is not None else None,
        "rows": result["rows"],
        "notes": result["notes"],
        "sweep": result["sweep"],
        "labels": {lab: int(sum(1 for x in table.column("label").to_pylist() if x == lab)) for lab in LABELS},
        "label_filter": wanted,
        "by": None
        if by is None
        else {"column": by, "path": str(folder / by_file(by)), "heads": grouped_rows(result["by_group"], wanted)},
        "heads": [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()} for r in shown],
    }  # NaN (no induction rows) as null: strict JSON
    if json_out:
        print(json_line(summary))
    elif not quiet and by is not None:
        _print_grouped(run, summary["by"], top)
    elif not quiet:
        _print(run, table, shown, wanted, result, folder, top)
    return summary


# columns left out first when a table is wider than the terminal: the secondary scores, then the
# label scores from the least specific; rank, layer, head, label and what the table is ranked by (|DLA|, the
# sweep's effect) stay
SCORE_COLUMNS = ("sink", "prev", "local", "induct", "dup", "entropy", "max w")
DROP_FIRST = ("max w", "dup", "entropy", "sink", "local", "induct", "prev")


def _console():
    from rich.console import Console

    return Console() if Console().is_terminal else Console(width=160, soft_wrap=True)


def _print_fitted(
    console, title: str, headers: list[str], rows: list[list[str]], left: tuple[str, ...], keep: tuple[str, ...]
) -> None:
    """The table at the console's width: columns that do not fit left out (DROP_FIRST, then from the
    right, never `keep`) and named in a line."""
    from ..output.column_fit import print_fitted

    print_fitted(
        console,
        headers,
        rows,
        complete_in="--json has every score",
        drop_first=DROP_FIRST,
        keep=keep,
        left=left,
        title=title,
    )


def _score(v) -> str:
    return "-" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.2f}"


def _print_grouped(run: Run, by: dict, top: int) -> None:
    from rich.markup import escape

    console = _console()
    column = by["column"]
    shown: dict = {}
    rows = []
    for r in by["heads"]:
        key = group_text(r[GROUP_VALUE])
        shown[key] = shown.get(key, 0) + 1
        if shown[key] > top:
            continue
        rows.append(
            [
                key,
                str(r["n_sequences"]),
                str(r["layer"]),
                str(r["q_head"]),
                r["label"],
                *(
                    _score(r[k])
                    for k in ("sink_score", "prev_token_score", "local_score", "induction_score", "entropy")
                ),
            ]
        )
    headers = ["seqs", "layer", "head", "label", "sink", "prev", "local", "induct", "entropy"]
    group = group_header(column, headers)
    _print_fitted(
        console,
        f"heads of {run.id} by {column}: the top {top} of each group, ranked by label, then the label's score",
        [group, *headers],
        rows,
        left=(group, "label"),
        keep=(group, "layer", "head", "label"),
    )
    console.print(escape(f"every head of every group written to {by['path']}"))


def _print(
    run: Run, table: pa.Table, shown: list[dict], wanted: list[str] | None, result: dict, folder: Path, top: int
) -> None:
    from rich.markup import escape

    console = _console()
    labels = table.column("label").to_pylist()
    counts = ", ".join(f"{lab} {labels.count(lab)}" for lab in LABELS if labels.count(lab))
    sweep = result.get("sweep")
    by = (
        f"measured effect on {sweep['metric']} (sweep {sweep['id']}, edit {sweep['edit']})"
        if sweep
        else "mean |head DLA|"
        if result["dla"]
        else f"label ({', '.join(RANK_ORDER)}), then the label's score"
    )
    which = (
        f"top {min(top, len(shown))} of {len(shown)} {' / '.join(wanted)} heads; all {len(labels)}: {counts}"
        if wanted
        else f"top {min(top, len(labels))} of {len(labels)}: {counts}"
    )
    headers = ["rank", "layer", "head", "label", *SCORE_COLUMNS]
    if result["dla"]:
        headers.append("|DLA|")
    if sweep:
        headers.append(f"Δ{sweep['metric']}")
    rows = []
    for r in shown[:top]:
        cells = [str(r["head_rank"]), str(r["layer"]), str(r["q_head"]), r["label"], *(_score(r[k]) for k in SCORES)]
        if result["dla"]:
            cells.append(_score(r["importance"]) + (f" #{r['dla_rank']}" if sweep and r["dla_rank"] else ""))
        if sweep:
            cells.append("-" if r["sweep_effect"] is None else f"{r['sweep_effect']:+.3f}")
        rows.append(cells)
    _print_fitted(
        console,
        f"heads of {run.id}, ranked by {by} ({which})",
        headers,
        rows,
        left=("label",),
        keep=("rank", "layer", "head", "label", *headers[len(SCORE_COLUMNS) + 4 :]),
    )
    console.print(escape(f"{result['rows']} attention rows per head; written to {folder / HEADS_FILE}"))
