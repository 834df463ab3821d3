"""`lmtrace intervene RUN_ID`: re-run an archived run under real edits and write a linked child run.

Modes:
  rescore     teacher-forces the parent's tokens at every step: the child's archive describes how
              each step's internals and distribution change under the edits, on the same context.
  regenerate  replays the parent's tokens up to the first edited step, then samples anew with the
              parent's seed and sampling settings (the same per-(seed, sequence, step) draws).

effects.parquet (one row per sequence and child step): the parent's token, the child's top-1,
logprob of the parent's token before (archived) and after (child), margin shift, KL(parent || child)
on the tokens both archives store at the step plus one tail bucket (`analysis.compare.stored_kl`, the
KL `compare` reports), and whether the winner changed; the four
token ids also as text (`parent_token_text`, ..., from the child's vocab.parquet).

What an edit needs beyond the parent's archive is prepared before the child's run directory is
created, so a bad request leaves nothing behind: chat spans (from the tokenizer), and, once the
model is loaded, mean values (`component_means` over the parent's final sequences), a head's values
in a source run (`head_patch_source`: the source's own KV-cached loop replayed with its tokens
forced) and each MoE router's routing rule (`routing_rule`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import yaml

from ..analysis.compare import stored_kl, stored_logprobs
from ..analysis.compare.values import finite
from ..archive import parquet_io
from ..archive.reader import Run, Vocabulary, open_run
from ..exits.errors import LmtraceError, SpecError
from ..archive.files import atomic_write_parquet
from ..archive.layout import EFFECTS
from ..runner.generation import GenerateResult, Progress, Replay, run_generate
from ..runner.parent import ParentView, chat_span_ranges, prompt_metadata_of, tokenizer_of
from ..capture.interventions import (CHAT_SPANS, AblateNeurons, EditSet, MaskExperts, MaskPositions, PatchHead,
                                     PatchResidual, Steer, load_steer_vector, mean_ablation_values, parse_entries,
                                     patch_source, routing_rule, validate_against)
from ..spec.run_spec import build_spec

# A finished batch's effects rows, until the child completes (a resumed child skips finished batches)
EFFECTS_PARTS = "effects.parts"
TEXT_COLUMNS = ("parent_token", "child_token", "child_top1", "parent_top1")  # ids that get a `_text` column
EFFECTS_SCHEMA = pa.schema(
    [(c, pa.int64()) for c in ("sequence", "step")] + [("context_identical", pa.bool_())]
    + [(c, pa.int64()) for c in ("parent_token", "child_token", "child_top1", "parent_top1")]
    + [(c, pa.float64()) for c in ("parent_logprob", "child_logprob_of_parent_token", "logprob_shift", "parent_margin",
                                   "child_margin", "margin_shift", "kl_parent_child_topk")]
    + [("winner_changed", pa.bool_())])


class ParentTeacher:
    """Forces the parent's token at steps < force_until[seq]; references the parent's token + top-k."""

    def __init__(self, parent: ParentView, force_until: list[int]):
        self.p = parent
        self.force_until = force_until
        self.k = max((len(a[0]) for a in parent.alts if a), default=0)

    def forced(self, seq_ids, step):
        return [self.p.generated[s][step] if step < min(self.force_until[s], len(self.p.generated[s])) else -1
                for s in seq_ids]

    def reference(self, seq_ids, step):
        rows = []
        for s in seq_ids:
            if step < len(self.p.generated[s]):
                rows.append([self.p.generated[s][step]] + self.p.alts[s][step])
            else:
                rows.append([-1] * (self.k + 1))
        return rows


class EffectsRecorder:
    """A StepSink collecting one effects row per active sequence and step; each finished batch's rows
    go to effects.parts/ (`batch_done`), and `write` joins them into effects.parquet."""

    def __init__(self, parent: ParentView):
        self.p = parent
        self.rows: dict[str, list] = {f.name: [] for f in EFFECTS_SCHEMA}  # the current batch's
        self.diverged: dict[int, bool] = {}
        self.final: pa.Table | None = None

    def on_step(self, r) -> None:
        c = r.choice
        seq_ids = r.seq_ids
        for b in np.flatnonzero(r.active):
            seq, step = seq_ids[b], r.step
            have_parent = step < len(self.p.generated[seq])
            identical = not self.diverged.get(seq, False) and have_parent
            parent_tok = self.p.generated[seq][step] if have_parent else None
            child_tok = int(c.token[b])
            ref = c.ref_logprobs[b].numpy() if c.ref_logprobs is not None else None
            after = float(ref[0]) if have_parent and ref is not None else None
            before = self.p.logprob[seq][step] if have_parent else None
            # KL(parent ‖ child) from what the two archives store at this step, as `compare` computes it
            kl = (finite(stored_kl(stored_logprobs(self.p.alts[seq][step], self.p.alt_logprobs[seq][step],
                                                   parent_tok, self.p.logprob[seq][step]),
                                   stored_logprobs(c.alt_ids[b].tolist(), c.alt_logprobs[b].tolist(), child_tok,
                                                   float(c.logprob[b]))))
                  if have_parent and identical else None)
            values = {
                "sequence": seq, "step": step, "context_identical": identical, "parent_token": parent_tok,
                "child_token": child_tok, "child_top1": int(c.greedy_token[b]),
                "parent_top1": self.p.greedy[seq][step] if have_parent else None,
                "parent_logprob": before, "child_logprob_of_parent_token": after if identical else None,
                # the comparisons below are only meaningful on the parent's own context: null once it differs
                "logprob_shift": after - before if identical and after is not None and before is not None else None,
                "parent_margin": self.p.margin[seq][step] if have_parent else None,
                "child_margin": float(c.margin[b]),
                "margin_shift": float(c.margin[b]) - self.p.margin[seq][step] if identical else None,
                "kl_parent_child_topk": kl,
                "winner_changed": int(c.greedy_token[b]) != self.p.greedy[seq][step] if identical else None,
            }
            for k, v in values.items():
                self.rows[k].append(v)
            if parent_tok is None or child_tok != parent_tok:
                self.diverged[seq] = True

    def batch_done(self, run_dir: Path, batch: int) -> None:
        """Keep a finished batch's rows in effects.parts/ (written whole or not at all), before the
        batch is committed: a resumed child skips it, and replays an unfinished one from step 0."""
        parts = run_dir / EFFECTS_PARTS
        parts.mkdir(exist_ok=True)
        atomic_write_parquet(pa.table(self.rows, schema=EFFECTS_SCHEMA), parts / f"batch-{batch:06d}.parquet")
        self.rows = {f.name: [] for f in EFFECTS_SCHEMA}

    def batch_abandoned(self, seq_ids: list[int]) -> None:
        """A batch that ran out of memory is run again as halves, each from step 0 (replayed): drop its rows."""
        self.rows = {f.name: [] for f in EFFECTS_SCHEMA}
        for seq in seq_ids:
            self.diverged.pop(seq, None)

    def write(self, run_dir: Path) -> None:
        """effects.parquet from the batches' rows, with the text of each id column (`<column>_text`,
        null where the id is) from the child's own vocabulary (generate wrote it first)."""
        parts = run_dir / EFFECTS_PARTS
        files = sorted(parts.glob("batch-*.parquet")) if parts.is_dir() else []
        if not files and (run_dir / EFFECTS).is_file():  # a finalisation killed after it wrote it
            self.final = parquet_io.read_table(run_dir / EFFECTS)
            return
        table = pa.concat_tables([parquet_io.read_table(f) for f in files]) if files else EFFECTS_SCHEMA.empty_table()
        vocabulary = Vocabulary.read(run_dir)
        for col in TEXT_COLUMNS:
            ids = table.column(col).to_pylist()
            texts = vocabulary.text([-1 if i is None else i for i in ids])
            table = table.append_column(f"{col}_text", pa.array([None if i is None else x for i, x in zip(ids, texts)],
                                                                pa.string()))
        atomic_write_parquet(table, run_dir / EFFECTS)
        shutil.rmtree(parts, ignore_errors=True)
        self.final = table

    def table(self) -> pa.Table:
        """effects.parquet's table, once `write` has written it."""
        return self.final


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
                        self.values[(seq, self.step)] = x[b, -1, self.lo: self.hi].detach().clone()
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
    for what, a, b in (("weights", pm["model"].get("weights_sha256") or pm["model"]["reference"],
                        sm["model"].get("weights_sha256") or sm["model"]["reference"]),
                       ("dtype", pm.get("dtype"), sm.get("dtype")),
                       ("model.attn_implementation", pm["spec_resolved"]["model"].get("attn_implementation"),
                        sm["spec_resolved"]["model"].get("attn_implementation"))):
        if a != b:
            raise SpecError(f"{where}: source run {source.id} differs from parent run {parent.id} in {what}; a head's "
                            f"values can only be replayed from a run of the same model, dtype and attention kernel")
    n_src = sm["shape"]["n_sequences"]
    if e.source_sequence is not None and not 0 <= e.source_sequence < n_src:
        raise SpecError(f"{where}: source_sequence {e.source_sequence} is out of range: source run {source.id} has "
                        f"sequences 0..{n_src - 1}")
    if e.source_sequence is None and n_src < n_seq:
        raise SpecError(f"{where}: source run {source.id} has {n_src} sequences, the parent {n_seq}; set "
                        f"source_sequence to patch every sequence from one of them")
    return source


def head_patch_source(e: PatchHead, source: Run, adapter, tokenizer, n_seq: int):
    """(sequence, step) -> the head's slice of the o_proj input at the source's query position of that step.

    The values are recomputed exactly as the source computed them: its batches (same composition and
    padding) go through the same KV-cached loop (`Tracer`) with every archived token forced, its eos
    and stop strings, and the attention kernel its capture settings installed. A run patched with
    itself therefore changes nothing, bit for bit.
    """
    from ..capture import attention
    from ..runner.generation import capture_kernel, eager_kernel_reason, eos_ids
    from ..capture.sampling import Sampler
    from ..capture.tracer import ForcedTokens, Tracer

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
        tracer = Tracer(model, tokenizer, sampler=Sampler(0.0, 0, 1.0), seed=g.seed, max_new_tokens=g.max_new_tokens,
                        eos_ids=eos_ids(g.eos_token_id, model, tokenizer), stop_strings=g.stop, n_alternatives=2,
                        probes=None, pad_id=pad if pad is not None else tokenizer.pad_token_id,
                        device=next(model.parameters()).device)
        for seq_ids in batches:
            tracer.run_batch(seq_ids, [view.prompt_ids[s] for s in seq_ids], _Discard(), teacher=ForcedTokens(view.generated),
                             edits=capture)
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
            raise SpecError(f"{where}: steps from {first} are out of range: the parent run's steps are 0..{n_steps - 1}")
        seqs = range(len(view.prompt_ids)) if e.sequences == "all" else e.sequences
        longest = max(len(view.prompt_ids[s]) + len(view.generated[s]) for s in seqs)
        positions = (getattr(e, "mask", None) or []) + ([] if e.positions == "all" else list(e.positions))
        bad = [p for p in positions if p < 0]
        if bad:
            raise SpecError(f"{where}: positions {bad[:5]} are negative: positions are 0..{longest - 1}")
        if positions and min(positions) >= longest:
            raise SpecError(f"{where}: positions {sorted(set(positions))[:5]} are past every sequence: its sequences "
                            f"have positions 0..{longest - 1}")


def run_intervene(parent_ref: str, entries_data: list[dict], *, mode: str = "rescore", from_step: int | None = None,
                  runs_dir: str | None = None, run_id: str | None = None, temperature: float | None = None,
                  progress: Progress | None = None) -> tuple[GenerateResult, pa.Table]:
    if mode not in ("rescore", "regenerate"):
        raise SpecError(f"--mode {mode!r}: use rescore or regenerate")
    parent = open_run(parent_ref, runs_dir, require_complete=True)
    if (parent.manifest.get("spec_resolved", {}).get("model") or {}).get("device_map") is not None:
        from ..runner.models import refuse_spread

        refuse_spread(parent.id, "lmtrace intervene")
    root = Path(runs_dir) if runs_dir else parent.path.parent
    if run_id is not None and (root / run_id).exists():
        raise SpecError(f"--run-id {run_id}: a run {run_id} exists in {root}; intervene writes a new child run, "
                        f"choose another id")
    if from_step is not None:
        entries_data = [{"steps": {"from": from_step}, **e} for e in entries_data]
    plan = _plan(parent, entries_data, mode, from_step, progress)
    spec = _child_spec(parent, runs_dir, run_id, temperature, plan.max_new)
    given = {"parent": parent.id, "mode": mode, "from_step": from_step, "temperature": temperature,
             "interventions": plan.replay.manifest_extra["interventions"]}
    result = run_generate(spec, yaml.safe_dump(given, sort_keys=False), progress=progress, replay=plan.replay)
    return result, plan.effects.table()


def resume_child(child_ref: str, runs_dir: str | None = None, progress: Progress | None = None
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
        parent = open_run(recorded if (recorded / "manifest.json").is_file() else info.get("run_id", ""), child.parent,
                          require_complete=True)
    except LmtraceError as err:
        raise SpecError(f"run {child.name} replays edits on its parent run {info.get('run_id')}, which cannot be "
                        f"opened: {err}") from None
    plan = _plan(parent, manifest.get("interventions") or [], manifest.get("mode", "rescore"),
                 manifest.get("from_step"), progress)
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
    shape, cfg = parent.shape, parent.manifest["model"]["config"]
    n_layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    family = parent.manifest["model"].get("architecture_family")
    n_experts = (cfg.get("num_local_experts") or cfg.get("num_experts")) if family == "moe" else None
    validate_against(entries, n_layers, shape["n_heads"], shape["d_ffn"], shape["n_sequences"], n_experts=n_experts,
                     experts_per_token=cfg.get("num_experts_per_tok"), model_class=parent.manifest["model"]["class"])
    if family == "moe" and any(isinstance(e, AblateNeurons) for e in entries):
        raise SpecError("ablate_neurons: mixture-of-experts models have no single MLP down-projection (experts are "
                        "fused); ablate the MLP block (ablate_mlp) or a layer instead")
    view = ParentView.read(parent)
    n_seq = len(view.prompt_ids)
    check_edits_reach(entries, view, from_step)

    resources: dict[int, object] = {}
    tokenizer = None
    sources: dict[int, Run] = {}
    for i, e in enumerate(entries):
        where = f"interventions[{i}] ({e.kind})"
        if isinstance(e, Steer):
            resources[i] = load_steer_vector(e, shape["d_model"], lambda ref: open_run(ref, parent.path.parent))
        elif isinstance(e, PatchResidual):
            resources[i] = patch_source(e, lambda ref: open_run(ref, parent.path.parent))
        elif isinstance(e, PatchHead):
            sources[i] = check_patch_head_source(e, parent, n_seq, where)
        elif isinstance(e, MaskPositions) and e.span in CHAT_SPANS:
            tokenizer = tokenizer or tokenizer_of(parent)
            resources[i] = chat_span_ranges(parent, view, e.span, where, tokenizer)
    if sources and tokenizer is None:
        tokenizer = tokenizer_of(parent)

    first_edit = min((e.first_step() for e in entries), default=from_step or 0)
    if mode == "rescore":
        force_until = [len(g) for g in view.generated]
        max_new = max(force_until)
    else:
        force_until = [min(first_edit, len(g)) for g in view.generated]
        max_new = None
    holder: dict[str, EditSet] = {}

    def prepare(adapter) -> None:
        """Runs once the child's model is loaded, before its run directory exists: what needs the model."""
        resources.update(mean_ablation_values(entries, adapter,
                                              lambda: [view.prompt_ids[s] + view.generated[s] for s in range(n_seq)],
                                              progress.message if progress is not None else None))
        for i, e in enumerate(entries):
            where = f"interventions[{i}] ({e.kind})"
            if isinstance(e, PatchHead):
                if progress is not None:
                    progress.message(f"replaying source run {sources[i].id} for head {e.layer}.{e.head}")
                resources[i] = head_patch_source(e, sources[i], adapter, tokenizer, n_seq)
            elif isinstance(e, MaskExperts):
                resources[i] = routing_rule(adapter, e.layer, where)
        holder["edits"] = EditSet(entries, adapter, {s: len(view.prompt_ids[s]) for s in range(n_seq)}, resources)

    class _LazyEdits:
        """The EditSet `prepare` built (the hooks need the child's modules)."""

        def attached(self):
            return holder["edits"].attached()

        def begin(self, *a):
            return holder["edits"].begin(*a)

        def edit_mask(self, *a):
            return holder["edits"].edit_mask(*a)

    effects = EffectsRecorder(view)
    replay = Replay(
        prompts=view.prompts, rendered=view.rendered, prompt_ids=view.prompt_ids, metadata=prompt_metadata_of(parent),
        teacher=ParentTeacher(view, force_until), edits=_LazyEdits() if entries else None, observer=effects,
        manifest_extra={"kind": "intervene", "parent": {"run_id": parent.id, "path": str(parent.path.resolve())},
                        "interventions": [e.model_dump(mode="json") for e in entries], "mode": mode,
                        "from_step": from_step, "first_edited_step": first_edit},
        finalize=effects.write, batch_done=effects.batch_done, batch_abandoned=effects.batch_abandoned, on_model=prepare,
        parent=(parent.id, parent.manifest),
    )
    return _Plan(replay, effects, max_new)
