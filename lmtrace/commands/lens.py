"""`lmtrace lens RUN`: the deferred logit lens, computed from the archived residual stream.

With `capture.lens.when: deferred` (the default) `generate` does not run the lens per step: it
archives, at every captured layer, the residual stream after the layer in float32 (`resid`) — the
exact tensor the inline lens reads. This module later applies the same final norm + unembedding
(`LogitLens`, same dtype mode) to those rows, writes `lens_ids` / `lens_probs` with the chunking and
codec of the run, adds `lens_top1`, `lens_top1_prob`, `lens_margin` to `steps.parquet`, and only
then records `lens.computed` in the manifest. The result is what an inline run would have archived,
bit for bit: each step's product has the rows the inline lens had (the generation batch's
sequences × the captured layers), because a CPU matrix product can round a row differently
depending on its place in the product (docs/archive.md, "Logit-lens precision and cost").

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

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from ..archive import layout, parquet_io
from ..archive.reader import Run, lens_state
from ..exits.errors import ArchiveError

if TYPE_CHECKING:
    from ..runner.generation import GenerateResult

# What the lens reads from the archive: hashed against the checksums before it computes (on the demo
# run 17 ms for these 9 files, against 34 ms for all 71; the arrays it does not read dominate larger
# runs). The consolidated tensors.zarr/zarr.json is not read: the lens regenerates it.
LENS_READS = tuple(layout.table_file(t) for t in ("tokens", "sequences", "steps")) + tuple(
    f"{layout.TENSORS}/{name}/" for name in ("resid", "generated_len"))
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
        raise ArchiveError(f"run {run.id} captured no logit lens (capture.lens.enabled: false, or capture: none); "
                         f"generate it again with the lens enabled")
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
    from ..exits.faults import kill_point
    from ..archive.runs import now_iso, read_manifest, write_manifest
    from ..exits.interrupts import work_recorded, work_started

    work_started()  # (a second run of `lmtrace lens A B`, the lens after `generate --lens`)
    with RunDir(run.path, Shard()).lock():
        manifest = read_manifest(run.path)
        if lens_state(manifest) == "ready":  # another `lmtrace lens` finished it meanwhile
            return _already(run)
        if manifest.get("status") != "complete":
            raise ArchiveError(f"run {run.id} is {manifest.get('status')}: the deferred lens is computed on complete "
                             f"runs; finish it first (`lmtrace generate --resume {run.id}`)")
        _check_inputs(run.path, manifest, run.id)
        note(f"computing the logit lens of {run.id}")  # only now: a refusal stays one line
        t0 = time.time()
        rows, new_steps = _compute(Run(run.path, consolidated=False), manifest, device, note, loaded)
        kill_point("lens-written")
        from ..archive.integrity import record_update

        try:
            checksums = record_update(run.path, manifest, LENS_WRITES, {layout.table_file("steps"): new_steps},
                                      lambda m: write_manifest(run.path, m))
        finally:
            new_steps.unlink(missing_ok=True)  # (moved into place unless the recording failed)
        kill_point("lens-checksums")
        manifest["lens"]["computed"] = {"by": "lmtrace lens", "at": now_iso(), "seconds": round(time.time() - t0, 3),
                                        "model_load_s": rows["model_load_s"], "device": rows.pop("device"),
                                        "rows": rows["rows"]}
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
    from ..archive.integrity import verify
    from ..archive.damage import damaged_message

    problems, _, _ = verify(path, manifest, prefix=LENS_READS)
    if problems:
        raise ArchiveError(damaged_message(run_id, problems[0]))


def _compute(run: Run, manifest: dict, device: str | None, note, loaded=None) -> tuple[dict, Path]:
    """Write the lens arrays and the consolidated metadata; returns the summary and the new
    steps.parquet (a temporary file beside it, moved into place when the checksums are recorded)."""
    import torch  # here, not at the top: a no-op `lmtrace lens` answers without importing it (seconds)

    from ..capture.arch import adapter_for
    from ..archive.shards import checksummed, sequences_per_shard
    from ..archive.writer import compressors_for, consolidate, create_array
    from ..capture.lens_stats import lens_target_columns
    from ..capture.lens import LogitLens
    from ..runner.models import load_run_model

    spec = manifest["spec_resolved"]
    t_load = time.time()
    # The run's own dtype and device (not the spec's `auto`, which could pick another), so the lens
    # is what inline would have computed; --device overrides the device only. A run spread over
    # devices (model.device_map) is loaded with its placement again, unless --device names one.
    # Eager attention: the lens never runs attention, and eager loads every family (Gemma 2,
    # GPT-OSS refuse sdpa).
    if loaded is None:
        spread = spec["model"].get("device_map") is not None
        loaded = load_run_model(manifest, run.id, purpose="the deferred logit lens",
                                overrides={"device": device or (None if spread else manifest.get("device")),
                                           "dtype": manifest.get("dtype"), "attn_implementation": "eager"},
                                note=note, spread_ok=True)
    load_s = time.time() - t_load
    adapter = adapter_for(loaded.model)
    lens = LogitLens(adapter, int(spec["capture"]["lens"]["top_k"]), spec["capture"]["lens"]["dtype"])

    layers = run.layers
    resid_layers = list(manifest["shape"]["resid_layers"])
    missing = [layer for layer in layers if layer not in resid_layers]
    if missing or "resid" not in run.array_names():
        raise ArchiveError(f"run {run.id} has no archived residual at layers {missing or layers}: the lens cannot be "
                           f"computed from it")
    at = [resid_layers.index(layer) for layer in layers]
    resid = run.array("resid")
    n_seq, n_steps = resid.shape[:2]
    L, k = len(layers), lens.k
    chunk = int(spec["output"]["chunk_steps"])
    for s in layout.LENS_ARRAYS:  # what an interrupted `lmtrace lens` left (not recorded): computed again
        shutil.rmtree(run.path / layout.TENSORS / s.name, ignore_errors=True)
    group = _writable_group(run.path)
    codec, level = spec["output"]["codec"], int(spec["output"]["level"])
    # sharded like the run's own arrays (format 3), or one chunk file per sequence and block (format 2);
    # chunks with their crc32c when the run's have them (format 4)
    per_shard = sequences_per_shard(resid)
    out = {s.name: create_array(group, s, (n_seq, n_steps, L, k), chunk,
                                compressors_for(codec, level, s, checksum=checksummed(resid)), chunk_sequences=per_shard)
           for s in layout.LENS_ARRAYS}
    gen_len = run.generated_len()

    top1 = np.full((n_seq, n_steps, L), -1, dtype=np.int32)
    top1_prob = np.full((n_seq, n_steps, L), np.nan, dtype=np.float32)
    margin = np.full((n_seq, n_steps, L), np.nan, dtype=np.float32)
    targets = _targets(run, n_seq, n_steps)  # [seq, step, 2]: chosen, runner-up (as the inline lens had them)
    t_rank = np.full((n_seq, n_steps, L, 2), -1, dtype=np.int32)
    t_prob = np.full((n_seq, n_steps, L, 2), np.nan, dtype=np.float32)
    n_rows = 0
    from ..exits.faults import kill_point

    for seqs in _batches(run):
        B = len(seqs)
        n_of = np.maximum(gen_len[seqs], 0).astype(int)  # steps each sequence generated
        n = int(n_of.max())
        for s0 in range(0, n, chunk):  # one block of steps at a time, as generate writes them
            s1 = min(s0 + chunk, n_steps)
            x = np.stack([np.asarray(resid[seq, s0:s1])[:, at] for seq in seqs])  # [B, steps, L, d] float32
            ids = np.full((B, s1 - s0, L, k), -1, dtype=np.int32)
            probs = np.full((B, s1 - s0, L, k), np.nan, dtype=np.float32)
            margins = np.full((B, s1 - s0, L), np.nan, dtype=np.float32)
            for j in range(min(s1, n) - s0):
                live = n_of > s0 + j
                # The rows of one step of the whole batch, in the inline lens's order (sequence, layer),
                # finished sequences included as zeros (inline ran the lens on their pad steps and
                # dropped the result): a CPU matrix product can round a row differently depending on
                # its place in the product (e.g. the last rows of a tile), so only the same rows in
                # the same places give the inline values bit for bit.
                rows = np.where(live[:, None, None], x[:, j], np.float32(0))
                tg = np.repeat(targets[seqs, s0 + j], L, 0)  # the rows' (chosen, runner-up); 0 for finished ones
                i, p, m, tr, tp = lens.of_residuals(torch.from_numpy(np.ascontiguousarray(rows)).reshape(B * L, -1),
                                                    torch.from_numpy(tg))
                ids[live, j] = i.reshape(B, L, k)[live]
                probs[live, j] = p.reshape(B, L, k)[live]
                margins[live, j] = m.reshape(B, L)[live]
                t_rank[np.asarray(seqs)[live], s0 + j] = tr.reshape(B, L, 2)[live]
                t_prob[np.asarray(seqs)[live], s0 + j] = tp.reshape(B, L, 2)[live]
                n_rows += int(live.sum()) * L
            for b, seq in enumerate(seqs):  # steps a sequence did not generate keep the fill values
                out["lens_ids"][seq:seq + 1, s0:s1] = ids[b][None]
                out["lens_probs"][seq:seq + 1, s0:s1] = probs[b][None]
                top1[seq, s0:s1], top1_prob[seq, s0:s1] = ids[b, :, :, 0], probs[b, :, :, 0]
                margin[seq, s0:s1] = margins[b]
        note(f"lens: sequences {seqs[0]}..{seqs[-1]} ({n} steps)")
        kill_point("lens-batch")
    columns = dict(zip(layout.LENS_STEP_COLUMNS, (top1, top1_prob, margin)))
    columns.update(lens_target_columns(t_rank, t_prob, layers))
    new_steps = _steps_with_columns(run, columns, layers)
    try:
        consolidate(run.path)
    except BaseException:
        new_steps.unlink(missing_ok=True)
        raise
    return {"rows": n_rows, "device": str(loaded.device), "model_load_s": round(load_s, 3)}, new_steps


def _targets(run: Run, n_seq: int, n_steps: int) -> np.ndarray:
    """[sequence, step, 2] int64: the chosen token and the runner-up (the most likely other token at
    T=1, from `alt_ids`) of every generated step, from tokens.parquet; 0 where no step was generated."""
    from ..capture.lens_stats import lens_targets

    t = run.tokens().select(["sequence", "step", "is_prompt", "token_id", "alt_ids"]).to_pandas()
    t = t[~t.is_prompt]
    out = np.zeros((n_seq, n_steps, 2), dtype=np.int64)
    if len(t):
        alt = np.stack([np.asarray(a[:2]) for a in t.alt_ids])
        out[t.sequence.to_numpy().astype(np.int64), t.step.to_numpy().astype(np.int64)] = lens_targets(t.token_id.to_numpy(), alt)
    return out


def _batches(run: Run) -> list[list[int]]:
    """The run's generation batches (sequence indices, in their rows' order), from `sequences.parquet`."""
    table = run.sequences()
    batches: dict[int, list[int]] = {}
    for seq, batch in sorted(zip(table.column("sequence").to_pylist(), table.column("batch").to_pylist())):
        batches.setdefault(batch, []).append(seq)
    return [batches[b] for b in sorted(batches)]


def _writable_group(path: Path):
    import zarr

    # not the consolidated metadata: it lists the lens arrays of an interrupted lens, removed by _compute
    return zarr.open_group(str(path / layout.TENSORS), mode="a", zarr_format=3, use_consolidated=False)


def _steps_with_columns(run: Run, values: dict[str, np.ndarray], layers: list[int]) -> Path:
    """steps.parquet with the lens columns (in the archive's column order), written to a temporary
    file beside it; returns its path."""
    target = run.path / layout.table_file("steps")
    table = parquet_io.read_table(target)
    seq = table.column("sequence").to_numpy()
    step = table.column("step").to_numpy()
    li = np.searchsorted(np.asarray(layers), table.column("layer").to_numpy())
    names = [c for c in layout.STEP_COLUMNS if c in table.column_names or c in values]
    columns = {c: (pa.array(values[c][seq, step, li]) if c in values else table.column(c)) for c in names}
    out = pa.table(columns, schema=layout.step_schema(names))
    tmp = target.with_name(f".{target.name}.lens.tmp")
    try:
        parquet_io.write_table(out, tmp, row_group_size=65536)
    except BaseException:
        tmp.unlink(missing_ok=True)  # (a full disk, a signal)
        raise
    return tmp


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
