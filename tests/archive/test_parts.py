"""Table part files stay few while a run is written (levelled merging, lmtrace/archive/parts.py), and
a kill at any step of a merge neither loses nor duplicates a committed row (issue 33)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmtrace.archive.parts import FANOUT
from lmtrace.archive.reader import IncompleteRunWarning, Run, table_files
from lmtrace.archive.writer import ArchiveWriter
from tests.helpers.archives import TABLES_ONLY_SHAPE
from tests.helpers.cli import run_cli as _run


def _block(batch: int, s0: int) -> pa.Table:
    """Rows a block of batch `batch` (two sequences) might give: distinct values, so a row lost or
    written twice shows."""
    seqs = [batch, batch + 1] * 2
    steps = [s0, s0, s0 + 1, s0 + 1]
    return pa.table(
        {
            "sequence": pa.array(seqs, pa.int32()),
            "step": pa.array(steps, pa.int32()),
            "value": pa.array([s * 1000.0 + t for s, t in zip(seqs, steps)], pa.float32()),
        }
    )


def _rows(files: list[Path]) -> list[tuple]:
    t = pa.concat_tables([pq.read_table(f) for f in files]) if files else pa.table({"sequence": [], "step": []})
    return sorted(zip(t.column("sequence").to_pylist(), t.column("step").to_pylist()))


def test_part_files_stay_few_while_blocks_are_committed_and_each_row_is_read_once(tmp_path, monkeypatch):
    # durability is not what this counts: 512 syncs took ~100 s
    monkeypatch.setattr("lmtrace.archive.writer.flush_filesystem", lambda path: None)
    writer = ArchiveWriter(tmp_path, TABLES_ONLY_SHAPE, chunk_steps=2, codec="none", level=0)
    writer.rollback([])
    expected, most = [], 0
    for batch in range(0, 64, 2):  # 32 batches × 16 blocks: 512 block parts
        for s0 in range(0, 32, 2):
            writer.write_block(batch, [batch, batch + 1], s0, s0 + 2, {}, {"steps": _block(batch, s0)})
            expected += [(batch, s0), (batch + 1, s0), (batch, s0 + 1), (batch + 1, s0 + 1)]
            most = max(most, len(list((tmp_path / "steps.parts").iterdir())))
            if len(expected) % 96 == 0:
                assert _rows(table_files(tmp_path, "steps")) == sorted(expected)
    # 512 parts climb three levels of 8: fewer than 8 parts per level, whatever the moment
    assert most <= 3 * (FANOUT - 1) + 1, most
    assert _rows(table_files(tmp_path, "steps")) == sorted(expected)
    assert writer.compact_tables() == {"steps": len(expected)}
    table = pq.read_table(tmp_path / "steps.parquet")
    # the compacted table keeps the blocks' order (by batch, then block), whatever the merges were
    order = [(b, s0) for b in range(0, 64, 2) for s0 in range(0, 32, 2)]
    assert table.equals(pa.concat_tables([_block(b, s0) for b, s0 in order]))


def _spec(tmp_path: Path, model) -> Path:
    """12 prompts in batches of 2, 16 tokens in blocks of 2: 48 block parts of `tokens` and of `steps`."""
    path = tmp_path / "spec.json"
    path.write_text(
        json.dumps(
            {
                "model": str(model),
                "prompts": [f"Item {i} is" for i in range(12)],
                "generation": {"max_new_tokens": 16, "batch_size": 2, "temperature": 0.9, "seed": 3, "eos_token_id": 0},
                "output": {"chunk_steps": 2},
            }
        )
    )
    return path


def _assert_each_committed_row_once(run_dir: Path) -> None:
    with pytest.warns(IncompleteRunWarning):
        run = Run(run_dir, check=False)
    tokens = run.tokens().to_pandas()
    assert not tokens.duplicated(["sequence", "position"]).any()
    steps = run.steps().to_pandas()
    assert not steps.duplicated(["sequence", "step", "layer"]).any()
    gen = tokens[~tokens.is_prompt]
    for seq, n in run.committed_steps().items():
        assert set(range(n)) <= set(gen[gen.sequence == seq].step), (seq, n)
    _assert_reads_of_some_rows_equal_the_whole_table_filtered(run)


def _assert_reads_of_some_rows_equal_the_whole_table_filtered(run: Run) -> None:
    """`Run.table(name, columns=, sequences=)` (what heads and report read) against the whole table
    filtered here with pandas: from part files (an unfinished run) or the compacted file."""
    for name, columns in (("tokens", ["sequence", "position", "token_id"]), ("steps", ["sequence", "step", "layer"])):
        whole = run.table(name).to_pandas()
        assert run.table(name, columns=columns).to_pandas().equals(whole[columns])
        present = sorted(whole.sequence.unique())  # a killed run: those with committed rows
        for seqs in ([present[0]], present[1::3] or present[:1], [present[-1]]):
            got = run.table(name, sequences=seqs).to_pandas()
            want = whole[whole.sequence.isin(seqs)].reset_index(drop=True)
            assert len(want) and got.equals(want), (name, seqs)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_llama_dir):
    base = tmp_path_factory.mktemp("parts")
    spec = _spec(base, tiny_llama_dir)
    out = _run(["generate", str(spec), "--run-id", "reference"], base / "runs")
    assert out.returncode == 0, out.stderr
    return spec, base / "runs" / "reference"


@pytest.mark.slow
@pytest.mark.parametrize("point", ["merge-written", "merge-renamed", "merge-removing@3", "merge-removing@12"])
def test_a_kill_at_each_step_of_a_merge_resumes_to_the_same_archive(reference_run, tmp_path, point):
    from tests.helpers.archives import assert_same_archive

    spec, reference = reference_run
    runs = tmp_path / "runs"
    out = _run(["generate", str(spec), "--run-id", "k"], runs, LMTRACE_TEST_KILL_AT=point)
    assert out.returncode == -signal.SIGKILL, (point, out.stderr[-2000:])
    parts = list((runs / "k" / "tokens.parts").iterdir())
    if point != "merge-written":  # the merged part is there beside (some of) the parts it covers
        assert any(p.name.startswith("m1_") for p in parts), parts
    _assert_each_committed_row_once(runs / "k")
    out = _run(["generate", "--resume", "k"], runs)
    assert out.returncode == 0, out.stderr
    assert _run(["verify", "k"], runs, quiet=False).returncode == 0
    assert_same_archive(Run(reference), Run(runs / "k"))
    for table in ("tokens", "steps", "sequences"):  # bit-identical files, not only equal rows
        assert (reference / f"{table}.parquet").read_bytes() == (runs / "k" / f"{table}.parquet").read_bytes(), table


@pytest.mark.slow
def test_a_run_killed_late_holds_few_parts_and_resumes_to_the_same_archive(reference_run, tmp_path):
    from tests.helpers.archives import assert_same_archive

    spec, reference = reference_run
    runs = tmp_path / "runs"
    out = _run(["generate", str(spec), "--run-id", "k"], runs, LMTRACE_TEST_KILL_AT="block-committed@44")
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    for table in ("tokens", "steps"):  # 44 blocks committed: 5 merged parts of 8 and 4 block parts
        names = sorted(p.name for p in (runs / "k" / f"{table}.parts").iterdir())
        assert len(names) <= 9, names
    _assert_each_committed_row_once(runs / "k")
    with pytest.warns(IncompleteRunWarning):
        committed = Run(runs / "k", check=False).committed_steps()
    assert sum(committed.values()) == 44 * 2 * 2
    out = _run(["generate", "--resume", "k"], runs)
    assert out.returncode == 0, out.stderr
    assert_same_archive(Run(reference), Run(runs / "k"))
    _assert_reads_of_some_rows_equal_the_whole_table_filtered(Run(runs / "k"))


def test_a_read_that_races_a_merge_lists_the_parts_again(tmp_path, monkeypatch):
    """A reader of a running run lists the parts, then the writer merges them before the reader opens
    them: the read is tried again over the merged part, not reported as damage."""
    from lmtrace.archive.reader import read_table_files

    monkeypatch.setattr("lmtrace.archive.writer.flush_filesystem", lambda path: None)
    writer = ArchiveWriter(tmp_path, TABLES_ONLY_SHAPE, chunk_steps=2, codec="none", level=0)
    writer.rollback([])
    for s0 in range(0, 2 * (FANOUT - 1), 2):  # one block short of a merge
        writer.write_block(0, [0, 1], s0, s0 + 2, {}, {"steps": _block(0, s0)})
    calls = []

    def read(files):
        calls.append([f.name for f in files])
        if len(calls) == 1:  # the writer commits the 8th block and merges while this reader holds its list
            writer.write_block(0, [0, 1], 2 * (FANOUT - 1), 2 * FANOUT, {}, {"steps": _block(0, 2 * (FANOUT - 1))})
        return _rows(files)

    rows = read_table_files(tmp_path, "steps", read)
    assert len(calls) == 2 and calls[1] == ["m1_shard-0-of-1_000000.parquet"], calls
    assert rows == sorted((s, t) for t in range(2 * FANOUT) for s in (0, 1))


def test_shards_of_one_run_merge_only_their_own_parts(tmp_path, monkeypatch):
    """Two writers (SLURM shards) of one run, interleaved: each merges its own parts, a resumed one
    clears what a kill during its merge left (and nothing of the other's), and the compacted table
    holds every row once, in block order."""
    monkeypatch.setattr("lmtrace.archive.writer.flush_filesystem", lambda path: None)
    writers = {
        key: ArchiveWriter(tmp_path, TABLES_ONLY_SHAPE, chunk_steps=2, codec="none", level=0, writer_key=key)
        for key in ("shard-0-of-2", "shard-1-of-2")
    }
    for w in writers.values():
        w.rollback([])
    blocks = []
    for s0 in range(0, 2 * FANOUT, 2):
        for batch in (0, 2, 4, 6):  # shard 0 owns batches 0 and 4, shard 1 batches 2 and 6
            writers[f"shard-{batch // 2 % 2}-of-2"].write_block(
                batch, [batch, batch + 1], s0, s0 + 2, {}, {"steps": _block(batch, s0)}
            )
            blocks.append((batch, s0))
    parts = tmp_path / "steps.parts"
    merged = sorted(p.name for p in parts.glob("m*"))
    assert merged == [
        "m1_shard-0-of-2_000000.parquet",
        "m1_shard-0-of-2_000001.parquet",
        "m1_shard-1-of-2_000000.parquet",
        "m1_shard-1-of-2_000001.parquet",
    ], merged
    for name in merged:  # each covers 8 blocks of its own shard's batches
        covers = json.loads(pq.read_metadata(parts / name).metadata[b"lmtrace.covers"])
        assert len(covers) == FANOUT and {int(c[1:7]) // 2 % 2 for c in covers} == {int(name[9])}, (name, covers)
    # what a kill between a merge's rename and its deletions leaves: the merged part and its sources,
    # each with its own rows again (the merged part's blocks, in its row order)
    first = parts / merged[0]
    meta = pq.read_metadata(first).metadata
    sources = json.loads(meta[b"lmtrace.covers"])
    table, at = pq.read_table(first), 0
    for name, n in json.loads(meta[b"lmtrace.units"]):
        pq.write_table(table.slice(at, n), parts / f"{name}.parquet")
        at += n
    assert sorted(f"{name}.parquet" for name, _ in json.loads(meta[b"lmtrace.units"])) == sources
    assert _rows(table_files(tmp_path, "steps")) == sorted(r for b, s0 in blocks for r in _block_keys(b, s0))
    ArchiveWriter(
        tmp_path, TABLES_ONLY_SHAPE, chunk_steps=2, codec="none", level=0, writer_key="shard-1-of-2"
    ).rollback([])
    assert all((parts / name).exists() for name in sources)  # another shard's leftovers are not its to clear
    ArchiveWriter(
        tmp_path, TABLES_ONLY_SHAPE, chunk_steps=2, codec="none", level=0, writer_key="shard-0-of-2"
    ).rollback([])
    assert not any((parts / name).exists() for name in sources)
    rows = writers["shard-0-of-2"].compact_tables()
    assert rows == {"steps": 4 * len(blocks)}
    order = sorted(blocks)  # block names sort by batch, then step
    assert pq.read_table(tmp_path / "steps.parquet").equals(pa.concat_tables([_block(b, s0) for b, s0 in order]))


def _block_keys(batch: int, s0: int) -> list[tuple]:
    t = _block(batch, s0)
    return list(zip(t.column("sequence").to_pylist(), t.column("step").to_pylist()))


def test_two_shards_updating_prompt_and_generated_lengths_at_once_lose_neither(tmp_path, monkeypatch):
    """prompt_len and generated_len are one chunk over every sequence, which each writer (a SLURM task)
    updates by read-modify-write. Forced interleaving: each read of their chunk waits (up to 2 s) until
    the other writer has read it too, so unguarded both read the chunk before either writes it, and the
    second write puts the first writer's sequences back to -1. Guarded, the second writer only reads
    once the first has written, and the waits time out."""
    import asyncio
    import threading

    from zarr.storage import LocalStore

    monkeypatch.setattr("lmtrace.archive.writer.flush_filesystem", lambda path: None)
    writers = [
        ArchiveWriter(tmp_path, TABLES_ONLY_SHAPE, chunk_steps=2, codec="none", level=0, writer_key=f"shard-{i}-of-2")
        for i in (0, 1)
    ]
    barriers = {name: threading.Barrier(2, timeout=2.0) for name in ("prompt_len", "generated_len")}
    read = LocalStore.get

    async def get_after_the_other_writer(self, key, *args, **kwargs):
        value = await read(self, key, *args, **kwargs)
        name = key.split("/")[0]
        if name in barriers and "/c/" in key:
            try:
                await asyncio.to_thread(barriers[name].wait)
            except threading.BrokenBarrierError:
                pass
        return value

    monkeypatch.setattr(LocalStore, "get", get_after_the_other_writer)
    seqs = {0: [0, 1], 1: [2, 3]}  # shard i's batch of two sequences
    prompt = {s: 10 + s for s in range(4)}
    generated = {s: 20 + s for s in range(4)}

    def shard(i: int) -> None:
        w = writers[i]
        w.write_prompt(seqs[i], {}, np.asarray([prompt[s] for s in seqs[i]], dtype=np.int32))
        w.finish_batch(
            seqs[i][0],
            seqs[i],
            np.asarray([generated[s] for s in seqs[i]], dtype=np.int32),
            pa.table({"sequence": pa.array(seqs[i], pa.int32())}),
        )

    failures = []

    def run(i: int) -> None:
        try:
            shard(i)
        except BaseException as err:  # noqa: BLE001 (reported below, not lost in the thread)
            failures.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures and not any(t.is_alive() for t in threads), failures
    import zarr

    group = zarr.open_group(str(tmp_path / "tensors.zarr"), mode="r")
    assert group["prompt_len"][:4].tolist() == [prompt[s] for s in range(4)]
    assert group["generated_len"][:4].tolist() == [generated[s] for s in range(4)]
