"""An intervention child (`lmtrace intervene`) against its parent, one sequence at a time: both
runs' generated tokens aligned by step, where they differ, the edits (the manifest's interventions,
labelled as `lmtrace ls` labels them) and the child's effects.parquet rows of that sequence."""

from __future__ import annotations

import pyarrow.compute as pc

from ..archive.effects import has_effects, read_effects
from ..archive.reader import Run
from ..archive.summary import edits_label
from ..output.jsonout import strict
from ..viewdata.queries import NotFound, check_sequence, table_rows

EFFECT_COLUMNS = [
    "step",
    "context_identical",
    "logprob_shift",
    "parent_logprob",
    "child_logprob_of_parent_token",
    "margin_shift",
    "kl_parent_child_topk",
    "winner_changed",
]


def edits(run: Run) -> dict | None:
    """A child's edits: the one-line label and each intervention as the manifest records it."""
    m = run.manifest
    if m.get("kind") != "intervene":
        return None
    return {
        "label": edits_label(m),
        "interventions": m.get("interventions") or [],
        "mode": m.get("mode"),
        "from_step": m.get("from_step"),
        "first_edited_step": m.get("first_edited_step"),
        "parent_id": (m.get("parent") or {}).get("run_id"),
    }


def _generated(run: Run, seq: int) -> dict[int, str]:
    t = table_rows(run, "tokens", ["step", "token_text"], where=(pc.field("sequence") == seq) & ~pc.field("is_prompt"))
    return dict(zip(t.column("step").to_pylist(), t.column("token_text").to_pylist()))


def _effects(run: Run, seq: int) -> dict[int, dict]:
    t = read_effects(run, sequence=seq, columns=EFFECT_COLUMNS)
    return {} if t is None else {r["step"]: r for r in t.to_pylist()}


def against_parent(child: Run, parent: Run | None, seq: int) -> dict:
    """Sequence `seq` of the child next to the same sequence of its parent (None: the parent is not in
    the runs directory), step by step."""
    info = edits(child)
    if info is None:
        raise NotFound(f"run {child.id} is not an intervention child (kind {child.manifest.get('kind')!r})")
    check_sequence(child, seq)
    mine = _generated(child, seq)
    theirs = _generated(parent, seq) if parent is not None else {}
    effects = _effects(child, seq)
    rows = []
    for step in sorted(set(mine) | set(theirs)):
        e = effects.get(step, {})
        a, b = theirs.get(step), mine.get(step)
        rows.append(
            {
                "step": step,
                "parent": a,
                "child": b,
                "differs": a != b,
                **{k: strict(e.get(k)) for k in EFFECT_COLUMNS[1:]},
            }
        )
    return {
        **info,
        "sequence": seq,
        "parent_found": parent is not None,
        "has_effects": has_effects(child),
        "rows": rows,
    }
