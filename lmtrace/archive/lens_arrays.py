"""Writing the deferred logit lens into a complete run (`lmtrace lens`): its arrays, created like the
run's own (chunking, codec, shards, chunk checksums), and steps.parquet with the lens columns.

What is computed lives in `analysis/deferred_lens.py`; the command (`commands/lens.py`) holds the
run's locks and records the checksums and the manifest afterwards.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa

from . import layout, parquet_io


class LensArrays:
    """The run's lens arrays (`layout.LENS_ARRAYS`), created anew: what an interrupted `lmtrace lens`
    left (not recorded) is removed first and computed again."""

    def __init__(self, path: Path, resid, shape: tuple[int, int, int, int], output: dict):
        from .shards import checksummed, sequences_per_shard
        from .writer import compressors_for, create_array

        for s in layout.LENS_ARRAYS:
            shutil.rmtree(path / layout.TENSORS / s.name, ignore_errors=True)
        group = _writable_group(path)
        codec, level, chunk = output["codec"], int(output["level"]), int(output["chunk_steps"])
        # sharded like the run's own arrays (format 3), or one chunk file per sequence and block (format 2);
        # chunks with their crc32c when the run's have them (format 4)
        per_shard = sequences_per_shard(resid)
        self.arrays = {
            s.name: create_array(
                group,
                s,
                shape,
                chunk,
                compressors_for(codec, level, s, checksum=checksummed(resid)),
                chunk_sequences=per_shard,
            )
            for s in layout.LENS_ARRAYS
        }

    def write(self, seq: int, s0: int, s1: int, ids: np.ndarray, probs: np.ndarray) -> None:
        """Steps s0..s1 of one sequence: ids, probs [steps, layers, k]."""
        self.arrays["lens_ids"][seq : seq + 1, s0:s1] = ids[None]
        self.arrays["lens_probs"][seq : seq + 1, s0:s1] = probs[None]


def _writable_group(path: Path):
    import zarr

    # not the consolidated metadata: it lists the lens arrays of an interrupted lens, removed above
    return zarr.open_group(str(path / layout.TENSORS), mode="a", zarr_format=3, use_consolidated=False)


def steps_with_columns(run, values: dict[str, np.ndarray], layers: list[int]) -> Path:
    """steps.parquet with the lens columns (in the archive's column order), written to a temporary
    file beside it; returns its path."""
    target = run.path / layout.table_file("steps")
    table = parquet_io.read_table(target)
    seq = table.column("sequence").to_numpy()
    step = table.column("step").to_numpy()
    li = np.searchsorted(np.asarray(layers), table.column("layer").to_numpy())
    names = [c for c in layout.STEP_COLUMNS if c in table.column_names or c in values]
    columns = {c: (pa.array(values[c][seq, step, li]) if c in values else table.column(c)) for c in names}
    out = pa.table(columns, schema=layout.step_schema(names))
    tmp = target.with_name(f".{target.name}.lens.tmp")
    try:
        parquet_io.write_table(out, tmp, row_group_size=65536)
    except BaseException:
        tmp.unlink(missing_ok=True)  # (a full disk, a signal)
        raise
    return tmp
