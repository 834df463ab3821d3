"""`lmtrace generate SPEC --workers N`: one run as N shard processes on this machine.

One `lmtrace generate` runs torch on every core, but between two forwards its capture work (the
step's arrays, the token's statistics, the archive writer) runs mostly on one core. N shard
processes of the same run (`--shard I/N`), each with its share of the cores, overlap one process's
capture with another's forward: on 2 cores at batch 8 / 32 / 64, 1.10x / 1.12x / 1.00x the speed of
plain batched generation against 0.90x / 0.90x / 0.86x for one process (docs/batch.md, "Every core
of one machine").

Without `--workers`, `generate` runs a dataset this way by itself where that is faster
(`plan_default`): a model on the CPU, several CPUs, work enough to be worth a second process's
start and batches enough for every worker; `--workers 1` keeps one process. `--resume RUN` of a run
made by shard processes resumes each shard not complete the same way (`plan_default_resume`).

The workers are ordinary `lmtrace generate --shard I/N` processes: the run's files, locks,
completion and resume are the shards' own (docs/batch.md, "Shards and SLURM arrays"). This module
only checks the spec once, starts them with their thread counts, passes a signal on to each (they
run in their own process groups, so a terminal's Ctrl-C reaches them through here, once), follows
the run's progress through a callback (commands/workers_follow.py reads it from the run's log) and
returns the exit code the run deserves.
"""

from __future__ import annotations

import json
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


# `--workers auto`: the workers' models may take this share of the RAM available, the rest being for
# their batches (whose own budget, with batch_size: auto, is half of what is left once they are loaded)
MODELS_SHARE = 0.5
# `generate` without --workers splits a run only when its forwards are worth a second process's start
# (~1.5 s on 2 cores: 16 and 32 prompts of 16 tokens ran 1.4 s slower as two processes, 64 prompts 0.7 s
# faster): the model's parameters (`approx_parameters`) × the tokens to generate, at least SmolLM2-135M
# generating ~900 tokens (its 147.7 M counted from its config)
DEFAULT_MIN_WORK = 130 * 10**9
# ... and every worker gets at least this many batches of its own
DEFAULT_MIN_BATCHES = 2
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


def refuse_shard(shard: str | None) -> None:
    if shard is not None:
        raise SpecError(
            "--workers runs the shards itself: drop --shard (one shard by hand: "
            "lmtrace generate SPEC --run-id R --shard I/N)"
        )


def plan_new(
    spec_path: Path | None,
    overrides: list[str],
    workers: str,
    *,
    run_id,
    runs_dir,
    memory_budget,
    saes,
    chosen: tuple[int, str] | None = None,
) -> Plan:
    """A new run (or the run `run_id` continued, as `generate --run-id` does) as N shard processes;
    `chosen`: the count `plan_default` chose and why."""
    from ..archive.runs import new_run_id, runs_root

    if spec_path is None:
        raise SpecError("--workers needs a SPEC file (or --resume RUN_ID)")
    n = None if workers == "auto" else worker_count(workers)  # (a bad count is refused before the spec is read)
    spec = check_spec(spec_path, overrides, run_id, runs_dir)
    n, note = chosen or ((n, None) if n is not None else auto_workers(spec.model))
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
    note = f"shard{'s' if len(pending) > 1 else ''} {', '.join(str(i) for i in pending)} of {n} resumed"
    return Plan(rid, run_dir, [every[i] for i in pending], thread_env(n), n, note)


def plan_default(spec_path: Path | None, overrides: list[str], *, run_id, runs_dir, memory_budget, saes) -> Plan | None:
    """`generate SPEC` without --workers: the run as shard processes where that is faster
    (`default_workers`), else None (one process). A run `run_id` names that exists keeps the shards
    it was started with: those not complete continue, one worker each. A new run stays in one process
    when the environment sets OMP_NUM_THREADS (the caller chose the threads of one process). Other
    errors are left for the one-process path to report as it always does."""
    from ..archive.runs import read_manifest, runs_root
    from ..spec.run_spec import load_spec

    if spec_path is None:
        return None
    try:
        given = list(overrides) + ([f"output.run_id={json.dumps(run_id)}"] if run_id else [])
        spec, _, _ = load_spec(spec_path, given)
        rid = spec.output.run_id
        existing = runs_root(runs_dir, spec.output.runs_dir) / rid if rid else None
        if existing is not None and existing.is_dir():  # `--run-id R` of a run that exists: its own shards
            shards = read_manifest(existing).get("shards", 1)
            if shards < 2:
                return None
            chosen = (shards, f"run {rid} was started as {shards} shards")
            pending = unfinished_shards(existing, shards)
        else:
            chosen = None if os.environ.get("OMP_NUM_THREADS") else default_workers(spec)
            pending = None if chosen is None else list(range(chosen[0]))
        if chosen is None or not pending:
            return None  # (a complete run: the one-process path says so)
        plan = plan_new(
            spec_path,
            overrides,
            str(chosen[0]),
            run_id=run_id,
            runs_dir=runs_dir,
            memory_budget=memory_budget,
            saes=saes,
            chosen=chosen,
        )
    except Exception:  # noqa: BLE001 - one process, which reports the problem in its own words
        return None
    plan.commands = [plan.commands[i] for i in pending]
    return plan


def default_workers(spec) -> tuple[int, str] | None:
    """How many workers `generate` starts without --workers: for a run of DEFAULT_MIN_WORK or more
    on the CPU, as `--workers auto`, but no more than leaves each DEFAULT_MIN_BATCHES batches (with
    `batch_size: auto`, batches of a shard file's sequences); None for one process."""
    from ..runner.model_config import model_config
    from ..spec.prompts import load_prompts

    params = approx_parameters(model_config(spec.model)[2] or {})
    prompts = len(load_prompts(spec.prompts))
    if params is None or params * prompts * spec.generation.max_new_tokens < DEFAULT_MIN_WORK:
        return None
    if model_device(spec.model) != "cpu":  # (after the work: `device: auto` imports torch to tell)
        return None
    n, note = auto_workers(spec.model)
    size = spec.generation.batch_size
    batch = size if isinstance(size, int) else spec.output.chunk_sequences  # (auto: cut once loaded)
    batches = -(-prompts // batch)
    fit = min(n, batches // DEFAULT_MIN_BATCHES)
    if fit < 2:
        return None
    if fit < n:
        note = f"{prompts} prompts in {batches} batches: {DEFAULT_MIN_BATCHES} or more for each of {fit}"
    return fit, f"{note}; --workers 1 for one process"


def approx_parameters(cfg: dict) -> int | None:
    """About the parameters of a model from its config alone (no torch: a run too small to split
    decides within a second): each layer's attention (4 d²) and gated MLP (3 d d_ffn, or 8 d² without
    a d_ffn), and the embedding; 147.7 M for SmolLM2-135M's 134.5 M. None without the sizes."""
    from ..runner.model_config import model_sizes

    n_layers, _, d = model_sizes(cfg)
    if not (n_layers and d):
        return None
    ffn = cfg.get("intermediate_size") or cfg.get("n_inner")
    return n_layers * (4 * d * d + (3 * d * ffn if ffn else 8 * d * d)) + (cfg.get("vocab_size") or 0) * d


def plan_default_resume(resume: str, overrides: list[str], *, runs_dir, memory_budget) -> Plan | None:
    """`generate --resume RUN` without --workers or --shard: a run started as shard processes (its
    manifest's `shards`) has each unfinished shard resumed, as `--resume RUN --workers N`; None for a
    run of one process (or one that cannot be read: the one-process path says why)."""
    from ..archive.runs import find_run, read_manifest, runs_root

    try:
        shards = read_manifest(find_run(resume, runs_root(runs_dir))).get("shards", 1)
    except Exception:  # noqa: BLE001
        return None
    if shards < 2:
        return None
    return plan_resume(resume, overrides, runs_dir=runs_dir, memory_budget=memory_budget)


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
    from ..runner.model_config import preflight
    from ..spec.run_spec import load_spec

    given = list(overrides) + ([f"output.run_id={json.dumps(run_id)}"] if run_id else [])
    spec, _, _ = load_spec(spec_path, given)
    device = model_device(spec.model)
    if device != "cpu":
        raise SpecError(
            f"--workers splits a run over CPU processes; this spec runs the model on {device}: "
            "drop --workers, or set model.device: cpu"
        )
    preflight(spec, runs_dir)
    return spec


def model_device(model) -> str:
    """Where a spec's model runs: `cpu`, another device, or `device_map M` (placed by accelerate)."""
    device, device_map = str(model.device), model.device_map
    if device_map is not None:
        return f"device_map {device_map}"
    if device == "auto":
        import torch  # (only here: whether `auto` means a GPU)

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


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


def run_workers(commands: list[list[str]], env: dict[str, str], poll: Callable[[], None] | None = None):
    """Start the workers, wait for all of them, passing SIGINT and SIGTERM on; their exit codes.
    `poll` is called every POLL_S while they run (RunFollower.poll). Their stderr (a worker's error
    line) comes through this process's, so a progress bar stays whole; once a signal was passed on, a
    worker that stops as interrupted has its lines dropped: the caller says it once, for the run."""
    import threading

    procs: list[subprocess.Popen] = []
    signalled = threading.Event()
    held: dict[int, list[str]] = {}

    def send(signum):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    def pass_on(signum, _frame):
        signalled.set()
        send(signum)

    def relay(i: int, stream) -> None:
        for line in stream:
            if signalled.is_set():
                held.setdefault(i, []).append(line)
            else:
                sys.stderr.write(line)
                sys.stderr.flush()

    old = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    relays: list[threading.Thread] = []
    try:
        for i, cmd in enumerate(commands):
            # stdout (each prints the run id) discarded; stderr relayed
            p = subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
            procs.append(p)
            relays.append(threading.Thread(target=relay, args=(i, p.stderr), daemon=True))
            relays[-1].start()
        while any(p.poll() is None for p in procs):
            time.sleep(POLL_S)
            if poll is not None:
                poll()
    finally:
        send(signal.SIGTERM)  # an error here (not a signal) leaves no worker behind
        for p in procs:
            p.wait()
        for t in relays:
            t.join()
        for s, handler in old.items():
            signal.signal(s, handler)
    for i, p in enumerate(procs):
        if p.returncode != EXIT_INTERRUPTED:
            sys.stderr.writelines(held.get(i, []))
    return [p.returncode for p in procs]
