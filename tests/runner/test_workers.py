"""`lmtrace generate --workers N`: one run as N shard processes on this machine, equal to a
single-process run; a signal passed on to every worker, then `--resume --workers` completes it;
flags it cannot combine with refused in one line."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from lmtrace.archive.reader import Run
from tests.helpers.archives import assert_same_archive
from tests.helpers.cli import assert_one_line_error, run_cli, sampled_spec, start_cli


def _spec(tmp_path: Path, model: str, max_new_tokens: int) -> Path:
    return sampled_spec(tmp_path, model, max_new_tokens=max_new_tokens, batch_size=1)


def _wait_shards_writing(run_dir: Path, workers: int, timeout=180) -> bool:
    """Until every worker's heartbeat exists (each is generating)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(list((run_dir / "heartbeats").glob(f"shard-*-of-{workers}.json"))) == workers:
            return True
        time.sleep(0.05)
    return False


def test_workers_write_one_run_equal_to_a_single_process_run(tmp_path, tiny_llama_dir):
    spec = _spec(tmp_path, str(tiny_llama_dir), 12)
    runs = tmp_path / "runs"
    budget = ["--memory-budget", "64MiB"]
    out = run_cli(["generate", str(spec), "--workers", "2", "--run-id", "w", *budget], runs)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "w\n"  # -q: the run id alone, once
    single = run_cli(["generate", str(spec), "--run-id", "single", *budget], runs)
    assert single.returncode == 0, single.stderr
    run = Run(runs / "w")
    assert run.status == "complete"
    # the run's budget is shared by its two processes on this machine: 32 MiB each
    assert run.manifest["memory_budget"] == {"bytes": 32 * 2**20, "from": "generation.memory_budget", "workers": 2}
    assert Run(runs / "single").manifest["memory_budget"] == {"bytes": 64 * 2**20, "from": "generation.memory_budget"}
    assert {k: v["status"] for k, v in run.shard_status.items()} == {
        "shard-0-of-2": "complete",
        "shard-1-of-2": "complete",
    }
    assert_same_archive(Run(runs / "single"), run)
    again = run_cli(["generate", "--resume", "w", "--workers", "2"], runs)
    assert_one_line_error(again, 2, "run w is already complete")


@pytest.mark.slow
def test_a_signal_reaches_every_worker_and_resume_with_workers_completes_the_run(tmp_path, tiny_llama_dir):
    spec = _spec(tmp_path, str(tiny_llama_dir), 250)
    runs = tmp_path / "runs"
    proc = start_cli(["generate", str(spec), "--workers", "2", "--run-id", "w", "-q"], runs)
    assert _wait_shards_writing(runs / "w", 2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 3, err
    assert "lmtrace generate --resume w --workers 2" in err and "Traceback" not in err
    manifest = json.loads((runs / "w" / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    shards = {json.loads(p.read_text())["status"] for p in (runs / "w" / "shards").glob("*.json")}
    assert shards == {"interrupted"}  # both workers got the signal and stopped cleanly
    again = run_cli(["generate", "--resume", "w", "--workers", "2"], runs)
    assert again.returncode == 0, again.stderr
    ref = run_cli(["generate", str(spec), "--run-id", "ref"], runs)
    assert ref.returncode == 0, ref.stderr
    assert_same_archive(Run(runs / "ref"), Run(runs / "w"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "2", "--shard", "0/2"], "--workers runs the shards itself: drop --shard"),
        (["--workers", "2", "--lens"], "drop --lens"),
        (["--workers", "0"], "--workers 0: give a number of processes"),
        (["--workers", "two"], "--workers two: give a number of processes"),
    ],
)
def test_workers_refuse_what_they_cannot_do_in_one_line(tmp_path, tiny_llama_dir, args, message):
    spec = _spec(tmp_path, str(tiny_llama_dir), 4)
    out = run_cli(["generate", str(spec), *args], tmp_path / "runs")
    assert_one_line_error(out, 2, message)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_resume_with_workers_of_a_run_not_started_as_shards_is_refused(tmp_path, tiny_llama_dir):
    spec = _spec(tmp_path, str(tiny_llama_dir), 3)
    runs = tmp_path / "runs"
    assert run_cli(["generate", str(spec), "--run-id", "one"], runs).returncode == 0
    out = run_cli(["generate", "--resume", "one", "--workers", "2"], runs)
    assert_one_line_error(out, 2, "was not started as shards", "lmtrace generate --resume one")


def test_workers_auto_counts_the_cpus_and_as_many_models_as_half_the_ram_available_holds(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """One worker per CPU, capped by the copies of the model (its parameters as transformers loads
    them, plus a process's own memory) that half the RAM available holds."""
    from transformers import AutoModelForCausalLM

    from lmtrace.commands import workers
    from lmtrace.spec.run_spec import load_spec

    model = load_spec(_spec(tmp_path, str(tiny_llama_dir), 4))[0].model
    loaded = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype="float32")
    weights = sum(p.numel() * p.element_size() for p in loaded.parameters())
    each = weights + workers.PROCESS_OVERHEAD
    assert workers.worker_bytes(model) == each
    monkeypatch.setattr(workers, "available_cpus", lambda: 64)
    monkeypatch.setattr("lmtrace.runner.batching.available_ram", lambda: 7 * each)
    n, note = workers.auto_workers(model)
    assert n == 3, note  # half of 7 copies' worth
    assert note.startswith("64 CPUs, but 50% of the ") and " of RAM available holds 3 of ~" in note, note
    monkeypatch.setattr("lmtrace.runner.batching.available_ram", lambda: 200 * each)
    assert workers.auto_workers(model) == (64, "one per CPU")
    monkeypatch.setattr("lmtrace.runner.batching.available_ram", lambda: each // 4)
    assert workers.auto_workers(model)[0] == 1  # never fewer than one
