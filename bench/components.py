"""Where the default capture's time goes, per generated token: a wall-clock timer around each piece.

Runs, in one process, the benchmark's floor (bench.floor_generate) and `run_generate` with the
default capture on the embedded model (64-token prompt, greedy, N new tokens), and reports the
milliseconds per step spent inside each capture tap, the attention observer, `Probes.collect`,
the token statistics, the step sink and the archive writer (the writer's rows run on its own
thread: they overlap the forward, but compete with it for the CPU). The timers add ~1 µs per call
(~0.2 ms a step); "extra" is the whole run's excess over the floor, timers included.

    .venv/bin/python bench/components.py            # N=96, two repeats
    .venv/bin/python bench/components.py --tokens 256 --repeats 3
    .venv/bin/python bench/components.py --head-dla   # the default capture plus capture.head_dla: its
                                                      # own pieces are the lines marked "head_dla"

docs/archive.md ("Cost") quotes this script's output. Like `bench.py`, it is only meaningful on an
otherwise idle machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import yaml  # noqa: E402

import bench  # noqa: E402
from lmtrace.archive import sink, writer  # noqa: E402
from lmtrace.capture import attention, attention_rows, probes, tracer  # noqa: E402
from lmtrace.runner import generation as gen  # noqa: E402
from lmtrace.runner.models import load_model  # noqa: E402
from lmtrace.spec.run_spec import ModelSpec, build_spec  # noqa: E402

SECONDS: dict[str, float] = {}


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[name] = SECONDS.get(name, 0.0) + time.perf_counter() - t0

    return wrapper


def instrument() -> None:
    P = probes.Probes
    for name in ("_block_tap", "_ffn_tap"):  # tap factories: time the taps they return
        make = getattr(P, name)
        setattr(P, name, lambda self, layer, *a, _make=make, _name=name: timed(f"tap {_name}", _make(self, layer, *a)))
    make_output = P._output_tap
    P._output_tap = lambda self, store, layer: timed(
        "tap _output_tap (attn/mlp outputs)", make_output(self, store, layer)
    )
    P.observe = timed("attention observer (Probes.observe)", P.observe)
    make_input = P._input_tap  # only with capture.head_dla: o_proj inputs, block 0's input, the final norm's input
    P._input_tap = lambda self, store, key: timed("head_dla: input taps", make_input(self, store, key))
    P._direct_logit_attribution = timed(
        "head_dla: Probes._direct_logit_attribution (in collect)", P._direct_logit_attribution
    )
    P.collect = timed("Probes.collect (incl. batched rows)", P.collect)
    attention_rows.BatchedRows.rows = timed("  BatchedRows.rows", attention_rows.BatchedRows.rows)
    attention_rows.BatchedRows.offer = timed("  BatchedRows.offer (in the observer)", attention_rows.BatchedRows.offer)
    attention._lmtrace_attention = timed("lmtrace attention fn (sdpa + observer)", attention._lmtrace_attention)
    tracer.choose = timed("token statistics (sampling.choose)", tracer.choose)
    sink.BlockSink.on_step = timed("step sink (BlockSink.on_step)", sink.BlockSink.on_step)
    sink.BlockSink._write = timed("writer thread: block (tables + arrays + commit)", sink.BlockSink._write)
    writer.ArchiveWriter._put = timed("  writer thread: array chunks", writer.ArchiveWriter._put)
    writer.ArchiveWriter._write_part = timed("  writer thread: parquet parts", writer.ArchiveWriter._write_part)
    writer.ArchiveWriter._commit = timed("  writer thread: sync + progress", writer.ArchiveWriter._commit)
    run = writer.BackgroundWriter._run

    def cpu_timed_run(self):  # the writer thread's own CPU time, whatever it waited for
        t0 = time.thread_time()
        try:
            return run(self)
        finally:
            SECONDS["writer thread CPU (all its work)"] = (
                SECONDS.get("writer thread CPU (all its work)", 0.0) + time.thread_time() - t0
            )

    writer.BackgroundWriter._run = cpu_timed_run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--head-dla", action="store_true", help="also capture per-head direct logit attribution")
    args = p.parse_args()
    n = args.tokens
    instrument()
    bench.set_threads()
    loaded = load_model(ModelSpec())
    prompt, prompt_ids = bench.make_prompt(loaded.tokenizer)
    floor_ids, _ = bench.floor_generate(loaded.model, prompt_ids, n)
    eos = bench.pick_eos(loaded.model.config.vocab_size, set(floor_ids))
    runs = tempfile.mkdtemp(prefix="lmtrace-components-")
    try:
        for rep in range(args.repeats):
            floor_s = min(bench.floor_generate(loaded.model, prompt_ids, n)[1] for _ in range(2))
            data = bench.spec_data("default", prompt, n, eos, runs)
            if args.head_dla:
                data["capture"] = {"head_dla": True}
            SECONDS.clear()
            result = gen.run_generate(build_spec(data, "components"), yaml.safe_dump(data), progress=gen.Progress())
            generate_s = json.loads((Path(result.run_dir) / "manifest.json").read_text())["timings"]["generate_s"]
            shutil.rmtree(result.run_dir)
            print(
                f"repeat {rep + 1}: floor {floor_s / n * 1000:.1f} ms/step, default capture {generate_s / n * 1000:.1f} "
                f"ms/step (extra {(generate_s - floor_s) / n * 1000:.1f}, ratio {floor_s / generate_s:.3f})"
            )
            for name, s in sorted(SECONDS.items(), key=lambda kv: -kv[1]):
                print(f"    {name:52s} {s / n * 1000:6.2f} ms/step")
    finally:
        shutil.rmtree(runs, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
