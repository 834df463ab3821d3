"""Commands that analyse and show archives: `explain`, `lens`, `heads`, `stats`, `compare`, `report`, `serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..output.jsonout import json_line
from . import help_format
from .app import Reporter, app, fail, lens_line, run_dir_or_root


@app.command(help="Attribute archived generated tokens to their context positions; results go into the run.")
def explain(
    run: str = typer.Argument(..., help="Run id (or unique prefix) or run directory."),
    steps: str = typer.Option(..., "--steps", help="Generated steps to explain: 0,4,9 or 2-5 or all."),
    sequence: int = typer.Option(0, "--sequence", help="Sequence (prompt index) of the run."),
    method: list[str] = typer.Option(
        ["grad_x_input"],
        "--method",
        "-m",
        help="grad_x_input, integrated_gradients, occlusion, attention_rollout, lrp (repeat or comma-separate).",
    ),
    target: str = typer.Option("chosen", "--target", help="chosen | runner-up | contrast (chosen − runner-up)."),
    quantity: str = typer.Option("logit", "--quantity", help="logit | logprob of the target token."),
    baseline: str = typer.Option(
        "mean", "--baseline", help="Integrated gradients baseline: mean | scaled-mean | pad | zero embedding."
    ),
    ig_steps: int = typer.Option(
        16, "--ig-steps", help="Integrated gradients: initial intervals (adaptive) or points (midpoint)."
    ),
    ig_rule: str = typer.Option(
        "adaptive", "--ig-rule", help="Integrated gradients: adaptive | midpoint (fixed grid)."
    ),
    ig_tolerance: float = typer.Option(
        0.01,
        "--ig-tolerance",
        help="Integrated gradients: completeness error allowed, relative to |f(x) − f(baseline)|.",
    ),
    ig_max_points: int = typer.Option(1024, "--ig-max-points", help="Integrated gradients: gradient budget per step."),
    ig_keep: str = typer.Option(
        "sink",
        "--ig-keep",
        help="Integrated gradients: positions kept at their own "
        "embedding in the baseline: `sink` (position 0, default), `special` (position 0 and every "
        "special token, e.g. a chat template's), none, or 0,3,...",
    ),
    ig_dtype: str = typer.Option(
        "float32",
        "--ig-dtype",
        help="Integrated gradients: float32 | float64 forwards and "
        "gradients (float64: twice the memory, a remedy when not converged).",
    ),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Exit 1 when a result failed its method's own check "
        "(integrated gradients did not converge, lrp did not conserve f).",
    ),
    batch_size: int = typer.Option(8, "--batch-size", help="Forwards per batch (IG points, occluded positions)."),
    rollout_exclude: str = typer.Option(
        "",
        "--rollout-exclude",
        help="Attention rollout: leave out these key positions and renormalise: `sink` (position 0) or 0,3,...",
    ),
    sae: list[str] = typer.Option(
        [],
        "--sae",
        help="grad_x_input and lrp also attribute to this SAE's latents and an error node at its hook: a "
        "SAELens directory or the name of an SAE the run recorded (repeatable).",
    ),
    sae_top: int = typer.Option(16, "--sae-top", help="With --sae: latents kept per position, by |attribution|."),
    device: Optional[str] = typer.Option(None, "--device", help="Device for the model (default: the run's)."),
    top: int = typer.Option(10, "--top", help="Top contributing positions to list per step and method."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Write the results, print nothing."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
):
    """Long because typer declares its twenty-odd options in the signature; the body only bundles them into
    commands.explain's Settings and call (the help text is the decorator's)."""
    Reporter(quiet or json_out).starting()
    from ..commands.explain import Settings, explain_command

    try:
        explain_command(
            run,
            steps,
            sequence=sequence,
            methods=method,
            device=device,
            runs_dir=runs_dir,
            settings=Settings(
                target=target,
                quantity=quantity,
                baseline=baseline,
                ig_steps=ig_steps,
                ig_rule=ig_rule,
                batch_size=batch_size,
                ig_tolerance=ig_tolerance,
                ig_max_points=ig_max_points,
                ig_keep=ig_keep,
                ig_dtype=ig_dtype,
                rollout_exclude=rollout_exclude,
                sae_top=sae_top,
            ),
            json_out=json_out,
            quiet=quiet,
            top=top,
            strict=strict,
            saes=sae,
        )
    except BaseException as err:  # noqa: BLE001
        fail(err, lambda: run_dir_or_root(run, runs_dir))


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
    from ..spec.run_spec import check_device_option

    reporter = Reporter(quiet or json_out)
    ref = runs[0]  # (the run being computed, named if the disk fills up)
    try:
        check_device_option(device)  # before any run is read
        for ref in runs:
            with warnings.catch_warnings():  # an unfinished run is refused below, in one line
                warnings.simplefilter("ignore", IncompleteRunWarning)
                run = open_run(ref, runs_dir)
            summary = compute_lens(run, device=device, note=reporter.message)
            if json_out:
                typer.echo(json_line(summary))
            elif not quiet:
                typer.echo(f"{run.id}: {lens_line(summary)}")
    except BaseException as err:  # noqa: BLE001
        reporter.stop()
        fail(err, lambda: run_dir_or_root(ref, runs_dir))
    reporter.stop()


@app.command()
def heads(
    run: str = typer.Argument(..., metavar="RUN", help="Run id (or unique prefix) or run directory."),
    per_sequence: bool = typer.Option(
        False, "--per-sequence", help="Also write per-sequence scores (analysis/heads_per_sequence.parquet)."
    ),
    out: Optional[Path] = typer.Option(None, "--out", help="Write heads.parquet here instead of RUN/analysis/."),
    top: int = typer.Option(20, "--top", help="Heads to print in the table (all are written)."),
    label: list[str] = typer.Option(
        [],
        "--label",
        metavar="LABEL",
        help="Show only heads with this label (repeatable, or "
        "comma-separated): induction, previous-token, local, focused, sink, diffuse. "
        "The files keep every head.",
    ),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors; heads.parquet is written."),
    by: Optional[str] = typer.Option(
        None,
        "--by",
        metavar="COLUMN",
        help="Also score every head per group of "
        "sequences: a column of sequences.parquet (prompt metadata, stop_reason, ...); "
        "written to analysis/heads_by_COLUMN.parquet.",
    ),
):
    """Classify every attention head (sink, previous-token, induction, ...) from the archive; no model."""
    from ..commands.heads import heads_command

    try:
        heads_command(
            run,
            runs_dir=runs_dir,
            out=out,
            per_sequence=per_sequence,
            json_out=json_out,
            top=top,
            labels=label,
            quiet=quiet,
            by=by,
        )
    except BaseException as err:  # noqa: BLE001
        fail(err, lambda: out or run_dir_or_root(run, runs_dir))


@app.command()
def stats(
    run: str = typer.Argument(..., metavar="RUN", help="Run id (or unique prefix) or run directory."),
    by: Optional[str] = typer.Option(
        None,
        "--by",
        metavar="COLUMN",
        help="Per group of sequences: a column of sequences.parquet (prompt metadata, stop_reason, ...).",
    ),
    lowest: int = typer.Option(5, "--lowest", help="Lowest-probability tokens listed per group."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Sequences, tokens, mean logprob and entropy, where the lens settles, the least likely tokens (per group)."""
    from ..commands.stats import stats_command

    try:
        stats_command(run, runs_dir=runs_dir, by=by, json_out=json_out, lowest=lowest)
    except BaseException as err:  # noqa: BLE001
        fail(err)


@app.command()
def compare(
    run_a: str = typer.Argument(..., metavar="A", help="Run id (or unique prefix) or run directory."),
    run_b: str = typer.Argument(..., metavar="B", help="Run id (or unique prefix) or run directory."),
    pair: str = typer.Option("auto", "--pair", help="Pair sequences by: auto | index | prompt (text)."),
    allow_incomplete: bool = typer.Option(
        False, "--allow-incomplete", help="Compare unfinished runs up to their committed steps."
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Write per-step / per-layer / per-head Parquet tables and report.md here."
    ),
    html_out: Optional[Path] = typer.Option(
        None,
        "--html",
        help="Also write the comparison as a self-contained HTML page here (as `lmtrace report A B --out PATH`).",
    ),
    top: int = typer.Option(5, "--top", help="Layers, heads and pairs to show in the summary."),
    exact: bool = typer.Option(
        False,
        "--exact",
        help="Load the model(s) and rescore the paired contexts: exact full-vocabulary KL/JS and logit differences.",
    ),
    exact_steps: Optional[str] = typer.Option(
        None, "--exact-steps", help="With --exact: only these paired steps (0,4,9 or 2-5; default all)."
    ),
    device: Optional[str] = typer.Option(None, "--device", help="With --exact: device for the model(s)."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    json_out: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Print the verdict line only (--out and --html are still written)."
    ),
):
    """Diff two runs from their archives (no model is loaded unless --exact): divergence, distributions, layers, heads."""
    from ..commands.compare import compare_view

    try:
        compare_view(
            run_a,
            run_b,
            runs_dir=runs_dir,
            allow_incomplete=allow_incomplete,
            pair=pair,
            json_out=json_out,
            out_dir=out,
            top=top,
            html_path=html_out,
            exact=exact,
            exact_steps=exact_steps,
            device=device,
            quiet=quiet,
        )
    except BaseException as err:  # noqa: BLE001
        fail(err, lambda: out or html_out or run_dir_or_root(run_a, runs_dir))


@app.command(help="Write a self-contained HTML report of a run (or of two runs compared); works offline.")
def report(
    runs: list[str] = typer.Argument(
        ...,
        metavar="RUN [RUN_B]",
        help="A run id (or unique prefix) or directory; "
        "two runs: a comparison report (as `lmtrace compare A B --html`).",
    ),
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        "-o",
        help="HTML file to write (default: RUN_DIR/report.html; for two runs A_DIR/compare-B.html).",
    ),
    sequence: list[str] = typer.Option(
        [],
        "--sequence",
        "-s",
        metavar="SEQUENCES",
        help="Sequences to show: 0,3 or 0-15 or all (repeatable; default: the first 2).",
    ),
    steps: Optional[str] = typer.Option(
        None,
        "--steps",
        help="Steps to show: 0,4,9 or 2-5 or all, with an optional "
        "stride 0-255:4 (default: all up to 256 steps, else a stride).",
    ),
    layer: list[int] = typer.Option(
        [],
        "--layer",
        "-l",
        help="Layer with per-head step × key heatmaps (repeatable; default: first, middle and last captured).",
    ),
    attention_step: Optional[int] = typer.Option(
        None,
        "--attention-step",
        help="Step first selected in the token view "
        "and of the layer × head attention grid (default: the last step "
        "shown; past a sequence's end, its last step).",
    ),
    png: Optional[Path] = typer.Option(
        None, "--png", help="Also write every figure as a PNG file into this directory."
    ),
    svg: Optional[Path] = typer.Option(
        None, "--svg", help="Also write every figure as an SVG file into this directory."
    ),
    pair: str = typer.Option("auto", "--pair", help="Two runs: pair sequences by auto | index | prompt."),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete", help="Two runs: compare unfinished runs."),
    open_: bool = typer.Option(False, "--open", help="Open the page in the default browser when written."),
    runs_dir: Optional[str] = typer.Option(
        None, "--runs-dir", help="Runs directory (default: $LMTRACE_RUNS_DIR, ./runs)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
    json_out: bool = typer.Option(False, "--json", help='Print {"path": ...} and sizes as JSON.'),
):
    """Long because typer declares its options in the signature; the body only passes them on to
    report.report_runs and prints the page's path (the help text is the decorator's)."""
    try:
        from ..report import report_runs

        result = report_runs(
            runs,
            runs_dir=runs_dir,
            out=out,
            sequences=sequence or None,
            steps=steps,
            layers=layer or None,
            attention_step=attention_step,
            png=png,
            svg=svg,
            pair=pair,
            allow_incomplete=allow_incomplete,
        )
    except BaseException as err:  # noqa: BLE001
        fail(err, lambda: out or run_dir_or_root(runs[0], runs_dir))
    if json_out:
        typer.echo(json_line(result.summary()))
    elif not quiet:
        typer.echo(str(result.path))
    if open_:
        import webbrowser

        webbrowser.open(result.path.resolve().as_uri())


@app.command()
def serve(
    runs_dir: Optional[str] = typer.Option(
        None, "--runs-dir", help="Runs directory (default: $LMTRACE_RUNS_DIR, ./runs)."
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", metavar="ADDRESS", help="Address to listen on; any but loopback needs --token."
    ),
    port: int = typer.Option(8765, "--port", metavar="N", help="Port to listen on (0: a free one, printed)."),
    token: Optional[str] = typer.Option(
        None,
        "--token",
        metavar="TOKEN",
        help="Access token every request must carry (the printed "
        "address sets it as a cookie); required with a non-loopback --host.",
    ),
    open_: bool = typer.Option(False, "--open", help="Open the address in the default browser."),
):
    """Explore the runs in a local, read-only web page: runs, sequences, and per token its attention, lens and alternatives."""
    try:
        from ..commands.serve import serve as serve_command

        serve_command(runs_dir, host, port, token, open_)
    except BaseException as err:  # noqa: BLE001
        if isinstance(err, KeyboardInterrupt):
            raise typer.Exit(0) from None
        fail(err)


help_format.fill_in(app)
help_format.install()
