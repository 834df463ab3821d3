"""The `lmtrace` command line: parse, call one function, map errors to exit codes. No logic here.

`app` (cli/app.py) holds the callback and the error mapping; this module defines `generate` and
`validate`, then registers the other commands in the order `lmtrace --help` lists them. Where one
command continues into another's step (`generate --resume` of an intervene child, `generate --lens`),
the CLI calls both: no command imports another."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from ..exits.errors import EXIT_INTERRUPTED, Interrupted
from ..output.jsonout import json_line
from .app import Reporter, app, fail, lens_line, one_line, run_dir_or_root


@app.command()
def generate(
    spec_path: Optional[Path] = typer.Argument(None, metavar="SPEC", help="YAML run spec (optional with --resume)."),
    set_: list[str] = typer.Option([], "--set", help="Override a spec key: --set generation.seed=3"),
    runs_dir: Optional[str] = typer.Option(
        None, "--runs-dir", help="Runs directory (default: spec, $LMTRACE_RUNS_DIR, ./runs)."
    ),
    run_id: Optional[str] = typer.Option(
        None,
        "--run-id",
        help="Run id (default: generated, sortable). An existing unfinished run with the same spec is resumed.",
    ),
    resume: Optional[str] = typer.Option(
        None,
        "--resume",
        metavar="RUN_ID",
        help="Continue an interrupted or killed run (an intervene child too: its edits are replayed from its parent).",
    ),
    shard: Optional[str] = typer.Option(
        None, "--shard", help="I/N: take every N-th prompt from I; `auto` reads SLURM array variables."
    ),
    memory_budget: Optional[str] = typer.Option(
        None,
        "--memory-budget",
        metavar="SIZE",
        help="Memory the batches may "
        "take beyond the model (8GiB, 512MB): sizes `batch_size: auto`, splits "
        "a batch over it (generation.memory_budget).",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output; print only the run id."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    log_json: bool = typer.Option(False, "--log-json", help="Progress and events as JSON lines on stderr."),
    lens: bool = typer.Option(
        False,
        "--lens",
        help="Compute the deferred logit lens right after generating, in "
        "this process (no second model load; as `lmtrace lens RUN`).",
    ),
    sae: list[str] = typer.Option(
        [],
        "--sae",
        metavar="DIR",
        help="Archive each token's top active latents of this "
        "SAE (SAELens directory; repeatable; as capture.features, top_k 32).",
    ),
    workers: Optional[str] = typer.Option(
        None,
        "--workers",
        metavar="N|auto",
        help="N shard processes here, CPUs and memory split (auto: one per CPU as RAM allows; default where faster).",
    ),
):
    """Run a spec: generate with capture hooks and stream everything to a run archive."""
    from ..commands.generate import GenerateJob

    plan = _workers_plan(spec_path, set_, workers, shard, runs_dir, run_id, resume, memory_budget, sae)
    if plan is not None:  # the run as shard processes, asked for or chosen (commands/workers.py)
        return _generate_workers(plan, quiet=quiet, json_out=json_out, log_json=log_json, lens=lens)
    reporter = Reporter(quiet, log_json) if log_json else Reporter(quiet or json_out)
    job = GenerateJob(runs_dir=runs_dir, run_id=run_id, resume=resume)
    try:
        job.prepare(
            spec_path, set_, shard=shard, memory_budget=memory_budget, lens=lens, note=reporter.message, saes=sae
        )
        result, lens_summary = _run_job(job, reporter, resume, runs_dir)
    except BaseException as err:  # noqa: BLE001 - mapped to a one-line error and exit code
        reporter.stop()
        fail(err, lambda: run_dir_or_root(job.run_ref, runs_dir))
    reporter.stop()
    _summarise(result, lens_summary, job.lens, reporter, quiet=quiet, json_out=json_out, log_json=log_json)


def _summarise(result, lens_summary, lens: bool, reporter: Reporter, *, quiet: bool, json_out: bool, log_json: bool):
    """What a run came to, on stdout (commands/generate.print_summary), and the exit code it deserves."""
    from ..commands.generate import print_summary

    code = print_summary(
        result,
        lens_summary,
        None if lens_summary is None else lens_line(lens_summary),
        lens=lens,
        quiet=quiet,
        json_out=json_out,
        log_json=log_json,
        message=reporter.message,
    )
    if code:
        raise typer.Exit(code)


def _workers_plan(spec_path, set_, workers, shard, runs_dir, run_id, resume, memory_budget, saes):
    """The shard processes `generate` starts: those `--workers N|auto` asks for; without it, those
    `plan_default` chooses for a dataset on the CPU, or a sharded run's own on `--resume`; None: one
    process (`--workers 1`, `--shard`, or nothing to gain)."""
    from ..commands import workers as w

    if workers == "1":
        return None
    try:
        if workers is None:
            if shard is not None:
                return None
            if resume:
                return w.plan_default_resume(resume, list(set_), runs_dir=runs_dir, memory_budget=memory_budget)
            return w.plan_default(
                spec_path, list(set_), run_id=run_id, runs_dir=runs_dir, memory_budget=memory_budget, saes=saes
            )
        w.refuse_shard(shard)
        if resume:
            return w.plan_resume(resume, list(set_), runs_dir=runs_dir, memory_budget=memory_budget)
        return w.plan_new(
            spec_path, list(set_), workers, run_id=run_id, runs_dir=runs_dir, memory_budget=memory_budget, saes=saes
        )
    except BaseException as err:  # noqa: BLE001 - mapped to a one-line error and exit code
        fail(err)


def _generate_workers(plan, *, quiet: bool, json_out: bool, log_json: bool, lens: bool):
    """The run as its plan's shard processes (commands/workers.py), reported as a run in one process
    is: its progress followed from disk, the same summary (text, -q, --json, --log-json) and `--lens`
    computed here once the run is complete (the workers hold no model by then: one load, as `lmtrace
    lens RUN`)."""
    import time

    from ..archive import layout
    from ..commands import workers as w
    from ..commands import workers_follow

    reporter = Reporter(quiet, log_json) if log_json else Reporter(quiet or json_out)
    rid, count = plan.run_id, len(plan.commands)
    threads = plan.env["OMP_NUM_THREADS"]
    why = f" ({plan.note})" if plan.note else ""
    reporter.message(
        f"run {rid}: {count} worker processes{why}, {threads} torch thread(s) each",
        event="workers",
        workers=count,
        torch_threads=int(threads) if threads.isdigit() else threads,
    )
    t0 = time.monotonic()
    follower = workers_follow.RunFollower(
        plan.run_dir, reporter.progress(), fresh=not (plan.run_dir / layout.MANIFEST).exists()
    )
    try:
        code = w.exit_code(w.run_workers(plan.commands, plan.env, follower.poll))
        follower.poll()
    except BaseException as err:  # noqa: BLE001 - mapped to a one-line error and exit code
        reporter.stop()
        fail(err)
    reporter.stop()
    if code == EXIT_INTERRUPTED:
        typer.echo(f"error: run {rid} interrupted; resume it with `lmtrace generate --resume {rid}`", err=True)
    if code:
        raise typer.Exit(code)  # each worker printed its own error line
    lens_summary = None
    try:
        result = workers_follow.run_result(plan.run_dir, time.monotonic() - t0)
        if lens:
            from ..commands.lens import lens_after

            lens_summary = lens_after(result, note=reporter.message)
    except BaseException as err:  # noqa: BLE001
        fail(err)
    _summarise(result, lens_summary, lens, reporter, quiet=quiet, json_out=json_out, log_json=log_json)


def _run_job(job, reporter: Reporter, resume: str | None, runs_dir: str | None) -> tuple:
    """Run a prepared generate job (an intervene child's resume through the intervene command) and its
    `--lens`; returns (result, the lens summary or None)."""
    if job.shard.count > 1:
        reporter.shard = job.shard.key
    progress = reporter.progress()
    if job.child:  # an intervene child: the intervene command replays its edits from its parent
        from ..commands.intervene import resume_child

        result, _ = resume_child(resume, runs_dir, progress=progress)
    else:
        result = job.run(progress)
    reporter.stop()
    lens_summary = None
    if job.lens:  # the lens command's own step, with the model still in memory
        from ..commands.lens import lens_after

        lens_summary = lens_after(result, note=reporter.message)
    return result, lens_summary


@app.command()
def validate(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="YAML run spec."),
    set_: list[str] = typer.Option([], "--set", help="Override a spec key: --set generation.seed=3"),
    json_out: bool = typer.Option(False, "--json", help="Print the resolved spec and estimate as JSON."),
    quiet: bool = typer.Option(
        False,
        "--quiet",
        "-q",
        help="Print nothing but errors and warnings: the exit code says whether the spec is valid.",
    ),
):
    """Check a spec, print it resolved with an archive-size estimate. Loads no model weights."""
    from ..commands.validate import validate_spec

    try:
        report = validate_spec(spec_path, list(set_))
    except BaseException as err:  # noqa: BLE001
        fail(err)
    if json_out:
        typer.echo(json_line(report))
        return
    if quiet:
        for line in report["warnings"]:
            typer.echo(f"warning: {line}", err=True)
        return
    import yaml

    typer.echo(yaml.safe_dump(report["resolved"], sort_keys=False).rstrip())
    comments = [report["summary"]]
    if report.get("placement"):
        comments.append(f"placement ({report['placement']['dtype']}): {report['placement']['text']}")
    for text in comments:  # YAML comments: on a terminal wrapped at its width, each line a comment
        typer.echo(_comment(text))
    for line in report["warnings"]:
        typer.echo(f"warning: {line}", err=True)


def _comment(text: str) -> str:
    """`# text`: one line when piped (scripts read the last line), wrapped at a terminal's width."""
    import shutil
    import textwrap

    if not sys.stdout.isatty():
        return f"# {text}"
    return textwrap.fill(
        text,
        width=max(shutil.get_terminal_size().columns - 1, 40),
        initial_indent="# ",
        subsequent_indent="# ",
        break_long_words=False,
        break_on_hyphens=False,
    )


# Registered after generate and validate, in this order, so `lmtrace --help` lists the commands
# in the order a user meets them.
from . import archive_commands, edit_commands, analysis_commands  # noqa: E402,F401,I001


def _reflow_help() -> None:
    """Each command's help with every paragraph on one line: typer keeps the single line breaks of a
    docstring's later paragraphs, so text wrapped at 100 columns in the source came out ragged on an
    80-column terminal; rich wraps a one-line paragraph at the terminal's width."""
    import inspect

    for info in app.registered_commands:
        doc = info.help or inspect.getdoc(info.callback) or ""
        info.help = "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))


_reflow_help()


def run() -> None:
    """Entry point. Usage errors (missing argument, unknown option) are one `error:` line too.
    The command's signal handler stays until the process exits (interrupts.until_exit)."""
    from ..exits.faults import pause_point
    from ..exits.interrupts import until_exit

    until_exit()
    try:
        _run()
    finally:
        pause_point("exit")  # (test-only: the command returned, the process about to exit)


def _run() -> None:
    try:
        rv = app(standalone_mode=False)
    except typer.Abort:
        typer.echo("error: aborted by the user", err=True)
        sys.exit(130)
    except Interrupted as err:  # a signal before a command's own error mapping (its imports, say)
        typer.echo(f"error: {one_line(err)}", err=True)
        sys.exit(err.exit_code)
    except Exception as err:  # noqa: BLE001
        # click's exceptions (typer may vendor its own copy of click, so match them by shape, not class)
        if type(err).__name__ == "NoArgsIsHelpError":  # `lmtrace` alone: the help is already printed
            sys.exit(2)
        code = getattr(err, "exit_code", None)
        if not (hasattr(err, "format_message") and isinstance(code, int)):
            raise
        message = one_line(err.format_message()).rstrip(".")
        ctx = getattr(err, "ctx", None)
        if code == 2 and ctx is not None:
            message += f"; see `{ctx.command_path} --help`"
        typer.echo(f"error: {message}", err=True)
        sys.exit(code)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    run()
