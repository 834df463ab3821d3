"""`lmtrace generate SPEC --workers N`: one run as N shard processes on this machine.

One `lmtrace generate` runs torch on every core, but between two forwards its capture work (the
step's arrays, the token's statistics, the archive writer) runs mostly on one core. N shard
processes of the same run (`--shard I/N`), each with its share of the cores, overlap one process's
capture with another's forward: on 2 cores at batch 8 / 32 / 64, 1.10x / 1.12x / 1.00x the speed of
plain batched generation against 0.90x / 0.90x / 0.86x for one process (docs/batch.md, "Every core
of one machine").

The workers are ordinary `lmtrace generate --shard I/N` processes: the run's files, locks,
completion and resume are the shards' own (docs/batch.md, "Shards and SLURM arrays"). This module
only checks the spec once, starts them with their thread counts, passes a signal on to each (they
run in their own process groups, so a terminal's Ctrl-C reaches them through here, once), reports
the run's progress and returns the exit code the run deserves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..exits.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_PARTIAL_SHARDS, SpecError

POLL_S = 0.2
REPORT_S = 15.0  # a progress line on stderr this often (not with --quiet)


# `--workers auto`: the workers' models may take this share of the RAM available, the rest being for
# their batches (whose own budget, with batch_size: auto, is half of what is left once they are loaded)
MODELS_SHARE = 0.5
# what a worker holds beside its weights before its first batch: Python, torch, transformers and the
# tokenizer (~500 MiB with SmolLM2-135M on the CPU: 1,014 MiB at generation start, 513 MiB of it weights)
PROCESS_OVERHEAD = 512 * 2**20


@dataclass
class Plan:
    """What `generate --workers` starts: the run's id and directory, one command per worker, their
    environment, the run's shard count, and how `--workers auto` chose that count (None for N)."""

    run_id: str
    run_dir: Path
    commands: list[list[str]]
    env: dict[str, str]
    shards: int
    note: str | None = None


def refuse(flags: dict[str, object]) -> None:
    given = [flag for flag, value in flags.items() if value]
    if given:
        raise SpecError(
            f"--workers runs the shards itself: drop {', '.join(given)} (one shard by hand: "
            "lmtrace generate SPEC --run-id R --shard I/N)"
        )


def plan_new(
    spec_path: Path | None, overrides: list[str], workers: str, *, run_id, runs_dir, memory_budget, saes
) -> Plan:
    """A new run (or the run `run_id` continued, as `generate --run-id` does) as N shard processes."""
    from ..archive.runs import new_run_id, runs_root

    if spec_path is None:
        raise SpecError("--workers needs a SPEC file (or --resume RUN_ID)")
    n = None if workers == "auto" else worker_count(workers)  # (a bad count is refused before the spec is read)
    spec = check_spec(spec_path, overrides, run_id, runs_dir)
    n, note = (n, None) if n is not None else auto_workers(spec.model)
    rid = spec.output.run_id or new_run_id()
    commands = worker_commands(
        spec_path, rid, n, overrides=overrides, runs_dir=runs_dir, memory_budget=memory_budget, saes=saes
    )
    return Plan(rid, runs_root(runs_dir, spec.output.runs_dir) / rid, commands, thread_env(n), n, note)


def plan_resume(resume: str, overrides: list[str], *, runs_dir, memory_budget) -> Plan:
    """The shards of a sharded run that are not complete, each resumed on its original share of the CPUs."""
    from ..archive.runs import find_run, runs_root

    run_dir = find_run(resume, runs_root(runs_dir))
    rid, n = run_dir.name, shards_of(run_dir)
    pending = unfinished_shards(run_dir, n)
    if not pending:
        raise SpecError(f"run {rid} is already complete in {run_dir.parent}; nothing to resume")
    every = resume_commands(rid, n, overrides=overrides, runs_dir=runs_dir, memory_budget=memory_budget)
    return Plan(rid, run_dir, [every[i] for i in pending], thread_env(n), n)


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_count(text: str) -> int:
    """`--workers N`: the count N (`auto` is `auto_workers`, once the spec is known)."""
    from ..runner.batching import positive_int

    n = positive_int(text)
    if n is None:
        raise SpecError(f"--workers {text}: give a number of processes (1 or more) or `auto` (one per CPU)")
    return n


def auto_workers(model) -> tuple[int, str]:
    """`--workers auto` for a spec's model: one worker per CPU, but no more than the RAM available
    holds copies of the model in MODELS_SHARE of it; and the words that say which."""
    from ..archive.runs import human_bytes
    from ..runner.batching import available_ram

    cpus = available_cpus()
    each, free = worker_bytes(model), available_ram()
    if each is None or free is None:
        return cpus, "one per CPU; the model's size could not be told beforehand"
    fit = max(1, int(free * MODELS_SHARE) // each)
    if fit >= cpus:
        return cpus, "one per CPU"
    return fit, (
        f"{cpus} CPUs, but {MODELS_SHARE:.0%} of the {human_bytes(free)} of RAM available holds {fit} "
        f"of ~{human_bytes(each)}: the model and a process"
    )


def worker_bytes(model) -> int | None:
    """What one worker holds before its first batch: the model's parameters in the dtype it loads them
    in (counted on torch's meta device: no weights read) and PROCESS_OVERHEAD; None where the model's
    class cannot be built from its config here."""
    import torch

    from ..runner.models import load_config, resolve_dtype

    try:
        from transformers import AutoModelForCausalLM

        config = load_config(model)
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(config, trust_remote_code=model.trust_remote_code)
        dtype = resolve_dtype(model.dtype, torch.device("cpu"))
    except Exception:  # noqa: BLE001 - any failure: the count falls back to the CPUs, and the run says why it fails
        return None
    return sum(p.numel() for p in built.parameters()) * dtype.itemsize + PROCESS_OVERHEAD


def thread_env(workers: int) -> dict[str, str]:
    """The workers' environment: torch's threads split between them, unless the caller chose a count,
    and the run's memory budget split between them (batching.WORKERS_ENV)."""
    from ..runner.batching import WORKERS_ENV

    env = dict(os.environ)
    threads = str(max(1, available_cpus() // workers))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, threads)
    env[WORKERS_ENV] = str(workers)
    return env


def check_spec(spec_path: Path, overrides: list[str], run_id: str | None, runs_dir: str | None):
    """The spec as the workers will load it (every check that needs no weights, done once here); a
    CUDA model is refused: the workers would share its GPU memory, and its forward is not the bottleneck."""
    import json

    from ..runner.model_config import preflight
    from ..spec.run_spec import load_spec

    given = list(overrides) + ([f"output.run_id={json.dumps(run_id)}"] if run_id else [])
    spec, _, _ = load_spec(spec_path, given)
    device, device_map = str(spec.model.device), spec.model.device_map
    if device == "auto" and device_map is None:
        import torch  # (only here: whether `auto` means a GPU)

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" or device_map is not None:
        raise SpecError(
            f"--workers splits a run over CPU processes; this spec runs the model on {device_map or device}: "
            "drop --workers, or set model.device: cpu"
        )
    preflight(spec, runs_dir)
    return spec


def worker_commands(
    spec_path: Path, run_id: str, workers: int, *, overrides: list[str], runs_dir: str | None, memory_budget, saes
) -> list[list[str]]:
    """`generate SPEC --run-id R --shard I/N` for each worker, with the caller's options."""
    base = ["generate", str(spec_path), "--run-id", run_id, *(a for d in saes for a in ("--sae", d))]
    return _per_shard(base, workers, overrides, runs_dir, memory_budget)


def _per_shard(args: list[str], workers: int, overrides, runs_dir, memory_budget) -> list[list[str]]:
    """`lmtrace ARGS -q` with --set, --runs-dir and --memory-budget as given, and each `--shard I/N`."""
    base = [sys.executable, "-m", "lmtrace", *args, "-q", *(a for item in overrides for a in ("--set", item))]
    if runs_dir is not None:
        base += ["--runs-dir", runs_dir]
    if memory_budget is not None:
        base += ["--memory-budget", memory_budget]
    return [base + ["--shard", f"{i}/{workers}"] for i in range(workers)]


def shards_of(run_dir: Path) -> int:
    """How many shards a run was started with (its manifest's `shards`), for `--resume --workers`."""
    from ..archive.runs import read_manifest

    n = read_manifest(run_dir).get("shards", 1)
    if n < 2:
        raise SpecError(
            f"run {run_dir.name} was not started as shards (--workers or --shard): resume it with "
            f"`lmtrace generate --resume {run_dir.name}`"
        )
    return n


def unfinished_shards(run_dir: Path, workers: int) -> list[int]:
    """The shards of a run that are not complete (no status yet counts as not complete)."""
    from ..archive.rundir import RunDir, Shard

    return [i for i, status in RunDir(run_dir, Shard(0, workers)).shard_statuses().items() if status != "complete"]


def resume_commands(
    run_id: str, workers: int, *, overrides: list[str], runs_dir: str | None, memory_budget
) -> list[list[str]]:
    """Each shard of run `run_id` resumed (`generate --resume R --shard I/N`), in order."""
    return _per_shard(["generate", "--resume", run_id], workers, overrides, runs_dir, memory_budget)


def exit_code(codes: list[int]) -> int:
    """The run's exit code from its workers': 0 when all are; else a worker's own failure (its
    one-line error is on stderr), interruption before `partial shard failure` (4: a worker that
    finished while another did not)."""
    failed = [c for c in codes if c not in (EXIT_OK, EXIT_PARTIAL_SHARDS)]
    if not failed:
        return EXIT_PARTIAL_SHARDS if EXIT_PARTIAL_SHARDS in codes else EXIT_OK
    others = [c for c in failed if c != EXIT_INTERRUPTED]
    return others[0] if others else EXIT_INTERRUPTED


def run_workers(commands: list[list[str]], env: dict[str, str], run_dir: Path, report: Callable[[str], None] | None):
    """Start the workers, wait for all of them, passing SIGINT and SIGTERM on; their exit codes."""
    procs: list[subprocess.Popen] = []

    def pass_on(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for cmd in commands:
            # stdout (each prints the run id) discarded; stderr (a worker's error line) as it is
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, start_new_session=True))
        last = time.monotonic()
        while any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
            if report is not None and time.monotonic() - last >= REPORT_S:
                last = time.monotonic()
                report(progress_line(run_dir, len(procs)))
    finally:
        pass_on(signal.SIGTERM, None)  # an error here (not a signal) leaves no worker behind
        for p in procs:
            p.wait()
        for s, handler in old.items():
            signal.signal(s, handler)
    return [p.returncode for p in procs]


def progress_line(run_dir: Path, workers: int) -> str:
    from ..archive import layout
    from ..archive.summary import progress_label, run_summary

    if not (run_dir / layout.MANIFEST).is_file():
        return f"{workers} workers loading the model"
    r = run_summary(run_dir, size=False)
    shards = f", {r['shards_complete']} shards done" if r.get("shards_complete") else ""
    return f"{run_dir.name}: {progress_label(r) or r['status']}{shards} ({workers} workers)"
