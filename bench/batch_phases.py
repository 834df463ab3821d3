"""Where a batched dataset run's time goes: the main thread's CPU seconds per phase of one
`lmtrace generate` (default capture) and of the batched floor (`model.generate`) on the same batches.

The prompts and spec are bench/scale_bench.py's (N short prompts, --tokens new tokens, greedy, no
end-of-sequence token, the embedded model). In one process: the lmtrace run (`lmtrace.cli`, its
model load included in "main thread" but not in "run_batch"), then the floor on that run's batches
(`scale_bench.Floor`, the model loaded once and warmed on one batch of 2 tokens, not counted).
Each phase is `time.thread_time` (and `perf_counter`, "_wall") around the call: the model's forward (both), `choose`, the probes'
`collect`, the block sink (lmtrace). CPU time of the calling thread, so other work on the machine
changes it less than wall-clock time; with torch's default threads it still counts the main
thread's spinning at parallel regions, which grows with the machine's load. `--threads 1` (torch's
intra-op threads) measures the work itself: the numbers that compare across loads.

"per_step_ms" answers where a batch's time goes beyond the floor's, in wall milliseconds (medians
over the calls unless said): the forward of a decode step and of a prefill, for lmtrace and the
floor; lmtrace's `choose`, `collect` (of it: the FFN top-k and the attention rows) and sink per step;
`capture_excess_per_batch` (the steps whose choose + collect + sink took longer than the median, by
how much, per batch: mostly the first steps of a batch, while the writer encodes the batch before on
the other core); `writer_cpu_per_block` (the writer thread's CPU for one block: encoding, checksums,
files, table parts) and `final_drain` (the wait for the last block after the last forward).

    .venv/bin/python bench/batch_phases.py [--prompts 128] [--tokens 16] [--batch 32] [--threads 1] [--capture-none]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_bench import REPO, Floor, plan_batches, write_prompts, write_spec

sys.path.insert(0, str(REPO))

CPU: dict[str, float] = collections.defaultdict(float)
WALL: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()
CALL_WALL: dict[str, list[float]] = collections.defaultdict(list)  # each call's wall seconds, per phase
SIDE = ["lmtrace"]  # whose forwards are being timed: "lmtrace", then "floor"
WRITER_PHASES = ("writer_block", "drain")  # the writer's: in `per_step_ms`, not in the main thread's phases


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        t0, w0 = time.thread_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            CPU[name] += time.thread_time() - t0
            WALL[name] += time.perf_counter() - w0
            CALL_WALL[name].append(time.perf_counter() - w0)
            CALLS[name] += 1

    return wrapper


def timed_forward(fn):
    """The model's forward, its wall time kept per side and kind (a prefill: more than one position)."""

    def wrapper(module, *args, **kwargs):
        w0 = time.perf_counter()
        try:
            return fn(module, *args, **kwargs)
        finally:
            ids = kwargs.get("input_ids")
            kind = "prefill" if ids is not None and ids.shape[1] > 1 else "decode"
            CALL_WALL[f"{SIDE[0]}_forward_{kind}"].append(time.perf_counter() - w0)

    return wrapper


def instrument() -> None:
    """Phase timers on the forward (the model class's __call__), choose, collect (the FFN top-k and the
    attention rows in it), the sink, the writer's blocks and its last drain."""
    import torch
    import transformers.models.llama.modeling_llama as llama

    from lmtrace.archive import sink, writer
    from lmtrace.capture import attention_rows, probe_arrays, probes, tracer

    llama.LlamaForCausalLM.__call__ = timed("forward", timed_forward(torch.nn.Module.__call__))
    tracer.choose = timed("choose", tracer.choose)
    probes.Probes.collect = timed("collect", probes.Probes.collect)
    probe_arrays.topk_last = timed("ffn_topk", probe_arrays.topk_last)
    attention_rows.BatchedRows.rows = timed("attention_rows", attention_rows.BatchedRows.rows)
    sink.BlockSink.on_step = timed("sink", sink.BlockSink.on_step)
    tracer.Tracer.run_batch = timed("run_batch", tracer.Tracer.run_batch)
    writer.ArchiveWriter.write_block = timed("writer_block", writer.ArchiveWriter.write_block)  # the writer's thread
    writer.BackgroundWriter.drain = timed("drain", writer.BackgroundWriter.drain)


def per_step_ms(batches: int) -> dict:
    """Where a batch's time goes, in ms (module docstring); reads the calls kept so far."""
    import statistics

    def median(name: str) -> float | None:
        calls = CALL_WALL.get(name)
        return round(statistics.median(calls) * 1e3, 2) if calls else None

    # a step's capture: choose + collect + sink (no collect with `capture: none`)
    phases_run = [name for name in ("choose", "collect", "sink") if CALL_WALL.get(name)]
    steps = [sum(parts) for parts in zip(*(CALL_WALL[name] for name in phases_run))]
    typical = statistics.median(steps) if steps else 0.0
    out = {
        name: median(name)
        for name in (
            "lmtrace_forward_decode",
            "floor_forward_decode",
            "lmtrace_forward_prefill",
            "floor_forward_prefill",
            "choose",
            "collect",
            "ffn_topk",
            "attention_rows",
            "sink",
        )
    }
    out["capture_excess_per_batch"] = round(sum(max(0.0, t - typical) for t in steps) * 1e3 / max(batches, 1), 1)
    out["writer_cpu_per_block"] = round(CPU["writer_block"] * 1e3 / max(CALLS["writer_block"], 1), 1)
    out["final_drain"] = round(CALL_WALL["drain"][-1] * 1e3, 1) if CALL_WALL["drain"] else None
    return out


def phases() -> dict:
    out = {name: round(CPU[name], 3) for name in CPU if name not in WRITER_PHASES}
    out.update({name + "_wall": round(WALL[name], 3) for name in WALL if name not in WRITER_PHASES})
    CPU.clear()
    WALL.clear()
    CALLS.clear()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's own)")
    ap.add_argument("--capture-none", action="store_true", help="`capture: none` (forward-only) instead of the default")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.update({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    instrument()
    from lmtrace.cli.main import run

    with tempfile.TemporaryDirectory(prefix="lmtrace-phases-") as tmp:
        tmp = Path(tmp)
        spec = write_spec(
            tmp / "spec.json", write_prompts(tmp / "prompts.jsonl", args.prompts), args.tokens, args.batch, None
        )
        if args.capture_none:
            spec.write_text(json.dumps({**json.loads(spec.read_text()), "capture": "none"}))
        # one process, where its phases are measured (a run this size is split by default: --workers)
        argv = ["generate", str(spec), "--run-id", "phases", "--runs-dir", str(tmp / "runs"), "--workers", "1", "-q"]
        sys.argv = ["lmtrace", *argv]
        t0 = time.thread_time()
        try:
            run()
        except SystemExit as done:
            if done.code:
                raise
        result = {
            "torch_threads": torch.get_num_threads(),
            "lmtrace": {"main_thread": round(time.thread_time() - t0, 3)},
        }
        floor, batches = Floor(), plan_batches(tmp / "runs" / "phases")
        steps = per_step_ms(len(batches))  # before `phases` clears the CPU times
        result["lmtrace"].update(phases())
        SIDE[0] = "floor_warmup"
        floor.seconds(spec, batches[:1], 2)  # the model loaded and warm
        phases()
        SIDE[0] = "floor"
        t0 = time.thread_time()
        seconds = floor.seconds(spec, batches, args.tokens)["seconds"]
        result["floor"] = {"main_thread": round(time.thread_time() - t0, 3), "generate_wall": seconds, **phases()}
        steps.update({k: v for k, v in per_step_ms(len(batches)).items() if k.startswith("floor_")})
        result["per_step_ms"] = steps
    result["load_average"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
