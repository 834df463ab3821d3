"""lmtrace at scale: many short prompts with metadata, default capture, the embedded model (issue 33's benchmark).

Builds a prompt file (`prompts.jsonl`: N short prompts from a few templates filled in by a seeded
generator, with metadata columns `id`, `label`, `template`), then generates --tokens tokens for each
(`generation.eos_token_id: []`: no sequence stops early), default capture, greedy:
  - batch 1 on a subset (--batch1-prompts, 50 by default: batch 1 is the slow case), batch 8, 32 and
    `auto` (generation.memory_budget --memory-budget) on all N, and batch 64; batch 8, 32, 64 and auto each --repeats
    times (3), paired with the batched floor: plain `model.generate` in a child process (the model
    loaded by lmtrace's loader, not timed) on the same prompt ids in the same batches (the run's plan), left
    padding, greedy, exactly --tokens new tokens, no capture; each pair's ratio is the floor's seconds
    / the run's `generate_s`, the order alternating per repeat, and the median is reported;
    for each: tok/s of generation (the
    manifest's own `timings.tokens_per_s`, model load and finalising excluded) and of the whole process,
    files in the run (`find -type f | wc -l`), bytes on disk per generated token, and the generate
    process's peak RSS (its own `ru_maxrss`, from wait4);
  - batch 32 (--shards-batch: a number, or auto with --memory-budget shared by the two) as two
    `lmtrace generate --shard I/2` processes of one run started together, one torch thread each
    (OMP_NUM_THREADS=1 and LMTRACE_WORKERS=2: what `generate --workers 2` starts on 2 CPUs), paired
    with the floor like the single-process runs (the run's time: the slower shard's `generate_s`;
    peak RSS: both processes');
  - batch 8 again on N / 5 prompts: peak RSS at two N (flat in the number of prompts);
  - the batch-8 run as a 4-task SLURM array (`sbatch --array=0-3`, `lmtrace generate --shard auto`,
    one torch thread a task) on the one-node local cluster (scripts/slurm-cluster.sh), from submission
    to the run `complete`, against the batch-8 single process (needs root and the SLURM packages;
    otherwise the part says why it was skipped);
  - on the batch-8 run of N prompts (--tools-run: another of the runs above): how long `lmtrace ls` (the bench's runs directory), `lmtrace heads
    RUN` and `lmtrace report RUN` take (whole processes, Python's start included), and `lmtrace serve`'s
    run page in headless Chromium (bench/serve_bench.py's server and browser): the sequences list drawn
    on the first load after the server starts and on a second load.

    .venv/bin/python bench/scale_bench.py [--prompts 1000] [--tokens 16] [--repeats 3] [--runs-dir DIR]
                                          [--only PART ...] [--out bench/results/scale.json]

PART: batch8, tools, batch1, batch32, batch64, auto, shards2, small, slurm, run in this order (slurm needs the batch-8
run, tools the run --tools-run names: made by its part, or found in --runs-dir). The JSON is written
after every part. At 10,000 prompts: `--prompts 10000 --only batch32 --only tools --tools-run batch32`
(tools then run after batch32).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import MODEL, REPO, Server, browse, run_facts

sys.path.insert(0, str(REPO))  # the floor loads the model with this tree's lmtrace

PARTS = ("batch8", "tools", "batch1", "batch32", "batch64", "auto", "shards2", "small", "slurm")

# ---- the prompts --------------------------------------------------------------------------------
# Short prompts of a few kinds, each kind a template filled from word lists; `label` is the kind,
# `template` the template's name (several per label), so metadata columns have a few values each.
SUBJECTS = [
    "the river",
    "a lighthouse",
    "the old library",
    "a small robot",
    "the mountain village",
    "a violin",
    "the northern forest",
    "a train station",
    "the harbour",
    "a winter garden",
    "the desert road",
    "a clock tower",
]
COUNTRIES = [
    "France",
    "Japan",
    "Brazil",
    "Canada",
    "Egypt",
    "Norway",
    "Kenya",
    "Peru",
    "India",
    "Italy",
    "Chile",
    "Spain",
]
WORDS = ["hot", "early", "bright", "empty", "strong", "quiet", "open", "heavy", "young", "narrow", "wet", "fast"]
TEMPLATES = {
    "story/short": ("story", "Write a short story about {subject}."),
    "story/opening": ("story", "Once upon a time, {subject}"),
    "fact/capital": ("fact", "The capital of {country} is"),
    "fact/question": ("fact", "Question: What language is spoken in {country}? Answer:"),
    "arith/plus": ("arithmetic", "{a} + {b} ="),
    "arith/words": ("arithmetic", "What is {a} times {b}?"),
    "antonym/plain": ("antonym", "The opposite of {word} is"),
    "list/facts": ("list", "List three facts about {subject}:"),
}


def prompt_rows(n: int, seed: int = 0) -> list[dict]:
    """n prompt rows {id, prompt, label, template}: a seeded choice of template and fillers, so the same
    n and seed always give the same file."""
    rng = random.Random(seed)
    names = sorted(TEMPLATES)
    rows = []
    for i in range(n):
        name = rng.choice(names)
        label, text = TEMPLATES[name]
        prompt = text.format(
            subject=rng.choice(SUBJECTS),
            country=rng.choice(COUNTRIES),
            word=rng.choice(WORDS),
            a=rng.randint(2, 99),
            b=rng.randint(2, 99),
        )
        rows.append({"id": i, "prompt": prompt, "label": label, "template": name})
    return rows


def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(n)))
    return path


def write_spec(path: Path, prompts: Path, tokens: int, batch: int | str, budget: str | None) -> Path:
    generation = {"max_new_tokens": tokens, "temperature": 0.0, "seed": 0, "eos_token_id": [], "batch_size": batch}
    if budget is not None:
        generation["memory_budget"] = budget
    # default capture: no `capture` key
    path.write_text(
        json.dumps(
            {"model": MODEL, "prompts": {"file": str(prompts), "column": "prompt"}, "generation": generation}, indent=1
        )
    )
    return path


# ---- measuring a run ------------------------------------------------------------------------------
def lmtrace_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lmtrace", *args]


def bench_env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **extra}


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Run cmd; its wall time, exit code, stderr's tail and peak RSS (the child's own ru_maxrss from wait4:
    the kernel's high-water mark of that process, not of its siblings)."""
    import threading

    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env or bench_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # the pipes are drained on threads (not communicate(), whose wait() would race wait4 for the child)
    out: dict = {}
    readers = [
        threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f.read()), daemon=True)
        for k, f in (("stdout", proc.stdout), ("stderr", proc.stderr))
    ]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    for r in readers:
        r.join()
    return {
        "seconds": round(time.perf_counter() - t0, 2),
        "rc": proc.returncode,
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "stdout": out.get("stdout", ""),
        "stderr_tail": out.get("stderr", "")[-2000:],
    }


def archive_facts(run_dir: Path) -> dict:
    files = [f for f in run_dir.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    tokens = int(manifest["n_generated_tokens"])
    return {
        "files": len(files),
        "bytes": size,
        "generated_tokens": tokens,
        "bytes_per_token": round(size / max(tokens, 1)),
        "timings": manifest.get("timings", {}),
        "pace": batch_pace(run_dir),
        "batches": batch_sizes(run_dir),
    }


def batch_pace(run_dir: Path) -> dict:
    """Seconds between consecutive `batch_done` events (log.jsonl) and the tok/s of the median batch: the
    steady rate, which stalls on a shared machine (another process taking the cores) do not move."""
    import statistics

    done = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if '"batch_done"' in line]
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(done)]
    if not gaps:
        return {}
    median = statistics.median(gaps)
    tokens = statistics.median(b["tokens"] for b in done[1:])
    return {
        "batch_s_median": round(median, 3),
        "batch_s_max": round(max(gaps), 2),
        "tok_s_median_batch": round(tokens / median, 1),
    }


def batch_sizes(run_dir: Path) -> dict:
    """The sizes of the batches the run planned (progress/*.plan.jsonl): {size: count}, splits included."""
    sizes: dict[int, int] = {}
    for plan in sorted((run_dir / "progress").glob("*.plan.jsonl")):
        for line in plan.read_text().splitlines():
            if line.strip():
                n = len(json.loads(line)["sequences"])
                sizes[n] = sizes.get(n, 0) + 1
    return {str(k): v for k, v in sorted(sizes.items())}


def generate(runs: Path, specs: Path, name: str, prompts: Path, tokens: int, batch, budget=None) -> dict:
    """One single-process `lmtrace generate --workers 1` of the bench's own run id `name` (an earlier one
    removed first)."""
    spec = write_spec(specs / f"{name}.json", prompts, tokens, batch, budget)
    return generate_spec(runs, spec, name, prompts, batch, budget)


def generate_spec(runs: Path, spec: Path, name: str, prompts: Path, batch, budget=None) -> dict:
    if (runs / name).exists():
        shutil.rmtree(runs / name)
    print(f"[{time.strftime('%H:%M:%S')}] generate {name} (batch {batch})", file=sys.stderr, flush=True)
    argv = ["generate", str(spec), "--run-id", name, "--runs-dir", str(runs), "--workers", "1", "-q"]
    m = run_measured(lmtrace_cmd(*argv))
    if m["rc"] != 0:
        raise SystemExit(f"lmtrace generate {name} failed (exit {m['rc']}): {m['stderr_tail']}")
    facts = archive_facts(runs / name)
    t = facts["timings"]
    return {
        "run_id": name,
        "batch_size": batch,
        "memory_budget": budget,
        "prompts": sum(1 for _ in prompts.open()),
        "process_s": m["seconds"],
        "peak_rss_mib": m["peak_rss_mib"],
        "tok_s_generation": t.get("tokens_per_s"),
        "tok_s_process": round(facts["generated_tokens"] / m["seconds"], 2),
        **{k: facts[k] for k in ("files", "bytes", "generated_tokens", "bytes_per_token", "batches", "pace")},
        "model_load_s": t.get("model_load_s"),
        "generate_s": t.get("generate_s"),
        "finalize_s": t.get("finalize_s"),
    }


def generate_sharded(runs: Path, spec: Path, name: str, prompts: Path, batch, shards: int) -> dict:
    """One run as `shards` `lmtrace generate --shard I/N` processes started together on this machine,
    each with one torch thread (OMP_NUM_THREADS=1): the run's generation time is the slower shard's
    `generate_s` (shards/<shard>.json; model load and finalising excluded, as for one process); peak
    RSS is the shards' together (each its own ru_maxrss)."""
    from concurrent.futures import ThreadPoolExecutor

    if (runs / name).exists():
        shutil.rmtree(runs / name)
    print(
        f"[{time.strftime('%H:%M:%S')}] generate {name} (batch {batch}, {shards} shard processes)",
        file=sys.stderr,
        flush=True,
    )
    # what `generate --workers N` gives its workers: one thread each on 2 CPUs, the memory budget split N ways
    env = bench_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", LMTRACE_WORKERS=str(shards))
    cmds = [
        lmtrace_cmd("generate", str(spec), "--run-id", name, "--runs-dir", str(runs), "--shard", f"{i}/{shards}", "-q")
        for i in range(shards)
    ]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(shards) as pool:
        measured = list(pool.map(lambda cmd: run_measured(cmd, env), cmds))
    seconds = time.perf_counter() - t0
    for i, m in enumerate(measured):
        if m["rc"] != 0:
            raise SystemExit(
                f"lmtrace generate {name} --shard {i}/{shards} failed (exit {m['rc']}): {m['stderr_tail']}"
            )
    facts = archive_facts(runs / name)
    shard_s = [
        json.loads((runs / name / "shards" / f"shard-{i}-of-{shards}.json").read_text())["generate_s"]
        for i in range(shards)
    ]
    generate_s = max(shard_s)
    return {
        "run_id": name,
        "batch_size": batch,
        "shards": shards,
        "prompts": sum(1 for _ in prompts.open()),
        "process_s": round(seconds, 2),
        "peak_rss_mib": round(sum(m["peak_rss_mib"] for m in measured), 1),
        "tok_s_generation": round(facts["generated_tokens"] / generate_s, 3),
        "tok_s_process": round(facts["generated_tokens"] / seconds, 2),
        **{k: facts[k] for k in ("files", "bytes", "generated_tokens", "bytes_per_token", "batches")},
        "shard_generate_s": shard_s,
        "generate_s": generate_s,
        "default_workers": default_workers(spec),
    }


def default_workers(spec: Path) -> int:
    """The processes `lmtrace generate SPEC` (no --workers) starts for this spec on this machine."""
    from lmtrace.commands import workers
    from lmtrace.spec.run_spec import load_spec

    chosen = workers.default_workers(load_spec(spec)[0])
    return 1 if chosen is None else chosen[0]


# ---- the batched floor, paired with lmtrace ---------------------------------------------------------
class Floor:
    """Plain batched generation: the same model as lmtrace loads it (lmtrace's own loader, so the
    same dtype and weights), the same prompt ids (the spec's prompts rendered as lmtrace renders
    them), the same batches (the lmtrace run's plan), left padding, sdpa, `model.generate` greedy
    with exactly the run's number of new tokens and no capture. Each measurement is a fresh child
    process (`--floor-child`), as each `lmtrace generate` is, so both start equally cold; the model
    load is not timed (nor is it in lmtrace's `generate_s`)."""

    def __init__(self):
        self.loaded = None

    def measured(self, spec_path: Path, batches: list[list[int]], tokens: int, tmp: Path) -> dict:
        plan = tmp / "floor-batches.json"
        plan.write_text(json.dumps(batches))
        m = run_measured(
            [sys.executable, str(Path(__file__).resolve()), "--floor-child", str(spec_path), str(plan), str(tokens)]
        )
        if m["rc"] != 0:
            raise SystemExit(f"the batched floor failed (exit {m['rc']}): {m['stderr_tail']}")
        return json.loads(m["stdout"].strip().splitlines()[-1])

    def seconds(self, spec_path: Path, batches: list[list[int]], tokens: int) -> dict:
        import torch

        from lmtrace.runner.models import load_model
        from lmtrace.spec.prompts import load_prompts_and_metadata, render_prompts
        from lmtrace.spec.run_spec import load_spec

        spec = load_spec(spec_path)[0]
        if self.loaded is None:
            self.loaded = load_model(spec.model)
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        prompts, _ = load_prompts_and_metadata(spec.prompts)
        _, ids = render_prompts(tokenizer, prompts, spec.prompts.chat, spec.prompts.system)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        device = self.loaded.device
        generated = 0
        with torch.inference_mode():
            t0 = time.perf_counter()
            for seqs in batches:
                width = max(len(ids[s]) for s in seqs)
                input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
                mask = torch.zeros((len(seqs), width), dtype=torch.long)
                for row, s in enumerate(seqs):  # left padding, as lmtrace pads its batches
                    input_ids[row, width - len(ids[s]) :] = torch.tensor(ids[s], dtype=torch.long)
                    mask[row, width - len(ids[s]) :] = 1
                out = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=mask.to(device),
                    do_sample=False,
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    pad_token_id=pad,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                )
                generated += (out.shape[1] - width) * len(seqs)
            seconds = time.perf_counter() - t0
        return {"seconds": round(seconds, 3), "generated_tokens": generated, "tok_s": round(generated / seconds, 2)}


def plan_batches(run_dir: Path) -> list[list[int]]:
    """The batches a run generated, in order (progress/*.plan.jsonl; a split batch: its two halves)."""
    batches: dict[int, list[int]] = {}
    for plan in sorted((run_dir / "progress").glob("*.plan.jsonl")):
        for line in plan.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                batches[row["batch"]] = row["sequences"]  # a later line for the same key replaces it
    return [batches[k] for k in sorted(batches)]


def paired(
    runs: Path,
    specs: Path,
    name: str,
    prompts: Path,
    tokens: int,
    batch,
    floor: Floor,
    repeats: int,
    budget=None,
    shards: int = 1,
) -> dict:
    """`repeats` pairs of (lmtrace generate, the batched floor) on the same prompts and batches; the
    order alternates per repeat (lmtrace first in the first, whose plan gives the floor its batches).
    Each pair's ratio: lmtrace's tok/s (its manifest's generate_s) / the floor's; the median is reported.
    The other facts (files, bytes, RSS, pace) are those of the last repeat's run. With `shards` > 1
    lmtrace is that many one-thread shard processes of the run (`generate_sharded`); the floor is
    still one process on torch's default threads, on all the shards' batches."""
    spec = write_spec(specs / f"{name}.json", prompts, tokens, batch, budget)
    pairs = []
    run = None
    for r in range(repeats):
        order = ("lmtrace", "floor") if r % 2 == 0 else ("floor", "lmtrace")
        pair: dict = {"order": list(order), "load_average": round(os.getloadavg()[0], 2)}
        for what in order:
            if what == "lmtrace":
                run = (
                    generate_sharded(runs, spec, name, prompts, batch, shards)
                    if shards > 1
                    else generate_spec(runs, spec, name, prompts, batch, budget)
                )
                pair["lmtrace_tok_s"] = run["tok_s_generation"]
                pair["lmtrace_generate_s"] = run["generate_s"]
            else:
                print(
                    f"[{time.strftime('%H:%M:%S')}] floor {name} (model.generate, batched)", file=sys.stderr, flush=True
                )
                f = floor.measured(spec, plan_batches(runs / name), tokens, specs)
                pair["floor_tok_s"], pair["floor_s"] = f["tok_s"], f["seconds"]
                pair["floor_tokens"] = f["generated_tokens"]
        if pair["floor_tokens"] != run["generated_tokens"]:
            raise SystemExit(
                f"{name}: the floor generated {pair['floor_tokens']} tokens, lmtrace "
                f"{run['generated_tokens']}: the comparison would be unfair"
            )
        pair["ratio"] = round(pair["floor_s"] / pair["lmtrace_generate_s"], 3)
        pairs.append(pair)
    ratios = sorted(p["ratio"] for p in pairs)
    return {
        **run,
        "repeats": repeats,
        "pairs": pairs,
        "ratio_median": statistics.median(ratios),
        "floor_tok_s_median": statistics.median(p["floor_tok_s"] for p in pairs),
        "lmtrace_tok_s_median": statistics.median(p["lmtrace_tok_s"] for p in pairs),
    }


# ---- SLURM ----------------------------------------------------------------------------------------
def slurm_array(runs: Path, specs: Path, tmp: Path, tasks: int = 4) -> dict:
    """The batch-8 spec as a `tasks`-task array on a one-node cluster started for it (and stopped after)."""
    if os.geteuid() != 0:
        return {"skipped": "a local SLURM cluster needs root"}
    missing = [
        t
        for t in ("sbatch", "squeue", "slurmctld", "slurmd", "munged")
        if shutil.which(t) is None and not Path("/usr/sbin", t).exists()
    ]
    if missing:
        return {"skipped": f"SLURM packages not installed ({', '.join(missing)}): scripts/slurm-cluster.sh install"}
    state = tmp / "slurm-state"
    up = subprocess.run(
        ["bash", str(REPO / "scripts/slurm-cluster.sh"), "up", str(state)], capture_output=True, text=True, check=False
    )
    if up.returncode != 0:
        return {"skipped": f"the local cluster did not start: {up.stderr.strip()[-500:]}"}
    env = {**bench_env(), "SLURM_CONF": str(state / "slurm.conf")}
    try:
        logs = tmp / "slurm-logs"
        logs.mkdir(exist_ok=True)
        script = tmp / "task.sh"
        # one torch thread per task (docs/batch.md, "Threads"); /usr/bin/time records each task's peak RSS
        script.write_text(
            f"#!/bin/bash\ncd {REPO}\nexport OMP_NUM_THREADS=1 PYTHONPATH={REPO} TOKENIZERS_PARALLELISM=false "
            f"HF_HUB_OFFLINE=1\n/usr/bin/time -f %M -o {logs}/rss-$SLURM_ARRAY_TASK_ID.txt "
            f"{sys.executable} -m lmtrace generate {specs / 'batch8.json'} --shard auto --runs-dir {runs} -q\n"
        )
        print(f"[{time.strftime('%H:%M:%S')}] sbatch --array=0-{tasks - 1}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        sub = subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"--array=0-{tasks - 1}",
                "--cpus-per-task=1",
                "-o",
                str(logs / "task-%a.out"),
                str(script),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if sub.returncode != 0:
            return {"skipped": f"sbatch failed: {sub.stderr.strip()}"}
        job = sub.stdout.strip().split(";")[0]
        while True:
            q = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True, check=False)
            if q.returncode == 0 and not q.stdout.strip():
                break
            time.sleep(1)
        wall = time.perf_counter() - t0
        run_dir = runs / f"slurm-{job}"
        manifest = json.loads((run_dir / "manifest.json").read_text()) if (run_dir / "manifest.json").is_file() else {}
        if manifest.get("status") != "complete":
            outs = " | ".join(
                (logs / f"task-{i}.out").read_text()[-300:] for i in range(tasks) if (logs / f"task-{i}.out").exists()
            )
            raise SystemExit(f"the SLURM array's run {run_dir} is not complete ({manifest.get('status')}): {outs}")
        facts = archive_facts(run_dir)
        rss = [int((logs / f"rss-{i}.txt").read_text().split()[-1]) / 1024 for i in range(tasks)]
        return {
            "run_id": run_dir.name,
            "tasks": tasks,
            "cpus_per_task": 1,
            "submit_to_complete_s": round(wall, 1),
            "tok_s": round(facts["generated_tokens"] / wall, 2),
            "peak_rss_mib_per_task": [round(r, 1) for r in rss],
            **{k: facts[k] for k in ("files", "bytes", "generated_tokens", "bytes_per_token")},
        }
    finally:
        subprocess.run(
            ["bash", str(REPO / "scripts/slurm-cluster.sh"), "down", str(state)], capture_output=True, check=False
        )


# ---- reading the big run ----------------------------------------------------------------------------
def tools(runs: Path, run_id: str) -> dict:
    out = {}
    for name, args in (("ls", ("ls",)), ("heads", ("heads", run_id, "-q")), ("report", ("report", run_id))):
        print(f"[{time.strftime('%H:%M:%S')}] lmtrace {name}", file=sys.stderr, flush=True)
        m = run_measured(lmtrace_cmd(*args, "--runs-dir", str(runs)))
        if m["rc"] != 0:
            raise SystemExit(f"lmtrace {' '.join(args)} failed (exit {m['rc']}): {m['stderr_tail']}")
        out[name] = {"seconds": m["seconds"], "peak_rss_mib": m["peak_rss_mib"]}
    out["ls"]["runs"] = sum(1 for d in runs.iterdir() if (d / "manifest.json").is_file())
    report = runs / run_id / "report.html"
    if report.is_file():
        out["report"]["bytes"] = report.stat().st_size
    # Python's start and lmtrace's imports, which every process above includes
    start = run_measured(lmtrace_cmd("--help"))
    out["python_start_s"] = start["seconds"]

    print(f"[{time.strftime('%H:%M:%S')}] lmtrace serve: the run page", file=sys.stderr, flush=True)
    facts = run_facts(runs / run_id)
    server = Server(runs)
    try:
        time.sleep(0.5)
        seen = browse(server, facts, 2, 0)
    finally:
        memory = server.stop()
    first, later = seen["run_page"][0], seen["run_page"][1]
    out["serve_run_page"] = {
        "sequences_drawn_first_load_ms": round(first["sequences_drawn_ms"], 1),
        "first_contentful_paint_ms": first["first_contentful_paint_ms"],
        "server_cpu_first_load_ms": first["server_cpu_ms"],
        "sequences_drawn_second_load_ms": round(later["sequences_drawn_ms"], 1),
        "server_peak_rss_mib": memory["vmhwm_mib"],
    }
    return out


# ---- main -------------------------------------------------------------------------------------------
def main() -> None:
    if sys.argv[1:2] == ["--floor-child"]:  # Floor.measured's child: SPEC BATCHES_JSON TOKENS -> one JSON line
        spec_path, batches, tokens = Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text()), int(sys.argv[4])
        print(json.dumps(Floor().seconds(spec_path, batches, tokens)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batch1-prompts", type=int, default=50, help="prompts of the batch-1 run (a subset)")
    ap.add_argument("--memory-budget", default="2GiB", help="generation.memory_budget of the auto run")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="pairs of (lmtrace, the batched floor) at batch 8, 32, 64 and auto (default 3)",
    )
    ap.add_argument(
        "--runs-dir", type=Path, default=None, help="keep the runs here (default: a temporary directory, removed after)"
    )
    ap.add_argument("--only", action="append", choices=PARTS, help="run only this part (repeatable)")
    ap.add_argument(
        "--tools-run",
        default="batch8",
        choices=("batch8", "batch32", "auto"),
        help="the run the tools part measures ls, heads, report and serve on (default batch8)",
    )
    ap.add_argument(
        "--shards-batch",
        type=lambda v: v if v == "auto" else int(v),
        default=32,
        help="batch size of the shards2 part: a number (default 32) or auto (--memory-budget shared by the two)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "scale.json")
    args = ap.parse_args()
    parts = args.only or list(PARTS)

    tmp = tempfile.TemporaryDirectory(prefix="scale-bench-")
    runs = (args.runs_dir or Path(tmp.name) / "runs").resolve()
    specs = runs.parent / f"{runs.name}-scale-specs"  # outside the runs directory: `ls` lists runs only
    runs.mkdir(parents=True, exist_ok=True)
    specs.mkdir(exist_ok=True)
    n, small_n, one_n = args.prompts, max(args.prompts // 5, 1), min(args.batch1_prompts, args.prompts)
    prompts = write_prompts(specs / f"prompts-{n}.jsonl", n)
    write_spec(specs / "batch8.json", prompts, args.tokens, 8, None)  # the SLURM array's spec

    result: dict = {}
    commands: list[str] = []
    if args.only and args.out.is_file():  # parts not run now keep what an earlier run of the same size measured
        old = json.loads(args.out.read_text())
        if (old.get("prompts"), old.get("tokens")) == (n, args.tokens):
            result, commands = old.get("parts", {}), old.get("commands", [])
    commands.append(" ".join(sys.argv))
    # batch 8 first (the SLURM array's and the tools' run), the tools right after (whatever else is cut)
    floor = Floor()
    plan = {
        "batch8": lambda: paired(runs, specs, "batch8", prompts, args.tokens, 8, floor, args.repeats),
        "tools": lambda: {**tools(runs, args.tools_run), "run": args.tools_run},
        "batch1": lambda: generate(
            runs, specs, "batch1", write_prompts(specs / f"prompts-{one_n}.jsonl", one_n), args.tokens, 1
        ),
        "batch32": lambda: paired(runs, specs, "batch32", prompts, args.tokens, 32, floor, args.repeats),
        "batch64": lambda: paired(runs, specs, "batch64", prompts, args.tokens, 64, floor, args.repeats),
        "auto": lambda: paired(
            runs, specs, "auto", prompts, args.tokens, "auto", floor, args.repeats, args.memory_budget
        ),
        "shards2": lambda: paired(
            runs,
            specs,
            "shards2",
            prompts,
            args.tokens,
            args.shards_batch,
            floor,
            args.repeats,
            args.memory_budget if args.shards_batch == "auto" else None,
            shards=2,
        ),
        "small": lambda: generate(
            runs, specs, "batch8-small", write_prompts(specs / f"prompts-{small_n}.jsonl", small_n), args.tokens, 8
        ),
        "slurm": lambda: slurm_array(runs, specs, Path(tmp.name)),
    }
    # each part records its own prompts (and the auto run its memory budget)
    doc = {"commands": commands, "cpus": os.cpu_count(), "prompts": n, "tokens": args.tokens, "parts": result}
    if args.tools_run != "batch8":  # the tools measure a run made before them
        plan["tools"] = plan.pop("tools")
    try:
        for part, measure in plan.items():
            if part not in parts:
                continue
            needs = args.tools_run if part == "tools" else "batch8" if part == "slurm" else None
            if needs and not (runs / needs / "manifest.json").is_file():
                raise SystemExit(f"no {needs} run in {runs}: run the {needs} part (with --runs-dir {runs})")
            load = os.getloadavg()  # the machine is shared: the load each part started under
            started = time.strftime("%H:%M:%S UTC", time.gmtime())
            result[part] = {
                **measure(),
                "load_average_at_start": [round(x, 2) for x in load],
                "started": started,
                "finished": time.strftime("%H:%M:%S UTC", time.gmtime()),
            }
            # written after every part, so that a bench stopped part way keeps what it measured
            doc.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_average=os.getloadavg())
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=1))
    finally:
        tmp.cleanup()
    print_table(doc)
    print(f"written to {args.out}")


def print_table(doc: dict) -> None:
    p = doc["parts"]
    print(f"{doc['prompts']} prompts x {doc['tokens']} tokens, default capture, {MODEL}, {doc['cpus']} CPUs")
    head = (
        f"  {'run':<28} {'prompts':>7} {'tok/s gen':>9} {'median batch':>12} {'tok/s proc':>10} {'files':>6} "
        f"{'B/token':>8} {'peak RSS':>9}"
        f"  load at start"
    )
    print(head)
    ratios = [
        (label, p[key])
        for key, label in (
            ("batch8", "batch 8"),
            ("batch32", "batch 32"),
            ("batch64", "batch 64"),
            ("auto", "auto"),
            ("shards2", f"batch {p.get('shards2', {}).get('batch_size')}, 2 shards"),
        )
        if p.get(key, {}).get("pairs")
    ]
    if ratios:
        print(
            "  against the batched floor (plain model.generate, same prompts and batches, in the same bench run), "
            "paired per repeat:"
        )
        for label, r in ratios:
            each = ", ".join(f"{q['ratio']:.3f}" for q in r["pairs"])
            print(
                f"    {label:<18} x the floor: median {r['ratio_median']:.3f} ({each}); tok/s median lmtrace "
                f"{r['lmtrace_tok_s_median']}, floor {r['floor_tok_s_median']}; load "
                f"{', '.join(str(q['load_average']) for q in r['pairs'])}"
            )
    for key, label in (
        ("batch1", "batch 1"),
        ("batch8", "batch 8"),
        ("batch32", "batch 32"),
        ("batch64", "batch 64"),
        ("auto", "auto"),
        ("shards2", f"batch {p.get('shards2', {}).get('batch_size')}, 2 shards (RSS: both)"),
        ("small", "batch 8, fewer prompts"),
    ):
        r = p.get(key)
        if not r:
            continue
        if key == "auto":
            label = f"auto ({r['memory_budget']}; batches {r['batches']})"
        print(
            f"  {label:<28} {r['prompts']:>7} {r['tok_s_generation']:>9} {r.get('pace', {}).get('tok_s_median_batch', ''):>12} "
            f"{r['tok_s_process']:>10} {r['files']:>6} "
            f"{r['bytes_per_token']:>8} {r['peak_rss_mib']:>5} MiB  {r['load_average_at_start'][0]}"
        )
    s = p.get("slurm")
    if s:
        if "skipped" in s:
            print(f"  SLURM array: skipped ({s['skipped']})")
        else:
            one = p.get("batch8", {})
            print(
                f"  SLURM {s['tasks']}-task array: {s['submit_to_complete_s']} s submit to complete, {s['tok_s']} tok/s, "
                f"{s['files']} files, {s['bytes_per_token']} B/token, peak RSS per task "
                f"{', '.join(map(str, s['peak_rss_mib_per_task']))} MiB; one process (batch 8): "
                f"{one.get('process_s')} s (load at start {s['load_average_at_start'][0]})"
            )
    t = p.get("tools")
    if t:
        sp = t["serve_run_page"]
        print(
            f"  on the {t.get('run', 'batch8')} run: ls {t['ls']['seconds']} s ({t['ls']['runs']} runs), heads {t['heads']['seconds']} s, report "
            f"{t['report']['seconds']} s ({t['report'].get('bytes', 0) / 1e6:.1f} MB), python start {t['python_start_s']} s; "
            f"serve run page: sequences drawn {sp['sequences_drawn_first_load_ms']} ms (first load), "
            f"{sp['sequences_drawn_second_load_ms']} ms (second) (load at start {t['load_average_at_start'][0]})"
        )


if __name__ == "__main__":
    main()
