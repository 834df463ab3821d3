"""Dataset patching (`lmtrace sweep CORRUPT --source CLEAN`) over many prompt pairs in one process,
against one sweep process per pair (issue 34's speed target: >= 20x).

IOI-style pairs on the embedded SmolLM2-135M: "When Mary and John went to the PLACE, John gave a
THING to" (clean, answer " Mary") and the same with Mary as the giver (corrupted); PLACE x THING
make up to 100 pairs of equal token length, paired by a `pair_id` column (`--pair-by pair_id`).
The sweep patches every attention block (`--over attn`) at step 0, metric logit_diff:" Mary"," John".
The one-process-per-pair side is timed on a few pairs (`--sequences i`, each a full `lmtrace sweep`
process: start-up and model load included) and extrapolated to every pair.

    .venv/bin/python bench/patching_bench.py [--pairs 100] [--single 3] [--over attn]

`--methods` instead compares `--method attribution` with the exact sweep over every head (`--over heads`
unless given): the attribution sweep over all pairs, the exact sweep over the first `--exact-pairs`
(pass fewer than --pairs where the exact sweep is too slow to run on every pair), per-pair compute
(`sweep_s` / pairs) of each, Spearman's rank correlation of the per-head mean effects on the pairs both
swept, and whether the exact top 10 heads are all within the estimate's top 20 (writes
bench/results/attribution.json).

    .venv/bin/python bench/patching_bench.py --methods [--pairs 100] [--exact-pairs 100]
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
    ap.add_argument("--out", default=None)
    ap.add_argument("--methods", action="store_true", help="attribution against exact (over heads)")
    ap.add_argument("--exact-pairs", type=int, default=None, help="--methods: pairs the exact sweep runs on")
    args = ap.parse_args()
    if args.methods and args.over == "attn":
        args.over = "heads"
    args.out = args.out or str(REPO / "bench" / "results" / ("attribution.json" if args.methods else "patching.json"))
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
        if args.methods:
            return compare_methods(runs, sweep, args)
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


def compare_methods(runs: Path, sweep: list[str], args) -> None:
    import numpy as np

    from lmtrace.archive.reader import open_run
    from lmtrace.archive.sweeps import read_sweep

    k = min(args.exact_pairs or args.pairs, args.pairs)
    load_before = os.getloadavg()
    att_wall, att_id = lmtrace(runs, "sweep", "corrupt", "--source", "clean", "--method", "attribution", *sweep)
    ex_wall, ex_id = lmtrace(runs, "sweep", "corrupt", "--source", "clean", "--sequences", f"0-{k - 1}", *sweep)
    run = open_run(str(runs / "corrupt"))
    info = {
        i: json.loads((runs / "corrupt" / "sweeps" / i.strip() / "sweep.json").read_text()) for i in (att_id, ex_id)
    }
    frames = {}
    for name, i in (("attribution", att_id), ("exact", ex_id)):
        df = read_sweep(run, i.strip()).to_pandas()
        df = df[df.sequence < k]  # the pairs both swept
        frames[name] = df.groupby(["layer", "q_head"]).effect.mean()
    est, exact = frames["attribution"], frames["exact"].reindex(frames["attribution"].index)
    rho = float(np.corrcoef(est.rank(), exact.rank())[0, 1])
    rho_abs = float(np.corrcoef(est.abs().rank(), exact.abs().rank())[0, 1])
    top_exact = list(exact.abs().sort_values(ascending=False).index[:10])
    top_est = list(est.abs().sort_values(ascending=False).index[:20])
    att_pp = info[att_id]["timings"]["sweep_s"] / args.pairs
    ex_pp = info[ex_id]["timings"]["sweep_s"] / k
    result = {
        "pairs": args.pairs,
        "exact_pairs": k,
        "over": args.over,
        "n_cells": info[att_id]["n_cells"],
        "attribution_wall_s": round(att_wall, 2),
        "attribution_sweep_s": info[att_id]["timings"]["sweep_s"],
        "exact_wall_s": round(ex_wall, 2),
        "exact_sweep_s": info[ex_id]["timings"]["sweep_s"],
        "attribution_per_pair_s": round(att_pp, 4),
        "exact_per_pair_s": round(ex_pp, 4),
        "speedup_compute": round(ex_pp / att_pp, 1),
        "speedup_wall_extrapolated": round(ex_wall / k * args.pairs / att_wall, 1),
        "spearman": round(rho, 4),
        "spearman_abs": round(rho_abs, 4),
        "exact_top10_in_estimate_top20": sum(c in top_est for c in top_exact),
        "exact_top10": [
            [int(a), int(b), round(float(exact[(a, b)]), 4), round(float(est[(a, b)]), 4)] for a, b in top_exact
        ],
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
