"""Commands that edit a run's forward: `intervene` (a child run) and `sweep` (every component in turn)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..output.jsonout import json_line
from .app import Reporter, app, fail, run_dir_or_root


@app.command(help="Re-run an archived run under real interventions; writes a child run linked to its parent.")
def intervene(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Parent run id (or unique prefix) or directory."),
    spec_path: Optional[Path] = typer.Option(
        None, "--spec", help="YAML with `interventions:` (and optional mode, from_step)."
    ),
    ablate_head: list[str] = typer.Option(
        [], "--ablate-head", help="LAYER.HEAD[:mean], e.g. 12.3 (zero) or 12.3:mean."
    ),
    ablate_layer: list[str] = typer.Option(
        [], "--ablate-layer", help="LAYER[:mean]: skip a layer's residual contribution (or add its mean)."
    ),
    ablate_mlp: list[str] = typer.Option(
        [], "--ablate-mlp", help="LAYER[:mean]: zero (or mean-ablate) a layer's MLP output."
    ),
    ablate_attn: list[str] = typer.Option(
        [], "--ablate-attn", help="LAYER[:mean]: zero (or mean-ablate) a layer's attention output."
    ),
    ablate_neurons: list[str] = typer.Option([], "--ablate-neurons", help="LAYER:N1,N2,...[:mean] e.g. 7:120,455"),
    mask_positions: list[str] = typer.Option(
        [],
        "--mask-positions",
        help="Token positions to hide, e.g. 3-9 or 1,4, or a span: prompt, generated, system, user",
    ),
    feature_ablate: list[str] = typer.Option(
        [], "--feature-ablate", help="SAE:F: set feature F of an SAE (directory or the run's SAE name) to 0."
    ),
    feature_clamp: list[str] = typer.Option([], "--feature-clamp", help="SAE:F=V: set feature F of an SAE to V."),
    feature_steer: list[str] = typer.Option(
        [], "--feature-steer", help="SAE:F*C: add C times feature F's decoder direction at the SAE's hook."
    ),
    from_step: Optional[int] = typer.Option(None, "--from-step", help="Edits apply from this step on."),
    mode: Optional[str] = typer.Option(
        None, "--mode", help="rescore (teacher-force the parent's tokens) or regenerate."
    ),
    temperatures: Optional[str] = typer.Option(
        None, "--temperatures", help="Sweep: one regenerated child per temperature, e.g. 0.5,1.0"
    ),
    lens: bool = typer.Option(
        False,
        "--lens",
        help="Compute each child's deferred logit lens right after it is "
        "written, in this process (no second model load).",
    ),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    run_id: Optional[str] = typer.Option(None, "--run-id"),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No progress output; print only the child run id(s), one per line."
    ),
    json_out: bool = typer.Option(False, "--json"),
):
    """Long because typer declares its options in the signature; the body only passes them on to
    cli/intervene.py's intervene_command (the help text is the decorator's)."""
    reporter = Reporter(quiet or json_out)
    reporter.starting()
    from .intervene import intervene_command

    try:
        summary = intervene_command(
            run_ref,
            spec_path,
            dict(
                ablate_head=ablate_head,
                ablate_layer=ablate_layer,
                ablate_mlp=ablate_mlp,
                ablate_attn=ablate_attn,
                ablate_neurons=ablate_neurons,
                mask_positions=mask_positions,
                feature_ablate=feature_ablate,
                feature_clamp=feature_clamp,
                feature_steer=feature_steer,
            ),
            from_step=from_step,
            mode=mode,
            temperatures=temperatures,
            runs_dir=runs_dir,
            run_id=run_id,
            lens=lens,
            progress=reporter.progress(),
            json_out=json_out,
            quiet=quiet,
        )
    except BaseException as err:  # noqa: BLE001
        reporter.stop()
        if isinstance(err, typer.Exit):
            raise
        fail(err, lambda: run_dir_or_root(None, runs_dir) if runs_dir else run_dir_or_root(run_ref, None).parent)
    reporter.stop()
    if json_out:
        typer.echo(json_line(summary))


@app.command(help="Ablate or patch every head, block, layer, neuron or position in turn; results go into RUN/sweeps/.")
def sweep(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Run id (or unique prefix) or run directory."),
    over: Optional[str] = typer.Option(
        None, "--over", help="heads | attn | mlp | layers | neurons:LAYER | positions | resid:A-B | features"
    ),
    edit: Optional[str] = typer.Option(
        None, "--edit", help="zero | mean | patch (default zero); features: zero | clamp --value V | patch."
    ),
    sae: Optional[str] = typer.Option(
        None, "--sae", help="--over features: a SAELens directory, or the run's short name for one."
    ),
    features: Optional[str] = typer.Option(
        None, "--features", help="--over features: the features swept, 12,40,7 or 0-9 (default: the top 20 active)."
    ),
    top_features: Optional[int] = typer.Option(
        None, "--top-features", metavar="N", help="--over features: the N most active at the measured steps."
    ),
    value: Optional[float] = typer.Option(None, "--value", help="--edit clamp: the value the latent is set to."),
    source: Optional[str] = typer.Option(None, "--source", help="Patch: the run whose activations are patched in."),
    pair_by: Optional[str] = typer.Option(
        None,
        "--pair-by",
        metavar="COLUMN",
        help="Patch: pair the two runs' sequences by this id column of sequences.parquet (default: by index).",
    ),
    metric: list[str] = typer.Option(
        [],
        "--metric",
        "-m",
        help="logprob, prob, kl, rank, logit_diff:A,B (repeatable; the first ranks). Default: logprob, prob, kl, rank.",
    ),
    steps: Optional[str] = typer.Option(None, "--steps", help="Steps measured: 0,4,9 or 2-5 or all (default all)."),
    sequences: Optional[str] = typer.Option(None, "--sequences", help="Sequences: 0,2 or 0-3 or all (default all)."),
    positions: Optional[str] = typer.Option(
        None,
        "--positions",
        help="Edit one position at a time: 3-9 or 0,4 "
        "(default: every position at once; resid and positions: each prompt position).",
    ),
    batch: Optional[int] = typer.Option(
        None,
        "--batch",
        help="Cells per block (default 32); a forward runs a block on up to 16 sequences of one layout.",
    ),
    from_step: Optional[int] = typer.Option(
        None,
        "--from-step",
        help="Edits apply from this step on; the unedited "
        "prefix is computed once and its KV cache shared (steps >= it are measured).",
    ),
    method: Optional[str] = typer.Option(
        None,
        "--method",
        help="exact (default: every cell patched) | attribution "
        "(every cell estimated from one forward and backward per sequence or pair).",
    ),
    verify: Optional[int] = typer.Option(
        None,
        "--verify",
        metavar="N",
        help="Attribution: patch the estimate's top N "
        "cells exactly; per metric the rank correlation and each cell's two values.",
    ),
    graddrop: Optional[bool] = typer.Option(
        None, "--graddrop", help="Attribution: AtP*'s GradDrop check for cancellation (one more backward per layer)."
    ),
    spec_path: Optional[Path] = typer.Option(None, "--spec", help="YAML sweep spec (the same keys; flags override)."),
    shard: Optional[str] = typer.Option(
        None, "--shard", help="I/N or auto (SLURM array): split the cells over processes."
    ),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Sweep id (shared by shards; reused to continue)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the unfinished sweep --run-id."),
    top: int = typer.Option(20, "--top", help="Cells in the ranked table."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output; print only the sweep id."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    by: Optional[str] = typer.Option(
        None,
        "--by",
        metavar="COLUMN",
        help="Also the mean effect per group of "
        "sequences (a column of sequences.parquet) and cell, with a 95 % bootstrap "
        "interval over the group's sequences (1000 resamples, seed 0).",
    ),
):
    """Long because typer declares its twenty-odd options in the signature; the body only passes them on to
    cli/sweep.py's sweep_command (the help text is the decorator's)."""
    reporter = Reporter(quiet or json_out)
    reporter.starting()
    from .sweep import sweep_command

    try:
        sweep_command(
            run_ref,
            spec_path=spec_path,
            flags=dict(
                over=over,
                edit=edit,
                source=source,
                pair_by=pair_by,
                metrics=metric,
                steps=steps,
                sequences=sequences,
                positions=positions,
                batch=batch,
                from_step=from_step,
                method=method,
                verify=verify,
                graddrop=graddrop,
                sae=sae,
                features=features,
                top_features=top_features,
                value=value,
            ),
            runs_dir=runs_dir,
            run_id=run_id,
            shard=shard,
            resume=resume,
            top=top,
            json_out=json_out,
            quiet=quiet,
            note=reporter.message,
            by=by,
        )
    except BaseException as err:  # noqa: BLE001
        reporter.stop()
        fail(err, lambda: run_dir_or_root(run_ref, runs_dir))
    reporter.stop()
