"""Batch operation: kills at random moments, resume, signals, live-writer protection, shards, concurrency."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from lmtrace.archive.reader import IncompleteRunWarning, Run
from tests.helpers.archives import assert_same_archive
from tests.helpers.cli import sampled_spec

# One torch thread per process: several processes share the 2 cores in these tests, and
# oversubscribed OpenMP threads slow each step ~10x. Every run of a comparison uses the same
# thread count (it changes float results).
ENV = {"OMP_NUM_THREADS": "1"}


def _start(args, runs: Path) -> subprocess.Popen:
    env = {**os.environ, **ENV, "LMTRACE_RUNS_DIR": str(runs)}
    return subprocess.Popen(
        [sys.executable, "-m", "lmtrace.cli", *args, "-q"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run(args, runs: Path, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV, "LMTRACE_RUNS_DIR": str(runs)}
    return subprocess.run(
        [sys.executable, "-m", "lmtrace.cli", *args, "-q"], env=env, capture_output=True, text=True, timeout=timeout
    )


def _wait_writing(run_dir: Path, pid: int, timeout=120) -> bool:
    """Until the process's heartbeat exists (it is generating); False if it ended first."""
    beat = run_dir / "heartbeats" / "shard-0-of-1.json"
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if json.loads(beat.read_text())["pid"] == pid:
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    return False


def _open(path: Path) -> Run:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        return Run(path)


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path, tiny_llama_dir):
    spec = sampled_spec(tmp_path, str(tiny_llama_dir), max_new_tokens=80)
    runs = tmp_path / "runs"
    ref = _run(["generate", str(spec), "--run-id", "reference"], runs)
    assert ref.returncode == 0, ref.stderr
    reference = Run(runs / "reference")
    gen_s = reference.manifest["timings"]["generate_s"] + reference.manifest["timings"]["finalize_s"]
    rng = random.Random(0)
    kills = 0
    run_dir = runs / "killed"
    args = ["generate", str(spec), "--run-id", "killed"]
    while kills < 12:
        proc = _start(args, runs)
        started = _wait_writing(run_dir, proc.pid)
        if started:
            time.sleep(rng.uniform(0, gen_s))
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode in (0, -signal.SIGKILL), err
        if not (run_dir / "manifest.json").is_file():  # killed while loading the model: nothing to resume yet
            # (only lock files: the owner lock is taken before anything is written)
            assert not run_dir.exists() or not any(p.name not in (".lock", "owners") for p in run_dir.iterdir())
            continue
        manifest = json.loads((run_dir / "manifest.json").read_text())
        if proc.returncode == -signal.SIGKILL:
            kills += 1
        # A run killed after it wrote `complete` (while exiting) is complete: every run that says so
        # is checked against the reference below, so a false `complete` cannot pass.
        if proc.returncode == -signal.SIGKILL and manifest["status"] != "complete":
            # what was flushed is readable: every committed step of every batch has its tokens
            run = _open(run_dir)
            committed = run.committed_steps()
            if any(committed.values()):
                tokens = run.tokens().to_pandas()
                for seq, n in committed.items():
                    steps = tokens[(tokens.sequence == seq) & ~tokens.is_prompt].step
                    assert set(range(n)) <= set(steps), (seq, n)
        if manifest["status"] == "complete":  # it finished before the kill landed: compare, start over
            assert_same_archive(reference, Run(run_dir))
            import shutil

            shutil.rmtree(run_dir)
            args = ["generate", str(spec), "--run-id", "killed"]
            continue
        args = ["generate", "--resume", "killed"]
    if (run_dir / "manifest.json").is_file():
        final = _run(["generate", "--resume", "killed"], runs)
    else:  # the last kill landed on a run that had completed (compared and removed above)
        final = _run(["generate", str(spec), "--run-id", "killed"], runs)
    assert final.returncode == 0, final.stderr
    assert_same_archive(reference, Run(run_dir))


@pytest.mark.slow
def test_sigterm_interrupts_cleanly_and_resume_completes_identically(tmp_path, tiny_llama_dir):
    spec = sampled_spec(tmp_path, str(tiny_llama_dir), max_new_tokens=250)
    runs = tmp_path / "runs"
    proc = _start(["generate", str(spec), "--run-id", "term"], runs)
    assert _wait_writing(runs / "term", proc.pid)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert err.strip().splitlines()[-1].startswith("error: interrupted")
    assert json.loads((runs / "term" / "manifest.json").read_text())["status"] == "interrupted"
    again = _run(["generate", str(spec), "--run-id", "term"], runs)  # same spec and run id resumes
    assert again.returncode == 0, again.stderr
    ref = _run(["generate", str(spec), "--run-id", "ref"], runs)
    assert ref.returncode == 0
    assert_same_archive(Run(runs / "ref"), Run(runs / "term"))


def test_a_live_writer_is_never_touched_and_changed_specs_are_refused(tmp_path, tiny_llama_dir):
    spec = sampled_spec(tmp_path, str(tiny_llama_dir), max_new_tokens=2000, batch_size=3)
    runs = tmp_path / "runs"
    proc = _start(["generate", str(spec), "--run-id", "live"], runs)
    try:
        assert _wait_writing(runs / "live", proc.pid)
        out = _run(["generate", "--resume", "live"], runs)
        assert out.returncode == 2
        assert f"being written by pid {proc.pid}" in out.stderr and "Traceback" not in out.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    changed = _run(["generate", str(spec), "--run-id", "live", "--set", "generation.seed=12"], runs)
    assert changed.returncode == 2 and "differs at generation.seed" in changed.stderr


def test_concurrent_generates_never_collide(tmp_path, tiny_llama_dir):
    spec = sampled_spec(tmp_path, str(tiny_llama_dir), max_new_tokens=5)
    runs = tmp_path / "runs"
    procs = [_start(["generate", str(spec), "--set", "capture=none", "--json"], runs) for _ in range(3)]
    ids = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        ids.append(json.loads(out)["run_id"])
    assert len(set(ids)) == 3
    assert all(Run(runs / i).status == "complete" for i in ids)


def test_shards_write_one_run_equal_to_a_single_process_run(tmp_path, tiny_llama_dir):
    spec = sampled_spec(tmp_path, str(tiny_llama_dir), max_new_tokens=12, batch_size=1)
    runs = tmp_path / "runs"
    procs = [_start(["generate", str(spec), "--shard", f"{i}/2", "--run-id", "sharded"], runs) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    single = _run(["generate", str(spec), "--run-id", "single"], runs)
    assert single.returncode == 0, single.stderr
    sharded = Run(runs / "sharded")
    assert sharded.status == "complete"
    assert {k: v["status"] for k, v in sharded.shard_status.items()} == {
        "shard-0-of-2": "complete",
        "shard-1-of-2": "complete",
    }
    assert_same_archive(Run(runs / "single"), sharded)


def test_a_shard_finishing_after_another_failed_exits_4(tmp_path, tiny_llama_dir):
    spec = sampled_spec(tmp_path, str(tiny_llama_dir), max_new_tokens=400, batch_size=1)
    runs = tmp_path / "runs"
    other = _start(["generate", str(spec), "--shard", "1/2", "--run-id", "partial"], runs)
    beat = runs / "partial" / "heartbeats" / "shard-1-of-2.json"
    deadline = time.time() + 300
    while not beat.is_file():
        assert time.time() < deadline and other.poll() is None
        time.sleep(0.05)
    other.send_signal(signal.SIGTERM)
    assert other.wait(timeout=120) == 3
    short = _run(["generate", str(spec), "--shard", "0/2", "--run-id", "partial"], runs)
    assert short.returncode == 4, short.stderr
    assert "shard-1-of-2" in short.stderr and short.stderr.strip().startswith("error:")
    assert json.loads((runs / "partial" / "manifest.json").read_text())["status"] != "complete"


def test_a_sigkilled_intervene_child_shows_killed_and_resumes_equal_to_an_uninterrupted_child(tmp_path, tiny_llama_dir):
    """SIGKILL a child after its first batch finished and while the second is part-committed: `ls` and
    `show` say killed (nobody writes it), `generate --resume` skips the finished batch, continues the
    other from its last block, and the child equals one written without interruption, effects too."""
    import pandas as pd

    spec = sampled_spec(tmp_path, str(tiny_llama_dir), max_new_tokens=64, batch_size=1, eos_token_id=[])
    runs = tmp_path / "runs"
    assert _run(["generate", str(spec), "--run-id", "parent"], runs).returncode == 0
    edits = ["--ablate-head", "1.1", "--mode", "regenerate", "--from-step", "3"]
    proc = _start(["intervene", "parent", *edits, "--run-id", "kid"], runs)
    deadline, batches = time.time() + 300, {}
    while not (
        batches.get("0", {}).get("done")
        and 8 <= batches.get("1", {}).get("committed_steps", 0)
        and not batches["1"].get("done")
    ):
        assert time.time() < deadline and proc.poll() is None, (batches, proc.communicate())
        try:
            batches = json.loads((runs / "kid" / "progress" / "shard-0-of-1.json").read_text())["batches"]
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert json.loads((runs / "kid" / "manifest.json").read_text())["status"] == "running"  # what it last wrote
    env = {**os.environ, **ENV, "LMTRACE_RUNS_DIR": str(runs)}

    def view(*args):
        cmd = [sys.executable, "-m", "lmtrace.cli", *args, "--json"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True)
        return json.loads(done.stdout)

    listed = {r["run_id"]: r["status"] for r in view("ls")}
    assert listed == {"parent": "complete", "kid": "killed"}, listed
    assert view("show", "kid")["status"] == "killed"

    resumed = _run(["generate", "--resume", "kid"], runs)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip() == "kid"
    log = [json.loads(line) for line in (runs / "kid" / "log.jsonl").read_text().splitlines()]
    assert [e["from_step"] for e in log if e["event"] == "resume_batch"] == [batches["1"]["committed_steps"]]
    assert [e["batch"] for e in log if e["event"] == "batch_done"] == [0, 1, 2]  # batch 0 once: skipped on resume
    uninterrupted = _run(["intervene", "parent", *edits, "--run-id", "ref"], runs)
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    kid, ref = Run(runs / "kid"), Run(runs / "ref")
    assert kid.status == "complete" and kid.manifest["kind"] == "intervene"
    assert_same_archive(ref, kid)
    parent_tokens = Run(runs / "parent").tokens().to_pandas()
    assert not kid.tokens().to_pandas().token_id.equals(parent_tokens.token_id)  # the edit changed the text
    pd.testing.assert_frame_equal(
        pd.read_parquet(runs / "kid" / "effects.parquet"),
        pd.read_parquet(runs / "ref" / "effects.parquet"),
        check_exact=True,
    )
    assert not (runs / "kid" / "effects.parts").exists()
    assert view("verify", "kid")["ok"] is True
