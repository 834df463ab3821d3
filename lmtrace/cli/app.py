"""The typer app shared by every command: its callback (version, --debug, signals), the error
mapping to one `error:` line and an exit code, and the progress reporter."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import typer

from ..exits.errors import EXIT_RUN_FAILED, Interrupted, LmtraceError
from ..exits.interrupts import interrupt_on_signals

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Trace what happens inside a causal language model while it generates.",
)

_state = {"debug": False}


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"lmtrace {__version__}")
        raise typer.Exit(0)


@app.callback()
def main(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    version: bool = typer.Option(
        False, "--version", "-V", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
):
    _state["debug"] = debug
    # every command, from its first line: SIGTERM/SIGINT exit 3 with one line, never die by the signal
    ctx.call_on_close(interrupt_on_signals(ctx.invoked_subcommand))


def one_line(text: str) -> str:
    """Error messages are one line: a wrapped library message is joined back together."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _disk_full(err: BaseException) -> OSError | None:
    """The no-space (ENOSPC) or over-quota (EDQUOT) OSError behind `err`: itself or one it was raised
    from or while handling (a writer may wrap it), else None."""
    import errno

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return err
        err = err.__cause__ or err.__context__
    return None


def run_dir_or_root(ref: str | None, runs_dir: str | None) -> Path:
    """Where a command writes, for an error line: the run's directory, else the runs directory."""
    from ..archive.runs import find_run, runs_root

    root = runs_root(runs_dir)
    try:
        return find_run(ref, root) if ref else root
    except LmtraceError:
        return root


def fail(err: BaseException, where=None) -> None:
    """Map an error to one `error:` line and the exit code. `where()`: the directory the command
    writes into, named when the disk is full and the error does not say which file."""
    if isinstance(err, (SystemExit, typer.Exit)):  # e.g. rich's exit on a closed stdout pipe
        raise err
    if isinstance(err, BrokenPipeError):  # `lmtrace ls | head`: stdout went away, nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise typer.Exit(EXIT_RUN_FAILED)
    if _state["debug"]:
        raise err
    if isinstance(err, (LmtraceError, Interrupted)):
        typer.echo(f"error: {one_line(err)}", err=True)
        raise typer.Exit(err.exit_code)
    full = _disk_full(err)
    if full is not None:  # the same line and exit code as a run that fails on a full disk
        from ..archive.files import space_note

        target = where() if where is not None else run_dir_or_root(None, None)
        typer.echo(f"error: {space_note(target, full)}; free some space and run it again", err=True)
        raise typer.Exit(EXIT_RUN_FAILED)
    if isinstance(err, KeyboardInterrupt):
        typer.echo("error: aborted by the user", err=True)
        raise typer.Exit(130)
    message = one_line(f"{type(err).__name__}: {err}")
    typer.echo(f"error: internal error: {message} (rerun with --debug for the traceback)", err=True)
    raise typer.Exit(EXIT_RUN_FAILED)


class Reporter:
    """Rich progress bar on a terminal; plain timestamped lines otherwise (cron, SLURM .out files):
    sequences done of the total, tokens, tok/s and the estimated time left (progress.Estimate)."""

    def __init__(self, quiet: bool, log_json: bool = False):
        self.quiet = quiet
        self.log_json = log_json  # JSON lines on stderr instead of a bar or plain lines
        self.tty = sys.stderr.isatty() and not log_json
        self.bar = None
        self.task = None
        self.estimate = None
        self.shard = None  # `shard-I-of-N` of a sharded run: named in every progress line
        self.narrow = False  # the bar's layout for a terminal under 100 columns
        self.t0 = time.time()
        self.last_line = 0.0
        # seconds between plain progress lines (cron, SLURM logs)
        self.every = float(os.environ.get("LMTRACE_PROGRESS_EVERY") or 10)

    def progress(self):
        """The callbacks a generating command reports through."""
        from ..output.progress import Progress

        return Progress(self.start, self.advance, self.message, self.sequences_done)

    def message(self, text: str, **fields) -> None:
        if self.quiet:
            return
        if self.log_json:
            typer.echo(
                json.dumps(
                    {"time": round(time.time(), 3), "event": fields.pop("event", "message"), "message": text, **fields}
                ),
                err=True,
            )
        else:
            typer.echo(f"[{time.strftime('%H:%M:%S')}] {text}", err=True)

    def starting(self, text: str = "importing torch") -> None:
        """A first line within a second on a terminal, before imports that take seconds; not in
        scripts, cron or SLURM, where an early bad-input error stays the only line on stderr."""
        if self.tty:
            self.message(text)

    def start(self, n_prompts: int, max_tokens: int) -> None:
        from ..output.progress import Estimate

        self.t0 = self.last_line = time.time()
        self.estimate = Estimate(n_prompts, max_tokens, self.t0)
        if self.quiet:
            return
        if self.tty:
            import shutil

            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            # under 100 columns (an 80-column terminal) the bar is short and shows the count, the rate
            # and the time left, not the tokens and the time elapsed: the count is never cut
            self.narrow = shutil.get_terminal_size().columns < 100
            self.bar = Progress(
                TextColumn(f"generating{f' ({self.shard})' if self.shard else ''}"),
                BarColumn(bar_width=10 if self.narrow else 40),
                MofNCompleteColumn(),
                TextColumn("sequences, {task.fields[status]}"),
                *([] if self.narrow else [TimeElapsedColumn()]),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("gen", total=n_prompts, status="-")
        else:
            where = f"{self.shard}: " if self.shard else ""
            self.message(
                f"{where}generating: {n_prompts} prompt(s), up to {max_tokens} new tokens each",
                event="start",
                prompts=n_prompts,
                max_new_tokens=max_tokens,
                **({"shard": self.shard} if self.shard else {}),
            )

    def advance(self, tokens: int) -> None:
        self.estimate.advance(tokens)
        self._show()

    def sequences_done(self, n: int, tokens: int | None) -> None:
        self.estimate.sequences_done(n, tokens)
        self._show(sequences=n)

    def _show(self, sequences: int = 0) -> None:
        if self.quiet:
            return
        now = time.time()
        e = self.estimate
        rate, left = e.rate(now), e.seconds_left(now)
        if self.bar is not None:
            from ..output.progress import duration

            if self.narrow:
                eta = f", ~{duration(left)} left" if left is not None else ""
                status = f"{rate:.1f} tok/s{eta}"
            else:
                eta = f", about {duration(left)} left" if left is not None else ""
                status = f"{e.tokens} tokens, {rate:.1f} tok/s{eta}"
            self.bar.update(self.task, advance=sequences, status=status)
        elif now - self.last_line >= self.every:
            self.last_line = now
            self.message(
                self.progress_line(now),
                event="progress",
                sequences_done=e.sequences,
                sequences_total=e.total,
                tokens=e.tokens,
                tokens_per_s=round(rate, 2),
                eta_s=None if left is None else round(left),
                **({"shard": self.shard} if self.shard else {}),
            )

    def progress_line(self, now: float) -> str:
        """`shard-0-of-4: 120/500 sequences, 9695 tokens, 8.8 tok/s, ETA ~14 min (estimate)`."""
        from ..output.progress import duration

        e = self.estimate
        left = e.seconds_left(now)
        eta = f", ETA ~{duration(left)} (estimate)" if left is not None else ""
        where = f"{self.shard}: " if self.shard else ""
        return f"{where}{e.sequences}/{e.total} sequences, {e.tokens} tokens, {e.rate(now):.1f} tok/s{eta}"

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def lens_line(summary: dict) -> str:
    """The words `lmtrace lens` prints for a run, also after `generate --lens` / `intervene --lens`."""
    if summary["computed"]:
        return f"logit lens computed ({summary['rows']} rows, {summary['seconds']:.1f} s)"
    return summary["reason"]
