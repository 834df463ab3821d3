"""serve's sweep view of a feature sweep: the heatmap's cells named 'feature F (sae)', each the mean of
its rows of sweep.parquet (computed here with pandas), and one cell's rows read by its feature id."""

from __future__ import annotations

import pandas as pd
import pytest

from lmtrace.serve.sweep_view import cell_rows, sweep_heatmaps
from tests.helpers.sweep_runs import feature_sweep_run


def test_a_feature_sweeps_heatmap_and_cells_are_named_by_feature_and_sae(tmp_path, sharp_llama_dir):
    run, d = feature_sweep_run(tmp_path, sharp_llama_dir)
    long = pd.read_parquet(d / "sweep.parquet")
    view = sweep_heatmaps(run, d.name)
    [m] = view["metrics"]
    assert view["sae"] == "sae-l1" and m["dims"] == ["feature"] and m["coords"]["feature"] == [1, 4, 9]
    assert m["labels"]["feature"] == ["feature 1 (sae-l1)", "feature 4 (sae-l1)", "feature 9 (sae-l1)"]
    for f, value in zip([1, 4, 9], m["values"]):
        assert value == pytest.approx(long[long.neuron == f].effect.mean(), rel=1e-5)
    cell = cell_rows(run, d.name, "logprob", {"feature": 4})
    assert cell["label"] == "feature 4 (sae-l1)" and cell["component"] == "feature"
    own = long[long.neuron == 4].sort_values(["sequence", "step"])
    assert [r["effect"] for r in cell["rows"]] == pytest.approx(own.effect.tolist())
