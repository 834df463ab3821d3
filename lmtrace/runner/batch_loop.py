"""The batch loop of a run: this shard's batches, each run by the tracer and streamed block by block
into the archive. Batches already committed are skipped, a partly committed one resumes after its
last block, one that runs out of memory (or over `generation.memory_budget`) runs again as two
halves (batching.py)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from ..archive import layout
from ..archive.rundir import RunDir, archived_tokens
from ..archive.runs import human_bytes
from ..archive.sink import BlockSink
from ..capture.devices import cuda_devices, peak_memory, reset_peak_memory
from ..capture.tracer import ForcedTokens
from ..exits.errors import Interrupted, signal_name
from ..exits.interrupts import StopFlag
from .batching import Batch, BatchOutOfMemory, BatchQueue, Footprint, budget_refusal, with_oom_fault
from .peak_rss import PeakRss, rss_bytes

if TYPE_CHECKING:
    from .generation import Replay, Setup


@dataclass
class Generated:
    """What this shard's batches generated: the texts by sequence, the tokens, the seconds taken."""

    texts: dict[int, str]
    n_tokens: int
    seconds: float
    peak_gpu_memory: dict[str, int] = field(default_factory=dict)  # bytes per CUDA device, when on CUDA


class _ResumedReplay:
    """A replay's teacher in a batch resumed at step `upto`: below it the run's own archived tokens
    (what it chose then: sampled ones too, as a generate resume forces them), from it on the
    replay's forcing; the replay's reference tokens (the effects' parent tokens) throughout."""

    def __init__(self, archived: ForcedTokens, teacher, upto: int):
        self.archived, self.teacher, self.upto = archived, teacher, upto

    def forced(self, seq_ids, step):
        return self.archived.forced(seq_ids, step) if step < self.upto else self.teacher.forced(seq_ids, step)

    def reference(self, seq_ids, step):
        return self.teacher.reference(seq_ids, step)


class _Tee:
    """Each step fed to several sinks: the archive's, and a replay's observer."""

    def __init__(self, *sinks):
        self.sinks = sinks

    def on_step(self, result) -> None:
        for sink in self.sinks:
            sink.on_step(result)


def batch_queue(spec, rd: RunDir, setup: Setup, my_seqs: list[int], writer_core) -> BatchQueue:
    """This shard's batches: as recorded where a batch committed anything, the rest cut to
    `generation.batch_size`, or to `generation.memory_budget` (auto) by the footprint per sequence."""
    import torch

    g = spec.generation
    footprint = None
    budget = setup.budget.bytes if setup.budget is not None else None
    if budget is not None:
        on_cuda = bool(cuda_devices(setup.loaded.model, setup.loaded.device))
        footprint = Footprint(
            setup.shape,
            setup.adapter.n_layers,
            torch.empty((), dtype=setup.loaded.dtype).element_size(),
            len(setup.loaded.tokenizer),
            g.max_new_tokens,
            spec.output.chunk_steps,
            spec.output.chunk_keys,
            measured=on_cuda,
            budget=budget,
        )
    return BatchQueue(
        rd.path,
        rd.shard.key,
        my_seqs,
        g.batch_size,
        budget,
        {s: len(setup.prompt_ids[s]) for s in my_seqs},
        footprint,
        writer_core.committed,
    )


def _split(queue: BatchQueue, batch: Batch, committed: int, log, reason: str, budget_text, need=None) -> None:
    """A batch that does not fit runs again as two halves (a batch of one cannot: the run fails)."""
    if len(batch.seqs) == 1:
        raise budget_refusal(budget_text, need, batch.key, reason)
    first, second = queue.split(batch, committed)
    log.event(
        "batch_split",
        batch=batch.key,
        size=len(batch.seqs),
        sizes=[len(first.seqs), len(second.seqs)],
        batches=[first.key, second.key],
        from_step=first.from_step,
        reason=reason,
    )
    from ..exits.faults import kill_point

    kill_point("batch-split")


def generate_batches(
    tracer, spec, run_id, rd: RunDir, log, setup: Setup, replay: Replay | None, progress, queue: BatchQueue, writer
) -> Generated:
    """Run this shard's batches through `tracer` into `writer` (a BackgroundWriter); what they generated."""
    return _BatchLoop(tracer, spec, run_id, rd, log, setup, replay, progress, queue, writer).run()


class _BatchLoop:
    """One shard's pass over its batches, with what it keeps between them: the texts and token
    count so far, each CUDA device's peak memory, the signal flag, and (on CPU, with a memory
    budget) the process's RSS once the model is loaded, against which each batch's peak
    calibrates the footprint."""

    def __init__(
        self,
        tracer,
        spec,
        run_id,
        rd: RunDir,
        log,
        setup: Setup,
        replay: Replay | None,
        progress,
        queue: BatchQueue,
        writer,
    ):
        self.tracer, self.spec, self.run_id, self.rd, self.log = tracer, spec, run_id, rd, log
        self.setup, self.replay, self.progress, self.queue = setup, replay, progress, queue
        self.writer, self.writer_core = writer, writer.writer
        self.gpus = cuda_devices(setup.loaded.model, setup.loaded.device)
        reset_peak_memory(self.gpus)
        self.run_peak: dict[str, int] = {}
        # CPU, a budget: each batch's peak RSS above the process's now (the model loaded) calibrates the footprint
        self.rss_base = rss_bytes() if queue.footprint is not None and not self.gpus else None
        self.stop = StopFlag()
        self.texts: dict[int, str] = {}
        self.n_tokens = 0
        self.budget_text = setup.budget.text if setup.budget is not None else None

    def run(self) -> Generated:
        from ..archive.liveness import Heartbeat

        self.progress.start(len(self.rd.shard.sequences(len(self.setup.prompts))), self.spec.generation.max_new_tokens)
        t_gen = time.time()
        with self.stop.installed(), Heartbeat(self.rd.path, self.rd.shard.key):
            for planned in self.queue:
                self._batch(planned)
            self.writer.drain()
        return Generated(self.texts, self.n_tokens, time.time() - t_gen, self.run_peak)

    def _batch(self, planned: Batch) -> None:
        """One batch: skipped when committed, split when over the budget or out of memory, else run,
        flushed and handed to the writer with its rows of sequences.parquet."""
        import torch

        seq_ids, batch = planned.seqs, planned.key
        committed, done = self.writer_core.committed(batch)
        if done:
            self.progress.sequences_done(len(seq_ids), None)
            return
        committed = max(committed, planned.from_step)
        need = self.queue.over_budget(planned)
        if need is not None:
            _split(
                self.queue,
                planned,
                committed,
                self.log,
                f"its footprint, about {human_bytes(need)}, exceeds generation.memory_budget {self.budget_text}",
                self.budget_text,
                need,
            )
            return
        self.queue.record(planned)
        batch_prompts = [self.setup.prompt_ids[i] for i in seq_ids]
        sink = BlockSink(
            self.writer,
            self.setup.shape,
            batch,
            seq_ids,
            batch_prompts,
            self.setup.loaded.tokenizer,
            self.spec.output.chunk_steps,
            self.setup.step_columns,
            self.progress,
            start_step=committed,
        )
        teacher, edits, feed = self._forcing(sink, seq_ids, batch, committed)
        before = sum(torch.cuda.memory_allocated(d) for d in self.gpus)
        reset_peak_memory(self.gpus)
        rss = PeakRss() if self.rss_base is not None else nullcontext()
        try:
            with rss:
                outcome_ = self.tracer.run_batch(
                    seq_ids,
                    batch_prompts,
                    feed,
                    teacher=teacher,
                    edits=edits,
                    should_stop=with_oom_fault(self.stop, len(seq_ids)),
                    forward_running=self.writer.forward_running(),
                )
        except (BatchOutOfMemory, torch.cuda.OutOfMemoryError) as err:
            del sink, feed
            self._out_of_memory(planned, err)
            return
        growth = self._memory_growth(seq_ids, batch_prompts, before, rss)
        sink.flush()
        if outcome_.interrupted:
            raise Interrupted(
                f"interrupted by {signal_name(self.stop.signal)} (batch of sequence {batch}); flushed "
                f"steps are kept; resume with `lmtrace generate --resume {self.run_id}`",
                self.stop.signal,
                resumable=True,
            )
        if self.replay is not None and self.replay.batch_done is not None:
            self.replay.batch_done(self.rd.path, batch)
        self._finish(seq_ids, batch, batch_prompts, outcome_, growth)

    def _forcing(self, sink, seq_ids, batch, committed: int):
        """(teacher, edits, feed) of a batch: a resumed batch forces its archived tokens below
        `committed`; a replay adds its own forcing, edits and observer."""
        teacher, edits, feed = None, None, sink
        if committed:
            self.log.event("resume_batch", batch=batch, from_step=committed)
            teacher = ForcedTokens(archived_tokens(self.rd.path, seq_ids, committed), committed)
        replay = self.replay
        if replay is not None:
            if replay.teacher is not None:
                teacher = replay.teacher if teacher is None else _ResumedReplay(teacher, replay.teacher, committed)
            edits = replay.edits
            feed = _Tee(sink, replay.observer) if replay.observer is not None else sink
        return teacher, edits, feed

    def _out_of_memory(self, planned: Batch, err: BaseException) -> None:
        """A batch out of memory: what it handed over is committed, the rest runs again as two halves."""
        import torch

        if self.replay is not None and self.replay.batch_abandoned is not None:
            self.replay.batch_abandoned(planned.seqs)
        if self.gpus:
            torch.cuda.empty_cache()
        self.writer.drain()  # the blocks handed over are committed: the halves continue after them
        reason = "out of memory" + (
            " (CUDA)" if isinstance(err, torch.cuda.OutOfMemoryError) else f" ({err})" if str(err) else ""
        )
        _split(
            self.queue,
            planned,
            max(self.writer_core.committed(planned.key)[0], planned.from_step),
            self.log,
            reason,
            self.budget_text,
        )

    def _memory_growth(self, seq_ids, batch_prompts, before: int, rss) -> int | None:
        """The batch's peak above the model: CUDA allocations, or (CPU, a budget) RSS; each observed
        by the footprint when batches are sized to a budget."""
        peaks = peak_memory(self.gpus)
        for d, v in peaks.items():
            self.run_peak[d] = max(self.run_peak.get(d, 0), v)
        growth = None
        footprint: Footprint | None = self.queue.footprint
        if self.gpus:
            growth = sum(peaks.values()) - before
            if footprint is not None:
                footprint.observe(len(seq_ids), max(len(p) for p in batch_prompts), growth)
        elif self.rss_base is not None:
            growth = rss.peak - self.rss_base
            footprint.observe(len(seq_ids), max(len(p) for p in batch_prompts), rss.peak - rss.start)
        return growth

    def _finish(self, seq_ids, batch, batch_prompts, outcome_, growth: int | None) -> None:
        """The batch's texts decoded, its rows of sequences.parquet handed to the writer."""
        tokenizer = self.setup.loaded.tokenizer
        gen_len = np.asarray([len(x) for x in outcome_.generated], dtype=np.int32)
        for b, seq in enumerate(seq_ids):
            self.texts[seq] = tokenizer.decode(outcome_.generated[b], skip_special_tokens=True)
        self.n_tokens += int(gen_len.sum())
        seq_table = _sequence_rows(self.setup, seq_ids, batch, batch_prompts, gen_len, outcome_.stop_reason, self.texts)
        self.writer.submit(self.writer_core.finish_batch, batch, seq_ids, gen_len, seq_table)
        self.log.event(
            "batch_done",
            batch=batch,
            sequences=seq_ids,
            tokens=int(gen_len.sum()),
            **({"peak_growth": growth} if growth is not None else {}),
        )
        if self.rss_base is not None:  # what the allocator keeps is not free for the next batch's cut
            self.queue.footprint.retained = max(0, rss_bytes() - self.rss_base)
        self.progress.sequences_done(len(seq_ids), int(gen_len.sum()))


def _sequence_rows(setup: Setup, seq_ids, batch, batch_prompts, gen_len, stop_reason, texts) -> pa.Table:
    """One batch's rows of sequences.parquet: lmtrace's columns, then the prompts' metadata columns."""
    table = pa.table(
        {
            "sequence": seq_ids,
            "batch": [batch] * len(seq_ids),
            "prompt": [setup.prompts[i] for i in seq_ids],
            "prompt_rendered": [setup.rendered[i] for i in seq_ids],
            "prompt_len": [len(p) for p in batch_prompts],
            "generated_len": gen_len.tolist(),
            "stop_reason": stop_reason,
            "generated_text": [texts[i] for i in seq_ids],
        },
        schema=layout.sequence_schema(),
    )
    if setup.metadata is None:
        return table
    rows = setup.metadata.take(pa.array(seq_ids, pa.int64()))
    for name in rows.column_names:
        table = table.append_column(rows.schema.field(name), rows.column(name))
    return table
