"""The `lmtrace` command line: parse, call one function, map errors to exit codes. No logic here."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from ..errors import EXIT_RUN_FAILED, Interrupted, LmtraceError
from ..interrupts import interrupt_on_signals
from ..jsonout import json_line
from . import help_format

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Trace what happens inside a causal language model while it generates.")

_state = {"debug": False}


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"lmtrace {__version__}")
        raise typer.Exit(0)


@app.callback()
def main(ctx: typer.Context, debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
         version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                      help="Print the version and exit.")):
    _state["debug"] = debug
    # every command, from its first line: SIGTERM/SIGINT exit 3 with one line, never die by the signal
    ctx.call_on_close(interrupt_on_signals(ctx.invoked_subcommand))


def _one_line(text: str) -> str:
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


def _run_dir(ref: str | None, runs_dir: str | None) -> Path:
    """Where a command writes, for an error line: the run's directory, else the runs directory."""
    from ..archive.runs import find_run, runs_root

    root = runs_root(runs_dir)
    try:
        return find_run(ref, root) if ref else root
    except LmtraceError:
        return root


def _fail(err: BaseException, where=None) -> None:
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
        typer.echo(f"error: {_one_line(err)}", err=True)
        raise typer.Exit(err.exit_code)
    full = _disk_full(err)
    if full is not None:  # the same line and exit code as a run that fails on a full disk
        from ..archive.writer import space_note

        target = where() if where is not None else _run_dir(None, None)
        typer.echo(f"error: {space_note(target, full)}; free some space and run it again", err=True)
        raise typer.Exit(EXIT_RUN_FAILED)
    if isinstance(err, KeyboardInterrupt):
        typer.echo("error: aborted by the user", err=True)
        raise typer.Exit(130)
    message = _one_line(f"{type(err).__name__}: {err}")
    typer.echo(f"error: internal error: {message} (rerun with --debug for the traceback)", err=True)
    raise typer.Exit(EXIT_RUN_FAILED)


class _Reporter:
    """Rich progress bar on a terminal; plain timestamped lines otherwise (cron, SLURM .out files)."""

    def __init__(self, quiet: bool, log_json: bool = False):
        self.quiet = quiet
        self.log_json = log_json  # JSON lines on stderr instead of a bar or plain lines
        self.tty = sys.stderr.isatty() and not log_json
        self.bar = None
        self.task = None
        self.done = 0
        self.t0 = time.time()
        self.last_line = 0.0

    def message(self, text: str, **fields) -> None:
        if self.quiet:
            return
        if self.log_json:
            typer.echo(json.dumps({"time": round(time.time(), 3), "event": fields.pop("event", "message"),
                                   "message": text, **fields}), err=True)
        else:
            typer.echo(f"[{time.strftime('%H:%M:%S')}] {text}", err=True)

    def starting(self, text: str = "importing torch") -> None:
        """A first line within a second on a terminal, before imports that take seconds; not in
        scripts, cron or SLURM, where an early bad-input error stays the only line on stderr."""
        if self.tty:
            self.message(text)

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
            self.message(f"generating: {n_prompts} prompt(s), up to {max_tokens} new tokens each", event="start",
                         prompts=n_prompts, max_new_tokens=max_tokens)

    def advance(self, tokens: int) -> None:
        self.done += tokens
        if self.quiet:
            return
        rate = self.done / max(time.time() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.update(self.task, advance=tokens, rate=f"{rate:.1f}")
        elif time.time() - self.last_line > 10:
            self.last_line = time.time()
            self.message(f"{self.done} tokens, {rate:.1f} tok/s", event="progress", tokens=self.done,
                         tokens_per_s=round(rate, 2))

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


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
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output; print only the run id."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    log_json: bool = typer.Option(False, "--log-json", help="Progress and events as JSON lines on stderr."),
    lens: bool = typer.Option(False, "--lens", help="Compute the deferred logit lens right after generating, in "
                              "this process (no second model load; as `lmtrace lens RUN`)."),
):
    """Run a spec: generate with capture hooks and stream everything to a run archive."""
    from ..spec import load_spec

    reporter = _Reporter(quiet, log_json) if log_json else _Reporter(quiet or json_out)
    try:
        shard_obj, slurm_run_id = None, None
        if shard is not None:  # importing .generate imports torch (seconds): plain spec errors stay fast
            from ..archive.rundir import parse_shard

            shard_obj, slurm_run_id = parse_shard(shard)
        child = False  # an intervene child being resumed: its edits are replayed from its parent
        if resume:
            from ..commands.resume import run_kind, spec_for_resume

            spec, text = spec_for_resume(resume, runs_dir, set_)
            run_id = spec.output.run_id
            child = run_kind(resume, runs_dir) == "intervene"
        else:
            if spec_path is None:
                from ..errors import SpecError

                raise SpecError("give a SPEC file, or --resume RUN_ID")
            run_id = run_id or slurm_run_id
            overrides = list(set_) + ([f"output.run_id={json.dumps(run_id)}"] if run_id else [])
            spec, text, _ = load_spec(spec_path, overrides)  # before torch is even imported: bad specs fail fast
        if shard_obj is not None and shard_obj.count > 1 and spec.output.run_id is None:
            from ..errors import SpecError

            raise SpecError("a sharded run needs a shared run id: pass --run-id (with --shard auto it is "
                            "slurm-<SLURM_ARRAY_JOB_ID>)")
        from ..commands.validate import preflight

        if not child:  # (a child's prompts are its parent's archived ones)
            preflight(spec, runs_dir)  # prompts, runs dir, model reference and layers, before loading weights
        reporter.message("spec checked; importing torch")  # the first line within a second; torch takes seconds
        from ..archive.rundir import check_target, parse_shard
        from ..generation import run_generate
        from ..progress import Progress
        from ..archive.runs import runs_root

        if shard_obj is None:
            shard_obj, _ = parse_shard(None)

        if lens and not spec.capture.lens_deferred:
            from ..errors import SpecError

            if not spec.capture.lens_inline:
                raise SpecError("--lens: this spec captures no logit lens (capture.lens.enabled: false, or "
                                "capture: none); drop --lens or enable the lens")
            lens = False  # an inline lens is computed during generation anyway
        check_target(runs_root(runs_dir, spec.output.runs_dir), spec, shard_obj, bool(resume),
                     kind="intervene" if child else "generate")
        progress = Progress(reporter.start, reporter.advance, reporter.message)
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
        _fail(err, lambda: _run_dir(resume or run_id, runs_dir))
    reporter.stop()
    summary = {"run_id": result.run_id, "run_dir": str(result.run_dir), "status": result.status,
               "sequences": result.n_sequences, "generated_tokens": result.n_tokens,
               "seconds": round(result.seconds, 2), **({"lens": lens_summary} if lens else {})}
    if log_json:
        reporter.message(f"run {result.run_id}: {result.status}", event="finished", **summary)
    if result.status.startswith("shard-complete-others-failed:"):
        from ..errors import EXIT_PARTIAL_SHARDS

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
            typer.echo(f"  {_lens_line(lens_summary)}")


def _lens_line(summary: dict) -> str:
    """The words `lmtrace lens` prints for a run, also after `generate --lens` / `intervene --lens`."""
    if summary["computed"]:
        return f"logit lens computed ({summary['rows']} rows, {summary['seconds']:.1f} s)"
    return summary["reason"]


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
        _fail(err)
    if json_out:
        typer.echo(json_line(report))
        return
    if quiet:
        for line in report["warnings"]:
            typer.echo(f"warning: {line}", err=True)
        return
    import yaml

    typer.echo(yaml.safe_dump(report["resolved"], sort_keys=False).rstrip())
    typer.echo(f"# {report['summary']}")
    if report.get("placement"):
        typer.echo(f"# placement ({report['placement']['dtype']}): {report['placement']['text']}")
    for line in report["warnings"]:
        typer.echo(f"warning: {line}", err=True)


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
        _fail(err)


@app.command()
def show(
    run: str = typer.Argument(..., help="Run id (or unique prefix) or run directory."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json", help="The same as JSON (with --step: that step's details)."),
    no_color: bool = typer.Option(False, "--no-color", help="Probabilities as numbers instead of colours."),
    step: Optional[int] = typer.Option(None, "--step", help="Show this generated step in detail: chosen token, "
                                       "alternatives and logit lens as text."),
    sequence: Optional[int] = typer.Option(None, "--sequence", help="Only this sequence (with --step: default 0)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print the generated text only (with --step: the "
                               "chosen token's text only)."),
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
        _fail(err)


@app.command()
def verify(
    run: str = typer.Argument(..., help="Run id (or unique prefix) or run directory."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on stdout: the exit code says it (0 "
                               "intact, 2 damaged, with the one error line)."),
):
    """Check a complete run's files against the checksums recorded at completion (exit 2 when damaged)."""
    from ..commands.verify import verify_run

    try:
        code = verify_run(run, runs_dir, json_out, quiet=quiet)
    except BaseException as err:  # noqa: BLE001
        _fail(err)
    raise typer.Exit(code)


@app.command()
def intervene(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Parent run id (or unique prefix) or directory."),
    spec_path: Optional[Path] = typer.Option(None, "--spec", help="YAML with `interventions:` (and optional mode, from_step)."),
    ablate_head: list[str] = typer.Option([], "--ablate-head", help="LAYER.HEAD[:mean], e.g. 12.3 (zero) or 12.3:mean."),
    ablate_layer: list[str] = typer.Option([], "--ablate-layer", help="LAYER[:mean]: skip a layer's residual contribution (or add its mean)."),
    ablate_mlp: list[str] = typer.Option([], "--ablate-mlp", help="LAYER[:mean]: zero (or mean-ablate) a layer's MLP output."),
    ablate_attn: list[str] = typer.Option([], "--ablate-attn", help="LAYER[:mean]: zero (or mean-ablate) a layer's attention output."),
    ablate_neurons: list[str] = typer.Option([], "--ablate-neurons", help="LAYER:N1,N2,...[:mean] e.g. 7:120,455"),
    mask_positions: list[str] = typer.Option([], "--mask-positions", help="Token positions to hide, e.g. 3-9 or 1,4, or a span: prompt, generated, system, user"),
    from_step: Optional[int] = typer.Option(None, "--from-step", help="Edits apply from this step on."),
    mode: Optional[str] = typer.Option(None, "--mode", help="rescore (teacher-force the parent's tokens) or regenerate."),
    temperatures: Optional[str] = typer.Option(None, "--temperatures", help="Sweep: one regenerated child per temperature, e.g. 0.5,1.0"),
    lens: bool = typer.Option(False, "--lens", help="Compute each child's deferred logit lens right after it is "
                              "written, in this process (no second model load)."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    run_id: Optional[str] = typer.Option(None, "--run-id"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output; print only the child run id(s), one per line."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Re-run an archived run under real interventions; writes a child run linked to its parent."""
    reporter = _Reporter(quiet or json_out)
    reporter.starting()
    from ..progress import Progress
    from .intervene import intervene_command

    try:
        summary = intervene_command(
            run_ref, spec_path, dict(ablate_head=ablate_head, ablate_layer=ablate_layer, ablate_mlp=ablate_mlp,
                                     ablate_attn=ablate_attn, ablate_neurons=ablate_neurons,
                                     mask_positions=mask_positions),
            from_step=from_step, mode=mode, temperatures=temperatures, runs_dir=runs_dir, run_id=run_id, lens=lens,
            progress=Progress(reporter.start, reporter.advance, reporter.message), json_out=json_out, quiet=quiet)
    except BaseException as err:  # noqa: BLE001
        reporter.stop()
        if isinstance(err, typer.Exit):
            raise
        _fail(err, lambda: _run_dir(None, runs_dir) if runs_dir else _run_dir(run_ref, None).parent)
    reporter.stop()
    if json_out:
        typer.echo(json_line(summary))


@app.command()
def sweep(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Run id (or unique prefix) or run directory."),
    over: Optional[str] = typer.Option(None, "--over", help="heads | attn | mlp | layers | neurons:LAYER | positions | resid:A-B"),
    edit: Optional[str] = typer.Option(None, "--edit", help="zero | mean | patch (default zero)."),
    source: Optional[str] = typer.Option(None, "--source", help="Patch: the run whose activations are patched in."),
    metric: list[str] = typer.Option([], "--metric", "-m", help="logprob, prob, kl, rank, logit_diff:A,B (repeatable; "
                                     "the first ranks). Default: logprob, prob, kl, rank."),
    steps: Optional[str] = typer.Option(None, "--steps", help="Steps measured: 0,4,9 or 2-5 or all (default all)."),
    sequences: Optional[str] = typer.Option(None, "--sequences", help="Sequences: 0,2 or 0-3 or all (default all)."),
    positions: Optional[str] = typer.Option(None, "--positions", help="Edit one position at a time: 3-9 or 0,4 "
                                            "(default: every position at once; resid and positions: each prompt position)."),
    batch: Optional[int] = typer.Option(None, "--batch", help="Cells per forward (batch rows; default 32)."),
    from_step: Optional[int] = typer.Option(None, "--from-step", help="Edits apply from this step on; the unedited "
                                            "prefix is computed once and its KV cache shared (steps >= it are measured)."),
    spec_path: Optional[Path] = typer.Option(None, "--spec", help="YAML sweep spec (the same keys; flags override)."),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N or auto (SLURM array): split the cells over processes."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Sweep id (shared by shards; reused to continue)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the unfinished sweep --run-id."),
    top: int = typer.Option(20, "--top", help="Cells in the ranked table."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output; print only the sweep id."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
):
    """Ablate or patch every head, block, layer, neuron or position in turn; results go into RUN/sweeps/."""
    reporter = _Reporter(quiet or json_out)
    reporter.starting()
    from .sweep import sweep_command

    try:
        sweep_command(run_ref, spec_path=spec_path, flags=dict(over=over, edit=edit, source=source, metrics=metric,
                                                               steps=steps, sequences=sequences, positions=positions,
                                                               batch=batch, from_step=from_step),
                      runs_dir=runs_dir, run_id=run_id, shard=shard, resume=resume, top=top, json_out=json_out,
                      quiet=quiet, note=reporter.message)
    except BaseException as err:  # noqa: BLE001
        reporter.stop()
        _fail(err, lambda: _run_dir(run_ref, runs_dir))
    reporter.stop()


@app.command()
def explain(
    run: str = typer.Argument(..., help="Run id (or unique prefix) or run directory."),
    steps: str = typer.Option(..., "--steps", help="Generated steps to explain: 0,4,9 or 2-5 or all."),
    sequence: int = typer.Option(0, "--sequence", help="Sequence (prompt index) of the run."),
    method: list[str] = typer.Option(["grad_x_input"], "--method", "-m",
                                     help="grad_x_input, integrated_gradients, occlusion, attention_rollout "
                                          "(repeat or comma-separate)."),
    target: str = typer.Option("chosen", "--target", help="chosen | runner-up | contrast (chosen − runner-up)."),
    quantity: str = typer.Option("logit", "--quantity", help="logit | logprob of the target token."),
    baseline: str = typer.Option("mean", "--baseline", help="Integrated gradients baseline: mean | scaled-mean | pad | zero embedding."),
    ig_steps: int = typer.Option(16, "--ig-steps", help="Integrated gradients: initial intervals (adaptive) or "
                                                         "points (midpoint)."),
    ig_rule: str = typer.Option("adaptive", "--ig-rule", help="Integrated gradients: adaptive | midpoint (fixed grid)."),
    ig_tolerance: float = typer.Option(0.01, "--ig-tolerance", help="Integrated gradients: completeness error allowed, "
                                                                     "relative to |f(x) − f(baseline)|."),
    ig_max_points: int = typer.Option(1024, "--ig-max-points", help="Integrated gradients: gradient budget per step."),
    ig_keep: str = typer.Option("sink", "--ig-keep", help="Integrated gradients: positions kept at their own "
                                "embedding in the baseline: `sink` (position 0, default), `special` (position 0 and every "
                                "special token, e.g. a chat template's), none, or 0,3,..."),
    ig_dtype: str = typer.Option("float32", "--ig-dtype", help="Integrated gradients: float32 | float64 forwards and "
                                 "gradients (float64: twice the memory, a remedy when not converged)."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when integrated gradients did not converge."),
    batch_size: int = typer.Option(8, "--batch-size", help="Forwards per batch (IG points, occluded positions)."),
    rollout_exclude: str = typer.Option("", "--rollout-exclude", help="Attention rollout: leave out these key "
                                        "positions and renormalise: `sink` (position 0) or 0,3,..."),
    device: Optional[str] = typer.Option(None, "--device", help="Device for the model (default: the run's)."),
    top: int = typer.Option(10, "--top", help="Top contributing positions to list per step and method."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Write the results, print nothing."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
):
    """Attribute archived generated tokens to their context positions; results go into the run."""
    _Reporter(quiet or json_out).starting()
    from ..commands.explain import Settings, explain_command

    try:
        explain_command(run, steps, sequence=sequence, methods=method, device=device, runs_dir=runs_dir,
                        settings=Settings(target=target, quantity=quantity, baseline=baseline, ig_steps=ig_steps,
                                          ig_rule=ig_rule, batch_size=batch_size, ig_tolerance=ig_tolerance,
                                          ig_max_points=ig_max_points, ig_keep=ig_keep, ig_dtype=ig_dtype,
                                          rollout_exclude=rollout_exclude),
                        json_out=json_out, quiet=quiet, top=top, strict=strict)
    except BaseException as err:  # noqa: BLE001
        _fail(err, lambda: _run_dir(run, runs_dir))


@app.command()
def lens(
    runs: list[str] = typer.Argument(..., metavar="RUN...", help="Run ids (or unique prefixes) or run directories."),
    device: Optional[str] = typer.Option(None, "--device", help="Device for the model (default: the run's)."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON summary per run on stdout."),
):
    """Compute the deferred logit lens of complete runs from their archived residual stream."""
    import warnings

    from ..archive.reader import IncompleteRunWarning, open_run
    from ..commands.lens import compute_lens

    reporter = _Reporter(quiet or json_out)
    ref = runs[0]  # (the run being computed, named if the disk fills up)
    try:
        for ref in runs:
            with warnings.catch_warnings():  # an unfinished run is refused below, in one line
                warnings.simplefilter("ignore", IncompleteRunWarning)
                run = open_run(ref, runs_dir)
            summary = compute_lens(run, device=device, note=reporter.message)
            if json_out:
                typer.echo(json_line(summary))
            elif not quiet:
                typer.echo(f"{run.id}: {_lens_line(summary)}")
    except BaseException as err:  # noqa: BLE001
        reporter.stop()
        _fail(err, lambda: _run_dir(ref, runs_dir))
    reporter.stop()


@app.command()
def heads(
    run: str = typer.Argument(..., metavar="RUN", help="Run id (or unique prefix) or run directory."),
    per_sequence: bool = typer.Option(False, "--per-sequence", help="Also write per-sequence scores "
                                      "(analysis/heads_per_sequence.parquet)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write heads.parquet here instead of RUN/analysis/."),
    top: int = typer.Option(20, "--top", help="Heads to print in the table (all are written)."),
    label: list[str] = typer.Option([], "--label", metavar="LABEL", help="Show only heads with this label (repeatable, or "
                                    "comma-separated): induction, previous-token, local, focused, sink, diffuse. "
                                    "The files keep every head."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors; heads.parquet is written."),
):
    """Classify every attention head (sink, previous-token, induction, ...) from the archive; no model."""
    from ..commands.heads import heads_command

    try:
        heads_command(run, runs_dir=runs_dir, out=out, per_sequence=per_sequence, json_out=json_out, top=top,
                      labels=label, quiet=quiet)
    except BaseException as err:  # noqa: BLE001
        _fail(err, lambda: out or _run_dir(run, runs_dir))


@app.command()
def compare(
    run_a: str = typer.Argument(..., metavar="A", help="Run id (or unique prefix) or run directory."),
    run_b: str = typer.Argument(..., metavar="B", help="Run id (or unique prefix) or run directory."),
    pair: str = typer.Option("auto", "--pair", help="Pair sequences by: auto | index | prompt (text)."),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete", help="Compare unfinished runs up to their committed steps."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write per-step / per-layer / per-head Parquet tables and report.md here."),
    html_out: Optional[Path] = typer.Option(None, "--html", help="Also write the comparison as a self-contained HTML "
                                            "page here (as `lmtrace report A B --out PATH`)."),
    top: int = typer.Option(5, "--top", help="Layers, heads and pairs to show in the summary."),
    exact: bool = typer.Option(False, "--exact", help="Load the model(s) and rescore the paired contexts: exact "
                                                       "full-vocabulary KL/JS and logit differences."),
    exact_steps: Optional[str] = typer.Option(None, "--exact-steps", help="With --exact: only these paired steps "
                                                                          "(0,4,9 or 2-5; default all)."),
    device: Optional[str] = typer.Option(None, "--device", help="With --exact: device for the model(s)."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print the verdict line only (--out and --html are "
                               "still written)."),
):
    """Diff two runs from their archives (no model is loaded unless --exact): divergence, distributions, layers, heads."""
    from ..commands.compare import compare_view

    try:
        compare_view(run_a, run_b, runs_dir=runs_dir, allow_incomplete=allow_incomplete, pair=pair,
                     json_out=json_out, out_dir=out, top=top, html_path=html_out, exact=exact,
                     exact_steps=exact_steps, device=device, quiet=quiet)
    except BaseException as err:  # noqa: BLE001
        _fail(err, lambda: out or html_out or _run_dir(run_a, runs_dir))


@app.command()
def report(
    runs: list[str] = typer.Argument(..., metavar="RUN [RUN_B]", help="A run id (or unique prefix) or directory; "
                                     "two runs: a comparison report (as `lmtrace compare A B --html`)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="HTML file to write (default: RUN_DIR/report.html; "
                                       "for two runs A_DIR/compare-B.html)."),
    sequence: list[str] = typer.Option([], "--sequence", "-s", metavar="SEQUENCES", help="Sequences to show: 0,3 or "
                                       "0-15 or all (repeatable; default: the first 2)."),
    steps: Optional[str] = typer.Option(None, "--steps", help="Steps to show: 0,4,9 or 2-5 or all, with an optional "
                                        "stride 0-255:4 (default: all up to 256 steps, else a stride)."),
    layer: list[int] = typer.Option([], "--layer", "-l", help="Layer with per-head step × key heatmaps (repeatable; "
                                    "default: first, middle and last captured)."),
    attention_step: Optional[int] = typer.Option(None, "--attention-step", help="Step of the layer × head attention "
                                                 "grid (default: the last step shown)."),
    png: Optional[Path] = typer.Option(None, "--png", help="Also write every figure as a PNG file into this directory."),
    svg: Optional[Path] = typer.Option(None, "--svg", help="Also write every figure as an SVG file into this directory."),
    pair: str = typer.Option("auto", "--pair", help="Two runs: pair sequences by auto | index | prompt."),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete", help="Two runs: compare unfinished runs."),
    open_: bool = typer.Option(False, "--open", help="Open the page in the default browser when written."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", help="Runs directory (default: $LMTRACE_RUNS_DIR, ./runs)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
    json_out: bool = typer.Option(False, "--json", help="Print {\"path\": ...} and sizes as JSON."),
):
    """Write a self-contained HTML report of a run (or of two runs compared); works offline."""
    try:
        from ..report import report_compare, report_run

        if png is not None and svg is not None:
            from ..errors import SpecError

            raise SpecError("give --png DIR or --svg DIR, not both")
        images, fmt = (svg, "svg") if svg is not None else (png, "png")
        if len(runs) == 1:
            result = report_run(runs[0], runs_dir=runs_dir, out=out, sequences=sequence or None, steps=steps,
                                layers=layer or None, attention_step=attention_step, png_dir=images, image_format=fmt)
        elif len(runs) == 2:
            result = report_compare(runs[0], runs[1], runs_dir=runs_dir, out=out, pair=pair,
                                    allow_incomplete=allow_incomplete, png_dir=images, image_format=fmt)
        else:
            from ..errors import SpecError

            raise SpecError(f"give one run (a run report) or two (a comparison), not {len(runs)}")
    except BaseException as err:  # noqa: BLE001
        _fail(err, lambda: out or _run_dir(runs[0], runs_dir))
    if json_out:
        typer.echo(json_line(result.summary()))
    elif not quiet:
        typer.echo(str(result.path))
    if open_:
        import webbrowser

        webbrowser.open(result.path.resolve().as_uri())


@app.command()
def serve(
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir", help="Runs directory (default: $LMTRACE_RUNS_DIR, ./runs)."),
    host: str = typer.Option("127.0.0.1", "--host", metavar="ADDRESS", help="Address to listen on; any but loopback needs --token."),
    port: int = typer.Option(8765, "--port", metavar="N", help="Port to listen on (0: a free one, printed)."),
    token: Optional[str] = typer.Option(None, "--token", metavar="TOKEN", help="Access token every request must carry (the printed "
                                        "address sets it as a cookie); required with a non-loopback --host."),
    open_: bool = typer.Option(False, "--open", help="Open the address in the default browser."),
):
    """Explore the runs in a local, read-only web page: runs, sequences, and per token its attention, lens and alternatives."""
    try:
        from ..commands.serve import serve as serve_command

        serve_command(runs_dir, host, port, token, open_)
    except BaseException as err:  # noqa: BLE001
        if isinstance(err, KeyboardInterrupt):
            raise typer.Exit(0)
        _fail(err)


help_format.fill_in(app)
help_format.install()


def run() -> None:
    """Entry point. Usage errors (missing argument, unknown option) are one `error:` line too."""
    try:
        rv = app(standalone_mode=False)
    except typer.Abort:
        typer.echo("error: aborted by the user", err=True)
        sys.exit(130)
    except Interrupted as err:  # a signal before a command's own error mapping (its imports, say)
        typer.echo(f"error: {_one_line(err)}", err=True)
        sys.exit(err.exit_code)
    except Exception as err:  # noqa: BLE001
        # click's exceptions (typer may vendor its own copy of click, so match them by shape, not class)
        if type(err).__name__ == "NoArgsIsHelpError":  # `lmtrace` alone: the help is already printed
            sys.exit(2)
        code = getattr(err, "exit_code", None)
        if not (hasattr(err, "format_message") and isinstance(code, int)):
            raise
        message = _one_line(err.format_message()).rstrip(".")
        ctx = getattr(err, "ctx", None)
        if code == 2 and ctx is not None:
            message += f"; see `{ctx.command_path} --help`"
        typer.echo(f"error: {message}", err=True)
        sys.exit(code)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    run()
