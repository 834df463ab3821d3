"""The exact sweep's packs: each swept sequence's plan (its ids, measured steps, the prefix its rows
share), sequences of one layout packed into one forward, and a pack's baseline (checked against the
archived log-probs), baseline metrics and, for patching, its sources' values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...archive.sweeps import PairColumns
from ...spec.sweep_spec import SweepSpec
from .checks import SweepError

if TYPE_CHECKING:
    from .inputs import SweepInputs

# Sequences of one layout (prompt length, measured steps, shared prefix) run together, one forward
# for all their rows: on a CPU a forward's cost is mostly streaming the weights, whatever its rows, so
# short sequences are cheaper together. A pack holds at most `--batch` rows' worth of a
# PACK_CONTEXT-token context: K x cells x tokens <= batch x PACK_CONTEXT.
PACK_CONTEXT = 256
MAX_PACK = 16


@dataclass
class PlannedSequence:
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


def plan_sequences(inp: SweepInputs, spec: SweepSpec, engine, seqs: list[int]) -> list[PlannedSequence]:
    """Each sequence's plan: its ids, measured steps, where its rows' forward starts and, for patching,
    its source's ids and the prefix the two share."""
    view, out = inp.view, []
    for s in seqs:
        P, steps = len(view.prompt_ids[s]), inp.seq_steps[s]
        ids = view.prompt_ids[s] + view.generated[s]
        shared, sids = 0, None
        if spec.edit == "patch":
            t, _ = inp.pairs[s]
            sids = inp.source_view.prompt_ids[t] + inp.source_view.generated[t]
            shared = agreeing_prefix(ids[: P + max(steps)], sids)
        start = engine.prefix_end(P, min(steps), shared)
        out.append(PlannedSequence(s, ids, P, steps, start, shared, sids))
    return out


def pack_sequences(planned: list[PlannedSequence], limit: int) -> list[list[PlannedSequence]]:
    """Consecutive sequences of the same layout, at most `limit` per pack."""
    packs: list[list[PlannedSequence]] = []
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


def prepare_pack(
    inp: SweepInputs,
    spec: SweepSpec,
    engine,
    adapter,
    pack: list[PlannedSequence],
    baseline_check: dict,
    source_baseline: dict,
):
    """The pack's input and baseline (checked per sequence against the archived log-probs), the baseline
    metrics and, for patching, each sequence's source values and the source's own metrics."""
    from .engine import capture_source

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
    wanted = {("feature", inp.features.site) if c.component == "feature" else (c.component, c.layer) for c in inp.cells}
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


def agreeing_prefix(ids: list[int], source_ids: list[int]) -> int:
    """How many leading tokens a sequence and its patch source have in common."""
    n = 0
    for a, b in zip(ids, source_ids):
        if a != b:
            break
        n += 1
    return n
