"""What one `lmtrace explain` step costs per method, against one forward pass of the same context.

On the embedded model as explain loads it (float32, eager attention, batch 1, a 64-token context, torch
threads as bench.py sets them; CPU time of the process, so a busy machine does not skew the ratios): one forward of the context (no gradients, last position's logits), then
one step of `lrp`, `grad_x_input` and `integrated_gradients` at its defaults (adaptive rule, 1 %
completeness tolerance, mean baseline with the sink kept), each the minimum of --repeats timings
(integrated gradients: --ig-repeats), which is robust to other processes on a shared machine.

    .venv/bin/python bench/explain_bench.py [--repeats 5] [--ig-repeats 1]

docs/explain.md ("Cost") and docs/performance.md quote its output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from lmtrace.analysis.attribution import METHODS, Scorer, Settings, StepContext  # noqa: E402
from lmtrace.runner.models import load_model  # noqa: E402
from lmtrace.spec.run_spec import ModelSpec  # noqa: E402


def best_ms(fn, repeats: int) -> tuple[float, object]:
    """The minimum over `repeats` calls of this process's CPU time (all its threads) in ms, and the last result:
    CPU time, not wall-clock, so that other processes on a shared machine do not enter the ratios."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best * 1000, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ig-repeats", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64, help="context length")
    p.add_argument("--no-ig", action="store_true", help="leave out integrated gradients (minutes per step)")
    args = p.parse_args()
    threads = bench.set_threads()
    loaded = load_model(ModelSpec(dtype="float32", attn_implementation="eager"))
    scorer = Scorer.of(loaded)
    _, ids = bench.make_prompt(loaded.tokenizer, args.tokens)
    with torch.no_grad():
        logits = scorer.logits(scorer.embeddings(ids)[None])[0]
    chosen, runner = [int(i) for i in logits.topk(2).indices]

    def forward():
        with torch.no_grad():
            return scorer.logits(scorer.embeddings(ids)[None])

    def step(name: str):
        ctx = StepContext(
            run=None,
            sequence=0,
            step=0,
            prompt_len=len(ids),
            ids=ids,
            chosen_id=chosen,
            runner_up_id=runner,
            archived_logprob=0.0,
            settings=Settings(),
            scorer=scorer,
        )
        return lambda: METHODS[name].fn(ctx)

    forward_ms, _ = best_ms(forward, args.repeats)
    print(json.dumps({"forward_cpu_ms": round(forward_ms, 1)}), flush=True)
    out = {
        "model": "embedded:smollm2-135m float32 eager",
        "context_tokens": len(ids),
        "threads": threads,
        "forward_cpu_ms": round(forward_ms, 1),
    }
    methods = [("lrp", args.repeats), ("grad_x_input", args.repeats), ("integrated_gradients", args.ig_repeats)]
    for name, repeats in methods[:2] if args.no_ig else methods:
        ms, res = best_ms(step(name), repeats)
        out[name] = {"cpu_ms": round(ms, 1), "x_forward": round(ms / forward_ms, 2)}
        if name == "lrp":
            out[name]["conservation_error_relative"] = res.info["conservation_error_relative"]
        if name == "integrated_gradients":
            out[name].update(gradient_points=res.info.get("gradient_points"), converged=res.info.get("converged"))
        print(json.dumps({name: out[name]}), flush=True)  # as measured: integrated gradients takes minutes
    if "integrated_gradients" in out:
        out["integrated_gradients"]["x_lrp"] = round(out["integrated_gradients"]["cpu_ms"] / out["lrp"]["cpu_ms"], 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
