"""Grouped aggregates: `heads --by`, `sweep --by` (mean effect and a 95 % bootstrap interval per group
and cell) and `stats --by`, grouping sequences by a column of sequences.parquet.

References: the test's own pandas / numpy on the Parquet files (weighted means of the per-sequence
head scores; the bootstrap redone from the sweep's rows with the documented draws)."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.cli import assert_one_line_error, lmtrace
from tests.helpers.runs import run_spec

PROMPTS = [
    "one two three one two three one two",
    "The cat sat on the mat and the cat",
    "red green blue red green blue red",
    "Paris is the capital of France and",
]
TOPICS = ["count", "animals", "count", None]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_llama_dir):
    """A run of a prompt file with a metadata column `topic` (one prompt without), which generation
    keeps in sequences.parquet."""
    tmp = tmp_path_factory.mktemp("grouped")
    f = tmp / "prompts.jsonl"
    f.write_text(
        "".join(
            json.dumps({"prompt": p, **({"topic": t} if t is not None else {})}) + "\n" for p, t in zip(PROMPTS, TOPICS)
        )
    )
    r = run_spec(
        tmp,
        {
            "model": str(tiny_llama_dir),
            "prompts": {"file": str(f)},
            "generation": {"max_new_tokens": 5, "batch_size": 4},
            "capture": {"lens": {"when": "inline"}},
            "output": {"float_dtype": "float32"},
        },
    )
    assert pq.read_table(r.path / "sequences.parquet").column("topic").to_pylist() == TOPICS
    return r


def test_heads_by_group_are_the_pooled_rows_of_its_sequences(run, capsys):
    from lmtrace.commands.heads import heads_command

    summary = heads_command(str(run.path), per_sequence=True, by="topic", json_out=True)
    capsys.readouterr()
    got = pd.read_parquet(run.path / "analysis" / "heads_by_topic.parquet")
    per = pd.read_parquet(run.path / "analysis" / "heads_per_sequence.parquet")
    per["topic"] = per.sequence.map(dict(enumerate(TOPICS)))
    assert (got.group_column == "topic").all()
    assert sorted(got.group_value.dropna().unique()) == ["animals", "count"] and got.group_value.isna().any()
    for (topic, layer, head), rows in per.groupby(["topic", "layer", "q_head"], dropna=False):
        mine = got[
            (got.group_value.isna() if topic is None or pd.isna(topic) else got.group_value == topic)
            & (got.layer == layer)
            & (got.q_head == head)
        ].iloc[0]
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
    assert {r["group_value"] for r in summary["by"]["heads"]} == {"count", "animals", None}


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

    summary = sweep_command(
        str(run.path),
        spec_path=None,
        flags={"over": "attn", "metrics": ["logprob"]},
        runs_dir=None,
        run_id=None,
        shard=None,
        resume=False,
        top=5,
        json_out=True,
        quiet=False,
        note=lambda *a, **k: None,
        by="topic",
    )
    capsys.readouterr()
    by = summary["by"]
    assert by["resamples"] == 1000 and by["seed"] == 0
    long = pd.read_parquet(
        next(p for p in (run.path / "sweeps").iterdir() if not p.name.startswith(".")) / "sweep.parquet"
    )
    long = long[long.metric == "logprob"]
    long["topic"] = long.sequence.map(dict(enumerate(TOPICS)))
    cells = {(c["group_value"], c["layer"]): c for c in by["cells"]}
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
    groups = {g["group_value"]: g for g in result["groups"]}
    assert set(groups) == {"count", "animals", None} and result["lens"]
    for key, rows in gen.groupby("topic", dropna=False):
        g = groups[None if pd.isna(key) else key]
        assert g["sequences"] == sum(1 for t in TOPICS if t == g["group_value"])
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
    assert not (run.path / "sweeps").is_dir() or not any(
        p.name.startswith(".partial") for p in (run.path / "sweeps").iterdir()
    )


# Metadata named like the output columns of heads, sweep and stats (`label`, `layer`, `q_head`), and a
# bool; the last prompt has none of them (its group is null).
COLLIDING = [
    {"prompt": PROMPTS[0], "label": "x", "layer": 3, "q_head": 10, "flag": True},
    {"prompt": PROMPTS[1], "label": "y", "layer": 12, "q_head": 2, "flag": False},
    {"prompt": PROMPTS[2], "label": "x", "layer": 3, "q_head": 2, "flag": True},
    {"prompt": PROMPTS[3]},
]
COLUMNS = ("label", "layer", "q_head", "flag")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# each terminal table's own headers: a group column of one of these names is headed `NAME (group)`
HEADS_HEADERS = ("seqs", "layer", "head", "label", "sink", "prev", "local", "induct", "entropy")
SWEEP_HEADERS = ("seqs", "component", "layer", "q_head", "neuron", "position", "effect", "95 % interval")


def _groups(column: str) -> dict:
    """value -> number of sequences, in the documented order (the column's own, null last)."""
    counts = Counter(row.get(column) for row in COLLIDING)
    return {v: counts[v] for v in [*sorted(v for v in counts if v is not None), None]}


def _text(value) -> str:
    """A group value as the terminal is documented to show it."""
    return "-" if value is None else ("true" if value else "false") if isinstance(value, bool) else str(value)


def _header(column: str, headers) -> str:
    return f"{column} (group)" if column in headers else column


def _first_cells(stdout: str, header: str) -> list[str]:
    """The first cell of every row of the borderless table whose header line starts with `header` (the
    group values of these tests hold no space)."""
    lines = ANSI.sub("", stdout).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header + "  "))
    cells = []
    for line in lines[start + 1 :]:
        if not line.strip() or line.startswith(("(", "every ")):
            break
        cells.append(line.split()[0])
    return cells


@pytest.fixture(scope="module")
def colliding(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("colliding")
    f = tmp / "prompts.jsonl"
    f.write_text("".join(json.dumps(row) + "\n" for row in COLLIDING))
    r = run_spec(
        tmp,
        {
            "model": str(tiny_llama_dir),
            "prompts": {"file": str(f)},
            "generation": {"max_new_tokens": 3, "batch_size": 4},
            "capture": {"lens": {"when": "inline"}},
            "output": {"float_dtype": "float32"},
        },
    )
    assert pq.read_table(r.path / "sequences.parquet").column("layer").to_pylist() == [3, 12, 3, None]
    return r


NARROW = {"COLUMNS": "80", "FORCE_COLOR": "1"}  # rich takes FORCE_COLOR as a terminal, COLUMNS as its width


def _ok(proc) -> str:
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "error" not in proc.stderr, proc.stderr
    return ANSI.sub("", proc.stdout)


def _fits(stdout: str, width: int = 80) -> None:
    lines = stdout.splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)


@pytest.mark.parametrize("column", COLUMNS)
def test_heads_by_a_column_named_like_an_output_column_keeps_both(colliding, tmp_path, column):
    """`heads --by label / layer / q_head / flag`: the file has one column of each name (pandas reads
    it), the group under group_value with the metadata's own type and values, the head's own layer,
    q_head and label beside it; `--json` and the 80-column table show the groups."""
    groups = _groups(column)
    summary = json.loads(
        _ok(lmtrace(tmp_path, "heads", str(colliding.path), "--by", column, "--per-sequence", "--json"))
    )
    path = colliding.path / "analysis" / f"heads_by_{column}.parquet"
    schema = pq.read_schema(path)
    assert schema.names[:3] == ["group_column", "group_value", "n_sequences"]
    assert len(set(schema.names)) == len(schema.names) and schema.names.count(column) <= 1
    assert schema.field("group_value").type == pq.read_schema(colliding.path / "sequences.parquet").field(column).type
    got = pd.read_parquet(path)
    assert (got.group_column == column).all()
    # grouped by the metadata, not by the head's own coordinate: each group has every (layer, q_head)
    # once, its n_rows the sum of its sequences' in heads_per_sequence.parquet
    per = pd.read_parquet(colliding.path / "analysis" / "heads_per_sequence.parquet")
    per["meta"] = per.sequence.map(lambda s: COLLIDING[s].get(column))
    n_heads = per[per.sequence == 0].shape[0]
    for value, n in groups.items():
        mine = got[got.group_value.isna()] if value is None else got[got.group_value == value]
        assert len(mine) == n_heads and not mine.duplicated(["layer", "q_head"]).any()
        assert (mine.n_sequences == n).all()
        theirs = per[per.meta.isna()] if value is None else per[per.meta == value]
        want = theirs.groupby(["layer", "q_head"]).n_rows.sum()
        assert mine.set_index(["layer", "q_head"]).n_rows.sort_index().tolist() == want.sort_index().tolist()
        assert set(mine.label) <= {"sink", "previous-token", "induction", "local", "focused", "diffuse"}
    assert summary["by"]["column"] == column
    rows = summary["by"]["heads"]
    assert list(dict.fromkeys(r["group_value"] for r in rows)) == list(groups)
    assert all(
        type(r["group_value"]) is type(next(v for v in groups if v is not None))
        for r in rows
        if r["group_value"] is not None
    )
    assert {(r["group_value"], r["n_sequences"]) for r in rows} == set(groups.items())
    narrow = _ok(lmtrace(tmp_path, "heads", str(colliding.path), "--by", column, "--top", "2", env=NARROW))
    _fits(narrow)
    cells = _first_cells(narrow, _header(column, HEADS_HEADERS))
    assert cells == [_text(v) for v in groups for _ in range(2)]


@pytest.mark.parametrize("column", COLUMNS)
def test_sweep_by_a_column_named_like_an_output_column_groups_by_the_metadata(colliding, tmp_path, column):
    """`sweep --by label / layer / q_head / flag` at 80 columns: the table lists each group's cells
    under its value; its `--json` (here the summary's `by`, reduced from the sweep just run) has each
    cell's group under group_value, the mean effect of the group's sequences (pandas on sweep.parquet)."""
    from lmtrace.archive.groups import sequence_groups
    from lmtrace.archive.reader import Run
    from lmtrace.commands.sweep import grouped_cells
    from lmtrace.output.jsonout import json_line

    groups = _groups(column)
    narrow = _ok(
        lmtrace(
            tmp_path,
            "sweep",
            str(colliding.path),
            "--over",
            "attn",
            "--steps",
            "0",
            "--metric",
            "logprob",
            "--by",
            column,
            "--top",
            "2",
            env=NARROW,
        )
    )
    _fits(narrow)
    assert _first_cells(narrow, _header(column, SWEEP_HEADERS)) == [_text(v) for v in groups for _ in range(2)]
    sweep_id = Run(colliding.path).manifest["sweeps"][-1]["id"]
    by = json.loads(
        json_line(
            grouped_cells(str(colliding.path), None, sweep_id, "logprob", sequence_groups(Run(colliding.path), column))
        )
    )
    assert by["column"] == column
    long = pd.read_parquet(colliding.path / "sweeps" / sweep_id / "sweep.parquet")
    long = long[long.metric == "logprob"]
    long["meta"] = long.sequence.map(lambda s: COLLIDING[s].get(column))
    assert list(dict.fromkeys(c["group_value"] for c in by["cells"])) == list(groups)
    for c in by["cells"]:
        rows = long[
            (long.meta.isna() if c["group_value"] is None else long.meta == c["group_value"])
            & (long.layer == c["layer"])
        ]
        assert c["n_sequences"] == groups[c["group_value"]] == rows.sequence.nunique()
        assert c["effect"] == pytest.approx(rows.effect.mean(), rel=1e-9, abs=1e-12)
    assert sorted({c["layer"] for c in by["cells"]}) == sorted(long.layer.unique())


def _stats_rows(stdout: str) -> list[list[str]]:
    """The rows of stats' first table (six cells: group, seqs, tokens, logprob, entropy, lens)."""
    rows = [
        [c.strip() for c in line.strip().strip("│").split("│")] for line in stdout.splitlines() if line.startswith("│")
    ]
    return [r for r in rows if len(r) == 6 and r[1].isdigit()]


@pytest.mark.parametrize("column", COLUMNS)
def test_stats_by_a_column_named_like_an_output_column(colliding, tmp_path, column):
    groups = _groups(column)
    result = json.loads(_ok(lmtrace(tmp_path, "stats", str(colliding.path), "--by", column, "--json")))
    assert result["by"] == column
    assert [(g["group_value"], g["sequences"]) for g in result["groups"]] == list(groups.items())
    tokens = pd.read_parquet(colliding.path / "tokens.parquet")
    gen = tokens[~tokens.is_prompt]
    for g in result["groups"]:
        seqs = [i for i, row in enumerate(COLLIDING) if row.get(column) == g["group_value"]]
        assert g["tokens"] == gen.sequence.isin(seqs).sum()
    narrow = _ok(lmtrace(tmp_path, "stats", str(colliding.path), "--by", column, env=NARROW))
    _fits(narrow)
    assert [(r[0], int(r[1])) for r in _stats_rows(narrow)] == [(_text(v), n) for v, n in groups.items()]


@pytest.mark.parametrize(
    "command",
    [
        ["heads", "--top", "1"],
        ["stats"],
        ["sweep", "--over", "attn", "--steps", "0", "--metric", "logprob", "--top", "1"],
    ],
)
def test_every_by_command_prints_its_groups_when_piped(colliding, tmp_path, command):
    """Piped (not a terminal), grouped by `layer`, a column named like one of heads' and sweep's own."""
    out = _ok(lmtrace(tmp_path, command[0], str(colliding.path), *command[1:], "--by", "layer"))
    groups = [_text(v) for v in _groups("layer")]
    if command[0] == "stats":
        assert [r[0] for r in _stats_rows(out)] == groups
    else:
        headers = HEADS_HEADERS if command[0] == "heads" else SWEEP_HEADERS
        assert _first_cells(out, _header("layer", headers)) == groups


def test_a_bool_group_is_json_true_in_every_json_and_a_bool_in_the_file(colliding, tmp_path):
    """One spelling of a bool group: JSON true / false in heads', sweep's and stats' --json, Arrow bool
    in heads_by_flag.parquet, `true` / `false` on the terminal (the other tests)."""
    outputs = {
        "heads": lmtrace(tmp_path, "heads", str(colliding.path), "--by", "flag", "--json"),
        "stats": lmtrace(tmp_path, "stats", str(colliding.path), "--by", "flag", "--json"),
        "sweep": lmtrace(
            tmp_path,
            "sweep",
            str(colliding.path),
            "--over",
            "attn",
            "--steps",
            "0",
            "--metric",
            "logprob",
            "--by",
            "flag",
            "--json",
        ),
    }
    for name, proc in outputs.items():
        text = _ok(proc)
        assert '"group_value":true' in text and '"group_value":false' in text, name
        assert not re.search(r'"(?i:true|false)"', text), name  # never the text "true" / "True"
        data = json.loads(text)
        values = (
            [r["group_value"] for r in data["by"]["heads"]]
            if name == "heads"
            else [g["group_value"] for g in data["groups"]]
            if name == "stats"
            else [c["group_value"] for c in data["by"]["cells"]]
        )
        assert list(dict.fromkeys(values)) == [False, True, None], name
    table = pq.read_table(colliding.path / "analysis" / "heads_by_flag.parquet")
    assert table.schema.field("group_value").type == pa.bool_()
    assert list(dict.fromkeys(table.column("group_value").to_pylist())) == [False, True, None]
