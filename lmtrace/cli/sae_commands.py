"""`lmtrace sae ...`: sparse autoencoders (docs/features.md)."""

from __future__ import annotations

from typing import Optional

import typer

from .app import Reporter, app, fail, run_dir_or_root

sae_app = typer.Typer(
    no_args_is_help=True,
    help="Sparse autoencoders: train one on a run's activations (sae train), read and check one (sae show).",
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(sae_app, name="sae")


@sae_app.command("train")
def train(
    run: str = typer.Argument(..., help="Run id (or unique prefix) or run directory, complete."),
    layer: int = typer.Option(..., "--layer", help="Layer of the site."),
    site: Optional[str] = typer.Option(
        None,
        "--site",
        help='resid_post (default), resid_pre, attn_out, mlp_out, mlp_in, attn_z or mlp_post (docs/features.md, "Sites").',
    ),
    transcoder: bool = typer.Option(
        False,
        "--transcoder",
        help="Train a transcoder of layer L's MLP: from its input (mlp_in) to its output (mlp_out), by replay.",
    ),
    latents: int = typer.Option(..., "--latents", help="Number of latents (d_sae)."),
    k: int = typer.Option(32, "--k", help="Active latents per token (TopK), or on average (BatchTopK)."),
    out: str = typer.Option(..., "--out", help="New directory to write the SAE to (SAELens format)."),
    arch: Optional[str] = typer.Option(
        None,
        "--arch",
        help="topk (default) | batchtopk (saved as jumprelu, as SAELens does); a transcoder: batchtopk only.",
    ),
    source: str = typer.Option(
        "auto",
        "--source",
        help="auto | archive (the run's residual vectors) | replay (every position, through the model).",
    ),
    heldout: float = typer.Option(0.1, "--heldout", help="Share of the run's sequences held out for the metrics."),
    epochs: int = typer.Option(1, "--epochs", help="Passes over the training activations."),
    max_tokens: int = typer.Option(200_000, "--max-tokens", help="Training activations kept at most."),
    batch: int = typer.Option(1024, "--batch", help="Activations per training step."),
    lr: float = typer.Option(1e-3, "--lr", help="Adam learning rate."),
    seed: int = typer.Option(0, "--seed", help="Seed of the split, the initialisation and the data order."),
    device: Optional[str] = typer.Option(None, "--device", help="Device for the model (default: the run's)."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
    json_out: bool = typer.Option(False, "--json", help="Print the training card as JSON on stdout."),
):
    """Train a TopK SAE (or an MLP transcoder) on a run's activations; save it in the SAELens format with a
    training card."""
    reporter = Reporter(quiet or json_out)
    reporter.starting()
    from ..commands.sae import sae_train_command

    try:
        sae_train_command(
            run,
            layer=layer,
            site=site,
            latents=latents,
            k=k,
            out=out,
            arch=arch,
            transcoder=transcoder,
            source=source,
            heldout=heldout,
            epochs=epochs,
            max_tokens=max_tokens,
            batch=batch,
            lr=lr,
            seed=seed,
            device=device,
            runs_dir=runs_dir,
            json_out=json_out,
            quiet=quiet,
            note=reporter.message,
        )
    except BaseException as err:  # noqa: BLE001
        fail(err, lambda: run_dir_or_root(run, runs_dir))


@sae_app.command("show")
def show(
    path: str = typer.Argument(..., metavar="DIR", help="An SAE directory (cfg.json + sae_weights.safetensors)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing: the exit code says whether it reads."),
    json_out: bool = typer.Option(False, "--json", help="Print it as JSON on stdout."),
):
    """Read and check an SAE directory (SAELens format); print its configuration, site and training card."""
    from ..commands.sae import sae_show_command

    try:
        sae_show_command(path, json_out=json_out, quiet=quiet)
    except BaseException as err:  # noqa: BLE001
        fail(err)


@app.command()
def features(
    run: str = typer.Argument(..., metavar="RUN", help="Run id (or unique prefix) or run directory, complete."),
    sae: str = typer.Option(
        ...,
        "--sae",
        metavar="NAME|DIR",
        help="An SAE directory (to compute), or the run's name "
        "for one of its SAEs (manifest `features`) or its directory (to find).",
    ),
    feature: Optional[int] = typer.Option(
        None, "--feature", metavar="F", help="Print this latent's max-activating examples, density and logit effects."
    ),
    by: Optional[str] = typer.Option(
        None,
        "--by",
        metavar="COLUMN",
        help="Features whose mean activation differs most between groups of sequences (a column of sequences.parquet).",
    ),
    top_k: int = typer.Option(32, "--top-k", help="Latents kept per token when computing."),
    prompt: bool = typer.Option(
        False,
        "--prompt",
        help="Computing: also the prompt positions (by a replay). --feature / --by: over the prompt positions.",
    ),
    source: str = typer.Option("auto", "--source", help="auto | archive (the run's residual vectors) | replay."),
    top: int = typer.Option(10, "--top", help="Examples (--feature) or features (--by) to print."),
    window: int = typer.Option(8, "--window", help="Tokens of context before the activating token (--feature)."),
    tokens: int = typer.Option(10, "--tokens", help="Promoted and suppressed tokens listed (--feature)."),
    device: Optional[str] = typer.Option(None, "--device", help="Device for the model (default: the run's)."),
    runs_dir: Optional[str] = typer.Option(None, "--runs-dir"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
):
    """SAE features of a run: compute them (--sae DIR), or find them (--feature F, --by COLUMN)."""
    reporter = Reporter(quiet or json_out)
    try:
        if feature is not None or by is not None:
            from ..commands.feature_find import features_find_command

            features_find_command(
                run,
                sae,
                feature=feature,
                by=by,
                top=top,
                window=window,
                n_tokens=tokens,
                device=device,
                runs_dir=runs_dir,
                json_out=json_out,
                prompt=prompt,
            )
        else:
            reporter.starting()
            from ..commands.features import features_compute_command

            features_compute_command(
                run,
                sae,
                top_k=top_k,
                prompt=prompt,
                source=source,
                device=device,
                runs_dir=runs_dir,
                json_out=json_out,
                quiet=quiet,
                note=reporter.message,
            )
    except BaseException as err:  # noqa: BLE001
        fail(err, lambda: run_dir_or_root(run, runs_dir))
