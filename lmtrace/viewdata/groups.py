"""A run's sequences grouped by a column of sequences.parquet, for the run page: per group the numbers
`lmtrace stats --by COLUMN` prints (analysis/run_stats.py: sequences, generated tokens, mean logprob and
entropy, where the logit lens settles, the lowest-probability tokens) and the group's top heads as
`lmtrace heads --by COLUMN` ranks them (analysis/heads.py: compute_heads over the group's rows,
grouped_rows's order). Nothing here computes a number of its own; nothing is written."""

from __future__ import annotations

from ..analysis.heads import compute_heads, grouped_rows
from ..analysis.run_stats import compute_stats
from ..archive import layout
from ..archive.groups import GROUP_VALUE, group_order, sequence_groups
from ..archive.reader import Run
from ..exits.errors import ArchiveDamaged, ArchiveError, SpecError
from ..output.jsonout import strict
from . import kept
from .errors import NotFound

OWN_COLUMNS = ("stop_reason", "generated_len", "prompt_len", "batch")  # sequences.parquet's own, offered
TOP_HEADS = 5  # heads shown per group (the terminal's --top is 20; every head is in `heads --by`'s file)
HEAD_FIELDS = (
    "layer",
    "q_head",
    "label",
    "n_sequences",
    "sink_score",
    "prev_token_score",
    "local_score",
    "induction_score",
    "entropy",
)


def group_columns(run: Run) -> list[str]:
    """The columns of sequences.parquet the page offers to group by: prompt metadata first, then
    stop_reason, the lengths and the batch (texts, one group per sequence, and `sequence` are left out)."""
    own = layout.sequence_schema().names
    names = run.sequences().column_names
    return [c for c in names if c not in own] + [c for c in OWN_COLUMNS if c in names]


def _heads_by_group(run: Run, by: str, top: int) -> tuple[dict, str | None]:
    """group key (group_order) -> the group's `top` heads in `heads --by`'s order; a note where the run has
    no attention to score."""
    try:
        result = compute_heads(run, groups=sequence_groups(run, by))
    except ArchiveDamaged:  # damaged bytes: the route's 409 naming the file
        raise
    except ArchiveError as err:  # no attention captured, or none committed yet: the page says so
        return {}, str(err)
    out: dict = {}
    for r in grouped_rows(result["by_group"], None):
        rows = out.setdefault(group_order(r[GROUP_VALUE]), [])
        if len(rows) < top:
            rows.append({k: r[k] for k in HEAD_FIELDS})
    return out, None


def sequence_groups_view(run: Run, by: str | None, top: int = TOP_HEADS) -> dict:
    """Without `by`: {"columns"} only. Else {"by", "columns", "lens", "heads_note", "groups": [{group_value,
    sequences, tokens, mean_logprob, mean_entropy, settle: {layer: steps} | None, lowest: [...], heads:
    [...]}]}, groups in the column's order (NaN, then null, last), strict JSON (NaN as null)."""
    columns = group_columns(run)
    if not by:
        return {"run_id": run.id, "by": None, "columns": columns, "groups": None}
    if by not in columns:
        raise NotFound(f"run {run.id} has no column {by!r} to group by; columns: {', '.join(columns)}")
    try:
        stats = kept.once(run, ("stats", by), lambda: compute_stats(run, by))
    except SpecError as err:
        raise NotFound(str(err)) from None
    heads, note = kept.once(run, ("heads_by", by, top), lambda: _heads_by_group(run, by, top))
    groups = [{**g, "heads": heads.get(group_order(g[GROUP_VALUE]), [])} for g in stats["groups"]]
    return strict(
        {"run_id": run.id, "by": by, "columns": columns, "lens": stats["lens"], "heads_note": note, "groups": groups}
    )
