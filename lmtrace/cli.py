"""The `lmtrace` command line: parse, call one function, map errors to exit codes. No logic here."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from .errors import EXIT_RUN_FAILED, LmtraceError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Trace what happens inside a causal language model while it generates.")

_state = {"debug": False}


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")):
    _state["debug"] = debug


def _fail(err: BaseException) -> None:
    if _state["debug"]:
        raise err
    if isinstance(err, LmtraceError):
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(err.exit_code)
    if isinstance(err, KeyboardInterrupt):
        typer.echo("error: aborted by the user", err=True)
        raise typer.Exit(130)
    typer.echo(f"error: internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback)", err=True)
    raise typer.Exit(EXIT_RUN_FAILED)


class _Reporter:
    """Rich progress bar on a terminal; plain timestamped lines otherwise (cron, SLURM .out files)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.bar = None
        self.task = None
        self.done = 0
        self.t0 = time.time()
        self.last_line = 0.0

    def message(self, text: str) -> None:
        if not self.quiet:
            typer.echo(f"[{time.strftime('%H:%M:%S')}] {text}", err=True)

    def start(self, n_prompts: int, max_tokens: int) -> None:
        self.t0 = self.last_line = time.time()
        if self.quiet:
            return
        total = n_prompts * max_tokens
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[rate]} tok/s"), TimeElapsedColumn(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("gen", total=total, rate="-")
        else:
            self.message(f"generating: {n_prompts} prompt(s), up to {max_tokens} new tokens each")

    def advance(self, tokens: int) -> None:
        self.done += tokens
        if self.quiet:
            return
        rate = self.done / max(time.time() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.update(self.task, advance=tokens, rate=f"{rate:.1f}")
        elif time.time() - self.last_line > 10:
            self.last_line = time.time()
            self.message(f"{self.done} tokens, {rate:.1f} tok/s")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


@app.command()
def generate(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="YAML run spec."),
    set_: list[str] = typer.Option([], "--set", help="Override a spec key: --set generation.seed=3"),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", help="Runs directory (default: spec, $LMTRACE_RUNS_DIR, ./runs)."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Run id (default: generated, sortable)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
):
    """Run a spec: generate with capture hooks and stream everything to a run archive."""
    from .generate import Progress, run_generate
    from .spec import load_spec

    reporter = _Reporter(quiet or json_out)
    try:
        overrides = list(set_) + ([f"output.run_id={json.dumps(run_id)}"] if run_id else [])
        spec, text, _ = load_spec(spec_path, overrides)
        result = run_generate(spec, text, runs_dir_flag=runs_dir,
                              progress=Progress(reporter.start, reporter.advance, reporter.message))
    except BaseException as err:  # noqa: BLE001 - mapped to a one-line error and exit code
        reporter.stop()
        if isinstance(err, typer.Exit):
            raise
        _fail(err)
    reporter.stop()
    summary = {"run_id": result.run_id, "run_dir": str(result.run_dir), "status": result.status,
               "sequences": result.n_sequences, "generated_tokens": result.n_tokens,
               "seconds": round(result.seconds, 2)}
    if json_out:
        typer.echo(json.dumps(summary))
    elif not quiet:
        typer.echo(f"run {result.run_id}: {result.status}, {result.n_sequences} sequence(s), "
                   f"{result.n_tokens} tokens in {result.seconds:.1f}s -> {result.run_dir}")
        for i, text in enumerate(result.texts[:5]):
            typer.echo(f"  [{i}] {text!r}")
        if len(result.texts) > 5:
            typer.echo(f"  ... {len(result.texts) - 5} more (lmtrace show {result.run_id})")


@app.command()
def validate(
    spec_path: Path = typer.Argument(..., metavar="SPEC"),
    set_: list[str] = typer.Option([], "--set", help="Override a spec key: --set generation.seed=3"),
    json_out: bool = typer.Option(False, "--json", help="Print the resolved spec and estimate as JSON."),
):
    """Check a spec, print it resolved with an archive-size estimate. Loads no model weights."""
    from .validate import validate_spec

    try:
        report = validate_spec(spec_path, list(set_))
    except BaseException as err:  # noqa: BLE001
        _fail(err)
    if json_out:
        typer.echo(json.dumps(report, indent=2, default=str))
        return
    import yaml

    typer.echo(yaml.safe_dump(report["resolved"], sort_keys=False).rstrip())
    typer.echo(f"# {report['summary']}")


@app.command("ls")
def ls_(
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json"),
):
    """List runs: id, status, model, prompts, tokens, size, created."""
    from .views import list_table

    try:
        list_table(runs_dir, json_out)
    except BaseException as err:  # noqa: BLE001
        _fail(err)


@app.command()
def show(
    run: str = typer.Argument(..., help="Run id (or unique prefix) or run directory."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json"),
):
    """Show a run's manifest summary and its generated text coloured by token probability."""
    from .views import show_run

    try:
        show_run(run, runs_dir, json_out)
    except BaseException as err:  # noqa: BLE001
        _fail(err)


def run() -> None:
    app()


if __name__ == "__main__":
    run()
