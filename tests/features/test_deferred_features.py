"""The deferred `lmtrace features RUN --sae DIR` from the archived residual vectors (docs/features.md,
"Deferred features") on a run holding `resid` at every layer, in shards of 2 sequences and blocks of
2 steps (a partial last shard and block): one layer read shard by shard equals zarr's own read of
that layer; the features written equal the SAE applied by the test's own numpy formula to the
model's own hidden states at each step's query position, for an SAE at resid_post 1 and one at
resid_pre 2 (the same vectors); a changed byte in a `resid` inner chunk fails the read and the
command, never a result from damaged bytes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tests.helpers.cli import assert_one_line_error, lmtrace
from tests.helpers.runs import PROMPTS, run_spec
from tests.helpers.saes import dense, encode, random_sae, top_of

D_SAE, TOP_K, NEW = 96, 6, 5


@pytest.fixture(scope="module")
def resid_run(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("deferred-features")
    run = run_spec(
        root,
        {
            "model": str(tiny_llama_dir),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": NEW, "batch_size": 3},
            "output": {"float_dtype": "float32", "chunk_sequences": 2, "chunk_steps": 2},
        },
    )
    assert list(run.manifest["shape"]["resid_layers"]) == [0, 1, 2, 3]
    return run


def test_one_resid_layer_read_shard_by_shard_equals_zarrs_read_of_that_layer(resid_run):
    import zarr

    from lmtrace.archive.feature_arrays import read_block

    resid = zarr.open_group(str(resid_run.path / "tensors.zarr"), mode="r")["resid"]
    assert tuple(resid.shards)[:2] == (2, 2) and resid.shape[:2] == (3, NEW)
    for start, stop in ((0, 2), (2, 3), (0, 3), (1, 3)):
        np.testing.assert_array_equal(read_block(resid, start, stop), np.asarray(resid[start:stop]))
        for layer in range(4):
            got = read_block(resid, start, stop, pick=(2, layer))
            assert got.shape == (stop - start, NEW, 64) and got.flags.c_contiguous
            np.testing.assert_array_equal(got, np.asarray(resid[start:stop, :, layer]))


@torch.inference_mode()
def _hidden_states(model_dir, ids: list[int]) -> list[np.ndarray]:
    """The model's own float32 hidden states: [0] the embeddings, [l + 1] the output of layer l."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return [h[0].numpy() for h in model(torch.tensor([ids]), output_hidden_states=True).hidden_states]


def test_deferred_features_equal_the_sae_on_the_models_own_hidden_states(resid_run, tiny_llama_dir, tmp_path):
    run_dir = shutil.copytree(resid_run.path, tmp_path / "runs" / resid_run.path.name)
    saes = {}
    for name, hook, seed in (("post-1", "blocks.1.hook_resid_post", 3), ("pre-2", "blocks.2.hook_resid_pre", 4)):
        saes[name] = random_sae(tmp_path / name, hook, 64, D_SAE, arch="topk", k=TOP_K, seed=seed, scale=3.0)
        args = ("features", str(run_dir), "--sae", str(tmp_path / name), "--top-k", str(TOP_K), "--json")
        proc = lmtrace(tmp_path, *args)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["source"] == "archive"
    import zarr

    group = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    tokens = resid_run.tokens().to_pandas().sort_values(["sequence", "position"])
    checked = 0
    for seq, g in tokens.groupby("sequence"):
        prompt, generated = g[g.is_prompt].token_id.tolist(), g[~g.is_prompt].token_id.tolist()
        after_layer_1 = _hidden_states(tiny_llama_dir, prompt + generated)[2]
        steps = [len(prompt) - 1 + s for s in range(len(generated))]  # each step's query position
        for name, (cfg, w) in saes.items():
            idx, val = group[f"feat_{name}_idx"][seq], group[f"feat_{name}_val"][seq]
            want = top_of(encode(cfg, w, after_layer_1[steps]), TOP_K)
            np.testing.assert_allclose(dense(idx[: len(generated)], val[: len(generated)], D_SAE), want, atol=2e-4)
            assert (idx[len(generated) :] == -1).all() and np.isnan(val[len(generated) :]).all()
            checked += int((idx >= 0).sum())
    assert checked > 20
    assert lmtrace(tmp_path, "verify", str(run_dir)).returncode == 0


def _first_inner_chunk(shard: bytes) -> tuple[int, int]:
    """(offset, nbytes) of the first inner chunk a shard file holds (its index: uint64 pairs, then crc32c)."""
    return tuple(int(v) for v in np.frombuffer(shard[-2 * 16 - 4 : -4], dtype="<u8")[:2])


def test_a_changed_byte_in_a_resid_inner_chunk_fails_the_read_and_the_command(resid_run, tmp_path):
    import zarr

    from lmtrace.archive.feature_arrays import read_block

    run_dir = shutil.copytree(resid_run.path, tmp_path / "runs" / resid_run.path.name)
    shard = run_dir / "tensors.zarr" / "resid" / "c" / "0" / "0" / "0" / "0"
    data = bytearray(shard.read_bytes())
    offset, nbytes = _first_inner_chunk(bytes(data))  # 2 sequences x 1 block of steps: 2 inner chunks
    data[offset + nbytes // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    resid = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")["resid"]
    with pytest.raises(Exception, match="(?i)checksum"):
        read_block(resid, 0, 2, pick=(2, 1))
    cfg, _ = random_sae(tmp_path / "sae", "blocks.1.hook_resid_post", 64, D_SAE, seed=3)
    proc = lmtrace(tmp_path, "features", str(run_dir), "--sae", str(tmp_path / "sae"), "--source", "archive")
    assert_one_line_error(proc, 2, "is damaged", "tensors.zarr/resid/")
    assert not (run_dir / "tensors.zarr" / "feat_sae_idx").exists()
