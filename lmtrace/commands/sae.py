"""`lmtrace sae train RUN --layer L --site S --latents N --k K --out DIR`: a TopK (or BatchTopK) SAE
trained on the activations of a run's sequences, saved in the SAELens format with a training card, and
measured on held-out sequences (docs/features.md).

Where the activations come from (`--source`): `archive` reads the run's archived residual vectors
(`resid`: one vector per generated token, at its query position; resid_post L and resid_pre L+1), no
forward needed; `replay` runs each sequence (prompt + generated tokens) through the model once and
collects every position but the first; `auto` (default) takes the archive where it holds the site, else
the replay. Either way the activations stream into a float16 file beside DIR (deleted at the end), so
memory stays bounded by `--max-tokens` × d_in × 2 bytes on disk and one batch in memory. The model is
loaded in any case: the held-out cross-entropy is measured in its forward.

`--transcoder` trains a transcoder of layer L's MLP instead: it reads the MLP's input (mlp_in,
blocks.L.ln2.hook_normalized, never archived, so always replayed) and is trained to write the MLP's output
(mlp_out, blocks.L.hook_mlp_out), both collected in the same forward into one row per position. It is
trained BatchTopK and saved as SAELens's jumprelu_transcoder (SAELens has no TopK transcoder); its held-out
metrics are the MLP output's explained variance and the loss recovered with its output in place of the
MLP's.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from ..analysis.features.activations import ActivationStore, replay
from ..analysis.features.metrics import ce_loss_recovered, reconstruction_metrics
from ..analysis.features.train import Target, TrainSettings, train_sae
from ..archive.reader import IncompleteRunWarning, Run, open_run
from ..exits.errors import SpecError
from ..exits.interrupts import work_recorded
from ..features.format import CFG, WEIGHTS, write_sae
from ..features.sites import Site, site_of
from ..output.jsonout import json_line
from ..output.terminal import fitted
from ..runner.parent import ParentView

CARD = "training_card.json"
SOURCES = ("auto", "archive", "replay")
ARCHS = ("topk", "batchtopk")


def _check_args(
    latents: int,
    k: int,
    arch: str,
    source: str,
    heldout: float,
    epochs: int,
    max_tokens: int,
    batch: int,
    lr: float,
    out: Path,
) -> None:
    if latents < 1:
        raise SpecError(f"--latents must be ≥ 1 (got {latents})")
    if not 1 <= k <= latents:
        raise SpecError(f"--k must be in 1..--latents ({latents}) (got {k})")
    if arch not in ARCHS:
        raise SpecError(f"--arch {arch!r}: expected one of {', '.join(ARCHS)}")
    if source not in SOURCES:
        raise SpecError(f"--source {source!r}: expected one of {', '.join(SOURCES)}")
    if not 0 < heldout < 1:
        raise SpecError(f"--heldout must be a fraction between 0 and 1 (got {heldout})")
    for name, value in (("--epochs", epochs), ("--max-tokens", max_tokens), ("--batch", batch)):
        if value < 1:
            raise SpecError(f"{name} must be ≥ 1 (got {value})")
    if not lr > 0:
        raise SpecError(f"--lr must be > 0 (got {lr})")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecError(f"--out {out} exists and is not an empty directory; name a new directory")


def _resolve_kind(transcoder: bool, site: str | None, arch: str | None, source: str) -> tuple[str, str]:
    """(site, architecture) with their defaults: resid_post and topk, or for a transcoder mlp_in and
    batchtopk; what a transcoder cannot be is refused in one line."""
    if not transcoder:
        return site or "resid_post", arch or "topk"
    if site not in (None, "mlp_in"):
        raise SpecError(
            f"--transcoder reads the MLP's input (mlp_in) and writes its output (mlp_out); drop --site {site} "
            f"(or pass --site mlp_in)"
        )
    if arch not in (None, "batchtopk"):
        raise SpecError(
            f"--transcoder is trained BatchTopK and saved as SAELens's jumprelu_transcoder (SAELens has no TopK "
            f"transcoder); drop --arch {arch} (or pass --arch batchtopk)"
        )
    if source == "archive":
        raise SpecError("--transcoder reads the MLP's input, which runs never archive; drop --source archive")
    return "mlp_in", "batchtopk"


def split_sequences(n: int, heldout: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) sequence indices, each sorted: a seeded random `heldout` share (≥ 1) held out."""
    if n < 2:
        raise SpecError(f"the run has {n} sequence(s); training needs at least 2 (one is held out for the metrics)")
    order = np.random.default_rng(seed).permutation(n)
    held = max(1, int(round(heldout * n)))
    return sorted(order[held:].tolist()), sorted(order[:held].tolist())


def archived(run: Run, resid_index: int, sequences: list[int]):
    """[steps, d_model] float32 per sequence: the archived residual vectors of its generated steps."""
    array = run.array("resid")
    lengths = run.generated_len()
    for seq in sequences:
        n = int(lengths[seq])
        if n:
            yield torch.from_numpy(np.asarray(array[seq, :n, resid_index, :], dtype=np.float32))


def sae_train_command(
    ref: str,
    *,
    layer: int,
    site: str | None,
    latents: int,
    k: int,
    out: str,
    arch: str | None = None,
    transcoder: bool = False,
    source: str = "auto",
    heldout: float = 0.1,
    epochs: int = 1,
    max_tokens: int = 200_000,
    batch: int = 1024,
    lr: float = 1e-3,
    seed: int = 0,
    batch_tokens: int = 2048,
    device: str | None = None,
    runs_dir: str | None = None,
    json_out: bool = False,
    quiet: bool = False,
    note=lambda text: None,
) -> dict:
    """Train an SAE on run `ref`'s activations at (`layer`, `site`), measure it on held-out sequences,
    save it with its training card in `out`, and report the card (`transcoder`: a transcoder of layer
    `layer`'s MLP)."""
    out_dir = Path(out)
    site, arch = _resolve_kind(transcoder, site, arch, source)
    _check_args(latents, k, arch, source, heldout, epochs, max_tokens, batch, lr, out_dir)
    the_site = site_of(layer, site)
    site_out = Site(layer, "mlp_out") if transcoder else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        run = open_run(ref, runs_dir, require_complete=True)
    resid_layers, use_archive = _archive_source(run, the_site, source)
    view = ParentView.read(run)
    sequences = [p + g for p, g in zip(view.prompt_ids, view.generated)]
    train_ids, held_ids = split_sequences(len(sequences), heldout, seed)
    model, adapter, d_in, pad_id = _load_model(run, the_site, device, note)
    target = Target(site_out.hook_name, site_out.width(adapter)) if site_out else Target()
    sites = (the_site, site_out) if site_out else the_site

    def activations(ids: list[int]):
        if use_archive:
            return archived(run, resid_layers.index(the_site.archived_resid_layer), ids)
        return replay(model, adapter, sites, [sequences[i] for i in ids], pad_id=pad_id, batch_tokens=batch_tokens)

    settings = TrainSettings(d_sae=latents, k=k, architecture=arch, epochs=epochs, batch=batch, lr=lr, seed=seed)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    sae, log, n, collect_s = _collect_and_train(
        run,
        the_site,
        lambda: activations(train_ids),
        use_archive,
        settings,
        (d_in, target),
        max_tokens,
        out_dir,
        t0,
        note,
    )
    note("measuring on held-out sequences")
    recon = reconstruction_metrics(sae, activations(held_ids))
    held = [sequences[i] for i in held_ids]
    ce = ce_loss_recovered(
        model, adapter, sae, the_site, held, pad_id=pad_id, batch_tokens=batch_tokens, site_out=site_out
    )
    data = _data_section(use_archive, train_ids, held_ids, n, max_tokens, collect_s)
    card = _card(run, the_site, layer, site, settings, sae, d_in, data, log, recon, ce, t0)
    if site_out is not None:
        card = _transcoder_card(card, site_out, sae.cfg.d_out)
    _save(sae, card, out_dir)
    work_recorded()
    card["path"] = str(out_dir)
    _report(card, json_out, quiet)
    return card


def _load_model(run: Run, the_site, device: str | None, note):
    """The run's model (for the held-out cross-entropy, and the replay): (model, adapter, d_in, pad id); a
    layer the model lacks or a site its family lacks is refused in one line."""
    from ..capture.arch import adapter_for
    from ..runner.models import load_run_model

    loaded = load_run_model(
        run.manifest, run.id, purpose="sae train (the held-out cross-entropy)", overrides={"device": device}, note=note
    )
    model = loaded.model.eval()
    adapter = adapter_for(model)
    the_site.check_family(adapter)  # a layer the model lacks, a site its family lacks: one line
    d_in = the_site.width(adapter)
    tok = loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return model, adapter, d_in, pad_id


def _collect_and_train(
    run: Run, the_site, training_activations, use_archive: bool, settings, shape, max_tokens, out_dir, t0, note
):
    """Stream the training activations (`training_activations()`) into a scratch store beside `out_dir` and
    train the SAE on them (`shape`: (d_in, Target)): (sae, training log, tokens, seconds spent collecting)."""
    d_in, target = shape
    with tempfile.TemporaryDirectory(prefix=".sae-train-", dir=out_dir.parent) as scratch:
        store = ActivationStore(Path(scratch), d_in + (target.d_out or 0), max_tokens)
        try:
            where = the_site.hook_name + (f" and {target.hook_name_out}" if target.transcoder else "")
            note(f"collecting activations at {where} ({'archive' if use_archive else 'replay'})")
            n = store.fill(training_activations())
            if n < settings.k:
                raise SpecError(
                    f"run {run.id} gives only {n} training activations at {the_site.hook_name}; "
                    f"use a run with more tokens (or --source replay)"
                )
            collect_s = time.time() - t0
            note(f"training on {n} activations")
            sae, log = train_sae(
                store,
                settings,
                the_site.hook_name,
                model_name=run.manifest["spec_resolved"]["model"].get("ref"),
                target=target,
            )
        finally:
            store.close()
    return sae, log, n, collect_s


def _data_section(use_archive: bool, train_ids, held_ids, n: int, max_tokens: int, collect_s: float) -> dict:
    """The training card's `data`: where the activations came from and how many there were."""
    return {
        "source": "archive" if use_archive else "replay",
        "positions": (
            "the run's archived vectors: each generated token's query position"
            if use_archive
            else "every position of prompt + generated tokens but the first"
        ),
        "training_sequences": len(train_ids),
        "heldout_sequences": held_ids,
        "tokens": n,
        "max_tokens": max_tokens,
        "collect_seconds": round(collect_s, 2),
    }


def _card(run: Run, the_site, layer, site, settings, sae, d_in, data, log, recon, ce, t0) -> dict:
    """The training card (training_card.json): the run, the site, the SAE's shape, its data, training and
    held-out metrics, and the seconds since `t0`."""
    return {
        "format": "lmtrace SAE training card 1",
        "run_id": run.id,
        "model": run.manifest["spec_resolved"]["model"].get("ref"),
        "model_weights_sha256": run.manifest.get("model", {}).get("weights_sha256"),
        "hook_name": the_site.hook_name,
        "layer": layer,
        "site": site,
        "architecture": settings.architecture,
        "saved_architecture": sae.cfg.architecture,
        "d_in": d_in,
        "latents": settings.d_sae,
        "k": settings.k,
        "data": data,
        "training": log,
        "heldout": {
            "tokens": recon["tokens"],
            "explained_variance": recon["explained_variance"],
            "mean_l0": recon["mean_l0"],
            "dead_fraction": recon["dead_fraction"],
            "ce_tokens": ce["tokens"],
            "ce_orig": ce["ce_orig"],
            "ce_sae": ce["ce_sae"],
            "ce_zero_ablation": ce["ce_zero"],
            "loss_recovered": ce["loss_recovered"],
        },
        "seconds": round(time.time() - t0, 2),
    }


def _transcoder_card(card: dict, site_out: Site, d_out: int) -> dict:
    """An SAE card made a transcoder's: both hook points, the output's width, and what the held-out
    metrics measure."""
    out = {}
    for key, value in card.items():
        out[key] = value
        if key == "hook_name":
            out["hook_name_out"] = site_out.hook_name
            out["site_out"] = site_out.kind
        if key == "d_in":
            out["d_out"] = d_out
    out["transcoder"] = True
    out["heldout"] = {
        **card["heldout"],
        "measured": "explained variance of the MLP's output; CE with the transcoder's output in place of the "
        "MLP's output, and with the MLP's output zeroed",
    }
    return out


def _report(card: dict, json_out: bool, quiet: bool) -> None:
    if json_out:
        print(json_line(card))
    elif not quiet:
        _print(card)


def _archive_source(run: Run, the_site, source: str) -> tuple[list[int], bool]:
    """(the run's resid layers, whether the activations come from its archived vectors); `--source
    archive` for a site the run did not archive is refused in one line."""
    resid_layers = list(run.shape.get("resid_layers") or [])
    in_archive = the_site.archived_resid_layer is not None and the_site.archived_resid_layer in resid_layers
    if source == "archive" and not in_archive:
        held = f"resid at layers {resid_layers}" if resid_layers else "no residual vectors"
        raise SpecError(
            f"run {run.id} has {held}, not {the_site.hook_name}: use --source replay (or auto), or "
            f"generate the run with capture.residual.vectors_at including that layer"
        )
    return resid_layers, in_archive and source != "replay"


def _save(sae, card: dict, out_dir: Path) -> None:
    """The SAE and its card written to a temporary directory beside `out_dir`, then renamed into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        write_sae(sae, tmp, {CARD: json.dumps(card, indent=2, allow_nan=False) + "\n"})
        if out_dir.exists():
            out_dir.rmdir()  # (checked empty above)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _num(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _print(card: dict) -> None:
    d, t, h = card["data"], card["training"], card["heldout"]
    kind = "BatchTopK (saved as jumprelu)" if card["architecture"] == "batchtopk" else "TopK"
    what, where, sae = f"{kind} SAE", card["hook_name"], "the SAE"
    if card.get("transcoder"):
        what, sae = "BatchTopK transcoder (saved as jumprelu_transcoder)", "the transcoder"
        where = f"{where} -> {card['hook_name_out']}"
    print(
        f"trained a {what}, {card['latents']} latents, k {card['k']}, at {where} of run "
        f"{card['run_id']}: {d['tokens']:,} tokens ({d['source']}), {t['epochs']} epoch(s), {t['steps']} steps, "
        f"{card['seconds']:.0f} s"
    )
    print(
        f"held out ({len(d['heldout_sequences'])} sequences, {h['tokens']:,} tokens): explained variance "
        + ("of the MLP output " if card.get("transcoder") else "")
        + f"{_num(h['explained_variance'], '.3f')}, mean L0 {_num(h['mean_l0'], '.1f')}, dead latents "
        f"{_num(None if h['dead_fraction'] is None else 100 * h['dead_fraction'], '.1f')} %, CE loss recovered "
        f"{_num(h['loss_recovered'], '.3f')} (CE {_num(h['ce_orig'], '.3f')} original, {_num(h['ce_sae'], '.3f')} "
        f"with {sae}, {_num(h['ce_zero_ablation'], '.3f')} zero-ablated)"
    )
    print(f"wrote {card['path']} ({CFG}, {WEIGHTS}, {CARD})")


def sae_show_command(path: str, *, json_out: bool = False, quiet: bool = False) -> dict:
    """`lmtrace sae show DIR`: an SAE directory read and checked as every command reads it; its
    configuration, its site, and the held-out metrics of its training card when it has one."""
    from ..features.format import read_sae
    from ..features.refs import transcoder_record
    from ..features.sites import parse_hook_name

    sae = read_sae(path)
    cfg = sae.cfg
    site = parse_hook_name(cfg.hook_name)
    card_path = Path(path) / CARD
    card = json.loads(card_path.read_text()) if card_path.is_file() else None
    info = {
        "path": str(path),
        "architecture": cfg.architecture,
        "d_in": cfg.d_in,
        "d_sae": cfg.d_sae,
        "k": cfg.k,
        "hook_name": cfg.hook_name,
        "layer": site.layer,
        "site": site.kind,
        "apply_b_dec_to_input": cfg.apply_b_dec_to_input,
        "normalize_activations": cfg.normalize_activations,
        "model_name": cfg.model_name,
        **transcoder_record(cfg),
        "training_card": card,
    }
    if json_out:
        print(json_line(info))
    if json_out or quiet:
        return info
    k = f", k {cfg.k}" if cfg.k is not None else ""
    print(
        fitted(
            f"{path}: {cfg.architecture} {'' if cfg.transcoder else 'SAE, '}d_in {cfg.d_in}, {cfg.d_sae} latents{k}, "
            f"at {cfg.hook_name} (lmtrace site {site.kind}, layer {site.layer})"
            + (f", writing {cfg.hook_name_out} (d_out {cfg.d_out})" if cfg.transcoder else "")
            + "; b_dec applied to the input: "
            f"{'yes' if cfg.apply_b_dec_to_input else 'no'}; input normalisation: {cfg.normalize_activations}"
            + (f"; model {cfg.model_name}" if cfg.model_name else "")
        )
    )
    if card is not None:
        h = card.get("heldout", {})
        print(
            fitted(
                f"trained on run {card.get('run_id')} ({card.get('data', {}).get('tokens')} tokens, "
                f"{card.get('data', {}).get('source')}); held out: explained variance "
                f"{_num(h.get('explained_variance'), '.3f')}, mean L0 {_num(h.get('mean_l0'), '.1f')}, dead "
                f"{_num(None if h.get('dead_fraction') is None else 100 * h['dead_fraction'], '.1f')} %, "
                f"CE loss recovered {_num(h.get('loss_recovered'), '.3f')}"
            )
        )
    return info
