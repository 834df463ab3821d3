"""An intervention child's effects (`lmtrace intervene`, docs/intervene.md): `layout.EFFECTS`, one row
per sequence and child step, written when the child completes. The report and `lmtrace serve` read
it here; a child interrupted before it finished has none."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from ..exits.errors import ArchiveError
from . import layout, parquet_io
from .reader import Run


def has_effects(run: Run) -> bool:
    return (run.path / layout.EFFECTS).is_file()


def read_effects(run: Run, *, sequence: int | None = None, columns: list[str] | None = None) -> pa.Table | None:
    """The child's effects rows (`sequence`: only that sequence's, `columns`: only those), in the file's
    order; None when it has no effects file. A file that cannot be read is a one-line ArchiveError."""
    path = run.path / layout.EFFECTS
    if not path.is_file():
        return None
    where = None if sequence is None else pc.field("sequence") == sequence
    try:
        return parquet_io.read_dataset(parquet_io.dataset(path), columns=columns, filter=where)
    except OSError as err:
        raise ArchiveError(f"run {run.id}: {layout.EFFECTS} is unreadable ({err}); `lmtrace verify {run.id}`") from None
