"""Progress that cron and SLURM logs can use (sequences done / total, tokens, tok/s, an estimated
time left, per shard) and `lmtrace ls` showing how far a running run has got."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from lmtrace.output.progress import Estimate, duration

PROMPTS = ["The cat", "Paris is the capital of", "One, two, three,", "Hello"]


def test_the_estimate_is_the_sequences_left_times_tokens_per_finished_sequence_at_the_rate_so_far():
    e = Estimate(total=10, max_new_tokens=50, now=100.0)
    assert e.seconds_left(100.0) is None  # nothing generated yet
    e.advance(20)  # 20 tokens in 10 s: 2 tok/s; no sequence finished: 50 tokens each at most
    assert e.rate(110.0) == 2.0
    assert e.seconds_left(110.0) == (10 * 50 - 20) / 2.0
    e.sequences_done(2, 20)  # two sequences took 10 tokens each
    e.sequences_done(3, None)  # a resume found three done: their tokens are not this process's
    e.advance(4)  # of the batch in progress
    assert e.seconds_left(112.0) == pytest.approx(((10 - 5) * 10 - 4) / (24 / 12.0))
    assert [duration(s) for s in (12, 840, 7500)] == ["12 s", "14 min", "2 h 05 min"]


def _spec(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"ref": str(model), "device": "cpu"},
                "prompts": PROMPTS,
                "generation": {"max_new_tokens": 3, "batch_size": 1},
                "capture": "none",
            }
        )
    )
    return path


LINE = re.compile(
    r"\[\d\d:\d\d:\d\d\] shard-1-of-2: (\d+)/2 sequences, (\d+) tokens, [\d.]+ tok/s"
    r"(, ETA ~\d+ (s|min)( \d\d min)? \(estimate\))?$"
)


def test_plain_progress_lines_name_the_shard_sequences_tokens_rate_and_eta(tmp_path, tiny_llama_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMTRACE_PROGRESS_EVERY": "0"}
    cmd = [
        sys.executable,
        "-m",
        "lmtrace.cli",
        "generate",
        str(_spec(tmp_path, tiny_llama_dir)),
        "--shard",
        "1/2",
        "--run-id",
        "sharded",
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)  # stderr is not a terminal
    assert done.returncode == 0, done.stderr
    lines = [m for m in map(LINE.match, done.stderr.splitlines()) if m]
    assert lines, done.stderr
    assert "shard-1-of-2: generating: 2 prompt(s), up to 3 new tokens each" in done.stderr
    counts = [int(m.group(1)) for m in lines]
    assert counts == sorted(counts) and counts[-1] == 2
    assert any(m.group(3) for m in lines)  # an ETA once tokens flow
    # the tokens the lines count are those the shard archived (its sequences 1 and 3)
    parts = list((tmp_path / "runs" / "sharded" / "sequences.parts").glob("*.parquet"))
    assert len(parts) == 2
    archived = sum(sum(pq.read_table(p).column("generated_len").to_pylist()) for p in parts)
    assert int(lines[-1].group(2)) == archived

    logged = subprocess.run(
        cmd[:-6] + ["--run-id", "json", "--runs-dir", str(tmp_path / "runs"), "--log-json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    events = [json.loads(x) for x in logged.stderr.splitlines() if x.startswith("{")]
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and progress[-1]["sequences_done"] == 4 and progress[-1]["sequences_total"] == 4
    assert {"tokens", "tokens_per_s", "eta_s"} <= progress[-1].keys()


def test_ls_shows_how_far_a_running_run_has_got_and_its_eta(tmp_path, tiny_llama_dir):
    from lmtrace.archive.summary import run_summary
    from lmtrace.output.progress import Progress
    from lmtrace.runner.generation import run_generate
    from lmtrace.spec.run_spec import build_spec

    data = yaml.safe_load(_spec(tmp_path, tiny_llama_dir).read_text())
    data["output"] = {"runs_dir": str(tmp_path / "runs"), "run_id": "live"}
    seen = []

    def sequences_done(n, tokens):  # while the run is live: its writer is this process
        seen.append(run_summary(tmp_path / "runs" / "live"))

    run_generate(build_spec(data, "t"), yaml.safe_dump(data), progress=Progress(sequences_done=sequences_done))
    # a batch counts once the writer has committed it (it may lag the loop by a batch)
    done = [r["sequences_done"] for r in seen]
    assert all(r["status"] == "running" and r["sequences_total"] == 4 for r in seen)
    assert done == sorted(done) and all(k - 1 <= d <= k for k, d in enumerate(done, 1)) and done[-1] >= 3, done
    # an estimate once a batch is done, while sequences are left (all done: the run is finishing, no
    # estimate; whether the writer has committed the last batch by the last call depends on timing)
    with_eta = [r for r in seen if 0 < r["sequences_done"] < 4]
    assert with_eta and all(r["eta_s"] is not None for r in with_eta)
    assert all(r["eta_s"] is None for r in seen if r["sequences_done"] == 4)
    from lmtrace.commands.ls import _cells

    assert re.fullmatch(r"running [123]/4 ~\d+s left", _cells(with_eta[0], short=True)["status"])
    complete = run_summary(tmp_path / "runs" / "live")
    assert complete["status"] == "complete" and "sequences_done" not in complete

    env = {**os.environ, "LMTRACE_RUNS_DIR": str(tmp_path / "runs")}
    ls = subprocess.run([sys.executable, "-m", "lmtrace.cli", "ls"], env=env, capture_output=True, text=True)
    header, row = ls.stdout.splitlines()
    assert header.split("\t")[-1] == "progress" and row.split("\t")[2] == "complete" and row.split("\t")[-1] == "-"
