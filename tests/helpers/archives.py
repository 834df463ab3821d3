"""Two archives compared table by table and array by array; the shape of an archive that holds tables only."""

from __future__ import annotations

import numpy as np

from lmtrace.archive.layout import RunShape
from lmtrace.archive.reader import Run

# a run of 64 sequences x 64 steps with no arrays: what table-writing tests (parts, compaction) need
TABLES_ONLY_SHAPE = RunShape(
    n_sequences=64,
    n_steps=64,
    max_prompt=2,
    layers=(0,),
    resid_layers=(),
    n_heads=1,
    n_kv_heads=1,
    head_dim=2,
    d_model=2,
    d_ffn=2,
    kv_head_of_head=(0,),
    attention=False,
    qkv=False,
    ffn=False,
    lens=False,
)


def assert_same_archive(a: Run, b: Run) -> None:
    """Run b's tokens, steps and sequences tables and every array equal run a's exactly."""
    for table in ("tokens", "steps", "sequences"):
        ta, tb = a.table(table).to_pandas(), b.table(table).to_pandas()
        assert ta.equals(tb), table
    assert a.array_names() == b.array_names()
    for name in a.array_names():
        np.testing.assert_array_equal(a.tensors[name][...], b.tensors[name][...], err_msg=name)
