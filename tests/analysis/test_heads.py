"""`lmtrace heads`: head scores and labels from the archive alone.

References: the test's own loops over the archived rows (read with zarr and pandas directly, query
position = prompt_len + step − 1), never lmtrace/heads.py; and attention rows set by hand so that
each head's class is known.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import zarr

from tests.helpers.cli import assert_one_line_error, lmtrace
from tests.helpers.runs import rerecord_checksums, run_spec

ANSI = re.compile(r"\x1b\[[0-9;]*m")

# A random word sequence said several times: the second half repeats the first (induction targets).
WORDS = "violet anchor mosaic thunder pepper glacier ribbon walnut".split()
PROMPTS = [" ".join(WORDS * 3), " ".join(WORDS[3:] * 4 + WORDS[:2])]
N = 6
SCORES = [
    "sink_score",
    "prev_token_score",
    "local_score",
    "induction_score",
    "duplicate_score",
    "entropy",
    "concentration",
]
# docs/heads.md, "Ranking": without a sweep or DLA, labels in this order, then the label's own score
RANK_ORDER = ["induction", "previous-token", "local", "focused", "sink", "diffuse"]
LABEL_SCORE = {
    "induction": "induction_score",
    "previous-token": "prev_token_score",
    "local": "local_score",
    "focused": "concentration",
    "sink": "sink_score",
    "diffuse": "entropy",
}


def _spec(model_dir, **capture) -> dict:
    return {
        "model": str(model_dir),
        "prompts": PROMPTS,
        "generation": {"max_new_tokens": N, "batch_size": 2},
        "capture": {"prefill_attention": True, "lens": {"enabled": False}, **capture},
        "output": {"float_dtype": "float32", "chunk_steps": 4},
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama_dir):
    return run_spec(tmp_path_factory.mktemp("heads"), _spec(tiny_llama_dir))


def _copy(run, dst: Path) -> Path:
    return Path(shutil.copytree(run.path, dst / run.path.name))


def _tokens(path: Path) -> dict[int, list[int]]:
    t = pd.read_parquet(path / "tokens.parquet").sort_values(["sequence", "position"])
    return {int(s): g.token_id.tolist() for s, g in t.groupby("sequence")}


def _rows(path: Path):
    """(sequence, query position, row [L, H, keys 0..q]) of every row `lmtrace heads` uses, read
    from the archive with zarr: prefill rows 1 .. P-2, then every generated step's row."""
    z = zarr.open_group(str(path / "tensors.zarr"), mode="r")
    P, G = z["prompt_len"][:], z["generated_len"][:]
    for seq in range(len(P)):
        p = int(P[seq])
        if "prefill_attn" in z:
            for q in range(1, p - 1):
                yield seq, q, z["prefill_attn"][seq, :, :, q, : q + 1].astype(np.float64)
        for step in range(int(G[seq])):
            q = p + step - 1
            if q >= 1:
                yield seq, q, z["attn"][seq, step, :, :, : q + 1].astype(np.float64)


def _own_scores(path: Path) -> dict[str, np.ndarray]:
    """Mean scores per (layer, head) by plain loops, the definitions of docs/heads.md."""
    toks = _tokens(path)
    acc: dict[str, list] = {s: [] for s in SCORES}
    for seq, q, row in _rows(path):
        t = toks[seq]
        L, H, _ = row.shape
        nan = np.full((L, H), np.nan)
        acc["sink_score"].append(row[:, :, 0])
        acc["prev_token_score"].append(row[:, :, q - 1])
        acc["local_score"].append(row[:, :, max(1, q - 4) : q + 1].sum(-1))
        ind = [j + 1 for j in range(q) if t[j] == t[q] and j + 1 < q]
        dup = [j for j in range(q) if t[j] == t[q]]
        acc["induction_score"].append(row[:, :, ind].sum(-1) if ind else nan)
        acc["duplicate_score"].append(row[:, :, dup].sum(-1) if dup else nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            acc["entropy"].append(-np.nansum(np.where(row > 0, row * np.log(row), 0.0), -1))
        acc["concentration"].append(row.max(-1))
    return {s: np.nanmean(np.stack(v), 0) for s, v in acc.items()}


def _heads_table(path: Path) -> pd.DataFrame:
    return pd.read_parquet(path / "analysis" / "heads.parquet").sort_values(["layer", "q_head"], ignore_index=True)


def _set_rows_by_hand(path: Path) -> dict[tuple[int, int], str]:
    """Overwrite `attn` and `prefill_attn` with hand-set rows: per layer-0 head a known pattern
    (previous-token, sink, induction, uniform), per layer-1 head local / focused / sink / previous;
    returns the expected label of each (layer, head) set."""
    toks = _tokens(path)
    g = zarr.open_group(str(path / "tensors.zarr"), mode="r+")
    attn, pre = g["attn"], g["prefill_attn"]
    P, G = g["prompt_len"][:], g["generated_len"][:]

    def row(kind: str, q: int, t: list[int]) -> np.ndarray:
        a = np.zeros(q + 1)
        if kind == "prev":
            a[q - 1] = 1
        elif kind == "sink":
            a[0] = 1
        elif kind == "induction":  # after the last earlier occurrence, else on itself
            js = [j for j in range(q) if t[j] == t[q] and j + 1 < q]
            a[js[-1] + 1 if js else q] = 1
        elif kind == "uniform":
            a[:] = 1 / (q + 1)
        elif kind == "local":
            lo = max(1, q - 3)
            a[lo : q + 1] = 1 / (q + 1 - lo)
        elif kind == "focused":  # 0.7 on position 1, the rest spread over the others
            a[:] = 0.3 / q
            a[1] = 0.7
        elif kind == "sink-ish":  # 0.6 on position 0, 0.4 on the previous token: a sink by the higher score
            a[0], a[q - 1] = 0.6, 0.4
        return a

    kinds = {0: ["prev", "sink", "induction", "uniform"], 1: ["local", "focused", "sink-ish", "prev"]}
    labels = {
        "prev": "previous-token",
        "sink": "sink",
        "induction": "induction",
        "uniform": "diffuse",
        "local": "local",
        "focused": "focused",
        "sink-ish": "sink",
    }
    A, PA = attn[...], pre[...]
    for seq in range(len(P)):
        p, t = int(P[seq]), toks[seq]
        for li, heads in kinds.items():
            for h, kind in enumerate(heads):
                for q in range(1, p):
                    PA[seq, li, h, q, :] = 0
                    PA[seq, li, h, q, : q + 1] = row(kind, q, t)
                for step in range(int(G[seq])):
                    q = p + step - 1
                    A[seq, step, li, h, :] = np.nan
                    A[seq, step, li, h, : q + 1] = row(kind, q, t)
    attn[...], pre[...] = A, PA
    rerecord_checksums(path)  # a run made this way, not a damaged one
    return {(li, h): labels[k] for li, heads in kinds.items() for h, k in enumerate(heads)}


def test_hand_set_heads_get_their_labels_and_the_tests_own_scores(base, tmp_path):
    path = _copy(base, tmp_path)
    expected = _set_rows_by_hand(path)
    proc = lmtrace(tmp_path, "heads", str(path), "--json", "--per-sequence")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
    got = _heads_table(path)
    assert len(got) == 4 * 4 and summary["path"] == str(path / "analysis" / "heads.parquet")
    for (layer, head), label in expected.items():
        row = got[(got.layer == layer) & (got["q_head"] == head)].iloc[0]
        assert row.label == label, (layer, head, row.to_dict())
    own = _own_scores(path)
    for s in SCORES:
        np.testing.assert_allclose(got[s].to_numpy(), own[s].reshape(-1), rtol=1e-5, atol=1e-6, err_msg=s)
    # the hand-set patterns score what they were built to: exactly 1 where one key takes all
    ind = got[(got.layer == 0) & (got["q_head"] == 2)].iloc[0]
    assert ind.induction_score == pytest.approx(1.0) and ind.n_induction_rows > 10
    assert got[(got.layer == 0) & (got["q_head"] == 0)].prev_token_score.iloc[0] == pytest.approx(1.0)
    assert got[(got.layer == 0) & (got["q_head"] == 1)].sink_score.iloc[0] == pytest.approx(1.0)
    # ranked: the head_rank column orders the rows, labels first in their documented order
    ranked = pd.read_parquet(path / "analysis" / "heads.parquet").sort_values("head_rank")
    assert ranked["head_rank"].tolist() == list(range(1, 17))
    assert ranked.label.map(RANK_ORDER.index).is_monotonic_increasing
    # per sequence: each sequence's means are the own computation over its rows only
    per = pd.read_parquet(path / "analysis" / "heads_per_sequence.parquet")
    assert sorted(per.sequence.unique()) == [0, 1] and len(per) == 2 * 16
    assert (per.groupby("sequence").n_rows.first().sum()) == got.n_rows.iloc[0]


def test_without_a_sweep_specific_mechanisms_rank_first_and_sinks_late(base, tmp_path):
    """No sweep, no DLA: induction and previous-token heads lead the table and --json, sinks and diffuse
    heads come last (docs/heads.md, "Ranking"), each label's heads by the label's own score."""
    path = _copy(base, tmp_path)
    expected = _set_rows_by_hand(path)
    proc = lmtrace(tmp_path, "heads", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    heads = json.loads(proc.stdout)["heads"]
    assert [h["head_rank"] for h in heads] == list(range(1, 17))
    hand = [h["label"] for h in heads if (h["layer"], h["q_head"]) in expected]
    assert hand == ["induction", "previous-token", "previous-token", "local", "focused", "sink", "sink", "diffuse"]
    assert heads[0]["label"] == "induction" and (heads[0]["layer"], heads[0]["q_head"]) == (0, 2)
    for a, b in zip(heads, heads[1:]):  # every head, the hand-set and the model's own
        assert RANK_ORDER.index(a["label"]) <= RANK_ORDER.index(b["label"]), (a, b)
        if a["label"] == b["label"]:
            assert a[LABEL_SCORE[a["label"]]] >= b[LABEL_SCORE[b["label"]]], (a, b)
    table = _table_rows(lmtrace(tmp_path, "heads", str(path), "--top", "3").stdout)
    assert [r[:3] for r in table] == [(h["layer"], h["q_head"], h["label"]) for h in heads[:3]]


def _table_rows(stdout: str) -> list[tuple[int, int, str]]:
    """(layer, head, label) of each row of the printed heads table (rank, layer, head, label first)."""
    rows = []
    for line in stdout.splitlines():
        cells = line.split()
        if len(cells) > 4 and all(c.isdigit() for c in cells[:3]):
            rows.append((int(cells[1]), int(cells[2]), cells[3]))
    return rows


def test_the_table_fits_80_columns_leaving_out_the_secondary_scores_first(base, tmp_path):
    """A terminal 80 columns wide (rich takes FORCE_COLOR as a terminal, COLUMNS as its width): every
    line fits, rank / layer / head / label whole, the left-out columns named; 200 columns show all."""
    path = _copy(base, tmp_path)
    _set_rows_by_hand(path)
    narrow = lmtrace(tmp_path, "heads", str(path), "--top", "16", env={"COLUMNS": "80", "FORCE_COLOR": "1"})
    assert narrow.returncode == 0, narrow.stderr
    lines = ANSI.sub("", narrow.stdout).splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    header = next(line.split() for line in lines if line.startswith("rank"))
    assert header[:4] == ["rank", "layer", "head", "label"] and "max" not in header
    assert "(left out to fit 80 columns: max w; --json has every score)" in lines
    heads = json.loads(lmtrace(tmp_path, "heads", str(path), "--json").stdout)["heads"]
    assert _table_rows(ANSI.sub("", narrow.stdout)) == [(h["layer"], h["q_head"], h["label"]) for h in heads]
    wide = ANSI.sub("", lmtrace(tmp_path, "heads", str(path), env={"COLUMNS": "200", "FORCE_COLOR": "1"}).stdout)
    assert "left out" not in wide and "max w" in wide


def test_label_filter_shows_only_those_heads_in_the_table_and_json(base, tmp_path):
    path = _copy(base, tmp_path)
    _set_rows_by_hand(path)
    proc = lmtrace(tmp_path, "heads", str(path), "--json", "--label", "sink", "--label", "induction")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    ranked = pd.read_parquet(path / "analysis" / "heads.parquet").sort_values("head_rank")
    assert len(ranked) == 16 and sum(got["labels"].values()) == 16  # the file and the counts: every head
    want = ranked[ranked.label.isin(["sink", "induction"])]
    assert [(h["layer"], h["q_head"]) for h in got["heads"]] == list(zip(want.layer, want["q_head"]))
    assert {(0, 1), (1, 2), (0, 2)} <= {(h["layer"], h["q_head"]) for h in got["heads"]}  # the hand-set ones
    assert got["label_filter"] == ["sink", "induction"]
    # the printed table, with the comma form
    proc = lmtrace(tmp_path, "heads", str(path), "--label", "previous-token,local", "--top", "16")
    assert proc.returncode == 0, proc.stderr
    want = ranked[ranked.label.isin(["previous-token", "local"])]
    assert _table_rows(proc.stdout) == list(zip(want.layer, want["q_head"], want.label))
    assert len(want) >= 3  # hand-set: two previous-token heads and a local one
    proc = lmtrace(tmp_path, "heads", str(path), "--label", "sinks")
    assert_one_line_error(proc, 2, "--label 'sinks'", "previous-token")


def test_scores_of_a_real_run_equal_the_tests_own_computation(base, tmp_path):
    """The tiny random model's own rows (prefill and generated), no hand-setting; a re-run replaces the file."""
    path = _copy(base, tmp_path)
    out = tmp_path / "elsewhere"
    proc = lmtrace(tmp_path, "heads", str(path), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "heads of" in proc.stdout and not (path / "analysis").exists()
    got = pd.read_parquet(out / "heads.parquet").sort_values(["layer", "q_head"], ignore_index=True)
    own = _own_scores(path)
    for s in SCORES:
        np.testing.assert_allclose(got[s].to_numpy(), own[s].reshape(-1), rtol=1e-5, atol=1e-6, err_msg=s)
    n_rows = sum(1 for _ in _rows(path))
    assert (got.n_rows == n_rows).all()
    (out / "heads.parquet").write_bytes(b"junk")  # a second run replaces whatever is there
    assert lmtrace(tmp_path, "heads", str(path), "--out", str(out), "--json").returncode == 0
    assert len(pq.read_table(out / "heads.parquet")) == 16


def test_run_without_attention_is_refused_in_one_line(tiny_llama_dir, tmp_path):
    for i, capture in enumerate(["none", {"attention": {"enabled": False}, "prefill_attention": False}]):
        spec = _spec(tiny_llama_dir)
        spec["generation"]["max_new_tokens"] = 2
        spec["capture"] = capture
        run = run_spec(tmp_path / str(i), spec)
        proc = lmtrace(tmp_path, "heads", str(run.path))
        assert_one_line_error(proc, 2, "no attention rows", "capture.attention.enabled: true")


def test_incomplete_run_is_scored_on_its_committed_steps_with_a_note(base, tmp_path):
    path = _copy(base, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["status"] = "interrupted"
    (path / "manifest.json").write_text(json.dumps(manifest))
    progress = next((path / "progress").glob("*.json"))
    p = json.loads(progress.read_text())
    for entry in p["batches"].values():
        entry.update(done=False, committed_steps=4)
    progress.write_text(json.dumps(p))
    proc = lmtrace(tmp_path, "heads", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert "interrupted: computed on its committed steps" in proc.stderr and "Traceback" not in proc.stderr
    got = _heads_table(path)
    P = zarr.open_group(str(path / "tensors.zarr"), mode="r")["prompt_len"][:]
    want = sum(int(p) - 2 for p in P) + 4 * len(P)  # prefill rows 1..P-2, then 4 committed steps each
    assert (got.n_rows == want).all()


@pytest.mark.slow
def test_embedded_model_scores_equal_the_tests_own_computation(tmp_path):
    """The embedded model's own rows (float16 `attn`, generated steps only), no prefill matrices."""
    spec = {
        "prompts": [PROMPTS[0]],
        "generation": {"max_new_tokens": 6},
        "capture": {"qkv": False, "ffn": {"enabled": False}, "lens": {"enabled": False}},
    }
    run = run_spec(tmp_path, spec)
    proc = lmtrace(tmp_path, "heads", str(run.path), "--json")
    assert proc.returncode == 0, proc.stderr
    got = _heads_table(run.path)
    assert len(got) == 30 * 9 and (got.n_rows == 6).all()
    own = _own_scores(run.path)
    for s in SCORES:
        np.testing.assert_allclose(got[s].to_numpy(), own[s].reshape(-1), rtol=1e-4, atol=1e-5, err_msg=s)
    assert set(got.label) <= {"sink", "previous-token", "induction", "local", "focused", "diffuse"}
