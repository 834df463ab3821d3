"""`lmtrace intervene RUN_ID`: re-run an archived run under real edits and write a linked child run.

Modes:
  rescore     teacher-forces the parent's tokens at every step: the child's archive describes how
              each step's internals and distribution change under the edits, on the same context.
  regenerate  replays the parent's tokens up to the first edited step, then samples anew with the
              parent's seed and sampling settings (the same per-(seed, sequence, step) draws).

The child's effects.parquet (one row per sequence and child step: what the edits changed) is
recorded by `analysis/intervention_effects.EffectsRecorder` while the child runs.

What an edit needs beyond the parent's archive is prepared before the child's run directory is
created, so a bad request leaves nothing behind: the SAEs of feature edits (`load_edit_saes`: read,
their features and checksums checked), chat spans (from the tokenizer), and, once the model is
loaded, the SAEs' hook points and widths (`check_edit_sites`), mean values (`component_means` over
the parent's final sequences), a head's values in a source run (`head_patch_source`: the source's
own KV-cached loop replayed with its tokens forced) and each MoE router's routing rule
(`routing_rule`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch
import yaml

from ..analysis.intervention_effects import EffectsRecorder
from ..archive.reader import Run, open_run
from ..capture.interventions import (
    CHAT_SPANS,
    AblateNeurons,
    EditSet,
    MaskExperts,
    MaskPositions,
    PatchHead,
    PatchResidual,
    Steer,
    check_edit_sites,
    load_edit_saes,
    load_steer_vector,
    mean_ablation_values,
    parse_entries,
    patch_source,
    routing_rule,
    validate_against,
)
from ..exits.errors import LmtraceError, SpecError
from ..runner.generation import GenerateResult, Progress, Replay, run_generate
from ..runner.parent import ParentView, chat_span_ranges, prompt_metadata_of, tokenizer_of
from ..spec.run_spec import build_spec


class ParentTeacher:
    """Forces the parent's token at steps < force_until[seq]; references the parent's token + top-k."""

    def __init__(self, parent: ParentView, force_until: list[int]):
        self.p = parent
        self.force_until = force_until
        self.k = max((len(a[0]) for a in parent.alts if a), default=0)

    def forced(self, seq_ids, step):
        return [
            self.p.generated[s][step] if step < min(self.force_until[s], len(self.p.generated[s])) else -1
            for s in seq_ids
        ]

    def reference(self, seq_ids, step):
        rows = []
        for s in seq_ids:
            if step < len(self.p.generated[s]):
                rows.append([self.p.generated[s][step]] + self.p.alts[s][step])
            else:
                rows.append([-1] * (self.k + 1))
        return rows


def _child_spec(parent: Run, runs_dir: str | None, run_id: str | None, temperature: float | None, max_new: int | None):
    data = dict(parent.manifest["spec_resolved"])
    data["output"] = {**data["output"], "run_id": run_id, "runs_dir": runs_dir or str(parent.path.parent)}
    if temperature is not None:
        data["generation"] = {**data["generation"], "temperature": temperature}
    if max_new is not None:
        data["generation"] = {**data["generation"], "max_new_tokens": max_new}
    return build_spec(data, f"spec of parent run {parent.id}")


class _HeadCapture:
    """An `Edits` that edits nothing: records one head's slice of the output projection's input at the
    query position of every forward."""

    def __init__(self, module, lo: int, hi: int, wanted: set[int]):
        self.module, self.lo, self.hi, self.wanted = module, lo, hi, wanted
        self.values: dict[tuple[int, int], torch.Tensor] = {}
        self.step, self.seq_ids = 0, []

    def begin(self, step, seq_ids, positions, prefill):
        self.step, self.seq_ids = step, seq_ids

    def edit_mask(self, mask, pads, seq_ids, step):
        return mask

    def attached(self):
        from contextlib import contextmanager

        @contextmanager
        def ctx():
            def hook(module, args):
                x = args[0]
                for b, seq in enumerate(self.seq_ids):
                    if seq in self.wanted:
                        self.values[(seq, self.step)] = x[b, -1, self.lo : self.hi].detach().clone()

            handle = self.module.register_forward_pre_hook(hook)
            try:
                yield self
            finally:
                handle.remove()

        return ctx()


class _Discard:
    def on_step(self, result):
        pass


def check_patch_head_source(e: PatchHead, parent: Run, n_seq: int, where: str) -> Run:
    """Open the source run of a patch_head entry and check it can provide that head's values."""
    source = open_run(e.source_run, parent.path.parent, require_complete=True)
    pm, sm = parent.manifest, source.manifest
    for what, a, b in (
        (
            "weights",
            pm["model"].get("weights_sha256") or pm["model"]["reference"],
            sm["model"].get("weights_sha256") or sm["model"]["reference"],
        ),
        ("dtype", pm.get("dtype"), sm.get("dtype")),
        (
            "model.attn_implementation",
            pm["spec_resolved"]["model"].get("attn_implementation"),
            sm["spec_resolved"]["model"].get("attn_implementation"),
        ),
    ):
        if a != b:
            raise SpecError(
                f"{where}: source run {source.id} differs from parent run {parent.id} in {what}; a head's "
                f"values can only be replayed from a run of the same model, dtype and attention kernel"
            )
    n_src = sm["shape"]["n_sequences"]
    if e.source_sequence is not None and not 0 <= e.source_sequence < n_src:
        raise SpecError(
            f"{where}: source_sequence {e.source_sequence} is out of range: source run {source.id} has "
            f"sequences 0..{n_src - 1}"
        )
    if e.source_sequence is None and n_src < n_seq:
        raise SpecError(
            f"{where}: source run {source.id} has {n_src} sequences, the parent {n_seq}; set "
            f"source_sequence to patch every sequence from one of them"
        )
    return source


def head_patch_source(e: PatchHead, source: Run, adapter, tokenizer, n_seq: int):
    """(sequence, step) -> the head's slice of the o_proj input at the source's query position of that step.

    The values are recomputed exactly as the source computed them: its batches (same composition and
    padding) go through the same KV-cached loop (`Tracer`) with every archived token forced, its eos
    and stop strings, and the attention kernel its capture settings installed. A run patched with
    itself therefore changes nothing, bit for bit.
    """
    from ..capture import attention
    from ..capture.sampling import Sampler
    from ..capture.tracer import ForcedTokens, Tracer
    from ..runner.generation import capture_kernel, eager_kernel_reason, eos_ids

    spec = build_spec(source.manifest["spec_resolved"], f"spec of source run {source.id}")
    view = ParentView.read(source)
    wanted = {e.source_sequence} if e.source_sequence is not None else set(range(n_seq))
    seqs = source.sequences().to_pandas().sort_values("sequence")
    batches = [g.sequence.tolist() for _, g in seqs.groupby("batch", sort=True) if wanted & set(g.sequence.tolist())]
    model = adapter.model
    cap = spec.capture
    installs = not cap.forward_only and (cap.attention.enabled or cap.qkv or cap.prefill_attention)
    previous = model.config._attn_implementation
    marked = []
    if installs:  # as run_generate does when the source captured attention or Q/K/V
        inner = capture_kernel(adapter, eager_kernel_reason(spec, adapter))
        attention.install(model)
        for i in range(adapter.n_layers):
            module = adapter.attn(i)
            if not hasattr(module, "_lmtrace_inner"):
                module._lmtrace_inner = inner
                marked.append(module)
    d = adapter.head_dim
    capture = _HeadCapture(adapter.o_proj(e.layer), e.head * d, (e.head + 1) * d, wanted)
    g = spec.generation
    pad = source.manifest["tokenizer"]["pad_token_id"]
    try:
        tracer = Tracer(
            model,
            tokenizer,
            sampler=Sampler(0.0, 0, 1.0),
            seed=g.seed,
            max_new_tokens=g.max_new_tokens,
            eos_ids=eos_ids(g.eos_token_id, model, tokenizer),
            stop_strings=g.stop,
            n_alternatives=2,
            probes=None,
            pad_id=pad if pad is not None else tokenizer.pad_token_id,
            device=next(model.parameters()).device,
        )
        for seq_ids in batches:
            tracer.run_batch(
                seq_ids,
                [view.prompt_ids[s] for s in seq_ids],
                _Discard(),
                teacher=ForcedTokens(view.generated),
                edits=capture,
            )
    finally:
        if installs:
            model.set_attn_implementation(previous)
            for module in marked:
                del module._lmtrace_inner
    values = capture.values
    lengths = {s: len(view.generated[s]) for s in wanted}

    def get(seq: int, step: int):
        s = e.source_sequence if e.source_sequence is not None else seq
        if s not in lengths or step >= lengths[s]:
            return None
        return values[(s, step)]

    return get


def check_edits_reach(entries, view: ParentView, from_step: int | None) -> None:
    """Refuse edits that cannot change anything in this parent: steps past the run, positions past
    every sequence. Exit 2, naming the valid range."""
    n_steps = max((len(g) for g in view.generated), default=0)
    if from_step is not None and not 0 <= from_step < n_steps:
        raise SpecError(f"--from-step {from_step} is out of range: the parent run's steps are 0..{n_steps - 1}")
    for i, e in enumerate(entries):
        where = f"interventions[{i}] ({e.kind})"
        first = e.first_step()
        if first >= n_steps or first < 0:
            raise SpecError(
                f"{where}: steps from {first} are out of range: the parent run's steps are 0..{n_steps - 1}"
            )
        seqs = range(len(view.prompt_ids)) if e.sequences == "all" else e.sequences
        longest = max(len(view.prompt_ids[s]) + len(view.generated[s]) for s in seqs)
        positions = (getattr(e, "mask", None) or []) + ([] if e.positions == "all" else list(e.positions))
        bad = [p for p in positions if p < 0]
        if bad:
            raise SpecError(f"{where}: positions {bad[:5]} are negative: positions are 0..{longest - 1}")
        if positions and min(positions) >= longest:
            raise SpecError(
                f"{where}: positions {sorted(set(positions))[:5]} are past every sequence: its sequences "
                f"have positions 0..{longest - 1}"
            )


def run_intervene(
    parent_ref: str,
    entries_data: list[dict],
    *,
    mode: str = "rescore",
    from_step: int | None = None,
    runs_dir: str | None = None,
    run_id: str | None = None,
    temperature: float | None = None,
    progress: Progress | None = None,
) -> tuple[GenerateResult, pa.Table]:
    if mode not in ("rescore", "regenerate"):
        raise SpecError(f"--mode {mode!r}: use rescore or regenerate")
    parent = open_run(parent_ref, runs_dir, require_complete=True)
    if (parent.manifest.get("spec_resolved", {}).get("model") or {}).get("device_map") is not None:
        from ..runner.models import refuse_spread

        refuse_spread(parent.id, "lmtrace intervene")
    root = Path(runs_dir) if runs_dir else parent.path.parent
    if run_id is not None and (root / run_id).exists():
        raise SpecError(
            f"--run-id {run_id}: a run {run_id} exists in {root}; intervene writes a new child run, choose another id"
        )
    if from_step is not None:
        entries_data = [{"steps": {"from": from_step}, **e} for e in entries_data]
    plan = _plan(parent, entries_data, mode, from_step, progress)
    spec = _child_spec(parent, runs_dir, run_id, temperature, plan.max_new)
    given = {
        "parent": parent.id,
        "mode": mode,
        "from_step": from_step,
        "temperature": temperature,
        "interventions": plan.replay.manifest_extra["interventions"],
    }
    result = run_generate(spec, yaml.safe_dump(given, sort_keys=False), progress=progress, replay=plan.replay)
    return result, plan.effects.table()


def resume_child(
    child_ref: str, runs_dir: str | None = None, progress: Progress | None = None
) -> tuple[GenerateResult, pa.Table]:
    """`lmtrace generate --resume CHILD`: continue an interrupted or killed intervene child with the edits
    its manifest records, replayed from its parent: finished batches are skipped (their effects rows
    are in effects.parts/), an unfinished one continues after its last committed block."""
    from ..archive.runs import read_manifest
    from ..runner.resume import spec_for_resume

    spec, text = spec_for_resume(child_ref, runs_dir, [])
    child = Path(spec.output.runs_dir) / spec.output.run_id
    manifest = read_manifest(child)
    info = manifest.get("parent") or {}
    recorded = Path(info.get("path") or "")
    try:
        parent = open_run(
            recorded if (recorded / "manifest.json").is_file() else info.get("run_id", ""),
            child.parent,
            require_complete=True,
        )
    except LmtraceError as err:
        raise SpecError(
            f"run {child.name} replays edits on its parent run {info.get('run_id')}, which cannot be opened: {err}"
        ) from None
    plan = _plan(
        parent,
        manifest.get("interventions") or [],
        manifest.get("mode", "rescore"),
        manifest.get("from_step"),
        progress,
    )
    result = run_generate(spec, text, progress=progress, replay=plan.replay, resume=True)
    return result, plan.effects.table()


@dataclass
class _Plan:
    replay: Replay
    effects: EffectsRecorder
    max_new: int | None  # the child's max_new_tokens (rescore: the parent's longest sequence)


def _plan(parent: Run, entries_data: list[dict], mode: str, from_step: int | None, progress: Progress | None) -> _Plan:
    """What a child replays: the edits checked against the parent, what they need from the parent's
    archive, and the replay of the parent's prompts (teacher, edits, effects) for run_generate."""
    entries = parse_entries(entries_data, "interventions")
    _check_against_parent(entries, parent)
    view = ParentView.read(parent)
    check_edits_reach(entries, view, from_step)
    entries, saes = load_edit_saes(entries, parent.manifest.get("features") or [])
    edits = _LazyEdits(entries, view, progress)
    edits.saes = saes
    edits.resources.update(saes)
    edits.read_archives(parent)

    first_edit = min((e.first_step() for e in entries), default=from_step or 0)
    if mode == "rescore":
        force_until = [len(g) for g in view.generated]
        max_new = max(force_until)
    else:
        force_until = [min(first_edit, len(g)) for g in view.generated]
        max_new = None
    effects = EffectsRecorder(view)
    replay = Replay(
        prompts=view.prompts,
        rendered=view.rendered,
        prompt_ids=view.prompt_ids,
        metadata=prompt_metadata_of(parent),
        teacher=ParentTeacher(view, force_until),
        edits=edits if entries else None,
        observer=effects,
        manifest_extra={
            "kind": "intervene",
            "parent": {"run_id": parent.id, "path": str(parent.path.resolve())},
            "interventions": [e.model_dump(mode="json") for e in entries],
            "mode": mode,
            "from_step": from_step,
            "first_edited_step": first_edit,
        },
        finalize=effects.write,
        batch_done=effects.batch_done,
        batch_abandoned=effects.batch_abandoned,
        on_model=edits.prepare,
        parent=(parent.id, parent.manifest),
    )
    return _Plan(replay, effects, max_new)


def _check_against_parent(entries: list, parent: Run) -> None:
    """The entries' layers, heads, neurons, experts and sequences exist in the parent's model and run."""
    shape, cfg = parent.shape, parent.manifest["model"]["config"]
    n_layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    family = parent.manifest["model"].get("architecture_family")
    n_experts = (cfg.get("num_local_experts") or cfg.get("num_experts")) if family == "moe" else None
    validate_against(
        entries,
        n_layers,
        shape["n_heads"],
        shape["d_ffn"],
        shape["n_sequences"],
        n_experts=n_experts,
        experts_per_token=cfg.get("num_experts_per_tok"),
        model_class=parent.manifest["model"]["class"],
    )
    if family == "moe" and any(isinstance(e, AblateNeurons) for e in entries):
        raise SpecError(
            "ablate_neurons: mixture-of-experts models have no single MLP down-projection (experts are "
            "fused); ablate the MLP block (ablate_mlp) or a layer instead"
        )


class _LazyEdits:
    """The child's `Edits`: what the entries need from archives is read first (`read_archives`), what
    needs the model once it is loaded (`prepare`, before the child's run directory exists); the
    EditSet built then installs the hooks (they need the child's modules)."""

    def __init__(self, entries: list, view: ParentView, progress: Progress | None):
        self.entries, self.view, self.progress = entries, view, progress
        self.n_seq = len(view.prompt_ids)
        self.resources: dict[int, object] = {}
        self.sources: dict[int, Run] = {}
        self.tokenizer = None
        self.saes: dict = {}  # entry index -> the SAE of a feature edit (`load_edit_saes`)
        self.edits: EditSet | None = None

    def read_archives(self, parent: Run) -> None:
        """Steering vectors, patch_residual values, patch_head source runs (checked) and chat spans."""
        for i, e in enumerate(self.entries):
            where = f"interventions[{i}] ({e.kind})"
            if isinstance(e, Steer):
                self.resources[i] = load_steer_vector(
                    e, parent.shape["d_model"], lambda ref: open_run(ref, parent.path.parent)
                )
            elif isinstance(e, PatchResidual):
                self.resources[i] = patch_source(e, lambda ref: open_run(ref, parent.path.parent))
            elif isinstance(e, PatchHead):
                self.sources[i] = check_patch_head_source(e, parent, self.n_seq, where)
            elif isinstance(e, MaskPositions) and e.span in CHAT_SPANS:
                self.tokenizer = self.tokenizer or tokenizer_of(parent)
                self.resources[i] = chat_span_ranges(parent, self.view, e.span, where, self.tokenizer)
        if self.sources and self.tokenizer is None:
            self.tokenizer = tokenizer_of(parent)

    def prepare(self, adapter) -> None:
        """Runs once the child's model is loaded, before its run directory exists: what needs the model."""
        view, n_seq, progress = self.view, self.n_seq, self.progress
        check_edit_sites(self.saes, adapter)
        self.resources.update(
            mean_ablation_values(
                self.entries,
                adapter,
                lambda: [view.prompt_ids[s] + view.generated[s] for s in range(n_seq)],
                progress.message if progress is not None else None,
            )
        )
        for i, e in enumerate(self.entries):
            where = f"interventions[{i}] ({e.kind})"
            if isinstance(e, PatchHead):
                if progress is not None:
                    progress.message(f"replaying source run {self.sources[i].id} for head {e.layer}.{e.head}")
                self.resources[i] = head_patch_source(e, self.sources[i], adapter, self.tokenizer, n_seq)
            elif isinstance(e, MaskExperts):
                self.resources[i] = routing_rule(adapter, e.layer, where)
        self.edits = EditSet(self.entries, adapter, {s: len(view.prompt_ids[s]) for s in range(n_seq)}, self.resources)

    def attached(self):
        return self.edits.attached()

    def begin(self, *a):
        return self.edits.begin(*a)

    def edit_mask(self, *a):
        return self.edits.edit_mask(*a)
