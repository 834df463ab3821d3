"""The background writer pauses while the model's forward runs (BackgroundWriter.forward_running)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lmtrace.archive.layout import RunShape
from lmtrace.archive.writer import ArchiveWriter, BackgroundWriter

STEPS, PROMPT, CHUNK_KEYS = 4, 2, 2  # attention rows of 6 keys: 3 key chunks per sequence and block
# one sequence per shard file: a block of the two sequences is two files, and the writer may pause between them


_SHAPE = dict(
    n_sequences=2,
    n_steps=STEPS,
    max_prompt=PROMPT,
    layers=(0, 1),
    resid_layers=(),
    n_heads=2,
    n_kv_heads=1,
    head_dim=2,
    d_model=2,
    d_ffn=2,
    kv_head_of_head=(0, 0),
    qkv=False,
    ffn=False,
    lens=False,
)


@pytest.fixture
def core(tmp_path):
    return ArchiveWriter(
        tmp_path, RunShape(**_SHAPE), chunk_steps=STEPS, codec="none", level=0, chunk_keys=CHUNK_KEYS, chunk_sequences=1
    )


def _block() -> dict[str, np.ndarray]:
    return {"attn": np.full((2, STEPS, 2, 2, PROMPT + STEPS), 0.5, dtype=np.float16)}


def _chunk_files(core) -> int:
    return sum(
        1 for f in (core.dir / "tensors.zarr" / "attn" / "c").rglob("*") if f.is_file() and not f.name.startswith(".")
    )


_Event = threading.Event


class WatchedEvent(_Event):
    """The writer's pause event, telling the test when the writer thread is held at a pause point
    (waiting on it while it is clear), instead of the test sleeping and hoping it got there."""

    def __init__(self):
        super().__init__()
        self.held = _Event()

    def wait(self, timeout=None):
        if not self.is_set():
            self.held.set()
        return super().wait(timeout)


@pytest.fixture
def watched_writer(core, monkeypatch):
    """A BackgroundWriter whose pause event is a WatchedEvent: (writer, event)."""
    events: list[WatchedEvent] = []

    def make():
        events.append(WatchedEvent())
        return events[-1]

    with monkeypatch.context() as patch:
        patch.setattr(threading, "Event", make)
        writer = BackgroundWriter(core)
    event = writer._outside_forward  # the pause event (the thread's own start event is another)
    assert isinstance(event, WatchedEvent)
    try:
        yield writer, event
    finally:
        writer.close()


def _wait_for(predicate, timeout=10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "the writer never got there"
        time.sleep(0.01)


def test_a_block_handed_over_during_a_forward_is_written_after_it(core, watched_writer):
    writer, event = watched_writer
    with writer.forward_running():
        writer.submit(core.write_block, 0, [0, 1], 0, STEPS, _block(), {})
        _wait_for(event.held.is_set)  # the writer took the block and is held before writing any of it
        assert _chunk_files(core) == 0 and core.committed(0) == (0, False)
    writer.drain()
    assert _chunk_files(core) == 2 and core.committed(0) == (STEPS, False)
    assert (core.arrays["attn"][:] == np.float16(0.5)).all()


def test_a_forward_starting_mid_block_stops_the_writer_at_its_next_file(core, watched_writer):
    writer, event = watched_writer
    forward = writer.forward_running()
    files_at_pause: list[int] = []
    wait = core.pace

    def pace():  # the second shard file: a forward starts just before the writer reaches it
        if not files_at_pause and _chunk_files(core) == 1:
            forward.__enter__()
            files_at_pause.append(1)
        wait()

    core.pace = pace
    writer.submit(core.write_block, 0, [0, 1], 0, STEPS, _block(), {})
    _wait_for(lambda: files_at_pause and event.held.is_set())  # held at the pause before the second file
    assert _chunk_files(core) == 1 and core.committed(0) == (0, False)
    forward.__exit__(None, None, None)
    writer.drain()
    assert _chunk_files(core) == 2 and core.committed(0) == (STEPS, False)


def test_a_forward_that_raises_lets_the_writer_go_on(core):
    writer = BackgroundWriter(core)
    try:
        with pytest.raises(KeyboardInterrupt):
            with writer.forward_running():
                writer.submit(core.write_block, 0, [0, 1], 0, STEPS, _block(), {})
                raise KeyboardInterrupt
        done = threading.Event()
        threading.Thread(target=lambda: (writer.drain(), done.set()), daemon=True).start()
        assert done.wait(10), "the writer stayed paused after the forward raised"
        assert core.committed(0) == (STEPS, False)
    finally:
        writer.close()


def test_generate_runs_every_forward_with_the_writer_paused(tmp_path, tiny_llama_dir, monkeypatch):
    """`lmtrace generate` wraps each model forward (prefill and decode steps) in forward_running."""
    from lmtrace.runner import generation as generate
    from tests.helpers.runs import PROMPTS, run_spec

    class Recording:
        inside, entered = False, 0

        def __enter__(self):
            self.inside, self.entered = True, self.entered + 1

        def __exit__(self, *exc):
            self.inside = False

    pause = Recording()
    monkeypatch.setattr(BackgroundWriter, "forward_running", lambda self: pause)
    forwards: list[bool] = []
    load = generate.load_model

    def load_watched(*args, **kwargs):
        loaded = load(*args, **kwargs)
        loaded.model.register_forward_pre_hook(lambda module, args: forwards.append(pause.inside))
        return loaded

    monkeypatch.setattr(generate, "load_model", load_watched)
    run = run_spec(
        tmp_path,
        {"model": str(tiny_llama_dir), "prompts": PROMPTS, "generation": {"max_new_tokens": 5, "batch_size": 2}},
    )
    assert run.manifest["status"] == "complete"
    assert len(forwards) == 2 * 5 and all(forwards) and pause.entered == len(forwards)


def test_a_forward_starting_mid_file_stops_the_writer_at_its_next_sequence(tmp_path):
    # two sequences in one shard file: the writer pauses between their chunks, not only between files
    core = ArchiveWriter(
        tmp_path, RunShape(**_SHAPE), chunk_steps=STEPS, codec="none", level=0, chunk_keys=CHUNK_KEYS, chunk_sequences=2
    )
    files = core.shard_files["attn"]
    encoded: list[int] = []
    encode = files.encode
    files.encode = lambda chunk: (encoded.append(1), encode(chunk))[1]
    writer = BackgroundWriter(core)
    forward = writer.forward_running()
    paused_after: list[int] = []
    wait = core.pace

    def pace():  # a forward starts once the first sequence's chunks are encoded
        if not paused_after and encoded:
            forward.__enter__()
            paused_after.append(len(encoded))
        wait()

    core.pace = pace
    try:
        writer.submit(core.write_block, 0, [0, 1], 0, STEPS, _block(), {})
        _wait_for(lambda: bool(paused_after))
        time.sleep(0.2)  # were the writer not held, it would encode the second sequence meanwhile
        assert paused_after == [3] and len(encoded) == 3  # one sequence: its 3 key chunks
        assert _chunk_files(core) == 0
        forward.__exit__(None, None, None)
        writer.drain()
        assert len(encoded) == 6 and _chunk_files(core) == 1
        assert (core.arrays["attn"][:] == np.float16(0.5)).all()
    finally:
        writer.close()
