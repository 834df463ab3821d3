"""Feature activations (docs/features.md): their archive bytes per token, and the deferred
`lmtrace features RUN --sae DIR` from the archived residual vectors against a replay through the model.

One run of embedded:smollm2-135m with the default capture (whose float16 residual at every layer is
what the archive source reads) and `capture.features` (the SAE below, top 32), --prompts prompts of
the lighthouse text cut at different lengths, --tokens new tokens each, greedy. Then fresh copies of
the default run get the deferred features, from the archive and by a replay (the same SAE, so the
replay stops at the same site), each as a user runs it: `lmtrace features COPY --sae DIR --source S`
in a process of its own, --repeats times each, alternating. Each is timed by its wall time and its
CPU seconds (user + system of the child, all threads: resource.getrusage(RUSAGE_CHILDREN), less
sensitive to other load on a shared machine), with the load average when it started; the command's
own `seconds` (the computation, after the imports, the SAE's read and the checksums of its inputs)
and the replay's model load are kept too. The SAE: a random TopK SAE (d_sae 16384, k 32, seeded) at
blocks.15.hook_resid_post. Bytes per token: the feat_* arrays' files over the run's generated tokens.

    .venv/bin/python bench/features_bench.py [--prompts 32] [--tokens 32] [--repeats 3]
    .venv/bin/python bench/features_bench.py --run RUN_DIR [--repeats 3]   # the deferred command only,
        on a complete run of embedded:smollm2-135m with the default capture made before
Writes bench/results/features.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=UserWarning, module="zarr")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml  # noqa: E402

from bench import PROMPT_SEED_TEXT, bench_sae  # noqa: E402
from lmtrace.archive.runs import dir_size  # noqa: E402
from lmtrace.runner.generation import run_generate  # noqa: E402
from lmtrace.spec.run_spec import build_spec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "features.json"


def timed_command(run_dir: Path, source: str, scratch: Path) -> dict:
    """`lmtrace features` on a fresh copy of run_dir, in a process of its own: wall, CPU, its own report."""
    copy = scratch / f"deferred-{source}" / run_dir.name
    shutil.rmtree(copy.parent, ignore_errors=True)
    shutil.copytree(run_dir, copy)
    cmd = [sys.executable, "-m", "lmtrace.cli", "features", str(copy), "--sae", str(bench_sae())]
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd + ["--top-k", "32", "--source", source, "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    out = json.loads(proc.stdout)
    entry = json.loads((copy / "manifest.json").read_text())["features"][-1]["computed"]
    shutil.rmtree(copy.parent, ignore_errors=True)
    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 3),
        "load_avg_1min": load,
        "command_seconds": out["seconds"],
        "model_load_s": entry["model_load_s"],
        "tokens": out["tokens"],
    }


def deferred_timings(run_dir: Path, repeats: int, scratch: Path) -> dict:
    """Both sources, alternating, `repeats` times each: every time, and the medians and the ratios."""
    times = {"archive": [], "replay": []}
    for _ in range(repeats):
        for source in times:
            times[source].append(timed_command(run_dir, source, scratch))
    out = {"runs": times}
    for key in ("wall_s", "cpu_s", "command_seconds"):
        med = {s: statistics.median(t[key] for t in times[s]) for s in times}
        out[f"median_{key}"] = med
        out[f"replay_over_archive_{key}"] = round(med["replay"] / med["archive"], 2)
    out["load_avg_1min"] = [t["load_avg_1min"] for s in times for t in times[s]]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--run", type=Path, help="time the deferred command only, on this complete run")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="lmtrace-features-bench-"))
    try:
        if args.run:
            manifest = json.loads((args.run / "manifest.json").read_text())
            out = {
                "run": str(args.run),
                "sequences": manifest["shape"]["n_sequences"],
                "generated_tokens": manifest["n_generated_tokens"],
                "cpus": os.cpu_count(),
            }
        else:
            out, default_run = generate_runs(args, root)
        out["deferred"] = deferred_timings(args.run or default_run, args.repeats, root)
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps(out, indent=2))
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def generate_runs(args, root: Path) -> tuple[dict, Path]:
    """The default run and the run with `capture.features`: their costs and bytes per token."""
    words = PROMPT_SEED_TEXT.split()
    prompts = [" ".join(words[: 8 + 3 * i % 40]) for i in range(args.prompts)]
    data = {
        "model": "embedded:smollm2-135m",
        "prompts": {"texts": prompts, "chat": False},
        "generation": {"max_new_tokens": args.tokens, "temperature": 0.0, "batch_size": 8},
        "output": {"runs_dir": str(root / "runs")},
    }
    timings = {}
    for name, capture in (("default", {}), ("features", {"features": [{"sae": str(bench_sae()), "top_k": 32}]})):
        d = {**data, "capture": capture, "output": {"runs_dir": str(root / name)}}
        t0 = time.time()
        result = run_generate(build_spec(d, "bench"), yaml.safe_dump(d))
        manifest = json.loads((result.run_dir / "manifest.json").read_text())
        timings[name] = {
            "generate_s": manifest["timings"]["generate_s"],
            "wall_s": round(time.time() - t0, 2),
            "tokens": manifest["n_generated_tokens"],
            "run_dir": result.run_dir,
        }
    tokens = timings["features"]["tokens"]
    tensors = timings["features"]["run_dir"] / "tensors.zarr"
    feat_bytes = sum(dir_size(d) for d in tensors.iterdir() if d.name.startswith("feat_"))
    out = {
        "prompts": args.prompts,
        "new_tokens": args.tokens,
        "generated_tokens": tokens,
        "generate_s": {k: v["generate_s"] for k, v in timings.items()},
        "feature_capture_overhead": timings["features"]["generate_s"] / timings["default"]["generate_s"] - 1,
        "feature_bytes_per_token": feat_bytes / tokens,
        "run_bytes_per_token": {k: dir_size(v["run_dir"]) / v["tokens"] for k, v in timings.items()},
        "load_avg_1min": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }
    return out, timings["default"]["run_dir"]


if __name__ == "__main__":
    main()
