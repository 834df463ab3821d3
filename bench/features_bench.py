"""Feature activations (docs/features.md): their archive bytes per token, and the deferred
`lmtrace features RUN --sae DIR` from the archived residual vectors against a replay through the model.

One run of embedded:smollm2-135m with the default capture (whose float16 residual at every layer is
what the archive source reads) and `capture.features` (the SAE below, top 32), --prompts prompts of
the lighthouse text cut at different lengths, --tokens new tokens each, greedy. Then two copies of
the same run without the inline arrays' manifest entry get the deferred features, one from the
archive, one by a replay; both are timed as the command reports them (`seconds`; the replay's model
load is reported apart), and by this process's CPU seconds (all threads; less sensitive to other load
on a shared machine). The SAE: a random TopK SAE (d_sae 16384, k 32, seeded) at
blocks.15.hook_resid_post. Bytes per token: the feat_* arrays' files over the run's generated tokens.

    .venv/bin/python bench/features_bench.py [--prompts 32] [--tokens 32]
Writes bench/results/features.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args(argv)
    from lmtrace.commands.features import compute_features

    words = PROMPT_SEED_TEXT.split()
    prompts = [" ".join(words[: 8 + 3 * i % 40]) for i in range(args.prompts)]
    root = Path(tempfile.mkdtemp(prefix="lmtrace-features-bench-"))
    try:
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
        deferred = {}
        for source in ("archive", "replay"):
            copy = root / f"deferred-{source}" / timings["default"]["run_dir"].name
            shutil.copytree(timings["default"]["run_dir"], copy)
            cpu0 = time.process_time()
            r = compute_features(str(copy), str(bench_sae()), top_k=32, source=source)
            cpu = time.process_time() - cpu0
            load = (json.loads((copy / "manifest.json").read_text())["features"][-1]["computed"]["model_load_s"]) or 0.0
            deferred[source] = {
                "seconds": r["seconds"],
                "model_load_s": load,
                "tokens": r["tokens"],
                "without_load_s": r["seconds"] - load,
                "cpu_s": round(cpu, 3),  # this process's CPU seconds, all threads, the model load included
            }
        out["deferred"] = deferred
        out["deferred_speedup_vs_replay"] = deferred["replay"]["seconds"] / deferred["archive"]["seconds"]
        out["deferred_speedup_vs_replay_without_load"] = (
            deferred["replay"]["without_load_s"] / deferred["archive"]["seconds"]
        )
        out["deferred_cpu_ratio_vs_replay"] = deferred["replay"]["cpu_s"] / deferred["archive"]["cpu_s"]
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps(out, indent=2))
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
