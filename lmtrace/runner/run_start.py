"""Starting a run's directory: the new run's manifest (status running) and spec, or a resumed or
joined run marked running again, then its vocab.parquet; a failure once the manifest exists is
recorded in it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from ..archive import layout
from ..archive.manifest import manifest_base
from ..archive.rundir import RunDir, check_target, finish_failed, outcome
from ..archive.runs import RunLog, now_iso, write_manifest
from ..archive.vocab import store_vocab
from ..exits.errors import LmtraceError, SpecError
from ..spec.prompt_metadata import schema_of
from .batching import MemoryBudget

if TYPE_CHECKING:
    from .generation import Setup


def new_manifest(spec, given_text, setup: Setup, run_id, shard, replay) -> dict:
    manifest = manifest_base(
        spec,
        given_text,
        setup.loaded,
        setup.adapter,
        setup.shape,
        setup.inner_name,
        run_id,
        setup.prompts,
        setup.eager_reason,
    )
    manifest["timings"]["model_load_s"] = round(setup.load_s, 3)
    if setup.probes is not None and setup.shape.attention and setup.inner_name != "eager":
        manifest["attention"]["row_method"] = setup.probes.row_method
    manifest["shards"] = shard.count
    if setup.features:  # capture.features: each SAE, its weights' sha256 (a resume checks them)
        manifest["features"] = [s.record() for s in setup.features]
    manifest["prompt_metadata"] = schema_of(setup.metadata)
    if setup.budget is not None:
        manifest["memory_budget"] = setup.budget.record
    if replay is not None:
        manifest.update(replay.manifest_extra)
    return manifest


def resumed_metadata(existing: dict, run_id: str, metadata: pa.Table | None) -> pa.Table | None:
    """The metadata columns a resumed or joining shard writes: those the run was started with (every
    batch's sequences part has the same columns); none for a run from before they were kept."""
    if "prompt_metadata" not in existing:
        return None
    had, has = existing["prompt_metadata"], schema_of(metadata)
    if had != has:
        show = lambda cols: ", ".join(f"{k}: {v}" for k, v in cols.items()) or "none"  # noqa: E731
        raise SpecError(
            f"run {run_id}: the prompt file's metadata columns ({show(has)}) differ from those the run "
            f"was started with ({show(had)}); use the prompt file the run was started with"
        )
    return metadata


def start_run(
    spec, given_text, rd: RunDir, existing, new_manifest, root, resume, tokenizer, budget: MemoryBudget | None = None
) -> None:
    """Write the new run's manifest (status running), or mark a resumed / joined run running again,
    then the run's vocab.parquet when it has none yet.

    A failure (or a signal) once the manifest exists is recorded in it before it propagates."""
    run_dir = rd.path
    try:
        with rd.lock():
            if existing is None and not (run_dir / layout.MANIFEST).is_file():
                manifest = new_manifest()
                write_manifest(run_dir, manifest)
                (run_dir / layout.SPEC).write_text(given_text)
            else:
                from ..archive.runs import read_manifest

                if existing is None:  # another shard created the run meanwhile: it must be this one
                    check_target(root, spec, rd.shard, resume, owned=True)
                manifest = read_manifest(run_dir)
                manifest.update(status="running", resumed=now_iso())
                manifest.pop("error", None)
                if budget is not None:  # (auto: chosen again from the memory free now; the last one chosen)
                    manifest["memory_budget"] = budget.record
                write_manifest(run_dir, manifest)
            # after the manifest (a directory with anything but it and the locks is not taken for a
            # run a kill interrupted at its start), under the lock (shards do not all decode it)
            vocab_s = store_vocab(run_dir, tokenizer)
            if vocab_s is not None:
                manifest["timings"]["vocab_s"] = vocab_s
                write_manifest(run_dir, manifest)
    except BaseException as err:
        if (run_dir / layout.MANIFEST).is_file() and not isinstance(err, SpecError):
            finish_failed(None, rd, RunLog(run_dir / layout.LOG), *outcome(err))
        if isinstance(err, OSError):  # e.g. a resume on a full disk: one line, not an internal error
            from ..archive.files import space_note

            raise LmtraceError(f"cannot start run {run_dir.name}: {space_note(run_dir, err)}") from None
        raise
