"""A sweep's effects.zarr and explain's scores.zarr end each chunk in its crc32c: a changed byte fails the
read, named, instead of reaching a view as a number."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import zarr

from lmtrace.archive.explanations import read_component
from lmtrace.archive.sweeps import EffectArray, read_effects, write_sweep
from lmtrace.archive.zarr_arrays import checked_array
from lmtrace.exits.errors import ArchiveDamaged, ArchiveError


def _flip_a_byte_of_the_chunk(array_dir: Path) -> None:
    chunks = [p for p in array_dir.rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert len(chunks) == 1, chunks
    data = bytearray(chunks[0].read_bytes())
    data[len(data) // 2] ^= 0x01
    chunks[0].write_bytes(bytes(data))


def test_a_changed_byte_in_a_sweep_s_effects_fails_the_read_naming_the_array(tmp_path):
    values = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    effect = EffectArray("logit_diff", ["layer", "q_head"], {"layer": [0, 1], "q_head": [0, 1, 2]}, values)
    final = tmp_path / "sweep-1"
    write_sweep(final, pa.table({"x": [1]}), pa.table({"x": [1]}), [effect], {"metrics": ["logit_diff"]})
    (got,) = read_effects(final)
    np.testing.assert_array_equal(got.values, values)  # read back as written
    _flip_a_byte_of_the_chunk(final / "effects.zarr" / "effect_logit_diff")
    with pytest.raises(ArchiveError, match="effect_logit_diff"):
        read_effects(final)


def test_a_changed_byte_in_an_explain_component_fails_the_read_as_a_damaged_run(tmp_path):
    group = zarr.open_group(str(tmp_path / "scores.zarr"), mode="w", zarr_format=3)
    values = np.linspace(-1, 1, 2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    checked_array(group, "lrp_heads", shape=values.shape, dtype="float32", chunks=values.shape)[...] = values
    run = SimpleNamespace(path=tmp_path, id="20260101-000000-000aaaaaa")
    entry = {"components": {"heads": "scores.zarr/lrp_heads"}, "steps": [3, 5]}
    np.testing.assert_array_equal(read_component(run, entry, "heads", step=5), values[1])
    _flip_a_byte_of_the_chunk(tmp_path / "scores.zarr" / "lrp_heads")
    with pytest.raises(ArchiveDamaged, match=r"run 20260101-000000-000aaaaaa is damaged: scores.zarr/lrp_heads is"):
        read_component(run, entry, "heads", step=5)
