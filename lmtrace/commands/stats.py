"""`lmtrace stats RUN [--by COLUMN]`: a run's sequences summarised, whole or per group of a column of
sequences.parquet: sequences, generated tokens, mean logprob and entropy, how many steps the logit
lens settles at each layer, and the lowest-probability generated tokens, computed by
analysis/run_stats.py."""

from __future__ import annotations

import warnings
from pathlib import Path

from ..analysis.run_stats import LOWEST, compute_stats
from ..archive.groups import GROUP_VALUE, group_header, group_text
from ..archive.reader import IncompleteRunWarning, open_run
from ..output.jsonout import json_line


def stats_command(
    ref: str, *, runs_dir: str | None = None, by: str | None = None, json_out: bool = False, lowest: int = LOWEST
) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)  # committed data only, as every view
        run = open_run(ref, runs_dir)
    result = compute_stats(run, by, lowest)
    if json_out:
        print(json_line(result))
    else:
        _print(result, Path(run.path))
    return result


def _print(result: dict, path: Path) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    by = result["by"]
    headers = ["seqs", "tokens", "mean logprob", "mean entropy", "lens settles at layer: steps"]
    group = group_header(by, headers) if by else None
    t = Table(title=escape(f"run {result['run_id']}" + (f" by {by}" if by else "")), title_justify="left")
    for col in ([group] if by else []) + headers:
        t.add_column(escape(col), justify="left" if col in (group, "lens settles at layer: steps") else "right")

    def f(v):
        return "-" if v is None else f"{v:.3f}"

    for g in result["groups"]:
        settle = (
            "(lens not computed)"
            if g["settle"] is None
            else ", ".join(f"{'never' if k < 0 else k}: {n}" for k, n in sorted(g["settle"].items()))
        )
        t.add_row(
            *([escape(group_text(g[GROUP_VALUE]))] if by else []),
            str(g["sequences"]),
            str(g["tokens"]),
            f(g["mean_logprob"]),
            f(g["mean_entropy"]),
            escape(settle),
        )
    console.print(t)
    low = Table(
        title="lowest-probability generated tokens" + (f" per {escape(by)}" if by else ""), title_justify="left"
    )
    headers = ["sequence", "step", "token", "prob"]
    group = group_header(by, headers) if by else None
    for col in ([group] if by else []) + headers:
        low.add_column(escape(col), justify="left" if col in (group, "token") else "right")
    for g in result["groups"]:
        for r in g["lowest"]:
            low.add_row(
                *([escape(group_text(g[GROUP_VALUE]))] if by else []),
                str(r["sequence"]),
                str(r["step"]),
                escape(repr(r["token_text"])),
                f"{r['prob']:.4f}",
            )
    console.print(low)
