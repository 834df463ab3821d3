"""The standing fault suite: same-id races, refused requests that must leave nothing behind, failures
recorded in the archive, damaged archives, signals outside the loop (issue 20).

Subprocess tests use the tiny random Llama (`tiny_llama_dir`) with one torch thread each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmtrace.archive.reader import Run

ENV = {"OMP_NUM_THREADS": "1"}


def _spec(tmp_path: Path, model, name="spec.yaml", **gen) -> Path:
    generation = {"max_new_tokens": 12, "batch_size": 2, "temperature": 0.9, "seed": 11, "eos_token_id": 0, **gen}
    path = tmp_path / name
    path.write_text(json.dumps({
        "model": str(model),
        "prompts": ["Count slowly:", "A long story about a cat and a dog", "Fruits:"],
        "generation": generation,
        "output": {"chunk_steps": 4},
    }))
    return path


def _env(runs: Path, **extra) -> dict:
    return {**os.environ, **ENV, "LMTRACE_RUNS_DIR": str(runs), **extra}


def _start(args, runs: Path, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lmtrace.cli", *args, "-q"], env=_env(runs, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(args, runs: Path, timeout=300, quiet=True, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmtrace.cli", *args, *(["-q"] if quiet else [])],
                          env=_env(runs, **env), capture_output=True, text=True, timeout=timeout)


def _race(args_a, args_b, runs: Path, pause: float = 4.0) -> list[subprocess.Popen]:
    """Two processes started together, each pausing `pause` s once it has created (or reopened) the run."""
    procs = [_start(args, runs, LMTRACE_TEST_PAUSE_AFTER_CREATE=str(pause)) for args in (args_a, args_b)]
    for p in procs:
        p.out, p.err = p.communicate(timeout=300)
    return procs


def _one_wrote_one_refused(procs) -> subprocess.Popen:
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [(p.returncode, p.err[-2000:]) for p in procs]
    loser = next(p for p in procs if p.returncode == 2)
    winner = next(p for p in procs if p.returncode == 0)
    line = loser.err.strip()
    assert line.startswith("error:") and "\n" not in line and "Traceback" not in line, loser.err
    assert f"being written by pid {winner.pid}" in line, line
    return winner


def test_two_writers_of_one_run_id_exactly_one_writes_and_the_archive_is_one_run(tmp_path, tiny_llama_dir):
    from tests.test_batch_ops import assert_same_archive

    runs = tmp_path / "runs"
    spec = _spec(tmp_path, tiny_llama_dir)
    _one_wrote_one_refused(_race(["generate", str(spec), "--run-id", "race"],
                                 ["generate", str(spec), "--run-id", "race"], runs))
    # two resumers of an interrupted run: the same
    killed = _start(["generate", str(spec), "--run-id", "resumed", "--set", "generation.max_new_tokens=400"], runs)
    beat = runs / "resumed" / "heartbeats" / "shard-0-of-1.json"
    deadline = time.time() + 120
    while not beat.is_file():
        assert time.time() < deadline and killed.poll() is None, killed.communicate()
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    _one_wrote_one_refused(_race(["generate", "--resume", "resumed"], ["generate", "--resume", "resumed"], runs))
    resumed = Run(runs / "resumed")
    assert resumed.status == "complete"
    # the raced run equals a run of the same spec by one process
    single = _run(["generate", str(spec), "--run-id", "single"], runs)
    assert single.returncode == 0, single.stderr
    assert_same_archive(Run(runs / "single"), Run(runs / "race"))


def _nothing_created(runs: Path) -> bool:
    return not runs.exists() or not any(runs.iterdir())


def test_eos_outside_the_vocabulary_is_refused_before_anything_is_created(tmp_path, tiny_llama_dir):
    runs = tmp_path / "runs"
    spec = _spec(tmp_path, tiny_llama_dir, eos_token_id=999999999)
    for cmd in (["validate", str(spec)], ["generate", str(spec), "--run-id", "eos"]):
        out = _run(cmd, runs, quiet=False)
        assert out.returncode == 2, out.stderr
        assert "eos_token_id" in out.stderr and "outside the vocabulary" in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert _nothing_created(runs), list(runs.rglob("*"))


def test_context_longer_than_the_model_is_refused_in_validate_and_generate(tmp_path, tiny_llama_dir):
    runs = tmp_path / "runs"
    # the tiny model has 4096 positions: 5000 new tokens never fit (refused before the model load), 4094 fit
    # only without a real prompt (refused once the prompts are tokenised, still before the run is created)
    for max_new in (5000, 4094):
        spec = _spec(tmp_path, tiny_llama_dir, max_new_tokens=max_new)
        gen = _run(["generate", str(spec)], runs)
        assert gen.returncode == 2, gen.stderr
        assert "exceed the 4096 positions" in gen.stderr and "max_new_tokens <=" in gen.stderr, gen.stderr
        assert _nothing_created(runs), list(runs.rglob("*"))
    val = _run(["validate", str(_spec(tmp_path, tiny_llama_dir, max_new_tokens=5000))], runs, quiet=False)
    assert val.returncode == 2 and "exceed the 4096 positions" in val.stderr, val.stderr


def test_shard_without_run_id_is_refused_before_the_model_load(tmp_path, tiny_llama_dir):
    # a checkpoint whose config reads fine but whose weights are missing: loading it would fail (exit 1)
    broken = tmp_path / "no-weights"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    runs = tmp_path / "runs"
    out = _run(["generate", str(_spec(tmp_path, broken)), "--shard", "0/2"], runs)
    assert out.returncode == 2 and "needs a shared run id" in out.stderr, out.stderr
    assert _nothing_created(runs)


def test_a_failure_after_the_run_exists_is_recorded_as_failed(tmp_path, tiny_llama_dir, monkeypatch):
    import lmtrace.generate as gen
    from lmtrace.errors import LmtraceError
    from tests.conftest import run_spec

    def broken_tracer(*args, **kwargs):
        raise RuntimeError("tracer could not start")

    monkeypatch.setattr(gen, "Tracer", broken_tracer)
    with pytest.raises(RuntimeError):
        run_spec(tmp_path, {"model": str(tiny_llama_dir), "prompts": ["Hello"], "output": {"run_id": "broken"},
                            "generation": {"max_new_tokens": 3}})
    manifest = json.loads((tmp_path / "runs" / "broken" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "tracer could not start" in manifest["error"], manifest.get("status")
    shard = json.loads((tmp_path / "runs" / "broken" / "shards" / "shard-0-of-1.json").read_text())
    assert shard["status"] == "failed" and "tracer could not start" in shard["error"]
    assert not issubclass(RuntimeError, LmtraceError)  # an internal error: exit 1 from the CLI


def test_sigterm_while_loading_exits_3_and_writes_nothing(tmp_path, tiny_llama_dir):
    runs = tmp_path / "runs"
    proc = _start(["generate", str(_spec(tmp_path, tiny_llama_dir)), "--run-id", "early"], runs)
    time.sleep(1.5)  # importing torch and loading: far from the generation loop
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert err.strip().startswith("error: interrupted by signal 15") and "Traceback" not in err, err
    assert not (runs / "early" / "manifest.json").exists()
