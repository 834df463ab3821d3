"""Which sequences run together: fixed-size batches, or `batch_size: auto` sized to a memory budget,
and the split of a batch that runs out of memory.

A batch is named by its first sequence index (its table parts and its entry in the writer's
progress file). Before a batch runs, its sequences are appended to `progress/<shard>.plan.jsonl`
(with `from_step`: steps its sequences committed in the batch they were split from), so a resume
runs every batch that committed anything with exactly the sequences it had; the sequences of no
such batch are planned again. A batch that runs out of memory (a CUDA out-of-memory error, or on
the CPU a footprint over the budget) is split in halves, each continuing from the steps
the batch had committed, teacher-forced like a resume: no sequence is lost or run twice.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from ..archive.batch_plan import Batch, plan_path, read_plan, record_batch
from ..exits.errors import LmtraceError, SpecError
from ..exits.faults import oom_at

MAX_BATCH = 4096
# blocks of captured arrays a sequence holds at once: the one being filled and the writer's queue (depth 2)
BLOCKS_IN_MEMORY = 3
# CPU: until a batch's RSS growth is measured, batches take 1/PROBE_SHARE of the budget by the computed footprint
PROBE_SHARE = 4
# CPU: an RSS growth below this says nothing about a batch (allocator arenas, lazily loaded code, the
# writer's buffers move RSS this much); budgets under PROBE_SHARE times it are sized by the computed footprint
RSS_RESOLUTION = 16 << 20
# CPU, measured: a batch takes at most this share of what is left of the budget, and at most GROWTH times the
# largest batch measured. A small batch's RSS growth undercounts a larger one's (memory the allocator freed
# earlier absorbs part of it): on SmolLM2-135M with a 512 MiB budget, 29 sequences grew RSS by 129 MiB, and the
# 87 sized from that rate without these margins peaked 588 MiB above the start
HEADROOM = 0.8
GROWTH = 2


class BatchOutOfMemory(Exception):
    """A batch did not fit: CUDA ran out of memory, or (CPU) its footprint exceeds the budget."""


class Footprint:
    """Bytes a batch takes beyond the model. CUDA (`measured`): the peak allocation growth per sequence
    and position, the largest seen; nothing before the first batch. CPU: computed (KV cache, capture
    blocks, prefill transients) as the first guess, then calibrated by the peak RSS growth of the
    batches that ran (the larger of the two): the arithmetic misses what the allocator and torch's
    temporaries hold. Until a CPU batch is measured, batches are cut to a quarter of the budget; the
    RSS the process still holds above its start (`retained`: memory the allocator kept from earlier
    batches, which a batch may not be able to reuse) is taken off the budget when a batch is cut. A CPU
    `budget` under PROBE_SHARE x RSS_RESOLUTION is sized by the computed footprint alone: RSS cannot
    resolve what a batch takes there, so neither growths nor the RSS retained are used."""

    def __init__(
        self,
        shape,
        n_layers: int,
        dtype_bytes: int,
        vocab: int,
        max_new: int,
        chunk_steps: int,
        chunk_keys: int | None,
        measured: bool,
        budget: int | None = None,
    ):
        self.shape, self.n_layers, self.dtype_bytes, self.vocab = shape, n_layers, dtype_bytes, vocab
        self.max_new, self.chunk_steps, self.chunk_keys, self.measured = max_new, chunk_steps, chunk_keys, measured
        self.per_position: float | None = None  # measured bytes per sequence and position, the largest seen
        self.retained = 0  # CPU: RSS above the process's when the first batch started, after the last batch
        self.largest_measured = 0  # CPU: sequences in the largest batch whose growth was measured
        self.computed_only = not measured and budget is not None and budget < PROBE_SHARE * RSS_RESOLUTION

    def computed(self, n: int, longest_prompt: int) -> int:
        s = self.shape
        positions = longest_prompt + self.max_new
        kv = 2 * self.n_layers * s.n_kv_heads * s.head_dim * positions * self.dtype_bytes
        blocks = (
            s.estimate_bytes_per_step(self.chunk_steps, self.chunk_keys) * self.chunk_steps * BLOCKS_IN_MEMORY
            if s.layers
            else 0
        )
        # the prefill's largest transients: one layer's attention scores and MLP activations, the logits
        prefill = 4 * (s.n_heads * longest_prompt**2 + 2 * longest_prompt * max(s.d_ffn, s.d_model)) + 8 * self.vocab
        return n * (kv + blocks + prefill)

    def bytes(self, n: int, longest_prompt: int) -> int | None:
        """The batch's footprint; None while a measured (CUDA) footprint has no measurement yet."""
        observed = None if self.per_position is None else int(n * self.per_position * (longest_prompt + self.max_new))
        if self.measured:
            return observed
        return max(self.computed(n, longest_prompt), observed or 0)

    def sizing_budget(self, budget: int) -> int:
        """What the next cut batch may take. CPU: the budget less what earlier batches left held; before a
        batch was measured (with a budget RSS can resolve) a quarter of that, so the first batch fits while
        the computed guess is off; once measured, HEADROOM of it."""
        if self.measured or self.computed_only or budget < PROBE_SHARE * RSS_RESOLUTION:
            return budget
        left = budget - self.retained
        if self.per_position is None:
            return left // PROBE_SHARE
        return int(left * HEADROOM)

    def largest_batch(self) -> int:
        """The most sequences the next cut batch may take: CPU, once measured, GROWTH times the largest
        measured batch, so each batch is measured at no more than twice the scale it was sized from."""
        if self.measured or self.per_position is None:
            return MAX_BATCH
        return min(MAX_BATCH, GROWTH * self.largest_measured)

    def observe(self, n: int, longest_prompt: int, peak_growth: int) -> None:
        """A batch of `n` ran and grew the peak by `peak_growth` bytes above what was held when it
        started (CUDA: allocated; CPU: RSS). On the CPU a growth under RSS_RESOLUTION says nothing about
        the batch (RSS moves that much for other reasons) and is not used, nor is any growth when the
        budget itself is under what RSS resolves (`computed_only`)."""
        if not self.measured and (peak_growth < RSS_RESOLUTION or self.computed_only):
            return
        self.largest_measured = max(self.largest_measured, n)
        rate = peak_growth / max(1, n * (longest_prompt + self.max_new))
        self.per_position = max(self.per_position or 0.0, rate)

    def did_not_fit(self, n: int, longest_prompt: int, budget: int) -> None:
        """A measured footprint after a batch of `n` ran out of memory: at least so much that it exceeds the
        budget, so the batches cut later are smaller."""
        if self.measured:
            self.per_position = max(self.per_position or 0.0, budget / (n * (longest_prompt + self.max_new)) * 1.001)


class BatchQueue:
    """This shard's batches in sequence order: recorded ones as recorded, the rest cut as they come
    (fixed size, or as many as fit the budget); `split` puts a batch's halves first."""

    def __init__(
        self,
        run_dir: Path,
        shard_key: str,
        my_seqs: list[int],
        size: int | str,
        budget: int | None,
        prompt_lens: dict[int, int],
        footprint: Footprint | None,
        committed,
    ):
        self.path = plan_path(run_dir, shard_key)
        self.size, self.budget, self.prompt_lens, self.footprint = size, budget, prompt_lens, footprint
        recorded = read_plan(run_dir)
        mine = set(my_seqs)
        kept: dict[int, Batch] = {}
        for key, batch in recorded.items():
            steps, done = committed(key)
            if set(batch.seqs) <= mine and (steps or done or batch.from_step):
                kept[key] = batch
        if not recorded and size != "auto":  # a run from before plans: the fixed batches, as then
            kept = {b[0]: Batch(b) for b in (my_seqs[i : i + size] for i in range(0, len(my_seqs), size))}
        # the plan: kept batches, and runs of the other sequences (cut into batches when reached)
        self.items: deque = deque()
        taken = {s for b in kept.values() for s in b.seqs}
        free: list[int] = []
        for s in my_seqs:
            if s in kept:
                if free:
                    self.items.append(free)
                    free = []
                self.items.append(kept[s])
            elif s not in taken:
                free.append(s)
        if free:
            self.items.append(free)
        self.rollback_keys = sorted(set(recorded) & set(my_seqs) | set(kept))

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if not self.items:
            raise StopIteration
        item = self.items.popleft()
        if isinstance(item, Batch):
            return item
        n = self._fitting(item)
        if n < len(item):
            self.items.appendleft(item[n:])
        return Batch(item[:n])

    def _fitting(self, seqs: list[int]) -> int:
        """How many of `seqs` (from the first) the next batch takes."""
        if self.size != "auto":
            return min(self.size, len(seqs))
        n, longest = 0, 0
        budget = self.footprint.sizing_budget(self.budget)
        for s in seqs[: self.footprint.largest_batch()]:
            longest = max(longest, self.prompt_lens[s])
            need = self.footprint.bytes(n + 1, longest)
            if need is None:  # nothing measured yet: one sequence, to measure it
                return 1
            if n and need > budget:
                break
            n += 1
        return max(n, 1)

    def over_budget(self, batch: Batch) -> int | None:
        """The batch's footprint when it exceeds the budget (CPU, or CUDA once measured), else None."""
        if self.budget is None or self.footprint is None:
            return None
        need = self.footprint.bytes(len(batch.seqs), max(self.prompt_lens[s] for s in batch.seqs))
        return need if need is not None and need > self.budget else None

    def record(self, batch: Batch) -> None:
        record_batch(self.path, batch)

    def split(self, batch: Batch, committed_steps: int) -> tuple[Batch, Batch]:
        """The halves of a batch that ran out of memory, both continuing from its committed steps."""
        if self.footprint is not None and self.budget is not None:
            self.footprint.did_not_fit(len(batch.seqs), max(self.prompt_lens[s] for s in batch.seqs), self.budget)
        half = len(batch.seqs) // 2
        start = max(batch.from_step, committed_steps)
        first, second = Batch(batch.seqs[:half], start), Batch(batch.seqs[half:], start)
        record_batch(self.path, second)  # before the first half runs: a resume must not run these again
        record_batch(self.path, first)
        self.items.appendleft(second)
        self.items.appendleft(first)
        return first, second


# `batch_size: auto` without `memory_budget`: the budget is this share of the memory free once the model is
# loaded: RAM (MemAvailable) on the CPU, where the allocator, torch's temporaries and other processes need the
# rest; on CUDA the devices' free memory (torch.cuda.mem_get_info), where the caching allocator's slack and the
# kernels' workspaces need the rest (a batch that still runs out of memory is split)
AUTO_SHARE_RAM = 0.5
AUTO_SHARE_CUDA = 0.8


@dataclass
class MemoryBudget:
    """The budget the batches are sized to: `generation.memory_budget`, or chosen from the free memory."""

    bytes: int
    text: str  # how messages name it: `8GiB`, or `auto (3.1 GB: 50 % of the 6.2 GB of RAM free)`
    record: dict  # the manifest's `memory_budget`


def available_ram() -> int | None:
    """Bytes of RAM available to a new allocation without swapping: /proc/meminfo's MemAvailable,
    else psutil's `virtual_memory().available` where psutil is installed, else None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def memory_budget(generation, gpus: list) -> MemoryBudget | None:
    """The budget of this process's batches: `generation.memory_budget` when given; for `batch_size:
    auto` without one, AUTO_SHARE_CUDA of the free memory of the CUDA devices the model computes on
    (`gpus`, summed: the budget is their allocations' sum), else AUTO_SHARE_RAM of the RAM available;
    None for a fixed batch size without a budget. Measured when called: once the model is loaded.
    One of the N processes `generate --workers N` starts (WORKERS_ENV) takes 1/N of it."""
    budget = _whole_budget(generation, gpus)
    workers = workers_sharing()
    if budget is None or workers == 1:
        return budget
    n = max(1, budget.bytes // workers)
    from ..archive.runs import human_bytes

    return MemoryBudget(
        n,
        f"{budget.text} / {workers} workers: {human_bytes(n)} each",
        {**budget.record, "bytes": n, "workers": workers},
    )


# Set by `generate --workers N` in each worker's environment: the run's processes on this machine,
# which share its memory budget (the spec's or the one chosen from the free memory) equally.
WORKERS_ENV = "LMTRACE_WORKERS"


def workers_sharing() -> int:
    """How many processes of this run share the machine's memory budget (WORKERS_ENV; 1 without it)."""
    text = os.environ.get(WORKERS_ENV, "1")
    n = positive_int(text)
    if n is None:
        raise SpecError(f"{WORKERS_ENV}={text}: give the number of this run's processes on this machine (1 or more)")
    return n


def positive_int(text: str) -> int | None:
    """`text` as a whole number of 1 or more, else None."""
    try:
        n = int(text)
    except ValueError:
        return None
    return n if n >= 1 else None


def _whole_budget(generation, gpus: list) -> MemoryBudget | None:
    from ..archive.runs import human_bytes

    if generation.memory_budget is not None:
        n = generation.budget_bytes
        return MemoryBudget(n, str(generation.memory_budget), {"bytes": n, "from": "generation.memory_budget"})
    if generation.batch_size != "auto":
        return None
    if gpus:
        import torch

        indices = sorted({torch.cuda.current_device() if d.index is None else d.index for d in gpus})
        free = sum(int(torch.cuda.mem_get_info(i)[0]) for i in indices)  # (`cuda` and `cuda:0` counted once)
        share, what = AUTO_SHARE_CUDA, f"free on {', '.join(f'cuda:{i}' for i in indices)}"
    else:
        free = available_ram()
        if free is None:
            raise SpecError(
                "batch_size: auto cannot measure the free memory on this system (no /proc/meminfo, "
                "no psutil): give generation.memory_budget (e.g. 8GiB, or --memory-budget 8GiB)"
            )
        share, what = AUTO_SHARE_RAM, "of RAM available"
    n = max(1, int(free * share))
    text = f"auto ({human_bytes(n)}: {share:.0%} of the {human_bytes(free)} {what})"
    return MemoryBudget(
        n, text, {"bytes": n, "from": "auto", "share": share, "free_bytes": free, "memory": "cuda" if gpus else "ram"}
    )


def budget_refusal(budget_text, need: int | None, seq: int, reason: str) -> LmtraceError:
    from ..archive.runs import human_bytes

    need_text = f" (it needs about {human_bytes(need)})" if need else ""
    return LmtraceError(
        f"sequence {seq} alone does not fit generation.memory_budget {budget_text}{need_text}: "
        f"{reason}; raise the budget (--memory-budget), lower generation.max_new_tokens, or capture "
        f"less (capture.attention.top_k, capture.qkv: false, capture: none)"
    )


def with_oom_fault(should_stop, n_seqs: int):
    """`should_stop` for a batch of `n_seqs` sequences (the tracer calls it after every step but the
    last). Test-only: with LMTRACE_TEST_OOM_AT=STEP:SIZE a batch of more than SIZE sequences raises
    BatchOutOfMemory after step STEP, standing in for a CUDA out-of-memory error there (exits/faults.py)."""
    fault = oom_at()
    if fault is None:
        return should_stop
    step, size = fault
    if n_seqs <= size:
        return should_stop
    calls = iter(range(1 << 62))

    def check() -> bool:
        if next(calls) == step:
            raise BatchOutOfMemory(f"LMTRACE_TEST_OOM_AT={step}:{size}")
        return should_stop()

    return check
