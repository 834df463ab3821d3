"""An intervention child's recorded edits, replayed with intervene's own hooks (`EditSet`) on one
full, unpadded forward of a step's context, so gradients and exact rescoring see the model the
child was generated under. Per-step patches from another run cannot be replayed that way
(`NOT_REPLAYABLE`); a float32 child must be reproduced to `REPLAY_TOLERANCE`."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...archive.reader import IncompleteRunWarning, Run
from ...capture.interventions import (
    CHAT_SPANS,
    EditSet,
    MaskExperts,
    MaskPositions,
    Steer,
    check_edit_sites,
    load_edit_saes,
    load_steer_vector,
    mean_ablation_values,
    parse_entries,
    routing_rule,
)
from ...exits.errors import ArchiveError, LmtraceError, SpecError

if TYPE_CHECKING:
    from .targets import Scorer

NOT_REPLAYABLE = {
    "patch_residual": "it overwrote the query position's residual at each step with another run's archived vector; "
    "one forward over the whole context cannot reproduce those per-step patches",
    "patch_head": "it overwrote a head's value at each step's query position with a replay of another run; "
    "one forward over the whole context cannot reproduce those per-step patches",
}
REPLAY_TOLERANCE = 1e-4  # |recomputed − archived| chosen-token logprob of a float32 child, nats


def is_child(run: Run) -> bool:
    """Whether the run is an intervention child with recorded edits."""
    return run.manifest.get("kind") == "intervene" and bool(run.manifest.get("interventions"))


def unreplayable_edit(run: Run) -> tuple[int, str] | None:
    """(index, kind) of the child's first edit that cannot be replayed over one context; None if all can
    (or the run is no intervention child). Callers refuse with it before loading any weights."""
    if not is_child(run):
        return None
    for i, e in enumerate(parse_entries(run.manifest["interventions"], f"run {run.id}")):
        if e.kind in NOT_REPLAYABLE:
            return i, e.kind
    return None


class ContextEdits(EditSet):
    """intervene's `EditSet` (the same hooks, the same edit code) applied to one full, unpadded forward of a
    step's context instead of a KV-cached step.

    In the child's own loop the prompt positions were computed at step 0 (the prefill) and position P−1+t at
    step t, and an edit active at step t edited the positions computed at that step. Here every position gets
    the step it was computed at, so an entry edits exactly the positions it edited in the child: `_selected`
    returns [B, n] with row p active iff the entry was active at step(p) (and selects that position)."""

    def __init__(self, entries: list, adapter, sequence: int, prompt_len: int, resources: dict):
        super().__init__(entries, adapter, {sequence: prompt_len}, resources)
        self.sequence = sequence
        self.P = prompt_len
        self.step_of = torch.zeros(0, dtype=torch.long)

    def begin_forward(self, batch: int, n: int, device) -> None:
        pos = torch.arange(n)
        self.step_of = torch.where(pos < self.P, 0, pos - self.P + 1)
        self.begin(int(self.step_of[-1]), [self.sequence] * batch, pos[None].expand(batch, n).to(device), False)

    def _selected(self, entry) -> torch.Tensor | None:
        if entry.sequences != "all" and self.sequence not in entry.sequences:
            return None
        active = torch.tensor([entry.active_at(int(t)) for t in self.step_of.tolist()], dtype=torch.bool)
        if entry.positions != "all":
            active &= torch.isin(torch.arange(len(active)), torch.tensor(entry.positions, dtype=torch.long))
        if not active.any():
            return None
        return active[None].expand(self.positions.shape).to(self.positions.device)

    def mask(self, mask: torch.Tensor) -> torch.Tensor:
        """[B, n] attention mask -> the mask with mask_positions' hidden keys removed (as at this step)."""
        return self.edit_mask(mask, [0] * mask.shape[0], [self.sequence] * mask.shape[0], self.step)

    def check_step(self, step: int, run_id: str) -> None:
        """mask_positions is replayed with one [B, n] key mask: exact only if the entry's activity is the same at
        every step 0..step (the queries computed earlier then hid the same keys, causality doing the rest)."""
        for i, e in enumerate(self.entries):
            if isinstance(e, MaskPositions) and len({e.active_at(t) for t in range(step + 1)}) > 1:
                raise SpecError(
                    f"run {run_id}: interventions[{i}] (mask_positions) is active at some of steps "
                    f"0..{step} but not all; explain replays it with one attention mask over the whole "
                    f"context, which cannot reproduce that: explain a step before it starts or after "
                    f"it is active throughout"
                )


def child_edits(run: Run, scorer: "Scorer", sequence: int, prompt_len: int) -> ContextEdits | None:
    """The edits an intervention child was generated under, ready to install on the scorer's model
    (None for an ordinary run). Refuses (exit 2) edit kinds that cannot be replayed under gradients."""
    from ...archive.reader import open_run
    from ...capture.arch import adapter_for
    from ...runner.parent import ParentView, chat_span_ranges, tokenizer_of

    if not is_child(run):
        return None
    bad = unreplayable_edit(run)
    if bad is not None:
        i, kind = bad
        raise SpecError(
            f"run {run.id} is an intervention child with interventions[{i}] ({kind}), which explain "
            f"cannot replay: {NOT_REPLAYABLE[kind]}. Explain its parent, or a child without {kind}"
        )
    m = run.manifest
    entries = parse_entries(m["interventions"], f"run {run.id}")
    parent_info = m.get("parent") or {}
    parent_path = Path(parent_info["path"]) if parent_info.get("path") else None
    state: dict = {}

    def parent() -> Run:
        if "run" not in state:
            ref = parent_path if parent_path is not None and parent_path.is_dir() else parent_info.get("run_id")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", IncompleteRunWarning)
                    state["run"] = open_run(ref, run.path.parent)
            except LmtraceError as err:
                raise ArchiveError(
                    f"run {run.id}: its edits need its parent run {parent_info.get('run_id')} "
                    f"(mean values, chat spans or steering runs), which cannot be opened: {err}"
                ) from None
        return state["run"]

    def view() -> "ParentView":
        if "view" not in state:
            state["view"] = ParentView.read(parent())
        return state["view"]

    adapter = adapter_for(scorer.model)
    resources: dict[int, object] = mean_ablation_values(
        entries, adapter, lambda: [view().prompt_ids[s] + view().generated[s] for s in range(len(view().prompt_ids))]
    )
    entries, saes = load_edit_saes(entries, [])  # feature edits: the recorded directory, its checksum checked
    check_edit_sites(saes, adapter)
    resources.update(saes)
    for i, e in enumerate(entries):
        where = f"run {run.id} interventions[{i}] ({e.kind})"
        if i in resources:  # a mean value or an SAE
            continue
        if isinstance(e, Steer):
            resources[i] = load_steer_vector(
                e, int(run.shape["d_model"]), lambda ref: open_run(ref, parent().path.parent)
            )
        elif isinstance(e, MaskPositions) and e.span in CHAT_SPANS:
            resources[i] = chat_span_ranges(parent(), view(), e.span, where, tokenizer_of(parent()))
        elif isinstance(e, MaskExperts):
            resources[i] = routing_rule(adapter, e.layer, where)
    return ContextEdits(entries, adapter, sequence, prompt_len, resources)
