"""Dataset patching (`lmtrace sweep CORRUPT --source CLEAN`) over many prompt pairs in one process,
against one sweep process per pair (issue 34's speed target: >= 20x).

IOI-style pairs on the embedded SmolLM2-135M: "When Mary and John went to the PLACE, John gave a
THING to" (clean, answer " Mary") and the same with Mary as the giver (corrupted); PLACE x THING
make up to 100 pairs of equal token length, paired by a `pair_id` column (`--pair-by pair_id`).
The sweep patches every attention block (`--over attn`) at step 0, metric logit_diff:" Mary"," John".
The one-process-per-pair side is timed on a few pairs (`--sequences i`, each a full `lmtrace sweep`
process: start-up and model load included) and extrapolated to every pair.

    .venv/bin/python bench/patching_bench.py [--pairs 100] [--single 3] [--over attn]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from sweep_bench import lmtrace  # bench/ is the script's directory: one way to time a process

REPO = Path(__file__).resolve().parents[1]
PLACES = ["store", "park", "house", "beach", "school", "office", "garden", "market", "church", "station"]
THINGS = ["drink", "book", "ball", "gift", "pen", "letter", "ring", "hat", "key", "cake"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=100)
    ap.add_argument("--single", type=int, default=3, help="single-pair processes timed (then extrapolated)")
    ap.add_argument("--over", default="attn")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "patching.json"))
    args = ap.parse_args()
    pairs = [(p, t) for p in PLACES for t in THINGS][: args.pairs]
    sweep = [
        "--over",
        args.over,
        "--edit",
        "patch",
        "--steps",
        "0",
        "--metric",
        'logit_diff:" Mary"," John"',
        "--pair-by",
        "pair_id",
        "-q",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        for name, giver in (("clean", "John"), ("corrupt", "Mary")):
            prompts = Path(tmp) / f"{name}.jsonl"
            prompts.write_text(
                "".join(
                    json.dumps(
                        {"prompt": f"When Mary and John went to the {p}, {giver} gave a {t} to", "pair_id": f"{p}-{t}"}
                    )
                    + "\n"
                    for p, t in pairs
                )
            )
            spec = Path(tmp) / f"{name}.yaml"
            spec.write_text(
                json.dumps(
                    {
                        "prompts": {"file": str(prompts)},
                        "capture": "none",
                        "generation": {"max_new_tokens": 1, "temperature": 0, "batch_size": 25},
                    }
                )
            )
            lmtrace(runs, "generate", str(spec), "--run-id", name, "-q")
        wall, sweep_id = lmtrace(runs, "sweep", "corrupt", "--source", "clean", *sweep)
        info = json.loads((runs / "corrupt" / "sweeps" / sweep_id.strip() / "sweep.json").read_text())
        singles = [
            lmtrace(runs, "sweep", "corrupt", "--source", "clean", "--sequences", str(i), *sweep)[0]
            for i in range(args.single)
        ]
    per_pair = sum(singles) / len(singles)
    result = {
        "pairs": len(pairs),
        "over": args.over,
        "n_cells": info["n_cells"],
        "one_process_s": round(wall, 2),
        "one_process_sweep_s": info["timings"]["sweep_s"],
        "single_pair_process_s": [round(s, 2) for s in singles],
        "per_pair_processes_s_extrapolated": round(per_pair * len(pairs), 1),
        "speedup": round(per_pair * len(pairs) / wall, 1),
        "top_normalised": info["patching"]["cells"][:3],
        "load": os.getloadavg(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
