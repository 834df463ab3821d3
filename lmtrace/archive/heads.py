"""`lmtrace heads`' files in a run: RUN/analysis/heads.parquet (and heads_per_sequence.parquet).

Each is written whole or not at all (a temporary file renamed into place), so a re-run replaces it
and a reader never sees half a file. Columns: docs/heads.md.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from .files import atomic_write_parquet

ANALYSIS_DIR = "analysis"
HEADS_FILE = "heads.parquet"
PER_SEQUENCE_FILE = "heads_per_sequence.parquet"


def by_file(column: str) -> str:
    """`lmtrace heads --by COLUMN`'s file: heads_by_<column>.parquet (other characters than letters,
    digits, - and _ as _)."""
    import re

    return f"heads_by_{re.sub(r'[^A-Za-z0-9_-]', '_', column)}.parquet"


def write_heads(folder: Path, table: pa.Table, per_sequence: pa.Table | None) -> None:
    """Write heads.parquet (and heads_per_sequence.parquet when given) into `folder` (created if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_parquet(table, folder / HEADS_FILE)
    if per_sequence is not None:
        atomic_write_parquet(per_sequence, folder / PER_SEQUENCE_FILE)
