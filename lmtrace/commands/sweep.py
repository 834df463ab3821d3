"""`lmtrace sweep RUN`: ablate or patch every head, block, layer, neuron or position in turn, in one process.

This module orchestrates (docs/sweep.md has the full text): it resolves the parent run and the
patch source, checks every input before the model is loaded, plans the blocks (one batch of cells
of one sequence), runs them through the engine, commits each block, and assembles the result.
What is computed lives below it:
  lmtrace/spec/sweep_spec.py           the sweep spec (flags or YAML)
  lmtrace/analysis/sweep/inputs   the runs, sequences, steps, cells and metrics, checked
  lmtrace/analysis/sweep/cells    the swept cells
  lmtrace/analysis/sweep/metrics  the metrics per (cell, sequence, step)
  lmtrace/analysis/sweep/engine   the forward: one cell per batch row, prefix KV reuse, patches
  lmtrace/analysis/sweep/packs    sequences of one layout in one forward, a pack's checked baseline
  lmtrace/analysis/sweep/effects  the per-cell mean effects (ranking, effects.zarr, report, heads)
  lmtrace/analysis/sweep/attribution(_run)  --method attribution: the estimate, its blocks, --verify
  lmtrace/archive/sweeps          the files: blocks, sweep.parquet, sweep_mean, effects.zarr, sweep.json

Output: RUN/sweeps/<id>/, recorded in the run's manifest under `sweeps`. Blocks are written as
Parquet parts under sweeps/.partial-<id>/: a killed or interrupted sweep continues from its
committed blocks, and shards (`--shard I/N`) share one partial directory; the last to finish
assembles the result.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..analysis.sweep import attribution_run as sweep_attribution
from ..analysis.sweep.effects import (
    cell_effects,
    effect_array,
    normalised_effect,
    patching_summary,
    ranking,
    sequence_means,
)
from ..analysis.sweep.feature_cells import feature_effect_array
from ..analysis.sweep.inputs import SweepInputs, sweep_inputs
from ..analysis.sweep.packs import MAX_PACK, PACK_CONTEXT, pack_sequences, plan_sequences, prepare_pack
from ..archive.files import atomic_write_json
from ..archive.liveness import OwnerLock
from ..archive.runs import locked
from ..archive.sweeps import (
    SWEEPS_DIR,
    EffectArray,
    block_table,
    create_partial,
    read_blocks,
    record_sweep,
    write_block,
    write_sweep,
    writer_key,
)
from ..exits.errors import Interrupted, SpecError
from ..exits.faults import pause_after_owning
from ..exits.interrupts import StopFlag
from ..spec.sweep_spec import SweepSpec


@dataclass
class SweepResult:
    sweep_id: str
    path: Path | None  # the finished sweep directory (None: this shard finished, others still running)
    status: str  # complete | shard-complete
    summary: dict
    seconds: float


def run_sweep(
    parent_ref: str,
    spec: SweepSpec,
    *,
    runs_dir: str | None = None,
    sweep_id: str | None = None,
    shard: tuple[int, int] = (0, 1),
    resume: bool = False,
    top: int = 20,
    note=lambda text: None,
) -> SweepResult:
    from ..archive.runs import new_run_id

    t0 = time.time()
    inp = sweep_inputs(parent_ref, spec, runs_dir)
    parent = inp.parent

    given = {"parent": parent.id, "source": inp.source_run.id if inp.source_run else None, **spec.given()}
    index, count = shard
    if resume and sweep_id is None:
        raise SpecError("--resume needs --run-id ID: the id of the unfinished sweep (sweeps/.partial-ID)")
    if count > 1 and sweep_id is None:
        raise SpecError("a sharded sweep needs a shared id: pass --run-id (with --shard auto it is slurm-<job id>)")
    sweep_id = sweep_id or new_run_id()
    # One process per sweep id and shard: a second `lmtrace sweep --run-id S` (with the same --shard)
    # exits 2 at once naming the holder's pid; the shards of one sweep hold keys of their own.
    owner = OwnerLock(parent.path, writer_key(sweep_id, index, count), parent.id).acquire()
    try:
        pause_after_owning()
        return _sweep_owned(inp, spec, given, sweep_id, shard, resume, top, note, t0)
    finally:
        owner.release()


def _plan_blocks(inp: SweepInputs, spec: SweepSpec) -> list:
    """The plan: blocks of cells, per sequence (attribution: a sequence a block); a shard takes every N-th."""
    cells = inp.cells
    if spec.method != "exact":
        return [(s, 0, cells) for s in inp.seqs]
    return [(s, j, cells[i : i + spec.batch]) for s in inp.seqs for j, i in enumerate(range(0, len(cells), spec.batch))]


def _sweep_owned(
    inp: SweepInputs,
    spec: SweepSpec,
    given: dict,
    sweep_id: str,
    shard: tuple[int, int],
    resume: bool,
    top: int,
    note,
    t0: float,
) -> SweepResult:
    """run_sweep's work once this process owns the sweep id and shard: check what exists, load the
    model, run this shard's blocks, and assemble when every block is committed."""
    from ..archive.runs import now_iso

    parent = inp.parent
    index, count = shard
    root = parent.path / SWEEPS_DIR
    final = root / sweep_id
    partial = root / f".partial-{sweep_id}"
    plan = {"spec": given, "shards": count}
    if final.exists():
        raise SpecError(f"sweep {sweep_id} of run {parent.id} already exists ({final}); choose another --run-id")
    if partial.exists():
        _check_plan(partial, plan, sweep_id)
    elif resume:
        raise SpecError(f"no unfinished sweep {sweep_id} of run {parent.id} to resume")
    loaded, adapter, engine = _load_engine(inp, spec, note)
    if inp.top_features is not None:  # --over features, not archived: the top features of a forward each
        choose_features(inp, adapter, partial, note)

    # only now is anything written into sweeps/
    root.mkdir(exist_ok=True)
    with locked(root / ".lock"):
        if partial.exists():  # another shard created it meanwhile: it must be this sweep
            _check_plan(partial, plan, sweep_id)
            if inp.top_features is not None:
                choose_features(inp, adapter, partial, note)  # the features it chose
        else:
            chosen = {"features": [c.neuron for c in inp.cells]} if inp.top_features is not None else {}
            n_blocks = len(_plan_blocks(inp, spec))
            create_partial(
                partial, {**plan, "n_blocks": n_blocks, "n_cells": len(inp.cells), **chosen, "created": now_iso()}
            )
    blocks = _plan_blocks(inp, spec)
    t_model = time.time()
    mine = [blk for k, blk in enumerate(blocks) if k % count == index]
    done = (_run_blocks if spec.method == "exact" else sweep_attribution.run_blocks)(
        inp, spec, engine, adapter, mine, partial, sweep_id, note
    )
    t_done = time.time()
    _write_shard_status(partial, shard, done, round(t_done - t0, 3), engine.skip_ok)
    with locked(root / ".lock"):
        n_files = len(list((partial / "blocks").glob("*.parquet")))
        if n_files < len(blocks) or final.exists():
            return SweepResult(
                sweep_id, None, "shard-complete", {"sweep_id": sweep_id, "blocks": done["n_done"]}, t_done - t0
            )
        table, checked = read_blocks(partial), None
        if spec.verify:
            table, checked = sweep_attribution.verify(
                inp, spec, engine, adapter, table, spec.verify, note, (pack_sequences, plan_sequences, prepare_pack)
            )
        timings = {
            "model_load_s": round(t_model - t0, 3),
            "sweep_s": round(t_done - t_model, 3),
            **({"verify_s": round(time.time() - t_done, 3)} if checked else {}),
        }
        info = _assemble(inp, spec, loaded, given, sweep_id, table, partial, final, top, timings, checked)
    return SweepResult(sweep_id, final, "complete", _summary(inp, sweep_id, final, info, t0), time.time() - t0)


def choose_features(inp: SweepInputs, adapter, partial: Path, note) -> None:
    """--over features without --features, the SAE's latents not archived: the top features of a forward
    of each swept sequence, or those the unfinished sweep (plan.json) chose."""
    from ..analysis.sweep.feature_cells import chosen_cells

    plan = partial / "plan.json"
    recorded = json.loads(plan.read_text()).get("features") if plan.exists() else None
    inp.cells = chosen_cells(inp, adapter, recorded, inp.feature_positions, note)


def _load_engine(inp: SweepInputs, spec: SweepSpec, note) -> tuple:
    """The model, loaded once, its adapter, and the engine that runs the cells (with the parent's mean
    values for --edit mean)."""
    from ..analysis.sweep.engine import MEAN_KIND, Engine
    from ..capture.arch import adapter_for
    from ..capture.interventions import component_means
    from ..runner.models import load_run_model

    parent, view, cells = inp.parent, inp.view, inp.cells
    loaded = load_run_model(parent.manifest, parent.id, purpose="the sweep", note=note)
    adapter = adapter_for(loaded.model)
    loaded.model.eval()
    means = None
    if spec.edit == "mean":
        n_seq = len(view.prompt_ids)
        wanted = {(MEAN_KIND[c.component], c.layer) for c in cells}
        note(f"mean values: one forward over each of the parent's {n_seq} sequences")
        means = component_means(adapter, [view.prompt_ids[s] + view.generated[s] for s in range(n_seq)], wanted)
    if inp.features is not None:
        inp.features.site.check(adapter, inp.features.sae.cfg.d_in, f"SAE {inp.features.path}")
        inp.features.sae.to(next(loaded.model.parameters()).device)
    engine = Engine(adapter, spec.edit, means, inp.metrics, inp.from_step, features=inp.features, value=spec.value)
    if spec.method == "attribution" and any(c.component == "position" for c in cells):
        loaded.model.set_attn_implementation("eager")  # the QK fix reads the attention patterns
    return loaded, adapter, engine


def _write_shard_status(partial: Path, shard: tuple[int, int], done: dict, seconds: float, prefix_skip) -> None:
    """This shard's blocks are committed: its shard-I-of-N.json (read when the sweep is assembled)."""
    index, count = shard
    atomic_write_json(
        partial / f"shard-{index}-of-{count}.json",
        {
            "status": "complete",
            "blocks": done["n_done"],
            "baseline_max_abs_diff": done["baseline_check"],
            "source_baseline": done["source_baseline"],
            "seconds": seconds,
            "prefix_skip": prefix_skip,
        },
    )


def _summary(inp: SweepInputs, sweep_id: str, final: Path, info: dict, t0: float) -> dict:
    """The finished sweep's summary (the CLI's --json and table): from sweep.json's content."""
    summary = {
        "sweep_id": sweep_id,
        "run_id": inp.parent.id,
        "path": str(final),
        "n_cells": len(inp.cells),
        "metric": inp.metrics[0].key,
        "baseline_max_abs_diff": info["baseline_max_abs_diff"],
        "seconds": round(time.time() - t0, 3),
        "sweep_s": info["timings"]["sweep_s"],
        "top": info["top"],
    }
    for key in ("patching", "method", "verify", "features"):
        if key in info:
            summary[key] = info[key]
    return summary


def _check_plan(partial: Path, plan: dict, sweep_id: str) -> None:
    """An unfinished sweep continues only with the settings it was started with."""
    started = json.loads((partial / "plan.json").read_text())
    if started["spec"] != plan["spec"] or started["shards"] != plan["shards"]:
        raise SpecError(
            f"sweep {sweep_id} exists unfinished with different settings; use another --run-id, or "
            f"the same settings to continue it"
        )


def _run_blocks(
    inp: SweepInputs, spec: SweepSpec, engine, adapter, mine: list, partial: Path, sweep_id: str, note
) -> dict:
    """Run and commit this shard's blocks not committed yet, packs of sequences at a time; the baseline
    once per pack (each sequence's checked against the archived log-probs). SIGTERM / SIGINT: finish the
    current blocks, then stop (exit 3)."""
    from transformers import DynamicCache

    from ..capture.kv_cache import packable

    def block_path(s: int, j: int) -> Path:
        return partial / "blocks" / f"s{s:05d}-b{j:06d}.parquet"

    pending = [(s, j, cells) for s, j, cells in mine if not block_path(s, j).exists()]
    todo: dict[int, set[int]] = {}  # sequence -> its blocks to run, in the order they come
    for s, j, _ in pending:
        todo.setdefault(s, set()).add(j)
    block_cells = {j: cells for _, j, cells in pending}
    planned = plan_sequences(inp, spec, engine, list(todo))
    longest = max((q.prompt_len + max(q.steps) for q in planned), default=1)
    widest = max((len(c) for c in block_cells.values()), default=1)
    limit = max(1, min(MAX_PACK, spec.batch * PACK_CONTEXT // (widest * longest)))
    if not packable(DynamicCache(config=engine.model.config)):
        limit = 1  # linear-attention states and the like: rows cannot be selected
    stop = StopFlag()
    baseline_check: dict = {}
    source_baseline: dict[str, dict] = {}  # patch: the source's own unedited logit_diff per measured step
    n_done = 0
    with stop.installed():
        for pack in pack_sequences(planned, limit):
            seq_in = prepare_pack(inp, spec, engine, adapter, pack, baseline_check, source_baseline)
            for j in sorted(set().union(*(todo[q.s] for q in pack))):
                members = [k for k, q in enumerate(pack) if j in todo[q.s]]
                cells = block_cells[j]
                sources = [pack[k].source for k in members] if spec.edit == "patch" else None
                logits = engine.run_cells(seq_in.select(members), cells, sources)
                for n, k in enumerate(members):
                    q = pack[k]
                    rows = logits[n * len(cells) : (n + 1) * len(cells)]
                    values = engine.measure(rows, q.base, q.steps, inp.view.generated[q.s], seq_in.first_step)
                    normalised = (
                        None
                        if q.pair is None
                        else {
                            key: normalised_effect(v, q.base_metrics[key][None], q.pair.source_values[key][None])
                            for key, v in values.items()
                        }
                    )
                    write_block(
                        block_table(cells, q.s, q.steps, values, q.base_metrics, q.pair, normalised), block_path(q.s, j)
                    )
                    n_done += 1
                note(
                    f"block {n_done}/{len(pending)} ({len(cells)} cells of {len(members)} sequence(s) from "
                    f"{pack[members[0]].s})"
                )
                if stop.signal is not None:
                    raise Interrupted(
                        f"interrupted by signal {stop.signal}; {n_done} block(s) committed; continue "
                        f"with the same command and --run-id {sweep_id} --resume"
                    )
    return {"n_done": n_done, "baseline_check": baseline_check, "source_baseline": source_baseline}


def _assemble(
    inp: SweepInputs,
    spec: SweepSpec,
    loaded,
    given: dict,
    sweep_id: str,
    table,
    partial: Path,
    final: Path,
    top: int,
    timings: dict,
    checked: dict | None,
) -> dict:
    """Every block is committed: write `sweeps/<id>/`, drop the partial directory, record the sweep in
    the manifest (call under the sweeps lock). Returns sweep.json's content."""
    source_run = inp.source_run
    shards = [json.loads(f.read_text()) for f in sorted(partial.glob("shard-*.json"))]
    metric_keys = [m.key for m in inp.metrics]
    info = _sweep_info(inp, loaded, given, sweep_id, shards, timings, ranking(table, metric_keys[0], top))
    if spec.method != "exact":
        info["method"] = {
            "name": spec.method,
            "graddrop": spec.graddrop,
            "estimate": "first-order: gradient x (edited - "
            "unedited value); value / effect hold the estimate, exact_value / exact_effect --verify's",
        }
        if checked:
            info["verify"] = checked
    if source_run is not None:
        info["patching"] = patching_summary(
            table, inp.source_run.id, inp.parent.id, len(inp.seqs), inp.pairs, metric_keys[0], spec.pair_by
        )
    if inp.features is not None:
        info["features"] = {**inp.features.record(), "features": sorted({c.neuron for c in inp.cells})}
    effects = []
    for metric in metric_keys:
        names, coords, values = effect_array(cell_effects(table, metric))
        if inp.features is not None:  # [feature(, position)]: the SAE's one layer dropped
            names, coords, values = feature_effect_array(names, coords, values)
        effects.append(EffectArray(metric, names, coords, values))
    write_sweep(final, table, sequence_means(table), effects, info)
    shutil.rmtree(partial, ignore_errors=True)
    record_sweep(
        inp.parent.path,
        {
            "id": sweep_id,
            "path": f"{SWEEPS_DIR}/{sweep_id}",
            "over": spec.over,
            "edit": spec.edit,
            "source": source_run.id if source_run else None,
            "metrics": metric_keys,
            "n_cells": len(inp.cells),
            "created": info["created"],
        },
    )
    return info


def _sweep_info(
    inp: SweepInputs, loaded, given: dict, sweep_id: str, shards: list[dict], timings: dict, top: list
) -> dict:
    """sweep.json's content common to every sweep: the runs, the spec, what was measured, the model and
    host, and the shards' baseline checks; `top` is the ranking."""
    from ..archive.runs import host_info, now_iso, package_versions

    parent, source_run = inp.parent, inp.source_run
    return {
        "kind": "sweep",
        "id": sweep_id,
        "parent": {"run_id": parent.id, "path": str(parent.path.resolve())},
        "source": ({"run_id": source_run.id, "path": str(source_run.path.resolve())} if source_run else None),
        "spec": given,
        "metrics": [m.key for m in inp.metrics],
        "n_cells": len(inp.cells),
        "sequences": inp.seqs,
        "steps": {str(s): inp.seq_steps[s] for s in inp.seqs},
        "semantics": "rescore (teacher-forced parent tokens)"
        + (
            f"; edits from step {inp.from_step} on, the unedited prefix's KV cache shared by every row"
            if inp.from_step
            else ""
        ),
        "model": {
            "reference": loaded.reference,
            "weights_sha256": loaded.weights_sha256,
            "dtype": str(loaded.dtype).replace("torch.", ""),
            "device": str(loaded.device),
            "attn_implementation": loaded.model.config._attn_implementation,
        },
        "packages": package_versions(),
        "host": host_info(),
        "created": now_iso(),
        "baseline_max_abs_diff": max([v for sh in shards for v in sh["baseline_max_abs_diff"].values()] or [0.0]),
        "prefix_skip": all(sh.get("prefix_skip", True) for sh in shards),
        "source_baseline": (
            {k: v for sh in shards for k, v in sh.get("source_baseline", {}).items()} if source_run else None
        ),
        "timings": {**timings, "shards": len(shards)},
        "top": top,
    }


def sweep_groups(run_ref: str, runs_dir: str | None, by: str):
    """The run's sequences grouped by the sequences.parquet column `by` (archive.groups.SequenceGroups;
    checked before any cell is run)."""
    from ..archive.groups import sequence_groups
    from ..archive.reader import open_run

    return sequence_groups(open_run(run_ref, runs_dir, require_complete=True), by)


def grouped_cells(run_ref: str, runs_dir: str | None, sweep_id: str, metric: str, groups) -> dict:
    """A finished sweep's mean effect per group and cell on `metric`, with 95 % bootstrap intervals
    over the group's sequences (analysis.sweep.effects.grouped_effects), as plain dicts: `--json`'s
    `by` (each cell's group under `group_value`, archive/groups.py). groups: `sweep_groups`."""
    from ..analysis.sweep.effects import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, cell_records, grouped_effects
    from ..archive.groups import GROUP_VALUE
    from ..archive.reader import open_run
    from ..archive.sweeps import read_sweep

    frame = grouped_effects(read_sweep(open_run(run_ref, runs_dir), sweep_id), metric, groups.of)
    cells = cell_records(frame, ("layer", "q_head", "neuron", "position", "n_sequences", "n_rows"), keep=(GROUP_VALUE,))
    return {
        "column": groups.column,
        "metric": metric,
        "resamples": BOOTSTRAP_RESAMPLES,
        "seed": BOOTSTRAP_SEED,
        "interval": "95 % percentile bootstrap over the group's sequences",
        "cells": cells,
    }
