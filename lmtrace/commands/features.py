"""`lmtrace features RUN --sae DIR`: an SAE's feature activations computed for a complete run and
written into it, as `capture.features` would have archived them during generate.

From the archived residual vectors when the SAE reads a residual layer the run holds (no model load),
else by a replay of every sequence through the run's model (`analysis/features/deferred.py`); the
arrays are created like the run's own (`archive/feature_arrays.py`). As `lmtrace lens`: one writer at
a time (an owner lock, then the run's lock), the files read are checked against the run's checksums
first, the arrays are written, the checksums re-recorded for what was written only, and the manifest's
`features` entry written last. A kill before that leaves no entry; a rerun computes it all again.
Finding features in a run (`--feature`, `--by`) is in `commands/feature_find.py`.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from ..archive import layout
from ..archive.reader import IncompleteRunWarning, Run, open_run
from ..exits.errors import ArchiveError, SpecError
from ..output.jsonout import json_line

SOURCES = ("auto", "archive", "replay")


def _existing_width(run: Run) -> int | None:
    """The run's k_feat when it has feature arrays already (every SAE of a run shares it)."""
    for f in run.manifest.get("features") or []:
        name = f"feat_{f['name']}_idx"
        if name in run.array_names():
            return int(run.array(name).shape[-1])
    return None


def _like_array(run: Run, manifest: dict):
    """One of the run's per-step arrays (the new ones are sharded and checksummed like it), or None."""
    for name, spec in (manifest.get("arrays") or {}).items():
        if spec["dims"][:2] == ["sequence", "step"] and name in run.array_names():
            return run.array(name)
    return None


def compute_features(
    ref: str,
    sae_dir: str,
    *,
    top_k: int = 32,
    prompt: bool = False,
    source: str = "auto",
    device: str | None = None,
    runs_dir: str | None = None,
    note=lambda text: None,
) -> dict:
    """Compute and archive one SAE's features for a complete run; a no-op when the run has them."""
    from ..archive.liveness import OwnerLock
    from ..capture.feature_probe import short_names
    from ..digest import file_sha256
    from ..features import parse_hook_name, read_sae
    from ..features.format import WEIGHTS

    if source not in SOURCES:
        raise SpecError(f"--source {source!r}: expected one of {', '.join(SOURCES)}")
    if not 1 <= top_k <= 4096:
        raise SpecError(f"--top-k {top_k}: expected a whole number in 1..4096")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        run = open_run(ref, runs_dir, require_complete=True)
    path = Path(sae_dir).expanduser()
    sae = read_sae(path)  # bad SAE directories: one line, before any work
    site = parse_hook_name(sae.cfg.hook_name, f"SAE {path}")
    sha = file_sha256(path / WEIGHTS)
    for f in run.manifest.get("features") or []:
        if f["sha256"] == sha and f["top_k"] >= top_k and (f.get("prompt") or not prompt):
            return {"run_id": run.id, "computed": False, "name": f["name"], "reason": "features already present"}
    width = _existing_width(run)
    if width is not None and top_k > width:
        raise SpecError(
            f"--top-k {top_k}: the run's feature arrays keep {width} latents per token (k_feat); "
            f"give --top-k {width} or less"
        )
    shape = run.shape
    resid_layers = list(shape.get("resid_layers") or [])
    in_archive = site.archived_resid_layer is not None and site.archived_resid_layer in resid_layers
    if in_archive and sae.cfg.d_in != shape["d_model"]:
        raise SpecError(
            f"SAE {path}: d_in {sae.cfg.d_in} does not match {site.hook_name} of this model, which has "
            f"width {shape['d_model']} ({site.kind}); use an SAE trained on this model"
        )
    if source == "archive" and (not in_archive or prompt):
        held = f"resid at layers {resid_layers}" if resid_layers else "no residual vectors"
        why = "prompt positions are not archived" if in_archive else f"the run has {held}, not {site.hook_name}"
        raise SpecError(f"--source archive: {why}; use --source replay (or auto)")
    use_archive = in_archive and not prompt and source != "replay"
    taken = [f["name"] for f in run.manifest.get("features") or [] if f["sha256"] != sha]
    name = short_names([Path(n) for n in taken] + [path])[-1]
    owner = OwnerLock(run.path, "features", run.id).acquire()
    try:
        return _compute_owned(run, path, sae, site, sha, name, top_k, width or top_k, prompt, use_archive, device, note)
    finally:
        owner.release()


def _verify_inputs(run: Run, manifest: dict, use_archive: bool) -> None:
    """Check the checksums of what the computation reads (resid vectors or the token tables); ArchiveError if damaged."""
    from ..archive.damage import damaged_message
    from ..archive.integrity import verify

    reads = (
        (f"{layout.TENSORS}/resid/",) if use_archive else tuple(layout.table_file(t) for t in ("tokens", "sequences"))
    ) + (f"{layout.TENSORS}/generated_len/",)
    problems, _, _ = verify(run.path, manifest, prefix=reads)
    if problems:
        raise ArchiveError(damaged_message(run.id, problems[0]))


def _open_arrays(run: Run, manifest: dict, name: str, top_k: int, width: int, prompt: bool):
    """The `FeatureArrays` that take SAE `name`'s latents, shaped like the run's other arrays."""
    from ..archive.feature_arrays import FeatureArrays
    from ..archive.layout import FeatureShape

    shape = manifest["shape"]
    sizes = {
        "sequence": shape["n_sequences"],
        "step": shape["n_steps"],
        "prompt_pos": shape["max_prompt"],
        "k_feat": width,
    }
    return FeatureArrays(
        run.path,
        _like_array(run, manifest),
        FeatureShape(name, top_k, prompt),
        sizes,
        manifest["spec_resolved"]["output"],
    )


def _feature_entry(
    path: Path, sae, site, sha: str, name: str, top_k: int, prompt: bool, where: dict, seconds, load_s
) -> dict:
    """The manifest's `features` entry for SAE `name`: what it is, where it reads, and how it was computed."""
    from ..archive.runs import now_iso
    from ..features.refs import transcoder_record

    return {
        "name": name,
        "path": str(path.resolve()),
        "sha256": sha,
        "hook_name": sae.cfg.hook_name,
        "site": site.kind,
        "layer": site.layer,
        "d_in": sae.cfg.d_in,
        "d_sae": sae.cfg.d_sae,
        "architecture": sae.cfg.architecture,
        **transcoder_record(sae.cfg),
        "top_k": top_k,
        "prompt": prompt,
        "computed": {
            "by": "lmtrace features",
            "at": now_iso(),
            "source": where["source"],
            "tokens": where["tokens"],
            "seconds": seconds,
            "model_load_s": load_s,
        },
    }


def _compute_owned(
    run: Run,
    path: Path,
    sae,
    site,
    sha: str,
    name: str,
    top_k: int,
    width: int,
    prompt: bool,
    use_archive: bool,
    device: str | None,
    note,
) -> dict:
    """Compute and record SAE `name`'s features while the caller holds the run's owner lock."""
    from ..archive.integrity import record_update
    from ..archive.rundir import RunDir, Shard
    from ..archive.runs import read_manifest, write_manifest
    from ..archive.writer import consolidate
    from ..exits.faults import kill_point
    from ..exits.interrupts import work_recorded, work_started

    work_started()
    with RunDir(run.path, Shard()).lock():
        manifest = read_manifest(run.path)
        _verify_inputs(run, manifest, use_archive)
        note(f"computing the features of SAE {name} for {run.id} ({'archive' if use_archive else 'replay'})")
        t0 = time.time()
        run = Run(run.path, consolidated=False)
        arrays = _open_arrays(run, manifest, name, top_k, width, prompt)
        group = int(manifest["spec_resolved"]["output"].get("chunk_sequences") or 32)
        load_s, where = _write_values(
            run, manifest, sae, site, top_k, width, prompt, use_archive, device, group, arrays.write, note
        )
        consolidate(run.path)
        kill_point("features-written")
        checksums = record_update(
            run.path,
            manifest,
            (f"{layout.TENSORS}/zarr.json",) + arrays.written,
            {},
            lambda m: write_manifest(run.path, m),
        )
        seconds = round(time.time() - t0, 3)
        entry = _feature_entry(path, sae, site, sha, name, top_k, prompt, where, seconds, load_s)
        manifest["features"] = [f for f in manifest.get("features") or [] if f["name"] != name] + [entry]
        for spec in arrays.specs:
            manifest.setdefault("arrays", {})[spec.name] = {"dims": list(spec.dims), "dtype": spec.dtype}
        manifest["checksums"] = checksums
        write_manifest(run.path, manifest)
        work_recorded()
    return {"run_id": run.id, "computed": True, "name": name, **where, "seconds": seconds}


def _write_values(
    run: Run, manifest: dict, sae, site, top_k, width, prompt, use_archive, device, group, write, note
) -> tuple[float | None, dict]:
    """The values, from the archive or a replay: (model load seconds or None, {source, tokens})."""
    from ..analysis.features.deferred import from_archive, from_replay
    from ..features.sites import check_sae_sites

    if use_archive:
        index = list(manifest["shape"]["resid_layers"]).index(site.archived_resid_layer)
        return None, {"source": "archive", "tokens": from_archive(run, sae, index, top_k, width, group, write)}
    from ..capture.arch import adapter_for
    from ..runner.models import load_run_model
    from ..runner.parent import ParentView

    t0 = time.time()
    loaded = load_run_model(
        manifest,
        run.id,
        purpose="features (a replay)",
        overrides={"device": device, "attn_implementation": "eager"},
        note=note,
    )
    load_s = round(time.time() - t0, 3)
    model = loaded.model.eval()
    adapter = adapter_for(model)
    check_sae_sites(adapter, sae.cfg, "SAE")
    view = ParentView.read(run)
    tok = loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    shape = manifest["shape"]
    tokens = from_replay(
        model,
        adapter,
        site,
        sae,
        list(zip(view.prompt_ids, view.generated)),
        top_k=top_k,
        width=width,
        n_steps=shape["n_steps"],
        max_prompt=shape["max_prompt"],
        prompt=prompt,
        group=group,
        pad_id=pad_id,
        write=write,
    )
    return load_s, {"source": "replay", "tokens": tokens}


def features_compute_command(
    ref: str,
    sae_dir: str,
    *,
    top_k: int = 32,
    prompt: bool = False,
    source: str = "auto",
    device: str | None = None,
    runs_dir: str | None = None,
    json_out: bool = False,
    quiet: bool = False,
    note=lambda text: None,
) -> dict:
    out = compute_features(
        ref, sae_dir, top_k=top_k, prompt=prompt, source=source, device=device, runs_dir=runs_dir, note=note
    )
    if json_out:
        print(json_line(out))
    elif not quiet:
        if out["computed"]:
            print(
                f"{out['run_id']}: features of SAE {out['name']} computed from the {out['source']} "
                f"({out['tokens']:,} tokens, {out['seconds']:.2f} s)"
            )
        else:
            print(f"{out['run_id']}: {out['reason']} (SAE {out['name']})")
    return out
