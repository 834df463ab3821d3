"""`lmtrace generate`: spec -> model -> tracer with probes -> streamed run archive.

`run_generate` reads as its four steps, shared by generate, resume, shards and intervene:
`prepare` (model, prompts, shape, probes; nothing created), the run-directory protocol
(archive.rundir: open or join the directory, own this writer's key, `_start_run` writes or
reopens the manifest), `_generate_batches` (the tracer loop streaming into the archive) and
`_finalise` (the last shard compacts, checksums and marks the run complete)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from ..archive import layout
from ..archive.layout import RunShape
from ..archive.manifest import manifest_base
from ..archive.rundir import RunDir, Shard, archived_tokens, check_target, finish_failed, open_run_dir, outcome
from ..archive.runs import RunLog, human_bytes, now_iso, runs_root, write_manifest
from ..archive.sink import BlockSink
from ..archive.vocab import store_vocab
from ..archive.writer import ArchiveWriter, BackgroundWriter
from .batching import Batch, BatchOutOfMemory, BatchQueue, Footprint, MemoryBudget, budget_refusal, memory_budget, \
    with_oom_fault
from ..capture import attention
from ..capture.arch import adapter_for, sdpa_refused
from ..capture.devices import cuda_devices, layer_devices, peak_memory, reset_peak_memory
from ..capture.probes import Probes
from ..capture.sampling import Sampler
from ..capture.tracer import ForcedTokens, Tracer
from .context_length import check_context, model_positions
from ..exits.errors import Interrupted, LmtraceError, ModelLoadError, SpecError, signal_name
from ..exits.interrupts import StopFlag, work_recorded, work_started
from .models import LoadedModel, check_run_model, load_model
from .peak_rss import PeakRss, rss_bytes
from ..output.progress import Progress
from ..spec.prompt_metadata import schema_of
from ..spec.prompts import load_prompts_and_metadata, render_prompts
from ..spec.run_spec import RunSpec, resolve_layers, resolve_vector_layers


def eos_ids(spec_value, model, tokenizer) -> set[int]:
    if spec_value is not None:
        values = spec_value if isinstance(spec_value, list) else [spec_value]
    else:
        gen_cfg = getattr(model, "generation_config", None)
        values = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        if values is None:
            values = tokenizer.eos_token_id
        values = values if isinstance(values, list) else [values]
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size
    bad = [v for v in values if v is not None and not 0 <= v < vocab]
    if bad:
        raise SpecError(f"generation.eos_token_id: {bad} outside the vocabulary 0..{vocab - 1}")
    return {int(v) for v in values if v is not None}


def build_shape(spec: RunSpec, adapter, n_sequences: int, max_prompt: int) -> RunShape:
    cap = spec.capture
    forward_only = cap.forward_only
    layers = resolve_layers(cap.layers, adapter.n_layers)
    return RunShape(
        n_sequences=n_sequences, n_steps=spec.generation.max_new_tokens, max_prompt=max_prompt,
        layers=tuple(layers) if not forward_only else (), resid_layers=tuple(resolve_vector_layers(cap, adapter.n_layers)),
        n_heads=adapter.n_heads, n_kv_heads=adapter.n_kv_heads, head_dim=adapter.head_dim, d_model=adapter.d_model,
        d_ffn=adapter.d_ffn or 0, kv_head_of_head=tuple(adapter.kv_head_of_head()),
        k_attn=cap.attention.top_k, k_ffn=min(cap.ffn.top_k, adapter.d_ffn or 0), k_lens=cap.lens.top_k,
        attention=cap.attention.enabled, prefill_attention=cap.prefill_attention, qkv=cap.qkv,
        ffn=cap.ffn.enabled and adapter.d_ffn is not None, lens=cap.lens_inline, float_dtype=spec.output.float_dtype,
        resid_dtype=cap.residual.dtype, k_router=adapter.router_top_k if not forward_only else 0, head_dla=cap.head_dla and not forward_only,
    )


# ---------------------------------------------------------------------------------------------
@dataclass
class Replay:
    """How `intervene` drives the same loop: the parent's exact prompt ids, teacher forcing, edits."""

    prompts: list[str]
    rendered: list[str]
    prompt_ids: list[list[int]]
    metadata: pa.Table | None = None  # the prompts' metadata columns, one row per prompt
    teacher: object | None = None  # tracer.Teacher
    edits: object | None = None  # tracer.Edits
    observer: object | None = None  # extra StepSink fed every step (e.g. the effects table)
    manifest_extra: dict = field(default_factory=dict)
    finalize: Callable[[Path], None] | None = None  # writes extra files before the run is completed
    batch_abandoned: Callable[[list[int]], None] | None = None  # a batch out of memory, run again as halves
    batch_done: Callable[[Path, int], None] | None = None  # a batch's steps all seen (before it is committed)
    on_model: Callable[[object], None] | None = None  # receives the adapter once the model is loaded
    parent: tuple[str, dict] | None = None  # (run id, manifest) of the replayed run: its model must be unchanged


class _ResumedReplay:
    """A replay's teacher in a batch resumed at step `upto`: below it the run's own archived tokens
    (what it chose then: sampled ones too, as a generate resume forces them), from it on the
    replay's forcing; the replay's reference tokens (the effects' parent tokens) throughout."""

    def __init__(self, archived: ForcedTokens, teacher, upto: int):
        self.archived, self.teacher, self.upto = archived, teacher, upto

    def forced(self, seq_ids, step):
        return self.archived.forced(seq_ids, step) if step < self.upto else self.teacher.forced(seq_ids, step)

    def reference(self, seq_ids, step):
        return self.teacher.reference(seq_ids, step)


class _Tee:
    def __init__(self, *sinks):
        self.sinks = sinks

    def on_step(self, result) -> None:
        for sink in self.sinks:
            sink.on_step(result)


@dataclass
class GenerateResult:
    run_id: str
    run_dir: Path
    status: str
    n_sequences: int
    n_tokens: int
    seconds: float
    texts: list[str] = field(default_factory=list)
    loaded: LoadedModel | None = field(default=None, repr=False)  # the model, for `--lens` in the same process


def _load(model_spec, note) -> tuple[LoadedModel, str | None]:
    """Load the model; a class transformers refuses to run with sdpa (soft-capping, sinks) is loaded with
    eager instead (lmtrace then runs the model's own eager kernel, see `Adapter.eager_kernel_reason`)."""
    try:
        return load_model(model_spec, note=note), None
    except ModelLoadError as err:
        if model_spec.attn_implementation != "sdpa" or not sdpa_refused(str(err)):
            raise
    eager = model_spec.model_copy(update={"attn_implementation": "eager"})
    return load_model(eager, note=note), "the model class refuses sdpa: loaded with eager"


def eager_kernel_reason(spec: RunSpec, adapter) -> str | None:
    """Why a capturing run's forward must use the model's eager kernel instead of sdpa (None: sdpa)."""
    if spec.model.attn_implementation == "eager":
        return "model.attn_implementation: eager"
    return adapter.eager_kernel_reason()


def capture_kernel(adapter, eager_reason: str | None):
    """The kernel the lmtrace attention function runs for the forward itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return adapter.eager_attention() if eager_reason is not None else sdpa_attention_forward


@dataclass
class Setup:
    """Everything a run needs before its directory is touched: the model, the prompts as token ids,
    the archive's shape, the probes. Preparing it creates nothing, so every refusal comes first."""

    loaded: LoadedModel
    adapter: object
    prompts: list[str]
    rendered: list[str]
    prompt_ids: list[list[int]]
    shape: RunShape
    probes: Probes | None
    inner_name: str  # the attention kernel the forward runs
    eager_reason: str | None
    eos: set[int]
    step_columns: list[str]
    load_s: float
    metadata: pa.Table | None = None  # the prompt file's other columns, one row per prompt (prompt_metadata.py)
    budget: MemoryBudget | None = None  # what the batches may take (batching.memory_budget), once the model is loaded


def prepare(spec: RunSpec, replay: Replay | None, progress: Progress) -> Setup:
    """Load the model, render the prompts, size the archive and build the probes."""
    # bad prompt files fail before any model is loaded
    prompts, metadata = (replay.prompts, replay.metadata) if replay is not None else load_prompts_and_metadata(spec.prompts)
    t0 = time.time()
    progress.message(f"loading model {spec.model.ref}")
    loaded, eager_reason = _load(spec.model, progress.message)
    load_s = time.time() - t0
    model, tokenizer = loaded.model, loaded.tokenizer
    if replay is not None and replay.parent is not None:
        check_run_model(replay.parent[1], replay.parent[0], loaded, spec.model.ref)
    adapter = adapter_for(model)
    if replay is not None:
        rendered, prompt_ids = replay.rendered, replay.prompt_ids
        if replay.on_model is not None:
            replay.on_model(adapter)
    else:
        rendered, prompt_ids = render_prompts(tokenizer, prompts, spec.prompts.chat, spec.prompts.system)
    shape = build_shape(spec, adapter, len(prompts), max(len(p) for p in prompt_ids))

    probes = None
    if not spec.capture.forward_only:
        eager_reason = eager_kernel_reason(spec, adapter)
        inner_name = "eager" if eager_reason is not None else "sdpa"
        if shape.attention or shape.qkv or shape.prefill_attention:
            inner = capture_kernel(adapter, eager_reason)
            attention.install(model)
        else:
            inner = None
        probes = Probes(adapter, shape, component_norms=spec.capture.component_norms,
                        margin_contributions=spec.capture.margin_contributions,
                        lens_dtype=spec.capture.lens.dtype, inner_attention=inner)
    else:
        inner_name = model.config._attn_implementation

    g = spec.generation
    eos = eos_ids(g.eos_token_id, model, tokenizer)  # refused before anything is created
    check_context([len(p) for p in prompt_ids], g.max_new_tokens, model_positions(model.config), spec.model.ref)
    return Setup(loaded, adapter, prompts, rendered, prompt_ids, shape, probes, inner_name, eager_reason, eos,
                 _step_columns(spec, shape, probes), load_s, metadata)


def _step_columns(spec: RunSpec, shape: RunShape, probes: Probes | None) -> list[str]:
    """steps.parquet's columns for this capture (none without probes)."""
    if probes is None:
        return []
    columns = ["sequence", "step", "layer", "resid_norm", "delta_norm"]
    if spec.capture.component_norms:
        columns += ["attn_norm", "mlp_norm"]
    if shape.lens:
        columns += list(layout.LENS_STEP_COLUMNS)
    if spec.capture.margin_contributions:
        columns += ["margin_contrib"]
    return columns


def run_generate(spec: RunSpec, given_text: str, *, runs_dir_flag: str | None = None,
                 progress: Progress | None = None, replay: Replay | None = None, shard: Shard | None = None,
                 resume: bool = False) -> GenerateResult:
    """Run a spec (or a replay for intervene) into a new run, a shard of a shared run, or a resumed run."""
    progress = progress or Progress()
    shard = shard or Shard()
    t_start = time.time()
    work_started()  # (a second child of `intervene --temperatures`: not recorded until it completes)
    root = runs_root(runs_dir_flag, spec.output.runs_dir)
    setup = prepare(spec, replay, progress)
    setup.budget = memory_budget(spec.generation, cuda_devices(setup.loaded.model, setup.loaded.device))
    if setup.budget is not None and setup.budget.record["from"] == "auto":
        progress.message(f"batch_size: auto: memory budget {setup.budget.text}; generation.memory_budget "
                         f"(--memory-budget) sets another")
    kind = replay.manifest_extra.get("kind", "generate") if replay is not None else "generate"
    run_id, run_dir, existing, owner = open_run_dir(root, spec, shard, resume, fresh=replay is not None and not resume,
                                                    kind=kind)
    try:
        if existing is not None:  # resuming, or joining a sharded run: the steps so far came from this model
            check_run_model(existing, run_id, setup.loaded, spec.model.ref)
            setup.metadata = _resumed_metadata(existing, run_id, setup.metadata)
        rd = RunDir(run_dir, shard)
        _start_run(spec, given_text, rd, existing, lambda: _new_manifest(spec, given_text, setup, run_id, shard, replay),
                   root, resume, setup.loaded.tokenizer, setup.budget)
        # From here on the manifest exists: every failure is recorded in it (finish_failed).
        return _write_run(spec, run_id, rd, existing, setup, replay, progress, t_start)
    except Interrupted as err:
        if err.resumable or not (run_dir / layout.MANIFEST).is_file():
            raise
        # a signal outside the loop (starting, finishing): the run is recorded interrupted all the same
        raise Interrupted(f"interrupted by {signal_name(err.signum)}: run {run_id} is recorded interrupted; resume "
                          f"it with `lmtrace generate --resume {run_id}`", err.signum, resumable=True) from None
    finally:
        owner.release()


def _new_manifest(spec, given_text, setup: Setup, run_id, shard, replay) -> dict:
    manifest = manifest_base(spec, given_text, setup.loaded, setup.adapter, setup.shape, setup.inner_name, run_id,
                             setup.prompts, setup.eager_reason)
    manifest["timings"]["model_load_s"] = round(setup.load_s, 3)
    if setup.probes is not None and setup.shape.attention and setup.inner_name != "eager":
        manifest["attention"]["row_method"] = setup.probes.row_method
    manifest["shards"] = shard.count
    manifest["prompt_metadata"] = schema_of(setup.metadata)
    if setup.budget is not None:
        manifest["memory_budget"] = setup.budget.record
    if replay is not None:
        manifest.update(replay.manifest_extra)
    return manifest


def _resumed_metadata(existing: dict, run_id: str, metadata: pa.Table | None) -> pa.Table | None:
    """The metadata columns a resumed or joining shard writes: those the run was started with (every
    batch's sequences part has the same columns); none for a run from before they were kept."""
    if "prompt_metadata" not in existing:
        return None
    had, has = existing["prompt_metadata"], schema_of(metadata)
    if had != has:
        show = lambda cols: ", ".join(f"{k}: {v}" for k, v in cols.items()) or "none"  # noqa: E731
        raise SpecError(f"run {run_id}: the prompt file's metadata columns ({show(has)}) differ from those the run "
                        f"was started with ({show(had)}); use the prompt file the run was started with")
    return metadata


def _start_run(spec, given_text, rd: RunDir, existing, new_manifest, root, resume, tokenizer,
               budget: MemoryBudget | None = None) -> None:
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


@dataclass
class _Generated:
    texts: dict[int, str]
    n_tokens: int
    seconds: float
    peak_gpu_memory: dict[str, int] = field(default_factory=dict)  # bytes per CUDA device, when on CUDA


def _write_run(spec, run_id, rd: RunDir, existing, setup: Setup, replay, progress, t_start) -> GenerateResult:
    """Generate and stream into a run whose manifest exists, then finalise; every failure ends in
    `failed` (or `interrupted`) with the error recorded in the manifest and the shard's status file."""
    shard, run_dir = rd.shard, rd.path
    log = RunLog(run_dir / layout.LOG)
    writer = None
    status = "failed"
    try:
        with rd.lock():
            writer_core = ArchiveWriter(run_dir, setup.shape, chunk_steps=spec.output.chunk_steps,
                                        codec=spec.output.codec, level=spec.output.level, writer_key=shard.key,
                                        chunk_keys=spec.output.chunk_keys,
                                        chunk_sequences=shard.sequences_per_file(len(setup.prompts), spec.output.chunk_sequences))
        my_seqs = shard.sequences(len(setup.prompts), writer_core.sequence_group)
        rd.set_shard_status("running")
        log.event("resumed" if existing else "started", run_id=run_id, shard=shard.key, n_prompts=len(setup.prompts),
                  **({"memory_budget": setup.budget.record} if setup.budget is not None else {}))
        queue = _batch_queue(spec, rd, setup, my_seqs, writer_core)
        writer_core.rollback(queue.rollback_keys)
        writer = BackgroundWriter(writer_core)
        generated = _generate_batches(spec, run_id, rd, log, setup, replay, progress, queue, writer)
        rd.set_shard_status("complete", tokens=generated.n_tokens, generate_s=round(generated.seconds, 3))
        status = _finalise(rd, log, writer_core, setup, replay, generated)
    except Interrupted as err:
        status = "interrupted"
        finish_failed(writer, rd, log, "interrupted", str(err))
        raise
    except BaseException as err:
        finish_failed(writer, rd, log, *outcome(err))
        if isinstance(err, OSError):  # a full disk while finishing, say: one line naming the path and free space
            raise LmtraceError(f"run {run_id} failed: {outcome(err)[1]}") from None
        raise
    finally:
        if writer is not None:
            try:
                writer.close()
            except BaseException:
                pass
    ordered = [generated.texts.get(i, "") for i in my_seqs]
    return GenerateResult(run_id, run_dir, status, len(my_seqs), generated.n_tokens, time.time() - t_start, ordered,
                          setup.loaded)


def _batch_queue(spec, rd: RunDir, setup: Setup, my_seqs: list[int], writer_core) -> BatchQueue:
    """This shard's batches: as recorded where a batch committed anything, the rest cut to
    `generation.batch_size`, or to `generation.memory_budget` (auto) by the footprint per sequence."""
    import torch

    g = spec.generation
    footprint = None
    budget = setup.budget.bytes if setup.budget is not None else None
    if budget is not None:
        on_cuda = bool(cuda_devices(setup.loaded.model, setup.loaded.device))
        footprint = Footprint(setup.shape, setup.adapter.n_layers, torch.empty((), dtype=setup.loaded.dtype).element_size(),
                              len(setup.loaded.tokenizer), g.max_new_tokens, spec.output.chunk_steps,
                              spec.output.chunk_keys, measured=on_cuda, budget=budget)
    return BatchQueue(rd.path, rd.shard.key, my_seqs, g.batch_size, budget,
                      {s: len(setup.prompt_ids[s]) for s in my_seqs}, footprint, writer_core.committed)


def _split(queue: BatchQueue, batch: Batch, committed: int, log, reason: str, budget_text, need=None) -> None:
    """A batch that does not fit runs again as two halves (a batch of one cannot: the run fails)."""
    if len(batch.seqs) == 1:
        raise budget_refusal(budget_text, need, batch.key, reason)
    first, second = queue.split(batch, committed)
    log.event("batch_split", batch=batch.key, size=len(batch.seqs), sizes=[len(first.seqs), len(second.seqs)],
              batches=[first.key, second.key], from_step=first.from_step, reason=reason)
    from ..exits.faults import kill_point

    kill_point("batch-split")


def _generate_batches(spec, run_id, rd: RunDir, log, setup: Setup, replay, progress, queue: BatchQueue,
                      writer) -> _Generated:
    """The tracer loop over this shard's batches, each streamed block by block into the archive;
    batches already committed are skipped, a partly committed one resumes after its last block,
    one that runs out of memory is split (batching.py)."""
    import torch

    from ..archive.liveness import Heartbeat

    g, tokenizer, writer_core = spec.generation, setup.loaded.tokenizer, writer.writer
    tracer = Tracer(setup.loaded.model, tokenizer, sampler=Sampler(g.temperature, g.top_k, g.top_p), seed=g.seed,
                    max_new_tokens=g.max_new_tokens, eos_ids=setup.eos, stop_strings=g.stop,
                    n_alternatives=spec.capture.alternatives, probes=setup.probes, pad_id=tokenizer.pad_token_id,
                    device=setup.loaded.device, layer_devices=layer_devices(setup.adapter))
    gpus = cuda_devices(setup.loaded.model, setup.loaded.device)
    reset_peak_memory(gpus)
    run_peak: dict[str, int] = {}
    # CPU, a budget: each batch's peak RSS above the process's now (the model loaded) calibrates the footprint
    rss_base = rss_bytes() if queue.footprint is not None and not gpus else None
    stop = StopFlag()
    texts: dict[int, str] = {}
    n_tokens = 0
    budget_text = setup.budget.text if setup.budget is not None else None
    progress.start(len(rd.shard.sequences(len(setup.prompts))), g.max_new_tokens)
    t_gen = time.time()
    with stop.installed(), Heartbeat(rd.path, rd.shard.key):
        for planned in queue:
            seq_ids, batch = planned.seqs, planned.key
            committed, done = writer_core.committed(batch)
            if done:
                progress.sequences_done(len(seq_ids), None)
                continue
            committed = max(committed, planned.from_step)
            need = queue.over_budget(planned)
            if need is not None:
                _split(queue, planned, committed, log, f"its footprint, about {human_bytes(need)}, exceeds "
                       f"generation.memory_budget {budget_text}", budget_text, need)
                continue
            queue.record(planned)
            batch_prompts = [setup.prompt_ids[i] for i in seq_ids]
            sink = BlockSink(writer, setup.shape, batch, seq_ids, batch_prompts, tokenizer,
                             spec.output.chunk_steps, setup.step_columns, progress, start_step=committed)
            teacher, edits, feed = None, None, sink
            if committed:
                log.event("resume_batch", batch=batch, from_step=committed)
                teacher = ForcedTokens(archived_tokens(rd.path, seq_ids, committed), committed)
            if replay is not None:
                if replay.teacher is not None:
                    teacher = replay.teacher if teacher is None else _ResumedReplay(teacher, replay.teacher, committed)
                edits = replay.edits
                feed = _Tee(sink, replay.observer) if replay.observer is not None else sink
            before = sum(torch.cuda.memory_allocated(d) for d in gpus)
            reset_peak_memory(gpus)
            rss = PeakRss() if rss_base is not None else nullcontext()
            try:
                with rss:
                    outcome_ = tracer.run_batch(seq_ids, batch_prompts, feed, teacher=teacher, edits=edits,
                                                should_stop=with_oom_fault(stop, len(seq_ids)),
                                                forward_running=writer.forward_running())
            except (BatchOutOfMemory, torch.cuda.OutOfMemoryError) as err:
                del sink, feed
                if replay is not None and replay.batch_abandoned is not None:
                    replay.batch_abandoned(seq_ids)
                if gpus:
                    torch.cuda.empty_cache()
                writer.drain()  # the blocks handed over are committed: the halves continue after them
                reason = "out of memory" + (" (CUDA)" if isinstance(err, torch.cuda.OutOfMemoryError) else
                                            f" ({err})" if str(err) else "")
                _split(queue, planned, max(writer_core.committed(batch)[0], planned.from_step), log, reason,
                       budget_text)
                continue
            peaks = peak_memory(gpus)
            for d, v in peaks.items():
                run_peak[d] = max(run_peak.get(d, 0), v)
            growth = None  # the batch's peak above the model: CUDA allocations, or (CPU, a budget) RSS
            if gpus:
                growth = sum(peaks.values()) - before
                if queue.footprint is not None:
                    queue.footprint.observe(len(seq_ids), max(len(p) for p in batch_prompts), growth)
            elif rss_base is not None:
                growth = rss.peak - rss_base
                queue.footprint.observe(len(seq_ids), max(len(p) for p in batch_prompts), rss.peak - rss.start)
            sink.flush()
            if outcome_.interrupted:
                raise Interrupted(f"interrupted by {signal_name(stop.signal)} (batch of sequence {batch}); flushed "
                                  f"steps are kept; resume with `lmtrace generate --resume {run_id}`", stop.signal,
                                  resumable=True)
            if replay is not None and replay.batch_done is not None:
                replay.batch_done(rd.path, batch)
            gen_len = np.asarray([len(x) for x in outcome_.generated], dtype=np.int32)
            for b, seq in enumerate(seq_ids):
                texts[seq] = tokenizer.decode(outcome_.generated[b], skip_special_tokens=True)
            n_tokens += int(gen_len.sum())
            seq_table = _sequence_rows(setup, seq_ids, batch, batch_prompts, gen_len, outcome_.stop_reason, texts)
            writer.submit(writer_core.finish_batch, batch, seq_ids, gen_len, seq_table)
            log.event("batch_done", batch=batch, sequences=seq_ids, tokens=int(gen_len.sum()),
                      **({"peak_growth": growth} if growth is not None else {}))
            if rss_base is not None:  # what the allocator keeps is not free for the next batch's cut
                queue.footprint.retained = max(0, rss_bytes() - rss_base)
            progress.sequences_done(len(seq_ids), int(gen_len.sum()))
        writer.drain()
    return _Generated(texts, n_tokens, time.time() - t_gen, run_peak)


def _sequence_rows(setup: Setup, seq_ids, batch, batch_prompts, gen_len, stop_reason, texts) -> pa.Table:
    """One batch's rows of sequences.parquet: lmtrace's columns, then the prompts' metadata columns."""
    table = pa.table({
        "sequence": seq_ids, "batch": [batch] * len(seq_ids), "prompt": [setup.prompts[i] for i in seq_ids],
        "prompt_rendered": [setup.rendered[i] for i in seq_ids], "prompt_len": [len(p) for p in batch_prompts],
        "generated_len": gen_len.tolist(), "stop_reason": stop_reason, "generated_text": [texts[i] for i in seq_ids],
    }, schema=layout.sequence_schema())
    if setup.metadata is None:
        return table
    rows = setup.metadata.take(pa.array(seq_ids, pa.int64()))
    for name in rows.column_names:
        table = table.append_column(rows.schema.field(name), rows.column(name))
    return table


def _finalise(rd: RunDir, log, writer_core, setup: Setup, replay, generated: _Generated) -> str:
    """This shard is complete. The last shard to finish (or the only one) compacts the tables,
    consolidates the Zarr metadata, records checksums and marks the run complete; the status."""
    from ..archive.integrity import record
    from ..exits.faults import kill_point
    from ..archive.runs import read_manifest

    t_done = time.time()
    with rd.lock():
        if not rd.all_shards_complete():
            log.event("shard_complete", shard=rd.shard.key, tokens=generated.n_tokens)
            failed = [k for k, v in rd.other_shard_statuses().items() if v in ("failed", "interrupted")]
            work_recorded()  # this shard is complete: a signal now leaves the exit code at 0 (or 4)
            return "shard-complete-others-failed:" + ",".join(failed) if failed else "shard-complete"
        if replay is not None and replay.finalize is not None:
            replay.finalize(rd.path)
        manifest = read_manifest(rd.path)
        probes = setup.probes
        if probes is not None and probes.kernel_args:  # what the attention kernel was called with
            manifest["attention"]["layers"] = {str(k): v for k, v in sorted(probes.kernel_args.items())}
        rows = writer_core.compact_tables()
        kill_point("finalize-compacted")
        writer_core.consolidate()
        manifest["timings"].update(generate_s=round(generated.seconds, 3), finalize_s=round(time.time() - t_done, 3),
                                   tokens_per_s=round(generated.n_tokens / max(generated.seconds, 1e-9), 3))
        if generated.peak_gpu_memory:  # this process's peak, per CUDA device (docs/devices.md)
            manifest["timings"]["peak_gpu_memory_bytes"] = generated.peak_gpu_memory
        n_generated = int(np.maximum(writer_core.arrays["generated_len"][:], 0).sum())
        manifest.update(status="complete", completed=now_iso(), n_generated_tokens=n_generated,
                        table_rows=rows, checksums=record(rd.path))
        kill_point("finalize-checksums")
        write_manifest(rd.path, manifest)
        work_recorded()  # the run is complete: a signal now leaves the exit code at 0
        log.event("complete", tokens=n_generated)
        return "complete"
