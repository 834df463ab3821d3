"""Sequences grouped by a column of sequences.parquet (`--by COLUMN` of heads, sweep and stats):
prompt metadata (a prompt file's extra fields) or any other column, such as `stop_reason`."""

from __future__ import annotations

from ..errors import SpecError


def sequence_groups(run, column: str) -> dict[int, object]:
    """sequence -> its value of `column` (None where null); `run`: a reader.Run. An unknown column is
    one line naming the ones there are."""
    table = run.sequences()
    if column not in table.column_names or column == "sequence":
        available = [c for c in table.column_names if c != "sequence"]
        raise SpecError(f"--by {column!r}: sequences.parquet of run {run.id} has no such column; "
                        f"columns: {', '.join(available)}")
    return dict(zip(table.column("sequence").to_pylist(), table.column(column).to_pylist()))
