"""`lmtrace generate --workers N`: one run as N shard processes on this machine, equal to a
single-process run; a signal passed on to every worker, then `--resume` completes it; chosen by
`generate` itself for a dataset on the CPU worth it; reported as one process reports a run."""

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
from lmtrace.commands.workers_follow import RunFollower
from lmtrace.output.progress import Progress
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
    again = run_cli(["generate", str(spec), "--run-id", "w", *budget], runs)  # its shards: none left to run
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
    assert "resume it with `lmtrace generate --resume w`" in err and "Traceback" not in err
    manifest = json.loads((runs / "w" / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    shards = {json.loads(p.read_text())["status"] for p in (runs / "w" / "shards").glob("*.json")}
    assert shards == {"interrupted"}  # both workers got the signal and stopped cleanly
    # what the command's progress reads of a resumed run: the sequences found done, then only the
    # batches the resume adds to the log (the interrupted run's own batch_done lines counted once)
    seen = {"start": None, "sequences": 0, "tokens": 0}
    progress = Progress(
        start=lambda n, steps: seen.update(start=(n, steps)),
        advance=lambda tokens: seen.update(tokens=seen["tokens"] + tokens),
        sequences_done=lambda n, tokens: seen.update(sequences=seen["sequences"] + n),
    )
    follower = RunFollower(runs / "w", progress, fresh=False)
    follower.poll()
    assert seen["start"] == (3, 250) and seen["sequences"] < 3, seen
    again = run_cli(["generate", "--resume", "w"], runs)  # its two shards, each resumed by a worker
    assert again.returncode == 0, again.stderr
    assert again.stdout == "w\n"
    follower.poll()
    assert seen["sequences"] == 3 and seen["tokens"] > 0, seen
    ref = run_cli(["generate", str(spec), "--run-id", "ref"], runs)
    assert ref.returncode == 0, ref.stderr
    assert_same_archive(Run(runs / "ref"), Run(runs / "w"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "2", "--shard", "0/2"], "--workers runs the shards itself: drop --shard"),
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


def _dataset_spec(tmp_path: Path, model: str, prompts: int, **generation) -> Path:
    spec = {
        "model": model,
        "prompts": [f"Prompt number {i}:" for i in range(prompts)],
        "generation": {"temperature": 0.9, "seed": 5, "eos_token_id": 0, **generation},
        "output": {"chunk_steps": 4},
    }
    path = tmp_path / "dataset.yaml"
    path.write_text(json.dumps(spec))
    return path


def test_generate_runs_a_dataset_worth_it_as_shard_processes_and_reports_it_as_one_process_would(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """Without --workers, a run of enough work on the CPU is split into one worker per CPU (here the
    threshold is lowered to the tiny model's run); the user sees what one process shows: the
    progress lines, the JSON summary, the lens computed after it; the archive equals one process's."""
    from typer.testing import CliRunner

    from lmtrace.archive.runs import lens_state
    from lmtrace.cli import app
    from lmtrace.commands import workers

    spec = _dataset_spec(tmp_path, str(tiny_llama_dir), 4, max_new_tokens=6, batch_size=1)
    runs = tmp_path / "runs"
    monkeypatch.setattr(workers, "DEFAULT_MIN_WORK", 1)
    monkeypatch.setattr(workers, "available_cpus", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LMTRACE_PROGRESS_EVERY", "0")
    args = ["generate", str(spec), "--run-id", "d", "--runs-dir", str(runs), "--log-json", "--lens"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    events = [json.loads(line) for line in out.stderr.splitlines()]
    first = events[0]
    assert first["event"] == "workers" and (first["workers"], first["torch_threads"]) == (2, 1), first
    assert "(one per CPU; --workers 1 for one process)" in first["message"], first
    assert {"event": "start", "prompts": 4, "max_new_tokens": 6}.items() <= events[1].items(), events[1]
    progress = [e for e in events if e["event"] == "progress"]
    assert (progress[-1]["sequences_done"], progress[-1]["tokens"]) == (4, 24), progress  # every batch logged
    finished = events[-1]
    assert (finished["event"], finished["run_id"], finished["status"], finished["sequences"]) == (
        "finished",
        "d",
        "complete",
        4,
    )
    assert finished["generated_tokens"] == 24 and finished["lens"]["computed"], finished
    assert out.stdout.startswith("run d: complete, 4 sequence(s), 24 tokens in "), out.stdout
    assert "logit lens computed" in out.stdout, out.stdout
    run = Run(runs / "d")
    assert run.manifest["shards"] == 2 and lens_state(run.manifest) == "ready", run.manifest["lens"]
    single = run_cli(["generate", str(spec), "--run-id", "single", "--workers", "1"], runs)
    assert single.returncode == 0, single.stderr
    assert Run(runs / "single").manifest["shards"] == 1
    for table in ("tokens", "steps", "sequences"):  # (the lens added its columns to the steps)
        want = Run(runs / "single").table(table).to_pandas()
        assert want.equals(run.table(table).to_pandas()[list(want.columns)]), table


def test_generate_keeps_one_process_below_the_work_or_the_batches_two_workers_need(tmp_path, monkeypatch):
    """The default count on the embedded model and 2 CPUs: two workers from 1,024 tokens to generate
    with two batches each; one process below that, with OMP_NUM_THREADS set, or for a GPU."""
    from lmtrace.commands import workers
    from lmtrace.spec.run_spec import load_spec

    monkeypatch.setattr(workers, "available_cpus", lambda: 2)
    monkeypatch.setattr("lmtrace.runner.batching.available_ram", lambda: 64 * 2**30)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def count(prompts, **generation):
        spec = load_spec(_dataset_spec(tmp_path, "embedded:smollm2-135m", prompts, **generation))[0]
        chosen = workers.default_workers(spec)
        return None if chosen is None else chosen[0]

    assert count(64, max_new_tokens=16, batch_size=8) == 2
    assert count(256, max_new_tokens=16, batch_size=64) == 2
    assert count(32, max_new_tokens=16, batch_size=8) is None  # 512 tokens: not worth a second process
    assert count(256, max_new_tokens=16, batch_size=128) is None  # two batches: one each would idle
    assert count(256, max_new_tokens=16, batch_size="auto") == 2  # batches of a shard file's 32 sequences
    plan = dict(run_id=None, runs_dir=str(tmp_path / "runs"), memory_budget=None, saes=[])
    spec = _dataset_spec(tmp_path, "embedded:smollm2-135m", 64, max_new_tokens=16, batch_size=8)
    assert workers.plan_default(spec, [], **plan).shards == 2
    assert workers.plan_default(spec, ["model.device=cuda"], **plan) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert workers.plan_default(spec, [], **plan) is None
    # a run too small to split is told from the model's config alone: no torch before the run's own import
    small = _dataset_spec(tmp_path, "embedded:smollm2-135m", 8, max_new_tokens=16, batch_size=2)
    code = (
        "import sys\nfrom lmtrace.commands import workers\n"
        f"assert workers.plan_default({str(small)!r}, [], run_id=None, runs_dir=None, memory_budget=None, saes=[]) is None\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_command_follows_the_workers_log_once_per_batch_and_not_the_batches_before_it(tmp_path):
    """RunFollower against a log written by hand: a resumed run's earlier batch_done lines are not
    counted again (the sequences found done come from the run's progress files, here none), a line
    still being written waits for its end, and a new run's log is read from its start."""
    from lmtrace.archive import layout

    run = tmp_path / "run"
    run.mkdir()
    (run / layout.MANIFEST).write_text(json.dumps({"shape": {"n_sequences": 3, "n_steps": 5}, "n_prompts": 3}))
    log = run / layout.LOG

    def done(seqs, tokens, end="\n"):
        with log.open("a") as fh:
            fh.write(json.dumps({"event": "batch_done", "sequences": seqs, "tokens": tokens}) + end)

    done([0], 5)  # before the command started

    def follow(fresh):
        seen = {"start": None, "sequences": 0, "tokens": 0}
        progress = Progress(
            start=lambda n, steps: seen.update(start=(n, steps)),
            advance=lambda tokens: seen.update(tokens=seen["tokens"] + tokens),
            sequences_done=lambda n, tokens: seen.update(sequences=seen["sequences"] + n),
        )
        return RunFollower(run, progress, fresh=fresh), seen

    follower, seen = follow(fresh=False)
    follower.poll()
    assert seen == {"start": (3, 5), "sequences": 0, "tokens": 0}
    done([1], 4)
    with log.open("a") as fh:
        fh.write('{"event": "batch_done", "seq')  # half a line: the writer is still at it
    follower.poll()
    assert (seen["sequences"], seen["tokens"]) == (1, 4)
    with log.open("a") as fh:
        fh.write('uences": [2], "tokens": 3}\n')
    follower.poll()
    follower.poll()
    assert (seen["sequences"], seen["tokens"]) == (2, 7)
    fresh, seen = follow(fresh=True)  # a run the workers created: every batch in its log is theirs
    fresh.poll()
    assert (seen["start"], seen["sequences"], seen["tokens"]) == ((3, 5), 3, 12)
