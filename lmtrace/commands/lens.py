"""`lmtrace lens RUN`: the deferred logit lens, computed from the archived residual stream.

With `capture.lens.when: deferred` (the default) `generate` does not run the lens per step: it
archives, at every captured layer, the residual stream after the layer in float32 (`resid`) — the
exact tensor the inline lens reads. `lmtrace lens` later applies the same final norm + unembedding
(`LogitLens`, same dtype mode) to those rows (`analysis/deferred_lens.py`), writes `lens_ids` /
`lens_probs` with the chunking and codec of the run (`archive/lens_arrays.py`), adds `lens_top1`,
`lens_top1_prob`, `lens_margin` to `steps.parquet`, and only then records `lens.computed` in the
manifest. The result is what an inline run would have archived, bit for bit: each step's product
has the rows the inline lens had (the generation batch's sequences × the captured layers), because
a CPU matrix product can round a row differently depending on its place in the product
(docs/archive.md, "Logit-lens precision and cost").

Why deferred by default: on a CPU the lens over every layer is ~1.7 GFLOP per step for a 135M
model, more than its own decode step (docs/archive.md, "Cost"); done later it costs nothing during
generation and is only paid for the runs someone looks at ("generate first, explain later").

Integrity: before computing, the files the lens reads (LENS_READS) are hashed against the run's
checksums, and a changed one is refused (exit 2, naming it): the lens must not be computed from
damaged data. Afterwards only the files it wrote are re-recorded (integrity.record_update); every
other file keeps its checksum from completion, so damage elsewhere stays visible to `lmtrace verify`.

Crash safety: arrays are written first, then `steps.parquet` is replaced and the checksums
re-recorded (in an order where every file matches the old record or the new one), then the manifest
says `computed`. A kill before that leaves the lens pending (a rerun recomputes all of it).
The whole computation holds the run's lock, so two `lmtrace lens` on one run do the work once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..archive import layout
from ..archive.reader import Run, lens_state
from ..exits.errors import ArchiveError

if TYPE_CHECKING:
    from ..runner.generation import GenerateResult

# What the lens reads from the archive: hashed against the checksums before it computes (on the demo
# run 17 ms for these 9 files, against 34 ms for all 71; the arrays it does not read dominate larger
# runs). The consolidated tensors.zarr/zarr.json is not read: the lens regenerates it.
LENS_READS = tuple(layout.table_file(t) for t in ("tokens", "sequences", "steps")) + tuple(
    f"{layout.TENSORS}/{name}/" for name in ("resid", "generated_len")
)
# What the lens writes in place: its arrays and the consolidated metadata (steps.parquet is replaced).
LENS_WRITES = (f"{layout.TENSORS}/zarr.json",) + tuple(f"{layout.TENSORS}/{s.name}/" for s in layout.LENS_ARRAYS)


def compute_lens(run: Run, *, device: str | None = None, note=lambda text: None, loaded=None) -> dict:
    """Compute and archive the deferred lens of a complete run; a no-op when it is already there.

    `loaded`: the run's model, already in memory (`generate --lens`, `intervene --lens`: the process
    that just generated the run), so it is not loaded again."""
    from ..archive.liveness import OwnerLock
    from ..exits.faults import pause_after_owning

    state = lens_state(run.manifest)
    if state == "ready":  # answered before taking any lock or importing torch
        return _already(run)
    if state == "none":
        raise ArchiveError(
            f"run {run.id} captured no logit lens (capture.lens.enabled: false, or capture: none); "
            f"generate it again with the lens enabled"
        )
    # One lens writer at a time: a second `lmtrace lens` of the run exits 2 naming the holder's pid.
    owner = OwnerLock(run.path, "lens", run.id).acquire()
    try:
        pause_after_owning()
        return _compute_owned(run, device, note, loaded)
    finally:
        owner.release()


def _already(run: Run) -> dict:
    return {"run_id": run.id, "computed": False, "reason": "logit lens already present"}


def _compute_owned(run: Run, device: str | None, note, loaded=None) -> dict:
    from ..archive.rundir import RunDir, Shard
    from ..archive.runs import now_iso, read_manifest, write_manifest
    from ..exits.faults import kill_point
    from ..exits.interrupts import work_recorded, work_started

    work_started()  # (a second run of `lmtrace lens A B`, the lens after `generate --lens`)
    with RunDir(run.path, Shard()).lock():
        manifest = read_manifest(run.path)
        if lens_state(manifest) == "ready":  # another `lmtrace lens` finished it meanwhile
            return _already(run)
        if manifest.get("status") != "complete":
            raise ArchiveError(
                f"run {run.id} is {manifest.get('status')}: the deferred lens is computed on complete "
                f"runs; finish it first (`lmtrace generate --resume {run.id}`)"
            )
        _check_inputs(run.path, manifest, run.id)
        note(f"computing the logit lens of {run.id}")  # only now: a refusal stays one line
        t0 = time.time()
        rows, new_steps = _compute(Run(run.path, consolidated=False), manifest, device, note, loaded)
        kill_point("lens-written")
        from ..archive.integrity import record_update

        try:
            checksums = record_update(
                run.path,
                manifest,
                LENS_WRITES,
                {layout.table_file("steps"): new_steps},
                lambda m: write_manifest(run.path, m),
            )
        finally:
            new_steps.unlink(missing_ok=True)  # (moved into place unless the recording failed)
        kill_point("lens-checksums")
        manifest["lens"]["computed"] = {
            "by": "lmtrace lens",
            "at": now_iso(),
            "seconds": round(time.time() - t0, 3),
            "model_load_s": rows["model_load_s"],
            "device": rows.pop("device"),
            "rows": rows["rows"],
        }
        for spec in layout.LENS_ARRAYS:
            manifest.setdefault("arrays", {})[spec.name] = {"dims": list(spec.dims), "dtype": spec.dtype}
        manifest["checksums"] = checksums
        write_manifest(run.path, manifest)
        work_recorded()  # a signal from now on leaves the lens recorded and the exit code 0
    run.manifest = manifest  # the caller's Run sees the lens without reopening the run
    run.__dict__.pop("tensors", None)
    return {"run_id": run.id, "computed": True, **rows, "seconds": manifest["lens"]["computed"]["seconds"]}


def _check_inputs(path: Path, manifest: dict, run_id: str) -> None:
    """Refuse (exit 2, naming the file) a run whose files the lens reads differ from their checksums."""
    from ..archive.damage import damaged_message
    from ..archive.integrity import verify

    problems, _, _ = verify(path, manifest, prefix=LENS_READS)
    if problems:
        raise ArchiveError(damaged_message(run_id, problems[0]))


def _compute(run: Run, manifest: dict, device: str | None, note, loaded=None) -> tuple[dict, Path]:
    """Write the lens arrays and the consolidated metadata; returns the summary and the new
    steps.parquet (a temporary file beside it, moved into place when the checksums are recorded).
    The model comes from `runner.models`, the values from `analysis.deferred_lens`, the files are
    written through `archive.lens_arrays`."""
    # here, not at the top: a no-op `lmtrace lens` answers without importing torch (seconds)
    from ..analysis.deferred_lens import deferred_lens
    from ..archive.lens_arrays import LensArrays, steps_with_columns
    from ..archive.writer import consolidate
    from ..capture.arch import adapter_for
    from ..capture.lens import LogitLens
    from ..runner.models import load_lens_model

    spec = manifest["spec_resolved"]
    t_load = time.time()
    if loaded is None:
        loaded = load_lens_model(manifest, run.id, device, note)
    load_s = time.time() - t_load
    adapter = adapter_for(loaded.model)
    lens = LogitLens(adapter, int(spec["capture"]["lens"]["top_k"]), spec["capture"]["lens"]["dtype"])

    layers = run.layers
    resid_layers = list(manifest["shape"]["resid_layers"])
    missing = [layer for layer in layers if layer not in resid_layers]
    if missing or "resid" not in run.array_names():
        raise ArchiveError(
            f"run {run.id} has no archived residual at layers {missing or layers}: the lens cannot be computed from it"
        )
    resid = run.array("resid")
    arrays = LensArrays(run.path, resid, (*resid.shape[:2], len(layers), lens.k), spec["output"])
    n_rows, columns = deferred_lens(
        run,
        lens,
        layers,
        [resid_layers.index(layer) for layer in layers],
        int(spec["output"]["chunk_steps"]),
        arrays.write,
        note,
    )
    new_steps = steps_with_columns(run, columns, layers)
    try:
        consolidate(run.path)
    except BaseException:
        new_steps.unlink(missing_ok=True)
        raise
    return {"rows": n_rows, "device": str(loaded.device), "model_load_s": round(load_s, 3)}, new_steps


def lens_after(result: "GenerateResult", note=lambda text: None) -> dict | None:
    """`generate --lens` / `intervene --lens`: the deferred lens of the run just written, with the
    model already in memory (no second load). None when this process did not complete the run
    (a shard whose siblings are still running: the last one to finish computes it)."""
    if result.status != "complete":
        return None
    import warnings

    from ..archive.reader import IncompleteRunWarning, open_run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        run = open_run(result.run_dir)
    if lens_state(run.manifest) == "none":  # (intervene children inherit their parent's capture)
        return {"run_id": run.id, "computed": False, "reason": "no logit lens captured in this run"}
    return compute_lens(run, note=note, loaded=result.loaded)
