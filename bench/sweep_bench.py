"""`lmtrace sweep` against one `lmtrace intervene` per component (issue 24's speed target).

A full zero-ablation sweep of the embedded model's 270 heads on one ~64-token prompt with 16
rescored steps, timed as a user runs it (`lmtrace sweep ...`, a process, model load included),
against `lmtrace intervene RUN --ablate-head L.H` processes for a sample of the same cells (their
time extrapolated to every cell). The sampled cells' logprobs are checked to agree within 1e-4.
Targets: >= 20x the components per second of intervene, and <= 3 minutes for the sweep.

The from-step case: the same 270 heads edited from step S on (`--from-step S`, default 8), where the
unedited prefix (prompt + steps < S) is computed once per sequence and every batch row continues its
KV cache, against the same cells and measured steps computed without the prefix cache (`--steps
S-15`: every row recomputes the whole context, as a sweep without cache reuse must) and against one
`lmtrace intervene --from-step S` per cell; sampled cells are checked against the intervene children.

    .venv/bin/python bench/sweep_bench.py [--case all|heads|from-step] [--from-step 8] [--intervene-samples 3]
                                          [--out bench/results/sweep.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = (
    "The history of the city of Paris begins with a small settlement of a Celtic tribe on an island in the river "
    "Seine. Over the following centuries the town grew into the capital of a kingdom, and its cathedral, its "
    "university and its markets drew scholars, traders and pilgrims from every part of Europe, until it was one of"
)


def lmtrace(runs: Path, *args: str) -> tuple[float, str]:
    env = {**os.environ, "LMTRACE_RUNS_DIR": str(runs), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "lmtrace.cli.main", *args], env=env, capture_output=True, text=True, cwd=REPO
    )
    if proc.returncode != 0:
        raise SystemExit(f"lmtrace {' '.join(args)} failed: {proc.stderr.strip()}")
    return time.perf_counter() - t0, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--intervene-samples", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="smoke test: the 30 attention blocks instead of the 270 heads")
    ap.add_argument("--case", choices=("all", "heads", "from-step"), default="all")
    ap.add_argument("--from-step", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sweep.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        spec = Path(tmp) / "spec.yaml"
        spec.write_text(
            json.dumps({"prompts": [PROMPT], "capture": "none", "generation": {"max_new_tokens": 16, "temperature": 0}})
        )
        lmtrace(runs, "generate", str(spec), "--run-id", "parent", "-q")
        out = Path(args.out)
        # one case alone updates its part of an earlier result file
        result = json.loads(out.read_text()) if args.case != "all" and out.is_file() else {}
        if args.case in ("all", "heads"):
            result = {**result, **every_step_case(runs, args)}
        if args.case in ("all", "from-step"):
            result["from_step"] = from_step_case(runs, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def _intervene_cells(runs: Path, args, table, extra: tuple[str, ...] = ()) -> tuple[list[float], float]:
    """One `lmtrace intervene` per sampled cell: its wall times and the largest |logprob difference| to the sweep."""
    import pandas as pd

    cells = [(0, 0), (14, 4), (29, 8)][: args.intervene_samples]
    times, worst = [], 0.0
    for layer, head in cells:
        flag = ["--ablate-attn", str(layer)] if args.quick else ["--ablate-head", f"{layer}.{head}"]
        t, out = lmtrace(runs, "intervene", "parent", *flag, *extra, "--json")
        times.append(t)
        child = json.loads(out)["children"][0]["run_id"]
        eff = pd.read_parquet(runs / child / "effects.parquet").sort_values("step")
        mine = table[(table["layer"] == layer) & ((table["q_head"] == head) if not args.quick else True)]
        mine = mine.sort_values("step")
        eff = eff[eff.step.isin(mine.step)]
        worst = max(
            worst, float((mine.value.to_numpy() - eff.child_logprob_of_parent_token.to_numpy()).__abs__().max())
        )
    return times, worst


def from_step_case(runs: Path, args) -> dict:
    import pandas as pd

    S, over = args.from_step, ("attn" if args.quick else "heads")
    common = ["--over", over, "--edit", "zero", "--metric", "logprob", "--batch", str(args.batch), "--json"]
    cached_s, out = lmtrace(runs, "sweep", "parent", *common, "--from-step", str(S), "--run-id", "from-step")
    cached = json.loads(out)
    full_s, out = lmtrace(runs, "sweep", "parent", *common, "--steps", f"{S}-15", "--run-id", "recomputed")
    full = json.loads(out)
    table = pd.read_parquet(runs / "parent" / "sweeps" / "from-step" / "sweep.parquet")
    times, worst = _intervene_cells(runs, args, table, ("--from-step", str(S)))
    n_cells, per_intervene = cached["n_cells"], sum(times) / len(times)
    return {
        "over": over,
        "cells": n_cells,
        "from_step": S,
        "measured_steps": f"{S}-15",
        "batch": args.batch,
        "sweep_s": round(cached_s, 2),
        "sweep_compute_s": cached["sweep_s"],
        "recomputed_s": round(full_s, 2),
        "recomputed_compute_s": full["sweep_s"],
        "speedup_vs_recomputed_compute": round(full["sweep_s"] / cached["sweep_s"], 2),
        "speedup_vs_recomputed_wall": round(full_s / cached_s, 2),
        "intervene_s_per_cell": round(per_intervene, 2),
        "speedup_vs_intervene": round(per_intervene * n_cells / cached_s, 1),
        "max_abs_diff_vs_intervene": worst,
    }


def every_step_case(runs: Path, args) -> dict:
    import pandas as pd

    over = "attn" if args.quick else "heads"
    sweep_s, out = lmtrace(
        runs,
        "sweep",
        "parent",
        "--over",
        over,
        "--edit",
        "zero",
        "--metric",
        "logprob",
        "--batch",
        str(args.batch),
        "--run-id",
        "heads",
        "--json",
    )
    summary = json.loads(out)
    table = pd.read_parquet(runs / "parent" / "sweeps" / "heads" / "sweep.parquet")
    n_cells = summary["n_cells"]
    times, worst = _intervene_cells(runs, args, table)
    per_intervene = sum(times) / len(times)
    return {
        "over": over,
        "cells": n_cells,
        "prompt_tokens": int(pd.read_parquet(runs / "parent" / "sequences.parquet").prompt_len[0]),
        "steps": 16,
        "batch": args.batch,
        "sweep_s": round(sweep_s, 2),
        "sweep_compute_s": summary["sweep_s"],
        "sweep_cells_per_s": round(n_cells / sweep_s, 3),
        "intervene_s_per_cell": round(per_intervene, 2),
        "intervene_cells_per_s": round(1 / per_intervene, 4),
        "speedup": round(per_intervene * n_cells / sweep_s, 1),
        "max_abs_diff_vs_intervene": worst,
        "targets": {"speedup>=20": per_intervene * n_cells / sweep_s >= 20, "sweep<=180s": sweep_s <= 180},
    }


if __name__ == "__main__":
    main()
