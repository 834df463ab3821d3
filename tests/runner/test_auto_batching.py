"""`generation.batch_size: auto` and `generation.memory_budget`: batches sized to the budget, a batch
that runs out of memory split in halves (the test-only LMTRACE_TEST_OOM_AT stands in for CUDA's
out-of-memory error), losing and duplicating no sequence, resumable after a kill at the split."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from lmtrace.archive.reader import Run
from lmtrace.exits.errors import LmtraceError, SpecError
from lmtrace.runner.batching import Batch
from lmtrace.runner.generation import run_generate
from lmtrace.spec.run_spec import build_spec

PROMPTS = ["The cat", "Paris is the capital of", "One, two, three,", "Hello", "A long story about a dog"]


def _data(tmp_path: Path, model: Path, run_id: str, **generation) -> dict:
    return {
        "model": {"ref": str(model), "device": "cpu"},
        "prompts": PROMPTS,
        "generation": {"max_new_tokens": 6, **generation},
        "capture": {"residual": {"vectors_at": [1]}},
        "output": {"runs_dir": str(tmp_path / "runs"), "run_id": run_id, "chunk_steps": 2},
    }


def _run(tmp_path, model, run_id, **generation) -> Run:
    data = _data(tmp_path, model, run_id, **generation)
    return Run(run_generate(build_spec(data, "test-spec"), yaml.safe_dump(data)).run_dir)


def _events(run: Run, name: str) -> list[dict]:
    return [e for e in map(json.loads, (run.path / "log.jsonl").read_text().splitlines()) if e.get("event") == name]


def assert_same_as(reference: Run, run: Run) -> None:
    """Every table (in key order) and array equal to the batch-size-1 run: token ids exactly, floats to
    float noise (a batch pads its prompts on the left)."""
    order = {"tokens": ["sequence", "position"], "steps": ["sequence", "step", "layer"], "sequences": ["sequence"]}
    for table, keys in order.items():  # rows in part order: by batch, then step
        a, b = (
            r.table(table).to_pandas().sort_values(keys, kind="stable").reset_index(drop=True) for r in (reference, run)
        )
        assert list(a.columns) == list(b.columns) and len(a) == len(b), table
        for column in a.columns:
            if column == "batch":  # the batch a sequence ran in
                continue
            x, y = a[column], b[column]
            if x.dtype.kind == "f":
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5, err_msg=f"{table}.{column}")
            elif x.dtype == object and any(isinstance(u, np.ndarray) and u.dtype.kind == "f" for u in x):
                for u, v in zip(x, y):  # float lists (alternatives' logprobs); null on prompt rows
                    assert (u is None) == (v is None), f"{table}.{column}"
                    if u is not None:
                        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5, err_msg=f"{table}.{column}")
            else:
                assert [str(v) for v in x] == [str(v) for v in y], f"{table}.{column}"
    assert reference.array_names() == run.array_names()
    for name in reference.array_names():
        a, b = reference.tensors[name][...], run.tensors[name][...]
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=2e-3, atol=2e-3, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.fixture(scope="module")
def batch_of_one(tmp_path_factory, tiny_llama_dir) -> Run:
    return _run(tmp_path_factory.mktemp("one"), tiny_llama_dir, "one", batch_size=1)


def _footprint_shape(n_sequences: int):
    """A run of 4-head layers (2 KV heads), prompts of 5 and 10 new tokens: what the footprint tests size."""
    from lmtrace.archive.layout import RunShape

    return RunShape(
        n_sequences=n_sequences,
        n_steps=10,
        max_prompt=5,
        layers=(),
        resid_layers=(),
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_model=64,
        d_ffn=128,
        kv_head_of_head=(0, 0, 1, 1),
    )


def test_auto_batching_under_injected_oom_equals_batch_size_one(tmp_path, tiny_llama_dir, batch_of_one, monkeypatch):
    # a budget every prompt fits in at once; then an out-of-memory error at step 3 in every batch of
    # more than one sequence (blocks of 2 steps: steps 0-3 are committed): 5 -> 2 + 3 -> 1 + 1, 1 + 2 -> 1 + 1,
    # each half continuing from step 4
    monkeypatch.setenv("LMTRACE_TEST_OOM_AT", "3:1")
    run = _run(tmp_path, tiny_llama_dir, "auto", batch_size="auto", memory_budget="64GiB")
    assert run.status == "complete"
    splits = _events(run, "batch_split")
    assert [(e["batch"], e["size"], e["sizes"]) for e in splits] == [
        (0, 5, [2, 3]),
        (0, 2, [1, 1]),
        (2, 3, [1, 2]),
        (3, 2, [1, 1]),
    ]
    assert all(e["reason"].startswith("out of memory") and e["from_step"] == 4 for e in splits)
    done = _events(run, "batch_done")
    assert sorted(s for e in done for s in e["sequences"]) == list(range(len(PROMPTS)))  # none lost, none twice
    assert_same_as(batch_of_one, run)


def test_a_budget_splits_fixed_batches_and_sizes_auto_ones_and_one_sequence_over_it_fails(
    tmp_path, tiny_llama_dir, batch_of_one
):
    from lmtrace.runner.batching import Footprint

    run = _run(tmp_path, tiny_llama_dir, "fixed", batch_size=4, memory_budget="1MB")
    splits = _events(run, "batch_split")
    assert splits and all("exceeds generation.memory_budget 1MB" in e["reason"] for e in splits)
    sizes = [len(e["sequences"]) for e in _events(run, "batch_done")]
    assert sum(sizes) == len(PROMPTS) and max(sizes) < 4
    assert_same_as(batch_of_one, run)

    auto = _run(tmp_path, tiny_llama_dir, "auto", batch_size="auto", memory_budget="1MB")
    assert not _events(auto, "batch_split")  # sized to fit from the start
    assert [len(e["sequences"]) for e in _events(auto, "batch_done")] == sizes

    with pytest.raises(
        LmtraceError,
        match=r"sequence 0 alone does not fit generation.memory_budget 10KB \(it needs "
        r"about .*\): .*raise the budget \(--memory-budget\)",
    ):
        _run(tmp_path, tiny_llama_dir, "tiny", batch_size="auto", memory_budget="10KB")
    assert Footprint  # the footprint's arithmetic is documented in docs/batch.md


ENV = {"OMP_NUM_THREADS": "1"}


def test_a_kill_at_a_split_resumes_to_the_same_archive(tmp_path, tiny_llama_dir, batch_of_one):
    data = _data(tmp_path, tiny_llama_dir, "killed", batch_size="auto", memory_budget="64GiB")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    env = {**os.environ, **ENV, "LMTRACE_TEST_OOM_AT": "3:2", "LMTRACE_TEST_KILL_AT": "batch-split"}
    cmd = [sys.executable, "-m", "lmtrace.cli", "generate", str(spec), "-q"]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr
    run_dir = tmp_path / "runs" / "killed"
    assert [e["sizes"] for e in _events(Run(run_dir), "batch_split")] == [[2, 3]]
    env.pop("LMTRACE_TEST_KILL_AT")  # the same faults again: the 3-sequence half splits once more
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmtrace.cli",
            "generate",
            "--resume",
            "killed",
            "-q",
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr
    run = Run(run_dir)
    assert [e["sizes"] for e in _events(run, "batch_split")] == [[2, 3], [1, 2]]
    assert run.status == "complete"
    assert_same_as(batch_of_one, run)
    verify = subprocess.run(
        [sys.executable, "-m", "lmtrace.cli", "verify", str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_out_of_memory_error_splits_the_batch(tmp_path, tiny_llama_dir, monkeypatch):
    """On CUDA: the footprint is measured (peak allocation growth) and the injected error is caught
    where torch.cuda.OutOfMemoryError is; the archive equals a batch-size-1 CUDA run."""
    data = _data(tmp_path, tiny_llama_dir, "cuda-one", batch_size=1)
    data["model"]["device"] = "cuda"
    one = Run(run_generate(build_spec(data, "t"), yaml.safe_dump(data)).run_dir)
    data = _data(tmp_path, tiny_llama_dir, "cuda-auto", batch_size="auto", memory_budget="1TB")
    data["model"]["device"] = "cuda"
    monkeypatch.setenv("LMTRACE_TEST_OOM_AT", "3:1")
    run = Run(run_generate(build_spec(data, "t"), yaml.safe_dump(data)).run_dir)
    assert run.manifest["timings"]["peak_gpu_memory_bytes"]
    assert sorted(s for e in _events(run, "batch_done") for s in e["sequences"]) == list(range(len(PROMPTS)))
    assert_same_as(one, run)


def test_a_cuda_out_of_memory_error_is_caught_and_splits_the_batch(tmp_path, tiny_llama_dir, batch_of_one, monkeypatch):
    """torch.cuda.OutOfMemoryError itself (raised here by the forward of any batch over 2 sequences,
    as CUDA would), on the CPU: the batch is split, the archive equals batch size 1."""
    from lmtrace.capture.tracer import Tracer

    real = Tracer.run_batch

    def run_batch(self, seq_ids, *args, **kw):
        if len(seq_ids) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, seq_ids, *args, **kw)

    monkeypatch.setattr(Tracer, "run_batch", run_batch)
    run = _run(tmp_path, tiny_llama_dir, "cuda-oom", batch_size=5)
    assert [(e["size"], e["sizes"], e["reason"]) for e in _events(run, "batch_split")] == [
        (5, [2, 3], "out of memory (CUDA)"),
        (3, [1, 2], "out of memory (CUDA)"),
    ]
    assert_same_as(batch_of_one, run)


def test_measured_footprints_size_the_batches_and_a_recorded_plan_resumes_as_recorded(tmp_path):
    """The CUDA path's arithmetic without a GPU: one sequence first, then as many as its measured
    peak growth per sequence and position lets the budget hold; and the plan file's records."""
    from lmtrace.archive.batch_plan import read_plan
    from lmtrace.runner.batching import Batch, BatchQueue, Footprint

    (tmp_path / "progress").mkdir()
    footprint = Footprint(
        shape=None, n_layers=0, dtype_bytes=0, vocab=0, max_new=10, chunk_steps=1, chunk_keys=None, measured=True
    )
    lens = {s: 5 for s in range(100)}
    committed = {}
    queue = BatchQueue(
        tmp_path,
        "shard-0-of-1",
        list(range(100)),
        "auto",
        1000 * 15 * 7,
        lens,
        footprint,
        lambda key: committed.get(key, (0, False)),
    )
    first = next(queue)
    assert first.seqs == [0]  # nothing measured yet
    footprint.observe(1, 5, 1000 * 15)  # 1000 bytes per position, 15 positions
    assert len(next(queue).seqs) == 7  # 7 x 15,000 bytes fit the 105,000 budget

    # records: the batch [8..15] ran, committed 4 steps, was split; a kill; the plan resumes as recorded
    queue.record(Batch(list(range(8, 16))))
    committed[8] = (4, False)
    queue.split(Batch(list(range(8, 16))), 4)
    assert {k: (b.seqs, b.from_step) for k, b in read_plan(tmp_path).items()} == {
        8: ([8, 9, 10, 11], 4),
        12: ([12, 13, 14, 15], 4),
    }
    resumed = BatchQueue(
        tmp_path,
        "shard-0-of-1",
        list(range(100)),
        "auto",
        1000 * 15 * 7,
        lens,
        footprint,
        lambda key: committed.get(key, (0, False)),
    )
    batches = list(resumed)
    assert [b.seqs for b in batches[:2]] == [list(range(0, 7)), [7]]  # before the recorded ones: cut anew
    assert [(b.seqs, b.from_step) for b in batches[2:4]] == [([8, 9, 10, 11], 4), ([12, 13, 14, 15], 4)]
    assert sorted(s for b in batches for s in b.seqs) == list(range(100))


def test_an_intervene_child_split_by_out_of_memory_equals_one_that_was_not(tmp_path, tiny_llama_dir, monkeypatch):
    """A child's effects table keeps one row per sequence and step when a batch is split."""
    from lmtrace.commands.intervene import run_intervene

    data = _data(tmp_path, tiny_llama_dir, "parent", batch_size=5)
    data["capture"] = "none"
    parent = run_generate(build_spec(data, "t"), yaml.safe_dump(data))
    edit = [{"kind": "ablate_layer", "layer": 1}]
    whole, whole_effects = run_intervene(str(parent.run_dir), edit, mode="regenerate", run_id="whole")
    monkeypatch.setenv("LMTRACE_TEST_OOM_AT", "3:2")
    split, split_effects = run_intervene(str(parent.run_dir), edit, mode="regenerate", run_id="split")
    assert [e["sizes"] for e in _events(Run(split.run_dir), "batch_split")] == [[2, 3], [1, 2]]
    keys = [("sequence", "ascending"), ("step", "ascending")]
    a, b = whole_effects.sort_by(keys).to_pandas(), split_effects.sort_by(keys).to_pandas()
    assert len(a) == len(b) and list(a.columns) == list(b.columns)
    for column in a.columns:
        if a[column].dtype.kind == "f":
            np.testing.assert_allclose(a[column], b[column], rtol=1e-4, atol=1e-5, err_msg=column)
        else:
            assert [str(v) for v in a[column]] == [str(v) for v in b[column]], column


def test_a_cpu_footprint_starts_at_a_quarter_of_the_budget_and_is_calibrated_by_the_measured_growth(tmp_path):
    """CPU: the computed footprint is the first guess, the first batch takes a quarter of the budget by
    it; a measured growth three times the computed one sizes the next batches to a third of what the
    computed footprint would let in (to HEADROOM of the budget); a growth RSS cannot resolve changes
    nothing; RSS still held from earlier batches is taken off the budget; a batch grows at most
    GROWTH times past the largest measured one."""
    from lmtrace.runner.batching import GROWTH, HEADROOM, MAX_BATCH, RSS_RESOLUTION, BatchQueue, Footprint

    (tmp_path / "progress").mkdir()
    shape = _footprint_shape(20_000)

    def cpu_queue():
        footprint = Footprint(
            shape, n_layers=4, dtype_bytes=4, vocab=1000, max_new=10, chunk_steps=2, chunk_keys=None, measured=False
        )
        return footprint, BatchQueue(
            tmp_path,
            "shard-0-of-1",
            list(range(20_000)),
            "auto",
            budget,
            {s: 5 for s in range(20_000)},
            footprint,
            lambda key: (0, False),
        )

    budget = 16 * RSS_RESOLUTION  # 256 MiB
    footprint, queue = cpu_queue()
    per_seq = footprint.computed(1, 5)  # the first guess, a sequence of 5 prompt + 10 new positions
    assert budget // 3 // per_seq < MAX_BATCH  # the budget, not the cap, sizes the batches below

    first = next(queue)
    assert len(first.seqs) == budget // 4 // per_seq  # a quarter of the budget, by the computed footprint
    footprint.observe(len(first.seqs), 5, RSS_RESOLUTION - 1)  # under the resolution: not a measurement
    assert len(next(queue).seqs) == budget // 4 // per_seq

    footprint.observe(len(first.seqs), 5, 3 * per_seq * len(first.seqs))  # it took 3x the computed footprint
    second = next(queue)
    assert len(second.seqs) == int(budget * HEADROOM) // (3 * per_seq) < GROWTH * len(first.seqs)
    assert footprint.bytes(len(second.seqs), 5) <= budget * HEADROOM < footprint.bytes(len(second.seqs) + 1, 5)
    footprint.observe(len(second.seqs), 5, per_seq * len(second.seqs))  # less than before: the largest rate stays
    assert len(next(queue).seqs) == int(budget * HEADROOM) // (3 * per_seq)
    footprint.retained = budget // 2  # the allocator kept half the budget after the last batch
    assert len(next(queue).seqs) == int((budget - budget // 2) * HEADROOM) // (3 * per_seq)
    footprint.retained = budget  # all of it: one sequence at a time, not a refusal
    assert len(next(queue).seqs) == 1

    # a batch planned before the measurement (a resume's recorded one), now over the budget, is split
    assert queue.over_budget(Batch(list(range(budget // per_seq)))) == 3 * per_seq * (budget // per_seq)

    # 200 sequences grew 100 MiB: the budget would let 409 in, twice the measured batch is the most
    footprint, queue = cpu_queue()
    footprint.observe(200, 5, 100 << 20)
    assert int(budget * HEADROOM) * 200 // (100 << 20) > 2 * 200
    assert len(next(queue).seqs) == GROWTH * 200


def test_a_small_cpu_footprint_never_calibrates_below_the_computed_one_nor_below_the_resolution(tmp_path):
    """A measured growth under the computed footprint leaves the computed one (the larger is used);
    budgets under 4x the RSS resolution are sized by the computed footprint alone, from the first batch
    to the last."""
    from lmtrace.runner.batching import HEADROOM, RSS_RESOLUTION, Footprint

    shape = _footprint_shape(1)
    footprint = Footprint(
        shape, n_layers=4, dtype_bytes=4, vocab=1000, max_new=10, chunk_steps=2, chunk_keys=None, measured=False
    )
    assert footprint.sizing_budget(4 * RSS_RESOLUTION - 1) == 4 * RSS_RESOLUTION - 1
    assert footprint.sizing_budget(8 * RSS_RESOLUTION) == 2 * RSS_RESOLUTION
    n = 4 * RSS_RESOLUTION // footprint.computed(1, 5)
    footprint.observe(n, 5, 4 * RSS_RESOLUTION // 2)  # half the computed footprint
    assert footprint.sizing_budget(8 * RSS_RESOLUTION) == int(8 * RSS_RESOLUTION * HEADROOM)  # measured
    assert footprint.bytes(n, 5) == footprint.computed(n, 5)

    # a run whose budget RSS cannot resolve: what the process holds after a batch (allocator arenas,
    # lazily loaded code) and a growth over the resolution leave the computed sizing as it was
    small = Footprint(
        shape,
        n_layers=4,
        dtype_bytes=4,
        vocab=1000,
        max_new=10,
        chunk_steps=2,
        chunk_keys=None,
        measured=False,
        budget=1_000_000,
    )
    small.retained = 400_000
    small.observe(2, 5, 2 * RSS_RESOLUTION)
    assert small.sizing_budget(1_000_000) == 1_000_000
    assert small.bytes(2, 5) == small.computed(2, 5)


def test_peak_rss_sees_a_transient_allocation_freed_before_the_end():
    """The peak over a stretch includes memory allocated and freed within it (a batch's prefill
    transients): a 128 MiB buffer touched, held until the sampler has read RSS twice, and freed."""
    import mmap

    from lmtrace.runner.peak_rss import PeakRss, rss_bytes

    size = 128 << 20
    before = rss_bytes()
    with PeakRss() as p:
        # mapped and unmapped here, not through malloc, which (runner/allocator.py, once a model was
        # loaded in this process) keeps freed memory for reuse
        buffer = mmap.mmap(-1, size)
        pages = np.frombuffer(buffer, dtype=np.uint8)
        pages[:] = 1  # every page touched, no temporary of that size
        del pages
        seen = p.samples
        for _ in range(10_000):  # the sampler reads every 5 ms; wait for two readings (not a timing check)
            if p.samples >= seen + 2:
                break
            time.sleep(0.001)
        buffer.close()
    assert rss_bytes() - before < size / 2  # freed: the end of the stretch alone would not show it
    assert p.peak - before >= size * 0.9


def test_cpu_batches_feed_their_peak_rss_growth_to_the_footprint(tmp_path, tiny_llama_dir, monkeypatch):
    """On the CPU with a budget the loop measures each batch's peak RSS, hands its growth over the
    batch to the footprint, logs the peak above the process's RSS before the first batch with the batch
    (`peak_growth`), and leaves the RSS still held after it as the footprint's `retained`."""
    from lmtrace.runner.batching import Footprint

    seen: list[tuple[int, int, int]] = []
    real_observe = Footprint.observe

    def observe(self, n, longest, growth):
        seen.append((n, growth, self.retained))
        real_observe(self, n, longest, growth)

    monkeypatch.setattr(Footprint, "observe", observe)
    run = _run(tmp_path, tiny_llama_dir, "measured", batch_size=2, memory_budget="64GiB")
    done = _events(run, "batch_done")
    assert [len(e["sequences"]) for e in done] == [n for n, _, _ in seen] == [2, 2, 1]
    assert all(isinstance(e["peak_growth"], int) and isinstance(g, int) for e, (_, g, _) in zip(done, seen))
    assert seen[0][2] == 0 and all(r >= 0 for _, _, r in seen)  # nothing held before the first batch


def _mem_available() -> int:
    """/proc/meminfo's MemAvailable in bytes, read here, independently of lmtrace."""
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="reads MemAvailable from /proc (Linux)")
def test_auto_without_a_budget_validates_and_generates_with_half_the_available_ram(
    tmp_path, tiny_llama_dir, batch_of_one
):
    data = _data(tmp_path, tiny_llama_dir, "auto-free", batch_size="auto")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "lmtrace.cli"]
    valid = subprocess.run([*cli, "validate", str(spec), "--json"], capture_output=True, text=True, env=env)
    assert valid.returncode == 0, valid.stderr
    note = json.loads(valid.stdout)["memory_budget"]
    assert note["share_ram"] == 0.5 and "50% of the RAM available once the model is loaded" in note["text"], note
    before = _mem_available()
    proc = subprocess.run([*cli, "generate", str(spec)], capture_output=True, text=True, env=env)
    after = _mem_available()
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "memory budget" in x]
    assert len(lines) == 1 and "batch_size: auto: memory budget auto (" in lines[0], proc.stderr
    run = Run(tmp_path / "runs" / "auto-free")
    chosen = run.manifest["memory_budget"]
    assert chosen["from"] == "auto" and chosen["memory"] == "ram", chosen
    # half of what was available while the run started (the machine's other processes move it: 10 % slack)
    low, high = sorted((before, after))
    assert 0.5 * low * 0.9 <= chosen["bytes"] <= 0.5 * high * 1.1, (chosen, before, after)
    assert run.manifest["spec_resolved"]["generation"]["memory_budget"] is None  # a resume chooses again
    assert_same_as(batch_of_one, run)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_without_a_budget_on_cuda_takes_80_percent_of_the_free_device_memory(tmp_path, tiny_llama_dir):
    data = _data(tmp_path, tiny_llama_dir, "cuda-free", batch_size="auto")
    data["model"]["device"] = "cuda"
    before = torch.cuda.mem_get_info(0)[0]
    run = Run(run_generate(build_spec(data, "t"), yaml.safe_dump(data)).run_dir)
    after = torch.cuda.mem_get_info(0)[0]
    chosen = run.manifest["memory_budget"]
    assert chosen["from"] == "auto" and chosen["memory"] == "cuda", chosen
    low, high = sorted((before, after))  # (the tiny model and the run's cache take a few MB of it)
    assert 0.8 * low * 0.95 <= chosen["bytes"] <= 0.8 * high * 1.05, (chosen, before, after)


def test_auto_without_a_budget_on_cuda_sums_the_free_memory_of_each_gpu_once(monkeypatch):
    """The CUDA choice on any machine: torch.cuda's free memory stood in for, two GPUs (the model's
    `cuda` and `cuda:0` are one of them)."""
    from lmtrace.runner.batching import memory_budget
    from lmtrace.spec.run_spec import GenerationSpec

    free = {0: 10 * 2**30, 1: 6 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    chosen = memory_budget(
        GenerationSpec(batch_size="auto"), [torch.device("cuda"), torch.device("cuda", 0), torch.device("cuda", 1)]
    )
    assert chosen.bytes == int(0.8 * 16 * 2**30)
    assert chosen.record == {
        "bytes": chosen.bytes,
        "from": "auto",
        "share": 0.8,
        "free_bytes": 16 * 2**30,
        "memory": "cuda",
    }
    assert "80% of the 16.0 GB free on cuda:0, cuda:1" in chosen.text, chosen.text
    given = memory_budget(GenerationSpec(batch_size="auto", memory_budget="8GiB"), [torch.device("cuda", 0)])
    assert (given.bytes, given.record["from"]) == (8 * 2**30, "generation.memory_budget")
    assert memory_budget(GenerationSpec(batch_size=4), [torch.device("cuda", 0)]) is None


def test_the_processes_of_generate_workers_share_the_budget_given_or_chosen(monkeypatch):
    """LMTRACE_WORKERS (set by `generate --workers N`) splits the budget N ways: the one given, and
    the one chosen from the free memory (torch.cuda's free memory stood in for)."""
    from lmtrace.runner.batching import memory_budget
    from lmtrace.spec.run_spec import GenerationSpec

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (10 * 2**30, 80 * 2**30))
    monkeypatch.setenv("LMTRACE_WORKERS", "4")
    given = memory_budget(GenerationSpec(batch_size="auto", memory_budget="8GiB"), [])
    assert given.record == {"bytes": 2 * 2**30, "from": "generation.memory_budget", "workers": 4}
    assert given.bytes == 2 * 2**30 and given.text.startswith("8GiB / 4 workers: "), given.text
    chosen = memory_budget(GenerationSpec(batch_size="auto"), [torch.device("cuda", 0)])
    assert chosen.bytes == int(0.8 * 10 * 2**30) // 4
    assert (chosen.record["share"], chosen.record["free_bytes"], chosen.record["workers"]) == (0.8, 10 * 2**30, 4)
    assert memory_budget(GenerationSpec(batch_size=4), []) is None
    monkeypatch.setenv("LMTRACE_WORKERS", "0")
    with pytest.raises(SpecError, match="LMTRACE_WORKERS=0: give the number of this run's processes"):
        memory_budget(GenerationSpec(batch_size="auto", memory_budget="8GiB"), [])
