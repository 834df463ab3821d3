"""The archive: readable without lmtrace, stop conditions, optional probes, and what a kill leaves."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.archives import TABLES_ONLY_SHAPE
from tests.helpers.cli import start_cli as _cli
from tests.helpers.cli import wait_committed as _wait_committed
from tests.helpers.reference import Reference
from tests.helpers.runs import PROMPTS, run_spec


def _tiny(tiny_llama_dir, **over):
    spec = {"model": str(tiny_llama_dir), "prompts": PROMPTS, "generation": {"max_new_tokens": 8, "batch_size": 2}}
    for key, value in over.items():
        spec[key] = value
    return spec


def test_xarray_and_pandas_read_a_run_without_lmtrace(tmp_path, tiny_llama_dir):
    # the full preset: prompt-time arrays too, so the prompt positions have their coordinate
    run = run_spec(tmp_path, _tiny(tiny_llama_dir, capture={"preset": "full", "residual": {"vectors_at": [1]}}))
    code = textwrap.dedent(f"""
        import sys, pandas as pd, xarray as xr, json
        ds = xr.open_zarr({str(run.path / "tensors.zarr")!r})
        assert ds["attn"].dims == ("sequence", "step", "layer", "q_head", "key"), ds["attn"].dims
        assert list(ds["layer"].values) == [0, 1, 2, 3]
        assert list(ds.q_head.values) == list(range(ds.sizes["q_head"]))  # `head` would be Dataset.head()
        assert list(ds.key.values) == list(range(ds.sizes["key"]))  # positions carry coordinates
        assert list(ds.prompt_pos.values) == list(range(ds.sizes["prompt_pos"]))
        assert ds["kv_head_of_head"].dims == ("q_head",)
        row = ds["attn"].sel(layer=2).isel(sequence=0, step=1).values
        assert abs(float(__import__("numpy").nansum(row[0])) - 1.0) < 1e-3
        tokens = pd.read_parquet({str(run.path / "tokens.parquet")!r})
        steps = pd.read_parquet({str(run.path / "steps.parquet")!r})
        seqs = pd.read_parquet({str(run.path / "sequences.parquet")!r})
        assert set(tokens.columns) >= {{"sequence", "position", "step", "token_id", "logprob", "alt_ids"}}
        # the documented types, nulls on prompt rows included (not float64 / object)
        dtypes = {{c: str(t) for c, t in tokens.dtypes.items()}}
        for col in ("step", "token_rank", "greedy_id", "eligible"):
            assert dtypes[col] == "Int32", (col, dtypes[col])
        for col in ("filter_changed", "is_eos"):
            assert dtypes[col] == "boolean", (col, dtypes[col])
        assert dtypes["sequence"] == dtypes["position"] == dtypes["token_id"] == "int32" and dtypes["is_prompt"] == "bool"
        assert tokens.step.isna().sum() == tokens.is_prompt.sum()
        assert str(steps.dtypes["layer"]) == "int32" and "object" not in set(map(str, steps.dtypes))
        assert len(steps) == int((~tokens.is_prompt).sum()) * 4
        assert json.load(open({str(run.path / "manifest.json")!r}))["status"] == "complete"
        assert "lmtrace" not in sys.modules
        print("ok", len(tokens), len(seqs))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_eos_and_stop_strings_end_each_sequence(tmp_path, tiny_llama_dir):
    base = run_spec(tmp_path / "base", _tiny(tiny_llama_dir))
    tokens = base.tokens().to_pandas()
    gen0 = tokens[(tokens.sequence == 0) & ~tokens.is_prompt].sort_values("step")
    eos = int(gen0.token_id.iloc[2])
    first = gen0.token_id.tolist().index(eos)
    run = run_spec(
        tmp_path / "eos", _tiny(tiny_llama_dir, generation={"max_new_tokens": 8, "batch_size": 2, "eos_token_id": eos})
    )
    seqs = run.sequences().to_pandas().set_index("sequence")
    assert seqs.loc[0, "stop_reason"] == "eos" and seqs.loc[0, "generated_len"] == first + 1
    t = run.tokens().to_pandas()
    last = t[(t.sequence == 0) & ~t.is_prompt].sort_values("step").iloc[-1]
    assert last.is_eos and last.token_id == eos
    # steps after the end are padding in the arrays
    assert np.isnan(run.array("attn")[0, first + 1 :]).all()
    assert not np.isnan(run.array("attn")[0, first, 0, 0, 0])

    stop = str(gen0.token_text.iloc[3]).strip() or str(gen0.token_text.iloc[3])
    run = run_spec(
        tmp_path / "stop", _tiny(tiny_llama_dir, generation={"max_new_tokens": 8, "batch_size": 2, "stop": [stop]})
    )
    seqs = run.sequences().to_pandas().set_index("sequence")
    assert seqs.loc[0, "stop_reason"] == "stop_string"
    assert seqs.loc[0, "generated_len"] <= 4
    assert stop in seqs.loc[0, "generated_text"]


def inner_chunks_present(shard_file: Path, chunks_per_shard: tuple[int, ...]) -> np.ndarray:
    """Which inner chunks a Zarr v3 shard file holds, read from its index at the end of the file
    (the sharding codec's format: uint64 offset and length per inner chunk, 2**64-1 for none,
    then 4 bytes of crc32c)."""
    data = shard_file.read_bytes()
    n = int(np.prod(chunks_per_shard))
    index = np.frombuffer(data[-16 * n - 4 : -4], dtype="<u8").reshape(*chunks_per_shard, 2)
    return index[..., 0] != np.uint64(2**64 - 1)


def test_small_blocks_archive_exactly_what_one_block_does(tmp_path, tiny_llama_dir):
    """The block size is a storage detail: blocks of 2 steps and attention chunks of 3 keys
    (sequences ending inside a block, a partial last block, a new buffer per block, key chunks past
    a block's context never written) give the same arrays and tables as one block of all keys."""
    base = run_spec(tmp_path / "base", _tiny(tiny_llama_dir, generation={"max_new_tokens": 12, "batch_size": 3}))
    gen = base.tokens().to_pandas()
    gen = gen[(gen.sequence == 1) & ~gen.is_prompt].sort_values("step")
    eos = int(gen.token_id.iloc[2])  # sequence 1 ends early; the others (most likely) later
    generation = {"max_new_tokens": 12, "batch_size": 3, "eos_token_id": eos}
    small = run_spec(
        tmp_path / "small", _tiny(tiny_llama_dir, generation=generation, output={"chunk_steps": 2, "chunk_keys": 3})
    )
    one = run_spec(
        tmp_path / "one", _tiny(tiny_llama_dir, generation=generation, output={"chunk_steps": 16, "chunk_keys": 4096})
    )
    seqs = small.sequences().to_pandas()
    assert seqs.generated_len.nunique() > 1, seqs  # rows inactive in some blocks
    assert one.tensors["attn"].chunks[-1] == one.tensors["attn"].shape[-1]
    # keys at steps 0 and 1 (block 0) reach the padded prompt and one generated token: of the
    # 3-key chunks, only those are in the shard file (c/<sequence group>/<block>/0/0/0)
    P, n_chunks = int(seqs.prompt_len.max()), -(-small.tensors["attn"].shape[-1] // 3)
    present = inner_chunks_present(
        small.path / "tensors.zarr" / "attn" / "c" / "0" / "0" / "0" / "0" / "0", (3, 1, 1, 1, n_chunks)
    )
    written = {int(c) for c in np.flatnonzero(present[0, 0, 0, 0])}
    assert written == set(range(-(-(P + 1) // 3))) and len(written) < n_chunks, (written, P, n_chunks)
    assert small.array_names() == one.array_names()
    for name in small.array_names():
        np.testing.assert_array_equal(small.tensors[name][...], one.tensors[name][...], err_msg=name)
    for table in ("tokens", "steps", "sequences"):
        assert small.table(table).to_pandas().equals(one.table(table).to_pandas()), table


def test_attention_chunks_on_disk_are_the_keys_each_block_reaches(tmp_path, tiny_llama_dir):
    """Without compression the attention chunk files hold exactly the key columns each block's
    context reaches, in whole chunks, and not the rows' padding to the run's longest context; the
    size estimate of `lmtrace validate` (RunShape.written_keys_per_step) counts the same."""
    from lmtrace.archive.layout import RunShape

    N, cs, K = 24, 4, 4
    run = run_spec(
        tmp_path,
        _tiny(
            tiny_llama_dir,
            generation={"max_new_tokens": N, "batch_size": 3},
            output={"codec": "none", "chunk_steps": cs, "chunk_keys": K},
        ),
    )
    seqs = run.sequences().to_pandas()
    assert (seqs.generated_len == N).all()  # every block is written for every sequence
    attn = run.tensors["attn"]
    _, _, L, H, max_len = attn.shape
    P = int(seqs.prompt_len.max())
    assert max_len == P + N
    files = [f for f in (run.path / "tensors.zarr" / "attn" / "c").rglob("*") if f.is_file()]
    # each shard file ends in its index: (offset, nbytes) uint64 per inner chunk, and a crc32c
    n_inner = 3 * -(-max_len // K)
    on_disk = sum(f.stat().st_size - (16 * n_inner + 4) for f in files)
    keys = 0  # key columns written by each block: its context, rounded up to whole chunks of K
    for s0 in range(0, N, cs):
        keys += min(-(-max_len // K), -(-(P + s0 + cs - 1) // K)) * K * cs
    # float16 rows, and the crc32c (4 bytes) each inner chunk (K keys of a block of cs steps) ends in
    assert on_disk == 3 * keys * L * H * 2 + 4 * 3 * keys // (K * cs)
    assert on_disk < 3 * N * max_len * L * H * 2 * 0.9  # well under the rows padded to max_len
    shape = RunShape(
        n_sequences=3,
        n_steps=N,
        max_prompt=P,
        layers=tuple(range(L)),
        resid_layers=(),
        n_heads=H,
        n_kv_heads=1,
        head_dim=1,
        d_model=1,
        d_ffn=1,
        kv_head_of_head=(0,) * H,
    )
    assert shape.written_keys_per_step(cs, K) * N == keys


def test_auto_codec_compresses_ids_and_attention_and_stores_activations_raw(tmp_path, tiny_llama_dir):
    """`output.codec: auto` (the default) as each array's own zarr.json states it; `zstd` for all; each
    followed by the chunk's crc32c."""

    def codecs(run, name):
        meta = json.loads((run.path / "tensors.zarr" / name / "zarr.json").read_text())
        (sharding,) = meta["codecs"]  # format 3: every array over `sequence` is sharded
        assert sharding["name"] == "sharding_indexed", meta["codecs"]
        names = [c["name"] for c in sharding["configuration"]["codecs"]]
        assert names[-1] == "crc32c", names  # format 4: every inner chunk ends in its checksum
        return names[:-1]

    full = {"preset": "full", "residual": {"vectors_at": [1]}}
    auto = run_spec(tmp_path / "auto", _tiny(tiny_llama_dir, capture=full))
    assert codecs(auto, "ffn_idx") == ["bytes", "zstd"]
    assert codecs(auto, "attn") == ["bytes", "zstd"]
    for name in ("q", "k", "v", "prompt_k", "prompt_v", "ffn_val", "resid"):  # float32 residuals: raw
        assert codecs(auto, name) == ["bytes"], name
    standard = run_spec(tmp_path / "standard", _tiny(tiny_llama_dir))
    assert codecs(standard, "resid") == ["bytes", "zstd"]  # float16 residuals
    zstd = run_spec(tmp_path / "zstd", _tiny(tiny_llama_dir, capture=full, output={"codec": "zstd"}))
    assert codecs(zstd, "q") == ["bytes", "zstd"] and codecs(zstd, "resid") == ["bytes", "zstd"]
    assert codecs(zstd, "attn") == ["bytes", "zstd"]
    for name in ("q", "attn"):
        np.testing.assert_array_equal(auto.tensors[name][...], zstd.tensors[name][...], err_msg=name)


def test_forward_only_run_still_archives_tokens_and_alternatives(tmp_path, tiny_llama_dir):
    run = run_spec(tmp_path, _tiny(tiny_llama_dir, capture="none"))
    assert run.status == "complete"
    assert {"attn", "q", "lens_ids", "ffn_idx"}.isdisjoint(run.array_names())
    t = run.tokens().to_pandas()
    gen = t[~t.is_prompt]
    assert len(gen) == 3 * 8 and gen.logprob.notna().all() and gen.alt_ids.map(len).eq(10).all()
    with pytest.raises(Exception, match="no steps table"):
        run.steps()
    # tokens equal those of a fully captured run
    full = run_spec(tmp_path / "full", _tiny(tiny_llama_dir))
    assert full.tokens().to_pandas().token_id.tolist() == t.token_id.tolist()


def test_topk_attention_and_prefill_matrices_match_the_reference(tmp_path, tiny_llama_dir):
    run = run_spec(
        tmp_path,
        _tiny(
            tiny_llama_dir,
            capture={"attention": {"top_k": 3}, "prefill_attention": True},
            output={"float_dtype": "float32"},
        ),
    )
    ref = Reference(str(tiny_llama_dir))
    idx, prob = run.array("attn_topk_idx")[:], run.array("attn_topk_prob")[:]
    pre = run.array("prefill_attn")[:]
    for seq in range(3):
        t = run.tokens().to_pandas()
        ids = t[t.sequence == seq].sort_values("position").token_id.tolist()
        P = int(run.prompt_len()[seq])
        r = ref.forward(ids)
        for layer in range(4):
            np.testing.assert_allclose(pre[seq, layer, :, :P, :P], r["attn"][layer][:, :P, :P].numpy(), atol=1e-5)
            assert np.isnan(pre[seq, layer, :, P:]).all()
            for s in (0, 5):
                row = r["attn"][layer][:, P - 1 + s, : P + s]
                top = row.topk(3)
                np.testing.assert_allclose(prob[seq, s, layer], top.values.numpy(), atol=1e-5)
                np.testing.assert_array_equal(np.sort(idx[seq, s, layer], -1), np.sort(top.indices.numpy(), -1))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_is_never_complete_and_keeps_flushed_steps(tmp_path, sig):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        textwrap.dedent("""
        prompts: ["Count slowly from one to one hundred:"]
        generation: {max_new_tokens: 400, eos_token_id: 0}
        output: {chunk_steps: 4}
    """)
    )
    runs = tmp_path / "runs"
    proc = _cli(["generate", str(spec)], runs)
    run_dir = _wait_committed(runs, 8)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] != "complete"
    if sig == signal.SIGTERM:
        assert proc.returncode == 3, err
        assert manifest["status"] == "interrupted"
        assert err.strip().splitlines()[-1].startswith("error: interrupted")
    committed = json.loads((run_dir / "progress" / "shard-0-of-1.json").read_text())["batches"]["0"]["committed_steps"]
    from lmtrace.archive.reader import IncompleteRunWarning, Run

    with pytest.warns(IncompleteRunWarning):
        run = Run(run_dir)
    tokens = run.tokens().to_pandas()
    gen = tokens[~tokens.is_prompt]
    assert gen.step.max() + 1 >= committed
    assert sorted(gen.step.tolist())[:committed] == list(range(committed))
    attn = run.array("attn")[0, :committed]
    assert not np.isnan(attn[:, :, :, 0]).any()  # every committed step has its rows


def test_compaction_killed_while_deleting_parts_keeps_the_full_table(tmp_path):
    """A kill between renaming `<table>.parquet` into place and deleting its parts must not lose rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmtrace.archive.writer import ArchiveWriter

    shape = replace(TABLES_ONLY_SHAPE, n_sequences=1, n_steps=4)
    writer = ArchiveWriter(tmp_path, shape, chunk_steps=2, codec="none", level=0)
    for i in range(3):
        writer._write_part("steps", f"b000000-s{i:08d}", pa.table({"x": [i, i]}))
    assert writer.compact_tables() == {"steps": 6}
    # what a kill during the parts' deletion leaves: the full table and one surviving part
    writer._write_part("steps", "b000000-s00000002", pa.table({"x": [2, 2]}))
    assert writer.compact_tables() == {"steps": 6}
    assert pq.read_table(tmp_path / "steps.parquet").num_rows == 6
    assert not (tmp_path / "steps.parts").exists()


def test_log_json_emits_one_json_object_per_stderr_line(tmp_path, tiny_llama_dir):
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps(_tiny(tiny_llama_dir, generation={"max_new_tokens": 3, "batch_size": 3})))
    proc = _cli(["generate", str(spec), "--log-json"], tmp_path / "runs")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    events = [json.loads(line) for line in err.strip().splitlines()]
    assert [e["event"] for e in events][-1] == "finished" and events[-1]["status"] == "complete"
    assert any(e["event"] == "start" for e in events)


def test_format_1_archives_still_read_and_compare(tmp_path, tiny_llama_dir):
    """Format 1 named the query-head dimension `head` and had no position coordinates: rewrite a
    fresh run into that shape on disk and check lmtrace still opens and compares it."""
    import json
    import shutil

    from lmtrace.analysis.compare import compare_runs
    from tests.helpers.runs import rerecord_checksums

    run = run_spec(tmp_path / "v2", _tiny(tiny_llama_dir))
    old = tmp_path / "v1"
    shutil.copytree(run.path, old)
    zarr_dir = old / "tensors.zarr"
    for meta in zarr_dir.rglob("zarr.json"):
        data = json.loads(meta.read_text())
        if data.get("dimension_names"):
            data["dimension_names"] = ["head" if d == "q_head" else d for d in data["dimension_names"]]
            meta.write_text(json.dumps(data))
    (zarr_dir / "q_head").rename(zarr_dir / "head")
    for name in ("key", "prompt_pos", "query_pos", "key_pos"):
        shutil.rmtree(zarr_dir / name, ignore_errors=True)
    group = json.loads((zarr_dir / "zarr.json").read_text())
    members = group["consolidated_metadata"]["metadata"]
    members["head"] = members.pop("q_head")
    for name in ("key", "prompt_pos", "query_pos", "key_pos"):
        members.pop(name, None)
    for meta in members.values():
        if meta.get("dimension_names"):
            meta["dimension_names"] = ["head" if d == "q_head" else d for d in meta["dimension_names"]]
    (zarr_dir / "zarr.json").write_text(json.dumps(group))
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 1
    (old / "manifest.json").write_text(json.dumps(manifest))
    rerecord_checksums(old)

    from lmtrace import open_run

    v1 = open_run(old)
    np.testing.assert_array_equal(v1.array("attn")[:], run.array("attn")[:])
    result = compare_runs(str(old), str(run.path))
    assert result.identical, result.verdict


@pytest.mark.parametrize("codec", ["auto", "zstd", "none"])
def test_shard_files_are_byte_identical_to_what_zarr_writes(tmp_path, codec):
    """lmtrace writes format-3 shard files itself (archive/shards.py). The same rows written by
    zarr's own sharding codec give the same bytes: sequences of one shard arriving in separate
    writes (read, merged, replaced), a block shorter than chunk_steps, attention rows cut at the
    keys a block reaches, and a prompt-time array; and zarr reads back what was written."""
    import zarr

    from lmtrace.archive import layout
    from lmtrace.archive.shards import ShardFiles
    from lmtrace.archive.writer import compressors_for, create_array

    rng = np.random.default_rng(0)
    cases = [
        (
            layout.ArraySpec("attn", ("sequence", "step", "layer", "q_head", "key"), "float16", True, auto_codec="lz4"),
            (5, 6, 2, 3, 21),
        ),
        (layout.ArraySpec("ffn_idx", ("sequence", "step", "layer", "k_ffn"), "int32", True), (5, 6, 2, 4)),
        (
            layout.ArraySpec(
                "prompt_k",
                ("sequence", "layer", "kv_head", "prompt_pos", "head_dim"),
                "float16",
                False,
                auto_codec="none",
            ),
            (5, 2, 1, 7, 4),
        ),
    ]
    for spec, shape in cases:
        mine = zarr.open_group(str(tmp_path / f"{codec}-mine.zarr"), mode="a", zarr_format=3)
        theirs = zarr.open_group(str(tmp_path / f"{codec}-zarr.zarr"), mode="a", zarr_format=3)
        arrays = [
            create_array(g, spec, shape, 4, compressors_for(codec, 1, spec), chunk_keys=8, chunk_sequences=4)
            for g in (mine, theirs)
        ]
        assert arrays[0].shards[0] == 4 and arrays[0].chunks[0] == 1
        files = ShardFiles.for_array(tmp_path / f"{codec}-mine.zarr" / spec.name, arrays[0], spec.per_step)
        assert files is not None
        data = (
            rng.standard_normal((5,) + shape[1:]).astype(spec.dtype)
            if spec.dtype != "int32"
            else rng.integers(0, 1000, (5,) + shape[1:]).astype(np.int32)
        )
        if spec.per_step:
            width = 11 if spec.key_chunked else shape[-1]  # attention: 2 of the 3 key chunks of 8
            block = data[..., :width]
            writes = [([0, 2], block[[0, 2], :4], 0), ([1], block[[1], :4], 0), ([4], block[[4], 4:6], 4)]
            for seqs, rows, s0 in writes:
                files.write(seqs, rows, s0)
                for row, seq in zip(rows, seqs):
                    arrays[1][seq, s0 : s0 + row.shape[0], ..., : -(-width // 8) * 8 if spec.key_chunked else width] = (
                        np.concatenate(
                            [row, np.full(row.shape[:-1] + (-(-width // 8) * 8 - width,), np.nan, np.float16)], -1
                        )
                        if spec.key_chunked
                        else row
                    )
            shards = ["c/0/0/" + "/".join(["0"] * (len(shape) - 2)), "c/1/1/" + "/".join(["0"] * (len(shape) - 2))]
        else:
            files.write([3, 0], data[[3, 0]])
            files.write([4], data[[4]])
            for seq in (3, 0, 4):
                arrays[1][seq] = data[seq]
            shards = ["c/0/" + "/".join(["0"] * (len(shape) - 1)), "c/1/" + "/".join(["0"] * (len(shape) - 1))]
        for shard in shards:
            ours = (tmp_path / f"{codec}-mine.zarr" / spec.name / shard).read_bytes()
            assert ours == (tmp_path / f"{codec}-zarr.zarr" / spec.name / shard).read_bytes(), (spec.name, shard)
        np.testing.assert_array_equal(arrays[0][...], arrays[1][...], err_msg=spec.name)


def test_files_do_not_multiply_with_sequences(tmp_path, tiny_llama_dir):
    """Format 3: a shard file holds `output.chunk_sequences` sequences × one block of steps of an
    array, so 2 or 12 prompts (one group of 16) make the same files, and 12 prompts in groups of 4
    three times as many shard files per array and block."""
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]  # 12 prompts
    gen = {"max_new_tokens": 6, "batch_size": 5}

    def count(run):
        return {
            name: sum(1 for f in (run.path / "tensors.zarr" / name / "c").rglob("*") if f.is_file())
            for name in run.manifest["arrays"]
        }  # the arrays over `sequence`

    spec = {
        "model": str(tiny_llama_dir),
        "generation": gen,
        "capture": {"preset": "full"},
        "output": {"chunk_steps": 4},
    }
    two = run_spec(
        tmp_path / "two", {**spec, "prompts": PROMPTS[:2], "output": {"chunk_steps": 4, "chunk_sequences": 16}}
    )
    twelve = run_spec(
        tmp_path / "twelve", {**spec, "prompts": prompts, "output": {"chunk_steps": 4, "chunk_sequences": 16}}
    )
    fours = run_spec(
        tmp_path / "fours", {**spec, "prompts": prompts, "output": {"chunk_steps": 4, "chunk_sequences": 4}}
    )
    assert twelve.sequences().to_pandas().generated_len.min() == 6  # both blocks written for every sequence
    assert count(two) == count(twelve), (count(two), count(twelve))
    per_step = {s.name for s in layout_arrays(twelve) if s.per_step}
    for name, n in count(twelve).items():
        assert n == (2 if name in per_step else 1), (name, n)  # 2 blocks of 4 steps; prompt-time: 1
        assert count(fours)[name] == 3 * n, name
    for name in twelve.manifest["arrays"]:  # the same values, however they are grouped into files
        np.testing.assert_array_equal(twelve.tensors[name][...], fours.tensors[name][...], err_msg=name)


def layout_arrays(run):
    from lmtrace.archive.layout import ArraySpec

    return [
        ArraySpec(name, tuple(a["dims"]), a["dtype"], a["dims"][:2] == ["sequence", "step"])
        for name, a in run.manifest["arrays"].items()
    ]


def test_format_2_archives_still_read_verify_and_take_a_lens(tmp_path, tiny_llama_dir):
    """Format 2 stored one chunk file per (sequence, block of steps) of an array, unsharded: rewrite a
    fresh run into that layout with zarr itself, and check that lmtrace opens, verifies and compares
    it, and that `lmtrace lens` writes its arrays into it in the run's own (unsharded) layout."""
    import shutil

    import zarr

    from lmtrace import open_run
    from lmtrace.analysis.compare import compare_runs
    from lmtrace.archive.integrity import verify
    from lmtrace.archive.shards import sharding_of
    from lmtrace.archive.writer import consolidate
    from tests.helpers.runs import rerecord_checksums, with_lens

    run = run_spec(tmp_path / "v3", _tiny(tiny_llama_dir))
    old = tmp_path / "v2" / run.path.name
    shutil.copytree(run.path, old)
    group = zarr.open_group(str(old / "tensors.zarr"), mode="a", zarr_format=3)
    for name in run.manifest["arrays"]:
        a = group[name]
        data, sharding = a[...], sharding_of(a)
        assert sharding is not None, name
        shutil.rmtree(old / "tensors.zarr" / name)
        b = zarr.create_array(
            str(old / "tensors.zarr" / name),
            shape=a.shape,
            chunks=sharding.chunk_shape,
            dtype=a.dtype,
            fill_value=a.fill_value,
            compressors=list(sharding.codecs[1:]) or None,
            dimension_names=a.metadata.dimension_names,
            zarr_format=3,
        )
        b[...] = data
    consolidate(old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 2
    (old / "manifest.json").write_text(json.dumps(manifest))
    rerecord_checksums(old)
    assert (
        len([f for f in (old / "tensors.zarr" / "resid" / "c").rglob("*") if f.is_file()]) == 3
    )  # a file per sequence

    v2 = open_run(old)
    for name in run.manifest["arrays"]:
        assert sharding_of(v2.tensors[name]) is None, name
        np.testing.assert_array_equal(v2.array(name)[...], run.array(name)[...], err_msg=name)
    assert verify(old, v2.manifest)[0] == []
    assert compare_runs(str(old), str(run.path)).identical
    lensed, lensed_v3 = with_lens(v2), with_lens(run)
    for name in ("lens_ids", "lens_probs"):
        assert sharding_of(lensed.tensors[name]) is None and sharding_of(lensed_v3.tensors[name]) is not None
        np.testing.assert_array_equal(lensed.array(name)[...], lensed_v3.array(name)[...], err_msg=name)
    assert verify(old, open_run(old).manifest)[0] == []


def test_format_3_archives_without_checksums_still_read_verify_and_take_a_lens_in_their_layout(
    tmp_path, tiny_llama_dir
):
    """Format 4 ends every chunk in its crc32c and writes Parquet page checksums; a format-3 archive
    (the same shards, no chunk checksums, Parquet pages without them) rewritten here with zarr and
    pyarrow themselves still opens, verifies, compares and takes a lens whose arrays are like its own."""
    import shutil

    import pyarrow.parquet as pq
    import zarr

    from lmtrace import open_run
    from lmtrace.analysis.compare import compare_runs
    from lmtrace.archive.integrity import verify
    from lmtrace.archive.shards import checksummed, sharding_of
    from lmtrace.archive.writer import consolidate
    from tests.helpers.runs import rerecord_checksums, with_lens

    run = run_spec(tmp_path / "v4", _tiny(tiny_llama_dir))
    old = tmp_path / "v3" / run.path.name
    shutil.copytree(run.path, old)
    group = zarr.open_group(str(old / "tensors.zarr"), mode="a", zarr_format=3)
    for name in list(group.array_keys()):
        a = group[name]
        sharding = sharding_of(a)
        codecs = [c.to_dict()["name"] for c in (sharding.codecs if sharding is not None else a.metadata.codecs)]
        assert codecs[-1] == "crc32c" and checksummed(a), (name, codecs)
        data = a[...]
        inner = list((sharding.codecs if sharding is not None else a.metadata.codecs)[1:-1])
        shutil.rmtree(old / "tensors.zarr" / name)
        b = zarr.create_array(
            str(old / "tensors.zarr" / name),
            shape=a.shape,
            dtype=a.dtype,
            fill_value=a.fill_value,
            chunks=sharding.chunk_shape if sharding is not None else a.chunks,
            shards=a.shards,
            compressors=inner or None,
            dimension_names=a.metadata.dimension_names,
            zarr_format=3,
        )
        b[...] = data
        assert not checksummed(b), name
    for table in old.glob("*.parquet"):
        pq.write_table(pq.read_table(table), table)  # pyarrow's default: no page checksums
    consolidate(old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 3
    (old / "manifest.json").write_text(json.dumps(manifest))
    rerecord_checksums(old)

    v3 = open_run(old)
    for name in run.manifest["arrays"]:
        np.testing.assert_array_equal(v3.array(name)[...], run.array(name)[...], err_msg=name)
    assert v3.tokens().equals(run.tokens()) and v3.steps().equals(run.steps())
    assert verify(old, v3.manifest)[0] == []
    assert compare_runs(str(old), str(run.path)).identical
    lensed, lensed_v4 = with_lens(v3), with_lens(run)
    for name in ("lens_ids", "lens_probs"):
        assert not checksummed(lensed.tensors[name]) and checksummed(lensed_v4.tensors[name]), name
        assert sharding_of(lensed.tensors[name]) is not None
        np.testing.assert_array_equal(lensed.array(name)[...], lensed_v4.array(name)[...], err_msg=name)
    assert verify(old, open_run(old).manifest)[0] == []


@pytest.mark.parametrize("preset", ["standard", "light"])
def test_validate_estimate_is_within_2x_of_the_measured_run(tmp_path, tiny_llama_dir, preset):
    """`lmtrace validate`'s size estimate against the bytes the same spec's run puts on disk."""
    import yaml

    from lmtrace.commands.validate import validate_spec

    spec = _tiny(
        tiny_llama_dir,
        generation={"max_new_tokens": 40, "batch_size": 3, "eos_token_id": []},
        capture={"preset": preset},
        output={"runs_dir": str(tmp_path / "runs")},
    )
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    estimate = validate_spec(path, [])["estimate"]
    run = run_spec(tmp_path, spec)
    assert (run.sequences().to_pandas().generated_len == 40).all()  # the estimate is for max_new_tokens
    measured = sum(f.stat().st_size for f in run.path.rglob("*") if f.is_file())
    estimated = estimate["tensor_bytes_max"] + estimate["table_bytes_max"]
    assert measured / 2 <= estimated <= 2 * measured, (estimated, measured)
