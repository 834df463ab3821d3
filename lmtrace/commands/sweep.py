"""`lmtrace sweep RUN`: ablate or patch every head, block, layer, neuron or position in turn, in one process.

This module orchestrates (docs/sweep.md has the full text): it resolves the parent run and the
patch source, checks every input before the model is loaded, plans the blocks (one batch of cells
of one sequence), runs them through the engine, commits each block, and assembles the result.
What is computed lives below it:
  lmtrace/spec/sweep_spec.py           the sweep spec (flags or YAML)
  lmtrace/analysis/sweep/cells    the swept cells
  lmtrace/analysis/sweep/metrics  the metrics per (cell, sequence, step)
  lmtrace/analysis/sweep/engine   the forward: one cell per batch row, prefix KV reuse, patches
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

import numpy as np

from ..analysis.sweep import attribution_run as sweep_attribution
from ..analysis.sweep.cells import Cell, build_cells
from ..analysis.sweep.checks import SweepError, measured_steps
from ..analysis.sweep.checks import check_source as _check_source
from ..analysis.sweep.effects import (
    cell_effects,
    effect_array,
    normalised_effect,
    patching_summary,
    ranking,
    sequence_means,
)
from ..analysis.sweep.metrics import Metric, parse_metrics
from ..archive.files import atomic_write_json
from ..archive.liveness import OwnerLock
from ..archive.runs import locked
from ..archive.sweeps import (
    SWEEPS_DIR,
    EffectArray,
    PairColumns,
    block_table,
    create_partial,
    read_blocks,
    record_sweep,
    write_block,
    write_sweep,
    writer_key,
)
from ..capture.interventions import parse_range_list
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


@dataclass
class _Inputs:
    """Everything a sweep needs from its runs, checked before the model is loaded."""

    parent: object  # archive Run
    view: object  # ParentView of the parent
    seqs: list[int]
    seq_steps: dict[int, list[int]]
    cells: list[Cell]
    metrics: list[Metric]
    from_step: int
    source_run: object | None = None
    source_view: object | None = None
    pairs: dict | None = None  # patch: parent sequence -> (source sequence, pair id)


def _inputs(parent_ref: str, spec: SweepSpec, runs_dir: str | None) -> _Inputs:
    """Resolve the parent (and the patch source) and validate the spec against them; raises SpecError."""
    from ..archive.pairs import pair_sequences
    from ..archive.reader import open_run
    from ..runner.parent import ParentView, tokenizer_of

    parent = open_run(parent_ref, runs_dir, require_complete=True)
    view = ParentView.read(parent)
    n_seq = len(view.prompt_ids)
    shape, cfg = parent.shape, parent.manifest["model"]["config"]
    n_layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    seqs = (
        list(range(n_seq)) if spec.sequences == "all" else sorted(set(parse_range_list(spec.sequences, "--sequences")))
    )
    bad = [s for s in seqs if not 0 <= s < n_seq]
    if bad:
        raise SpecError(f"--sequences: {bad} out of range: run {parent.id} has sequences 0..{n_seq - 1}")
    if not seqs:
        raise SpecError("--sequences: the sweep is empty (no sequences)")
    from_step = spec.from_step or 0
    seq_steps = {s: measured_steps(spec.steps, from_step, len(view.generated[s]), s, parent.id) for s in seqs}
    prompt_len = min(len(view.prompt_ids[s]) for s in seqs)
    longest = max(len(view.prompt_ids[s]) + max(seq_steps[s]) for s in seqs)  # the longest measured context
    edited = range(prompt_len - 1 + from_step, longest) if from_step else None
    cells = build_cells(
        spec.over, spec.edit, spec.positions, n_layers, shape["n_heads"], shape.get("d_ffn") or 0, prompt_len, edited
    )
    first_edited = min(len(view.prompt_ids[s]) - 1 + from_step for s in seqs)
    for c in cells:
        if c.position is None:
            continue
        if c.position >= longest:
            raise SpecError(f"positions: {c.position} is past every measured context (longest {longest} tokens)")
        if from_step and c.component != "position" and c.position < first_edited:
            raise SpecError(
                f"positions: {c.position} is in the unedited prefix of every sequence: with --from-step "
                f"{from_step} edits apply at positions {first_edited} and later (step s is computed at "
                f"position prompt length - 1 + s)"
            )
    tokenizer = tokenizer_of(parent)
    metrics = parse_metrics(spec.metrics, tokenizer, len(tokenizer))
    inputs = _Inputs(parent, view, seqs, seq_steps, cells, metrics, from_step)
    sweep_attribution.check(spec, metrics)
    if spec.edit == "patch":
        if spec.source is None:
            raise SpecError("--edit patch needs --source RUN_B (the run whose activations are patched in)")
        source_run = open_run(spec.source, parent.path.parent, require_complete=True)
        _check_source(parent, source_run)
        source_view = ParentView.read(source_run)
        inputs.pairs = pair_sequences(parent, source_run, seqs, spec.pair_by)
        for s in seqs:
            t, pair = inputs.pairs[s]
            a, b = len(view.prompt_ids[s]), len(source_view.prompt_ids[t])
            if a != b:
                raise SpecError(
                    f"pair {pair} (sequence {s} of run {parent.id}, sequence {t} of the source run "
                    f"{source_run.id}): the prompts are {a} and {b} tokens; patching pairs positions, so "
                    f"the prompts of a pair must have the same token length"
                )
        inputs.source_run, inputs.source_view = source_run, source_view
    elif spec.source is not None or spec.pair_by is not None:
        raise SpecError(f"--{'source' if spec.source is not None else 'pair-by'} is for --edit patch")
    return inputs


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
    inp = _inputs(parent_ref, spec, runs_dir)
    parent, cells = inp.parent, inp.cells

    # the plan: blocks of cells, per sequence; a shard takes every N-th block
    blocks = (
        [(s, j, cells[i : i + spec.batch]) for s in inp.seqs for j, i in enumerate(range(0, len(cells), spec.batch))]
        if spec.method == "exact"
        else [(s, 0, cells) for s in inp.seqs]
    )  # attribution: a sequence a block
    given = {
        "parent": parent.id,
        "source": inp.source_run.id if inp.source_run else None,
        **spec.model_dump(mode="json"),
    }
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
        return _sweep_owned(inp, spec, blocks, given, sweep_id, shard, resume, top, note, t0)
    finally:
        owner.release()


def _sweep_owned(
    inp: _Inputs,
    spec: SweepSpec,
    blocks: list,
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
    from ..analysis.sweep.engine import MEAN_KIND, Engine
    from ..archive.runs import now_iso
    from ..capture.arch import adapter_for
    from ..capture.interventions import component_means
    from ..runner.models import load_run_model

    parent, view, cells = inp.parent, inp.view, inp.cells
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

    # the model: loaded once
    loaded = load_run_model(parent.manifest, parent.id, purpose="the sweep", note=note)
    adapter = adapter_for(loaded.model)
    loaded.model.eval()
    means = None
    if spec.edit == "mean":
        n_seq = len(view.prompt_ids)
        wanted = {(MEAN_KIND[c.component], c.layer) for c in cells}
        note(f"mean values: one forward over each of the parent's {n_seq} sequences")
        means = component_means(adapter, [view.prompt_ids[s] + view.generated[s] for s in range(n_seq)], wanted)
    engine = Engine(adapter, spec.edit, means, inp.metrics, inp.from_step)
    if spec.method == "attribution" and any(c.component == "position" for c in cells):
        loaded.model.set_attn_implementation("eager")  # the QK fix reads the attention patterns

    # only now is anything written into sweeps/
    root.mkdir(exist_ok=True)
    with locked(root / ".lock"):
        if partial.exists():  # another shard created it meanwhile: it must be this sweep
            _check_plan(partial, plan, sweep_id)
        else:
            create_partial(partial, {**plan, "n_blocks": len(blocks), "n_cells": len(cells), "created": now_iso()})
    t_model = time.time()
    mine = [blk for k, blk in enumerate(blocks) if k % count == index]
    done = (_run_blocks if spec.method == "exact" else sweep_attribution.run_blocks)(
        inp, spec, engine, adapter, mine, partial, sweep_id, note
    )
    t_done = time.time()
    atomic_write_json(
        partial / f"shard-{index}-of-{count}.json",
        {
            "status": "complete",
            "blocks": done["n_done"],
            "baseline_max_abs_diff": done["baseline_check"],
            "source_baseline": done["source_baseline"],
            "seconds": round(t_done - t0, 3),
            "prefix_skip": engine.skip_ok,
        },
    )
    with locked(root / ".lock"):
        n_files = len(list((partial / "blocks").glob("*.parquet")))
        if n_files < len(blocks) or final.exists():
            return SweepResult(
                sweep_id, None, "shard-complete", {"sweep_id": sweep_id, "blocks": done["n_done"]}, t_done - t0
            )
        table, checked = read_blocks(partial), None
        if spec.verify:
            table, checked = sweep_attribution.verify(
                inp, spec, engine, adapter, table, spec.verify, note, (_packs, _plan_sequences, _prepare_pack)
            )
        info = _assemble(
            inp,
            spec,
            loaded,
            given,
            sweep_id,
            table,
            partial,
            final,
            top,
            {
                "model_load_s": round(t_model - t0, 3),
                "sweep_s": round(t_done - t_model, 3),
                **({"verify_s": round(time.time() - t_done, 3)} if checked else {}),
            },
            checked,
        )
    summary = {
        "sweep_id": sweep_id,
        "run_id": parent.id,
        "path": str(final),
        "n_cells": len(cells),
        "metric": inp.metrics[0].key,
        "baseline_max_abs_diff": info["baseline_max_abs_diff"],
        "seconds": round(time.time() - t0, 3),
        "sweep_s": info["timings"]["sweep_s"],
        "top": info["top"],
    }
    for key in ("patching", "method", "verify"):
        if key in info:
            summary[key] = info[key]
    return SweepResult(sweep_id, final, "complete", summary, time.time() - t0)


def _check_plan(partial: Path, plan: dict, sweep_id: str) -> None:
    """An unfinished sweep continues only with the settings it was started with."""
    started = json.loads((partial / "plan.json").read_text())
    if started["spec"] != plan["spec"] or started["shards"] != plan["shards"]:
        raise SpecError(
            f"sweep {sweep_id} exists unfinished with different settings; use another --run-id, or "
            f"the same settings to continue it"
        )


# Sequences of one layout (prompt length, measured steps, shared prefix) run together, one forward
# for all their rows: on a CPU a forward's cost is mostly streaming the weights, whatever its rows, so
# short sequences are cheaper together. A pack holds at most `--batch` rows' worth of a
# PACK_CONTEXT-token context: K x cells x tokens <= batch x PACK_CONTEXT.
PACK_CONTEXT = 256
MAX_PACK = 16


@dataclass
class _Sequence:
    """One swept sequence's plan and, once its pack ran its baseline, what its blocks need."""

    s: int
    ids: list[int]
    prompt_len: int
    steps: list[int]
    start: int
    shared: int = 0
    source_ids: list[int] | None = None
    base: object | None = None  # unedited logits [n_logits, V]
    base_metrics: dict | None = None
    source: object | None = None  # SourceValues
    pair: PairColumns | None = None


def _plan_sequences(inp: _Inputs, spec: SweepSpec, engine, seqs: list[int]) -> list[_Sequence]:
    view, out = inp.view, []
    for s in seqs:
        P, steps = len(view.prompt_ids[s]), inp.seq_steps[s]
        ids = view.prompt_ids[s] + view.generated[s]
        shared, sids = 0, None
        if spec.edit == "patch":
            t, _ = inp.pairs[s]
            sids = inp.source_view.prompt_ids[t] + inp.source_view.generated[t]
            shared = _agreeing_prefix(ids[: P + max(steps)], sids)
        start = engine.prefix_end(P, min(steps), shared)
        out.append(_Sequence(s, ids, P, steps, start, shared, sids))
    return out


def _packs(planned: list[_Sequence], limit: int) -> list[list[_Sequence]]:
    """Consecutive sequences of the same layout, at most `limit` per pack."""
    packs: list[list[_Sequence]] = []
    for q in planned:
        last = packs[-1] if packs else None
        if (
            last
            and len(last) < limit
            and (last[0].prompt_len, last[0].steps, last[0].start) == (q.prompt_len, q.steps, q.start)
        ):
            last.append(q)
        else:
            packs.append([q])
    return packs


def _run_blocks(inp: _Inputs, spec: SweepSpec, engine, adapter, mine: list, partial: Path, sweep_id: str, note) -> dict:
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
    planned = _plan_sequences(inp, spec, engine, list(todo))
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
        for pack in _packs(planned, limit):
            seq_in = _prepare_pack(inp, spec, engine, adapter, pack, baseline_check, source_baseline)
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


def _prepare_pack(
    inp: _Inputs, spec: SweepSpec, engine, adapter, pack: list[_Sequence], baseline_check: dict, source_baseline: dict
):
    """The pack's input and baseline (checked per sequence against the archived log-probs), the baseline
    metrics and, for patching, each sequence's source values and the source's own metrics."""
    from ..analysis.sweep.engine import capture_source

    parent, view = inp.parent, inp.view
    first_q = pack[0]
    seq_in = engine.pack([q.ids for q in pack], first_q.prompt_len, max(first_q.steps), first_q.start)
    base = engine.baseline(seq_in)
    first, T = seq_in.first_step, seq_in.ids.shape[1]
    tol = 1e-3 if parent.manifest.get("dtype") == "float32" else 5e-2
    for k, q in enumerate(pack):
        q.base = base[k]
        base_lp = q.base.log_softmax(-1)
        tokens = view.generated[q.s]
        diff = max(abs(float(base_lp[st - first, tokens[st]]) - view.logprob[q.s][st]) for st in q.steps)
        if diff > tol:
            raise SweepError(
                f"sequence {q.s}: the unedited forward's log-probs differ from the archived ones by "
                f"{diff:.2e} (> {tol}); the model or its settings do not reproduce run {parent.id}"
            )
        baseline_check[q.s] = diff
        q.base_metrics = {key: v[0] for key, v in engine.measure(q.base[None], q.base, q.steps, tokens, first).items()}
    if spec.edit != "patch":
        return seq_in
    wanted = {(c.component, c.layer) for c in inp.cells}
    if seq_in.prefix is not None and all(seq_in.start <= q.shared and len(q.source_ids) >= T for q in pack):
        # every source shares its sequence's prefix: one forward continues the pack's KV cache
        sources, src_logits = capture_source(
            adapter, [q.source_ids[:T] for q in pack], wanted, seq_in.n_logits, seq_in.prefix, seq_in.start
        )
        found = [(src, lg, first) for src, lg in zip(sources, src_logits)]
    else:
        found = []
        for q in pack:
            (src,), lg = capture_source(adapter, [q.source_ids[:T]], wanted, max(q.steps) + 1)
            found.append((src, lg[0], 0))
    for q, (src, src_logits, src_first) in zip(pack, found):
        t, pair_id = inp.pairs[q.s]
        tokens = view.generated[q.s]
        # the source's own metrics (the clean run's, the normaliser): its logits at the same positions
        # (row i: step src_first + i), scored on the patched run's tokens; NaN where the source sequence
        # is shorter than the measured context
        if len(q.source_ids) >= T:
            own = {
                key: v[0]
                for key, v in engine.measure(
                    src_logits[first - src_first :][None], q.base, q.steps, tokens, first
                ).items()
            }
            source_baseline[str(q.s)] = {m.key: own[m.key].tolist() for m in inp.metrics if m.tokens}
        else:
            own = {m.key: np.full(len(q.steps), np.nan) for m in inp.metrics}
        q.source, q.pair = src, PairColumns(pair_id, t, own)
    return seq_in


def _agreeing_prefix(ids: list[int], source_ids: list[int]) -> int:
    """How many leading tokens a sequence and its patch source have in common."""
    n = 0
    for a, b in zip(ids, source_ids):
        if a != b:
            break
        n += 1
    return n


def _assemble(
    inp: _Inputs,
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
    from ..archive.runs import host_info, now_iso, package_versions

    parent, source_run = inp.parent, inp.source_run
    shards = [json.loads(f.read_text()) for f in sorted(partial.glob("shard-*.json"))]
    metric_keys = [m.key for m in inp.metrics]
    info = {
        "kind": "sweep",
        "id": sweep_id,
        "parent": {"run_id": parent.id, "path": str(parent.path.resolve())},
        "source": ({"run_id": source_run.id, "path": str(source_run.path.resolve())} if source_run else None),
        "spec": given,
        "metrics": metric_keys,
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
        "top": ranking(table, metric_keys[0], top),
    }
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
    effects = []
    for metric in metric_keys:
        names, coords, values = effect_array(cell_effects(table, metric))
        dims = names
        effects.append(EffectArray(metric, dims, {d: coords[n] for n, d in zip(names, dims)}, values))
    write_sweep(final, table, sequence_means(table), effects, info)
    shutil.rmtree(partial, ignore_errors=True)
    record_sweep(
        parent.path,
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
