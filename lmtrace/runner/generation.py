"""`lmtrace generate`: spec -> model -> tracer with probes -> streamed run archive.

`run_generate` reads as its four steps, shared by generate, resume, shards and intervene:
`prepare` (model, prompts, shape, probes; nothing created), the run-directory protocol
(archive.rundir: open or join the directory, own this writer's key, `run_start.start_run` writes or
reopens the manifest), `batch_loop.generate_batches` (the tracer loop streaming into the archive)
and `_finalise` (the last shard compacts, checksums and marks the run complete)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from ..archive import layout
from ..archive.layout import FeatureShape, RunShape
from ..archive.rundir import RunDir, Shard, finish_failed, open_run_dir, outcome
from ..archive.runs import RunLog, now_iso, runs_root, write_manifest
from ..archive.writer import ArchiveWriter, BackgroundWriter
from ..capture import attention
from ..capture.arch import adapter_for, sdpa_refused
from ..capture.devices import cuda_devices, layer_devices
from ..capture.feature_probe import FeatureProbe, check_sites, check_unchanged, load_feature_saes
from ..capture.probes import Probes
from ..capture.sampling import Sampler
from ..capture.tracer import Tracer
from ..exits.errors import Interrupted, LmtraceError, ModelLoadError, SpecError, signal_name
from ..exits.interrupts import work_recorded, work_started
from ..output.progress import Progress
from ..spec.prompts import load_prompts_and_metadata, render_prompts
from ..spec.run_spec import RunSpec, resolve_layers, resolve_vector_layers
from .batch_loop import Generated, batch_queue, generate_batches
from .batching import MemoryBudget, memory_budget
from .context_length import check_context, model_positions
from .models import LoadedModel, check_run_model, load_model
from .run_start import new_manifest, resumed_metadata, start_run


def eos_ids(spec_value, model, tokenizer) -> set[int]:
    if spec_value is not None:
        values = spec_value if isinstance(spec_value, list) else [spec_value]
    else:
        gen_cfg = getattr(model, "generation_config", None)
        values = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        if values is None:
            values = tokenizer.eos_token_id
        values = values if isinstance(values, list) else [values]
    vocab = (
        model.config.get_text_config().vocab_size
        if hasattr(model.config, "get_text_config")
        else model.config.vocab_size
    )
    bad = [v for v in values if v is not None and not 0 <= v < vocab]
    if bad:
        raise SpecError(f"generation.eos_token_id: {bad} outside the vocabulary 0..{vocab - 1}")
    return {int(v) for v in values if v is not None}


def build_shape(spec: RunSpec, adapter, n_sequences: int, max_prompt: int, features=()) -> RunShape:
    cap = spec.capture
    forward_only = cap.forward_only
    layers = resolve_layers(cap.layers, adapter.n_layers)
    return RunShape(
        n_sequences=n_sequences,
        n_steps=spec.generation.max_new_tokens,
        max_prompt=max_prompt,
        layers=tuple(layers) if not forward_only else (),
        resid_layers=tuple(resolve_vector_layers(cap, adapter.n_layers)),
        n_heads=adapter.n_heads,
        n_kv_heads=adapter.n_kv_heads,
        head_dim=adapter.head_dim,
        d_model=adapter.d_model,
        d_ffn=adapter.d_ffn or 0,
        kv_head_of_head=tuple(adapter.kv_head_of_head()),
        k_attn=cap.attention.top_k,
        k_ffn=min(cap.ffn.top_k, adapter.d_ffn or 0),
        k_lens=cap.lens.top_k,
        attention=cap.attention.enabled,
        prefill_attention=cap.prefill_attention,
        qkv=cap.qkv,
        ffn=cap.ffn.enabled and adapter.d_ffn is not None,
        lens=cap.lens_inline,
        float_dtype=spec.output.float_dtype,
        resid_dtype=cap.residual.dtype,
        k_router=adapter.router_top_k if not forward_only else 0,
        head_dla=cap.head_dla and not forward_only,
        features=tuple(features),
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
    features: list = field(default_factory=list)  # capture.features: the SAEs (capture/feature_probe.LoadedSae)


def prepare(spec: RunSpec, replay: Replay | None, progress: Progress) -> Setup:
    """Load the model, render the prompts, size the archive and build the probes."""
    # bad prompt files fail before any model is loaded
    prompts, metadata = (
        (replay.prompts, replay.metadata) if replay is not None else load_prompts_and_metadata(spec.prompts)
    )
    saes = load_feature_saes(spec.capture.features)  # bad SAE directories, too
    t0 = time.time()
    progress.message(f"loading model {spec.model.ref}")
    loaded, eager_reason = _load(spec.model, progress.message)
    load_s = time.time() - t0
    model, tokenizer = loaded.model, loaded.tokenizer
    if replay is not None and replay.parent is not None:
        check_run_model(replay.parent[1], replay.parent[0], loaded, spec.model.ref)
    adapter = adapter_for(model)
    check_sites(saes, adapter)  # a hook point the model lacks, a d_in that does not match: before any step
    if replay is not None:
        rendered, prompt_ids = replay.rendered, replay.prompt_ids
        if replay.on_model is not None:
            replay.on_model(adapter)
    else:
        rendered, prompt_ids = render_prompts(tokenizer, prompts, spec.prompts.chat, spec.prompts.system)
    shape = build_shape(
        spec,
        adapter,
        len(prompts),
        max(len(p) for p in prompt_ids),
        [FeatureShape(s.name, s.top_k, s.prompt) for s in saes],
    )

    probes = None
    if not spec.capture.forward_only:
        eager_reason = eager_kernel_reason(spec, adapter)
        inner_name = "eager" if eager_reason is not None else "sdpa"
        if shape.attention or shape.qkv or shape.prefill_attention:
            inner = capture_kernel(adapter, eager_reason)
            attention.install(model)
        else:
            inner = None
        probes = Probes(
            adapter,
            shape,
            component_norms=spec.capture.component_norms,
            margin_contributions=spec.capture.margin_contributions,
            lens_dtype=spec.capture.lens.dtype,
            inner_attention=inner,
            features=FeatureProbe(adapter, saes, shape.k_feat, shape.max_prompt) if saes else None,
        )
    else:
        inner_name = model.config._attn_implementation

    g = spec.generation
    eos = eos_ids(g.eos_token_id, model, tokenizer)  # refused before anything is created
    check_context([len(p) for p in prompt_ids], g.max_new_tokens, model_positions(model.config), spec.model.ref)
    return Setup(
        loaded,
        adapter,
        prompts,
        rendered,
        prompt_ids,
        shape,
        probes,
        inner_name,
        eager_reason,
        eos,
        _step_columns(spec, shape, probes),
        load_s,
        metadata,
        features=saes,
    )


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


def run_generate(
    spec: RunSpec,
    given_text: str,
    *,
    runs_dir_flag: str | None = None,
    progress: Progress | None = None,
    replay: Replay | None = None,
    shard: Shard | None = None,
    resume: bool = False,
) -> GenerateResult:
    """Run a spec (or a replay for intervene) into a new run, a shard of a shared run, or a resumed run."""
    progress = progress or Progress()
    shard = shard or Shard()
    t_start = time.time()
    work_started()  # (a second child of `intervene --temperatures`: not recorded until it completes)
    root = runs_root(runs_dir_flag, spec.output.runs_dir)
    setup = prepare(spec, replay, progress)
    setup.budget = memory_budget(spec.generation, cuda_devices(setup.loaded.model, setup.loaded.device))
    if setup.budget is not None and setup.budget.record["from"] == "auto":
        progress.message(
            f"batch_size: auto: memory budget {setup.budget.text}; generation.memory_budget "
            f"(--memory-budget) sets another"
        )
    kind = replay.manifest_extra.get("kind", "generate") if replay is not None else "generate"
    run_id, run_dir, existing, owner = open_run_dir(
        root, spec, shard, resume, fresh=replay is not None and not resume, kind=kind
    )
    try:
        if existing is not None:  # resuming, or joining a sharded run: the steps so far came from this model
            check_run_model(existing, run_id, setup.loaded, spec.model.ref)
            check_unchanged(existing, setup.features, run_id)
            setup.metadata = resumed_metadata(existing, run_id, setup.metadata)
        rd = RunDir(run_dir, shard)
        start_run(
            spec,
            given_text,
            rd,
            existing,
            lambda: new_manifest(spec, given_text, setup, run_id, shard, replay),
            root,
            resume,
            setup.loaded.tokenizer,
            setup.budget,
        )
        # From here on the manifest exists: every failure is recorded in it (finish_failed).
        return _write_run(spec, run_id, rd, existing, setup, replay, progress, t_start)
    except Interrupted as err:
        if err.resumable or not (run_dir / layout.MANIFEST).is_file():
            raise
        # a signal outside the loop (starting, finishing): the run is recorded interrupted all the same
        raise Interrupted(
            f"interrupted by {signal_name(err.signum)}: run {run_id} is recorded interrupted; resume "
            f"it with `lmtrace generate --resume {run_id}`",
            err.signum,
            resumable=True,
        ) from None
    finally:
        owner.release()


def _write_run(spec, run_id, rd: RunDir, existing, setup: Setup, replay, progress, t_start) -> GenerateResult:
    """Generate and stream into a run whose manifest exists, then finalise; every failure ends in
    `failed` (or `interrupted`) with the error recorded in the manifest and the shard's status file."""
    shard, run_dir = rd.shard, rd.path
    log = RunLog(run_dir / layout.LOG)
    writer = None
    status = "failed"
    try:
        with rd.lock():
            writer_core = ArchiveWriter(
                run_dir,
                setup.shape,
                chunk_steps=spec.output.chunk_steps,
                codec=spec.output.codec,
                level=spec.output.level,
                writer_key=shard.key,
                chunk_keys=spec.output.chunk_keys,
                chunk_sequences=shard.sequences_per_file(len(setup.prompts), spec.output.chunk_sequences),
            )
        my_seqs = shard.sequences(len(setup.prompts), writer_core.sequence_group)
        rd.set_shard_status("running")
        log.event(
            "resumed" if existing else "started",
            run_id=run_id,
            shard=shard.key,
            n_prompts=len(setup.prompts),
            **({"memory_budget": setup.budget.record} if setup.budget is not None else {}),
        )
        queue = batch_queue(spec, rd, setup, my_seqs, writer_core)
        writer_core.rollback(queue.rollback_keys)
        writer = BackgroundWriter(writer_core)
        generated = generate_batches(
            _tracer(spec, setup), spec, run_id, rd, log, setup, replay, progress, queue, writer
        )
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
    return GenerateResult(
        run_id, run_dir, status, len(my_seqs), generated.n_tokens, time.time() - t_start, ordered, setup.loaded
    )


def _tracer(spec: RunSpec, setup: Setup) -> Tracer:
    """The generation loop for this spec, over the prepared model and probes."""
    g, tokenizer = spec.generation, setup.loaded.tokenizer
    return Tracer(
        setup.loaded.model,
        tokenizer,
        sampler=Sampler(g.temperature, g.top_k, g.top_p),
        seed=g.seed,
        max_new_tokens=g.max_new_tokens,
        eos_ids=setup.eos,
        stop_strings=g.stop,
        n_alternatives=spec.capture.alternatives,
        probes=setup.probes,
        pad_id=tokenizer.pad_token_id,
        device=setup.loaded.device,
        layer_devices=layer_devices(setup.adapter),
    )


def _finalise(rd: RunDir, log, writer_core, setup: Setup, replay, generated: Generated) -> str:
    """This shard is complete. The last shard to finish (or the only one) compacts the tables,
    consolidates the Zarr metadata, records checksums and marks the run complete; the status."""
    from ..archive.integrity import record
    from ..archive.runs import read_manifest
    from ..exits.faults import kill_point

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
        manifest["timings"].update(
            generate_s=round(generated.seconds, 3),
            finalize_s=round(time.time() - t_done, 3),
            tokens_per_s=round(generated.n_tokens / max(generated.seconds, 1e-9), 3),
        )
        if generated.peak_gpu_memory:  # this process's peak, per CUDA device (docs/devices.md)
            manifest["timings"]["peak_gpu_memory_bytes"] = generated.peak_gpu_memory
        n_generated = int(np.maximum(writer_core.arrays["generated_len"][:], 0).sum())
        manifest.update(
            status="complete",
            completed=now_iso(),
            n_generated_tokens=n_generated,
            table_rows=rows,
            checksums=record(rd.path),
        )
        kill_point("finalize-checksums")
        write_manifest(rd.path, manifest)
        work_recorded()  # the run is complete: a signal now leaves the exit code at 0
        log.event("complete", tokens=n_generated)
        return "complete"
