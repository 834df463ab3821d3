"""Two archives compared table by table and array by array."""

from __future__ import annotations

import numpy as np

from lmtrace.archive.reader import Run


def assert_same_archive(a: Run, b: Run) -> None:
    """Run b's tokens, steps and sequences tables and every array equal run a's exactly."""
    for table in ("tokens", "steps", "sequences"):
        ta, tb = a.table(table).to_pandas(), b.table(table).to_pandas()
        assert ta.equals(tb), table
    assert a.array_names() == b.array_names()
    for name in a.array_names():
        np.testing.assert_array_equal(a.tensors[name][...], b.tensors[name][...], err_msg=name)
