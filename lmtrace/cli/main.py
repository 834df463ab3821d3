"""The `lmtrace` command line: parse, call one function, map errors to exit codes. No logic here.

`app` (cli/app.py) holds the callback and the error mapping; this module defines `generate` and
`validate`, then registers the other commands in the order `lmtrace --help` lists them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from ..exits.errors import Interrupted
from ..output.jsonout import json_line
from .app import Reporter, app, fail, lens_line, one_line, run_dir_or_root


@app.command()
def generate(
    spec_path: Optional[Path] = typer.Argument(None, metavar="SPEC", help="YAML run spec (optional with --resume)."),
    set_: list[str] = typer.Option([], "--set", help="Override a spec key: --set generation.seed=3"),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", help="Runs directory (default: spec, $LMTRACE_RUNS_DIR, ./runs)."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Run id (default: generated, sortable). An existing "
                                         "unfinished run with the same spec is resumed."),
    resume: Optional[str] = typer.Option(None, "--resume", metavar="RUN_ID", help="Continue an interrupted or killed run "
                                         "(an intervene child too: its edits are replayed from its parent)."),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: take every N-th prompt from I; `auto` reads SLURM array variables."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", metavar="SIZE", help="Memory the batches may "
                                                "take beyond the model (8GiB, 512MB): sizes `batch_size: auto`, splits "
                                                "a batch over it (generation.memory_budget)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output; print only the run id."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    log_json: bool = typer.Option(False, "--log-json", help="Progress and events as JSON lines on stderr."),
    lens: bool = typer.Option(False, "--lens", help="Compute the deferred logit lens right after generating, in "
                              "this process (no second model load; as `lmtrace lens RUN`)."),
):
    """Run a spec: generate with capture hooks and stream everything to a run archive."""
    from ..spec.run_spec import load_spec

    reporter = Reporter(quiet, log_json) if log_json else Reporter(quiet or json_out)
    try:
        shard_obj, slurm_run_id = None, None
        if shard is not None:  # importing .generate imports torch (seconds): plain spec errors stay fast
            from ..archive.rundir import parse_shard

            shard_obj, slurm_run_id = parse_shard(shard)
        child = False  # an intervene child being resumed: its edits are replayed from its parent
        if resume:
            from ..runner.resume import run_kind, spec_for_resume

            spec, text = spec_for_resume(resume, runs_dir, set_ + ([f"generation.memory_budget={memory_budget}"]
                                                                   if memory_budget is not None else []))
            run_id = spec.output.run_id
            child = run_kind(resume, runs_dir) == "intervene"
        else:
            if spec_path is None:
                from ..exits.errors import SpecError

                raise SpecError("give a SPEC file, or --resume RUN_ID")
            run_id = run_id or slurm_run_id
            overrides = list(set_) + ([f"output.run_id={json.dumps(run_id)}"] if run_id else [])
            if memory_budget is not None:
                overrides.append(f"generation.memory_budget={json.dumps(memory_budget)}")
            spec, text, _ = load_spec(spec_path, overrides)  # before torch is even imported: bad specs fail fast
        if shard_obj is not None and shard_obj.count > 1 and spec.output.run_id is None:
            from ..exits.errors import SpecError

            raise SpecError("a sharded run needs a shared run id: pass --run-id (with --shard auto it is "
                            "slurm-<SLURM_ARRAY_JOB_ID>)")
        from ..commands.validate import preflight

        if not child:  # (a child's prompts are its parent's archived ones)
            preflight(spec, runs_dir)  # prompts, runs dir, model reference and layers, before loading weights
        reporter.message("spec checked; importing torch")  # the first line within a second; torch takes seconds
        from ..archive.rundir import check_target, parse_shard
        from ..runner.generation import run_generate
        from ..archive.runs import runs_root

        if shard_obj is None:
            shard_obj, _ = parse_shard(None)

        if lens and not spec.capture.lens_deferred:
            from ..exits.errors import SpecError

            if not spec.capture.lens_inline:
                raise SpecError("--lens: this spec captures no logit lens (capture.lens.enabled: false, or "
                                "capture: none); drop --lens or enable the lens")
            lens = False  # an inline lens is computed during generation anyway
        check_target(runs_root(runs_dir, spec.output.runs_dir), spec, shard_obj, bool(resume),
                     kind="intervene" if child else "generate")
        if shard_obj.count > 1:
            reporter.shard = shard_obj.key
        progress = reporter.progress()
        if child:
            from ..commands.intervene import resume_child

            result, _ = resume_child(resume, runs_dir, progress=progress)
        else:
            result = run_generate(spec, text, runs_dir_flag=runs_dir, shard=shard_obj, resume=bool(resume),
                                  progress=progress)
        reporter.stop()
        lens_summary = None
        if lens:
            from ..commands.lens import lens_after

            lens_summary = lens_after(result, note=reporter.message)
    except BaseException as err:  # noqa: BLE001 - mapped to a one-line error and exit code
        reporter.stop()
        fail(err, lambda: run_dir_or_root(resume or run_id, runs_dir))
    reporter.stop()
    summary = {"run_id": result.run_id, "run_dir": str(result.run_dir), "status": result.status,
               "sequences": result.n_sequences, "generated_tokens": result.n_tokens,
               "seconds": round(result.seconds, 2), **({"lens": lens_summary} if lens else {})}
    if log_json:
        reporter.message(f"run {result.run_id}: {result.status}", event="finished", **summary)
    if result.status.startswith("shard-complete-others-failed:"):
        from ..exits.errors import EXIT_PARTIAL_SHARDS

        others = result.status.split(":", 1)[1]
        typer.echo(f"error: this shard is complete, but {others} of run {result.run_id} failed or was interrupted; "
                   f"rerun it with `lmtrace generate --resume {result.run_id} --shard I/N`", err=True)
        raise typer.Exit(EXIT_PARTIAL_SHARDS)
    if json_out:
        typer.echo(json_line(summary))
    elif quiet:  # the run id alone, for scripts: RUN=$(lmtrace generate spec.yaml -q)
        typer.echo(result.run_id)
    else:
        what = ("this shard is complete; the run completes when its other shards do"
                if result.status == "shard-complete" else result.status)
        typer.echo(f"run {result.run_id}: {what}, {result.n_sequences} sequence(s), "
                   f"{result.n_tokens} tokens in {result.seconds:.1f}s -> {result.run_dir}")
        for i, text in enumerate(result.texts[:5]):
            typer.echo(f"  [{i}] {text!r}")
        if len(result.texts) > 5:
            typer.echo(f"  ... {len(result.texts) - 5} more (lmtrace show {result.run_id})")
        if lens_summary is not None:
            typer.echo(f"  {lens_line(lens_summary)}")


@app.command()
def validate(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="YAML run spec."),
    set_: list[str] = typer.Option([], "--set", help="Override a spec key: --set generation.seed=3"),
    json_out: bool = typer.Option(False, "--json", help="Print the resolved spec and estimate as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors and warnings: the exit "
                               "code says whether the spec is valid."),
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
    return textwrap.fill(text, width=max(shutil.get_terminal_size().columns - 1, 40), initial_indent="# ",
                         subsequent_indent="# ", break_long_words=False, break_on_hyphens=False)


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
    from ..exits.interrupts import until_exit
    from ..exits.faults import pause_point

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
