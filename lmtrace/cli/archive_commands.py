"""Commands that read archives and print them: `ls`, `show`, `verify`, `query`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .app import app, fail


@app.command("ls")
def ls_(
    kind: Optional[str] = typer.Option(None, "--kind", help="Only runs of this kind: generate | intervene."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print the run ids only, one per line."),
):
    """List runs: id, kind, status, model, prompts, tokens, lens, parent, edits, size, created.

    On a terminal the table fits its width: columns are left out in this order: lens, prompts,
    size, created, tokens, parent, model; then the edits cells are cut (…); a last line names
    what was left out. Piped: a header line, then one whole line per run, cells separated by
    tabs. Edits are written as the intervene flags that make them (`ablate-head 12.3 from 2
    (rescore)`).
    """
    from ..commands.ls import list_table

    try:
        list_table(runs_dir, json_out, kind, quiet=quiet)
    except BaseException as err:  # noqa: BLE001
        fail(err)


@app.command()
def show(
    run: str = typer.Argument(..., help="Run id (or unique prefix) or run directory."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json", help="The same as JSON (with --step: that step's details)."),
    no_color: bool = typer.Option(False, "--no-color", help="Probabilities as numbers instead of colours."),
    step: Optional[int] = typer.Option(
        None, "--step", help="Show this generated step in detail: chosen token, alternatives and logit lens as text."
    ),
    sequence: Optional[int] = typer.Option(None, "--sequence", help="Only this sequence (with --step: default 0)."),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Print the generated text only (with --step: the chosen token's text only)."
    ),
):
    """Show a run's manifest summary and its generated text coloured by token probability.

    Without colour (stdout not a terminal, NO_COLOR set, or --no-color) each generated token is
    followed by its probability in brackets, 2 significant digits: `Paris[0.93]`, and no colour
    legend is printed. --step S [--sequence K] prints that step's token, probability, rank (1 =
    the model's top-1, as the alternatives are numbered), the model's top-1 − top-2 margin and the
    chosen token's own margin, entropy, stability (explained in the output), its alternatives and
    (once `lmtrace lens` has run) the logit lens of every captured layer, ids read as text.
    """
    from ..commands.show import show_run

    try:
        show_run(run, runs_dir, json_out, no_color=no_color, step=step, sequence=sequence, quiet=quiet)
    except BaseException as err:  # noqa: BLE001
        fail(err)


@app.command()
def verify(
    run: str = typer.Argument(..., help="Run id (or unique prefix) or run directory."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json"),
    quiet: bool = typer.Option(
        False,
        "--quiet",
        "-q",
        help="Print nothing on stdout: the exit code says it (0 intact, 2 damaged, with the one error line).",
    ),
):
    """Check a complete run's files against the checksums recorded at completion (exit 2 when damaged)."""
    from ..commands.verify import verify_run

    try:
        code = verify_run(run, runs_dir, json_out, quiet=quiet)
    except BaseException as err:  # noqa: BLE001
        fail(err)
    raise typer.Exit(code)


@app.command()
def query(
    sql: str = typer.Argument(
        ...,
        metavar="SQL",
        help="A DuckDB SELECT over the views runs, sequences, tokens, steps, "
        "effects, heads, heads_per_sequence, heads_by, sweeps, explain (each with a run_id "
        "column). Read-only: COPY, ATTACH, SET, ... are refused.",
    ),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    fmt: Optional[str] = typer.Option(
        None,
        "--format",
        "-f",
        help="table (default on stdout) | csv | json (one object "
        "a line) | parquet (needs --out); with --out, the file's suffix decides.",
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Write the result to this file (never inside the runs directory)."
    ),
):
    """Answer questions across runs with SQL: every run's committed tables as DuckDB views (docs/query.md).

    Example: lmtrace query "SELECT run_id, count(*) FROM tokens WHERE NOT is_prompt GROUP BY run_id"
    """
    from ..commands.query import query_command

    try:
        query_command(sql, runs_dir=runs_dir, fmt=fmt, out=out)
    except BaseException as err:  # noqa: BLE001
        fail(err)
