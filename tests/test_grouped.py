"""Grouped aggregates: `heads --by`, `sweep --by` (mean effect and a 95 % bootstrap interval per group
and cell) and `stats --by`, grouping sequences by a column of sequences.parquet.

References: the test's own pandas / numpy on the Parquet files (weighted means of the per-sequence
head scores; the bootstrap redone from the sweep's rows with the documented draws)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import run_spec
from test_cli_errors import assert_one_line_error, lmtrace

PROMPTS = ["one two three one two three one two", "The cat sat on the mat and the cat",
           "red green blue red green blue red", "Paris is the capital of France and"]
TOPICS = ["count", "animals", "count", None]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_llama_dir):
    """A run of a prompt file with a metadata column `topic` (one prompt without), which generation
    keeps in sequences.parquet."""
    tmp = tmp_path_factory.mktemp("grouped")
    f = tmp / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, **({"topic": t} if t is not None else {})}) + "\n"
                         for p, t in zip(PROMPTS, TOPICS)))
    r = run_spec(tmp, {
        "model": str(tiny_llama_dir), "prompts": {"file": str(f)}, "generation": {"max_new_tokens": 5, "batch_size": 4},
        "capture": {"lens": {"when": "inline"}}, "output": {"float_dtype": "float32"}})
    assert pq.read_table(r.path / "sequences.parquet").column("topic").to_pylist() == TOPICS
    return r


def test_heads_by_group_are_the_pooled_rows_of_its_sequences(run, capsys):
    from lmtrace.commands.heads import heads_command

    summary = heads_command(str(run.path), per_sequence=True, by="topic", json_out=True)
    capsys.readouterr()
    got = pd.read_parquet(run.path / "analysis" / "heads_by_topic.parquet")
    per = pd.read_parquet(run.path / "analysis" / "heads_per_sequence.parquet")
    per["topic"] = per.sequence.map(dict(enumerate(TOPICS)))
    assert sorted(got.topic.dropna().unique()) == ["animals", "count"] and got.topic.isna().any()
    for (topic, layer, head), rows in per.groupby(["topic", "layer", "q_head"], dropna=False):
        mine = got[(got.topic.isna() if topic is None or pd.isna(topic) else got.topic == topic)
                   & (got.layer == layer) & (got.q_head == head)].iloc[0]
        assert mine.n_sequences == len(rows) and mine.n_rows == rows.n_rows.sum()
        for score in ("sink_score", "prev_token_score", "local_score", "entropy", "concentration"):
            want = (rows[score] * rows.n_rows).sum() / rows.n_rows.sum()
            assert mine[score] == pytest.approx(want, rel=1e-5, abs=1e-7), (topic, layer, head, score)
        ind = rows[rows.n_induction_rows > 0]
        if len(ind):
            want = (ind.induction_score * ind.n_induction_rows).sum() / ind.n_induction_rows.sum()
            assert mine.induction_score == pytest.approx(want, rel=1e-5, abs=1e-7)
        else:
            assert np.isnan(mine.induction_score)
    assert {r["topic"] for r in summary["by"]["heads"]} == {"count", "animals", None}


def _bootstrap(rows: pd.DataFrame, resamples: int, seed: int) -> tuple[float, float]:
    """The documented draws: the group's sequences ascending, rng.integers(0, n, (resamples, n)); each
    resample's mean over every row of the sequences drawn (a sequence drawn twice counts twice)."""
    seqs = np.sort(rows.sequence.unique())
    draws = np.random.default_rng(seed).integers(0, len(seqs), size=(resamples, len(seqs)))
    by_seq = {s: rows[rows.sequence == s].effect.to_numpy() for s in seqs}
    means = [np.concatenate([by_seq[seqs[i]] for i in d]).mean() for d in draws]
    return tuple(np.percentile(means, [2.5, 97.5]))


def test_sweep_by_group_means_and_bootstrap_intervals(run, capsys):
    from lmtrace.cli.sweep import sweep_command

    summary = sweep_command(str(run.path), spec_path=None, flags={"over": "attn", "metrics": ["logprob"]},
                            runs_dir=None, run_id=None, shard=None, resume=False, top=5, json_out=True, quiet=False,
                            note=lambda *a, **k: None, by="topic")
    capsys.readouterr()
    by = summary["by"]
    assert by["resamples"] == 1000 and by["seed"] == 0
    long = pd.read_parquet(next(p for p in (run.path / "sweeps").iterdir() if not p.name.startswith("."))
                           / "sweep.parquet")
    long = long[long.metric == "logprob"]
    long["topic"] = long.sequence.map(dict(enumerate(TOPICS)))
    cells = {(c["group"], c["layer"]): c for c in by["cells"]}
    assert len(cells) == 3 * long.layer.nunique()
    for (topic, layer), rows in long.groupby(["topic", "layer"], dropna=False):
        c = cells[(None if pd.isna(topic) else topic, int(layer))]
        assert c["effect"] == pytest.approx(rows.effect.mean(), rel=1e-9, abs=1e-12)
        assert c["n_sequences"] == rows.sequence.nunique() and c["n_rows"] == len(rows)
        low, high = _bootstrap(rows, 1000, 0)
        assert (c["low"], c["high"]) == pytest.approx((low, high), rel=1e-9, abs=1e-12)
        assert c["low"] <= c["effect"] <= c["high"] or rows.sequence.nunique() == 1


def test_stats_by_group_equal_pandas_on_the_files(run, capsys):
    from lmtrace.commands.stats import stats_command

    result = stats_command(str(run.path), by="topic", json_out=True, lowest=3)
    capsys.readouterr()
    tokens = pd.read_parquet(run.path / "tokens.parquet")
    steps = pd.read_parquet(run.path / "steps.parquet")
    topic = dict(enumerate(TOPICS))
    gen = tokens[~tokens.is_prompt].assign(topic=lambda t: t.sequence.map(topic))
    groups = {g["group"]: g for g in result["groups"]}
    assert set(groups) == {"count", "animals", None} and result["lens"]
    for key, rows in gen.groupby("topic", dropna=False):
        g = groups[None if pd.isna(key) else key]
        assert g["sequences"] == sum(1 for t in TOPICS if t == g["group"])
        assert g["tokens"] == len(rows)
        assert g["mean_logprob"] == pytest.approx(rows.logprob.astype(float).mean(), rel=1e-6)
        assert g["mean_entropy"] == pytest.approx(rows.entropy.astype(float).mean(), rel=1e-6)
        low = rows.sort_values(["prob", "sequence", "step"]).head(3)
        assert [(r["sequence"], r["step"]) for r in g["lowest"]] == list(zip(low.sequence, low.step))
        st = steps[steps.sequence.isin(rows.sequence.unique())].drop_duplicates(["sequence", "step"])
        assert {int(k): v for k, v in g["settle"].items()} == st.settle_layer.astype(int).value_counts().to_dict()


@pytest.mark.parametrize("command", ["heads", "stats"])
def test_an_unknown_by_column_is_one_line_naming_the_columns(run, tmp_path, command):
    proc = lmtrace(tmp_path, command, str(run.path), "--by", "nope")
    assert_one_line_error(proc, 2, "--by 'nope'", "columns: batch, prompt", "topic")


def test_sweep_refuses_an_unknown_by_column_before_running_cells(run, tmp_path):
    before = json.loads((run.path / "manifest.json").read_text()).get("sweeps") or []
    proc = lmtrace(tmp_path, "sweep", str(run.path), "--over", "attn", "--by", "nope")
    assert_one_line_error(proc, 2, "--by 'nope'", "stop_reason")
    assert (json.loads((run.path / "manifest.json").read_text()).get("sweeps") or []) == before
    assert not (run.path / "sweeps").is_dir() or not any(p.name.startswith(".partial") for p in (run.path / "sweeps").iterdir())
