"""`lmtrace intervene RUN_ID`: re-run an archived run under real edits and write a linked child run.

Modes:
  rescore     teacher-forces the parent's tokens at every step: the child's archive describes how
              each step's internals and distribution change under the edits, on the same context.
  regenerate  replays the parent's tokens up to the first edited step, then samples anew with the
              parent's seed and sampling settings (the same per-(seed, sequence, step) draws).

effects.parquet (one row per sequence and child step): the parent's token, the child's top-1,
logprob of the parent's token before (archived) and after (child), margin shift, KL(parent || child)
over the parent's stored top-k plus one tail bucket, and whether the winner changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from .archive.reader import Run, open_run
from .errors import SpecError
from .generate import GenerateResult, Progress, Replay, run_generate
from .interventions import (AblateHead, AblateNeurons, EditSet, PatchResidual, Steer, head_output_mean, load_steer_vector,
                            parse_entries, patch_source, validate_against)
from .spec import build_spec

EFFECTS = "effects.parquet"


@dataclass
class ParentView:
    """What a child needs from its parent archive, read once."""

    run: Run
    prompts: list[str]
    rendered: list[str]
    prompt_ids: list[list[int]]
    generated: list[list[int]]
    alts: list[list[list[int]]]  # [seq][step] -> alt ids
    alt_logprobs: list[list[list[float]]]
    logprob: list[list[float]]
    margin: list[list[float]]
    greedy: list[list[int]]

    @classmethod
    def read(cls, run: Run) -> "ParentView":
        seqs = run.sequences().to_pandas().sort_values("sequence")
        tokens = run.tokens().to_pandas()
        n = len(seqs)
        prompt_ids, generated, alts, alt_lp, logprob, margin, greedy = ([[] for _ in range(n)] for _ in range(7))
        for seq, t in tokens.groupby("sequence"):
            t = t.sort_values("position")
            prompt_ids[seq] = t[t.is_prompt].token_id.tolist()
            g = t[~t.is_prompt].sort_values("step")
            generated[seq] = g.token_id.tolist()
            alts[seq] = [list(x) for x in g.alt_ids]
            alt_lp[seq] = [list(x) for x in g.alt_logprobs]
            logprob[seq] = g.logprob.tolist()
            margin[seq] = g.margin.tolist()
            greedy[seq] = g.greedy_id.tolist()
        return cls(run, seqs.prompt.tolist(), seqs.prompt_rendered.tolist(), prompt_ids, generated, alts, alt_lp,
                   logprob, margin, greedy)


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


def kl_topk_with_tail(p_logprobs: np.ndarray, q_logprobs: np.ndarray) -> float:
    """KL(p || q) over the parent's stored top-k ids plus one bucket for the rest of the vocabulary.

    Both distributions are coarsened to the same k + 1 outcomes, so this is a lower bound of the
    full-vocabulary KL (coarsening never increases KL), exact when the tail mass is negligible.
    """
    p = np.exp(p_logprobs.astype(np.float64))
    q = np.exp(q_logprobs.astype(np.float64))
    p_tail, q_tail = max(1.0 - p.sum(), 0.0), max(1.0 - q.sum(), 1e-300)
    kl = float(np.sum(p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))))
    if p_tail > 0:
        kl += p_tail * (math.log(p_tail) - math.log(q_tail))
    return max(kl, 0.0)


class EffectsRecorder:
    """A StepSink collecting one effects row per active sequence and step."""

    def __init__(self, parent: ParentView):
        self.p = parent
        self.rows: dict[str, list] = {k: [] for k in (
            "sequence", "step", "context_identical", "parent_token", "child_token", "child_top1", "parent_top1",
            "parent_logprob", "child_logprob_of_parent_token", "logprob_shift", "parent_margin", "child_margin",
            "margin_shift", "kl_parent_child_topk", "winner_changed")}
        self.diverged: dict[int, bool] = {}

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
            kl = (kl_topk_with_tail(np.asarray(self.p.alt_logprobs[seq][step]), ref[1: 1 + len(self.p.alts[seq][step])])
                  if have_parent and identical and ref is not None else None)
            values = {
                "sequence": seq, "step": step, "context_identical": identical, "parent_token": parent_tok,
                "child_token": child_tok, "child_top1": int(c.greedy_token[b]),
                "parent_top1": self.p.greedy[seq][step] if have_parent else None,
                "parent_logprob": before, "child_logprob_of_parent_token": after,
                "logprob_shift": after - before if after is not None and before is not None else None,
                "parent_margin": self.p.margin[seq][step] if have_parent else None,
                "child_margin": float(c.margin[b]),
                "margin_shift": float(c.margin[b]) - self.p.margin[seq][step] if have_parent else None,
                "kl_parent_child_topk": kl,
                "winner_changed": int(c.greedy_token[b]) != self.p.greedy[seq][step] if have_parent else None,
            }
            for k, v in values.items():
                self.rows[k].append(v)
            if parent_tok is None or child_tok != parent_tok:
                self.diverged[seq] = True

    def table(self) -> pa.Table:
        return pa.table(self.rows)

    def write(self, run_dir: Path) -> None:
        pq.write_table(self.table(), run_dir / EFFECTS)


def _child_spec(parent: Run, runs_dir: str | None, run_id: str | None, temperature: float | None, max_new: int | None):
    data = dict(parent.manifest["spec_resolved"])
    data["output"] = {**data["output"], "run_id": run_id, "runs_dir": runs_dir or str(parent.path.parent)}
    if temperature is not None:
        data["generation"] = {**data["generation"], "temperature": temperature}
    if max_new is not None:
        data["generation"] = {**data["generation"], "max_new_tokens": max_new}
    return build_spec(data, f"spec of parent run {parent.id}")


def run_intervene(parent_ref: str, entries_data: list[dict], *, mode: str = "rescore", from_step: int | None = None,
                  runs_dir: str | None = None, run_id: str | None = None, temperature: float | None = None,
                  progress: Progress | None = None) -> tuple[GenerateResult, pa.Table]:
    if mode not in ("rescore", "regenerate"):
        raise SpecError(f"--mode {mode!r}: use rescore or regenerate")
    parent = open_run(parent_ref, runs_dir, require_complete=True)
    if from_step is not None:
        entries_data = [{"steps": {"from": from_step}, **e} for e in entries_data]
    entries = parse_entries(entries_data, "interventions")
    shape, cfg = parent.shape, parent.manifest["model"]["config"]
    n_layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    validate_against(entries, n_layers, shape["n_heads"], shape["d_ffn"], shape["n_sequences"])
    family = parent.manifest["model"].get("architecture_family")
    if family == "moe" and any(isinstance(e, AblateNeurons) for e in entries):
        raise SpecError("ablate_neurons: mixture-of-experts models have no single MLP down-projection (experts are "
                        "fused); ablate the MLP block (ablate_mlp) or a layer instead")
    view = ParentView.read(parent)
    n_seq = len(view.prompt_ids)

    resources: dict[int, object] = {}
    for i, e in enumerate(entries):
        if isinstance(e, AblateHead) and e.mode == "mean":
            resources[i] = head_output_mean(parent, e.layer, e.head)
        elif isinstance(e, Steer):
            resources[i] = load_steer_vector(e, shape["d_model"], lambda ref: open_run(ref, parent.path.parent))
        elif isinstance(e, PatchResidual):
            resources[i] = patch_source(e, lambda ref: open_run(ref, parent.path.parent))

    first_edit = min((e.first_step() for e in entries), default=from_step or 0)
    if mode == "rescore":
        force_until = [len(g) for g in view.generated]
        max_new = max(force_until)
    else:
        force_until = [min(first_edit, len(g)) for g in view.generated]
        max_new = None
    spec = _child_spec(parent, runs_dir, run_id, temperature, max_new)
    adapter_holder = {}

    class _LazyEdits:
        """Built once the child's model is loaded (the hooks need its modules)."""

        def __init__(self):
            self.inner = None

        def _get(self):
            if self.inner is None:
                self.inner = EditSet(entries, adapter_holder["adapter"],
                                     {s: len(view.prompt_ids[s]) for s in range(n_seq)}, resources)
            return self.inner

        def attached(self):
            return self._get().attached()

        def begin(self, *a):
            return self._get().begin(*a)

        def edit_mask(self, *a):
            return self._get().edit_mask(*a)

    effects = EffectsRecorder(view)
    given = {"parent": parent.id, "mode": mode, "from_step": from_step, "temperature": temperature,
             "interventions": [e.model_dump(mode="json") for e in entries]}
    replay = Replay(
        prompts=view.prompts, rendered=view.rendered, prompt_ids=view.prompt_ids,
        teacher=ParentTeacher(view, force_until), edits=_LazyEdits() if entries else None, observer=effects,
        manifest_extra={"kind": "intervene", "parent": {"run_id": parent.id, "path": str(parent.path.resolve())},
                        "interventions": given["interventions"], "mode": mode, "from_step": from_step,
                        "first_edited_step": first_edit},
        finalize=effects.write, on_model=lambda adapter: adapter_holder.__setitem__("adapter", adapter),
    )
    result = run_generate(spec, yaml.safe_dump(given, sort_keys=False), progress=progress, replay=replay)
    return result, effects.table()
