"""A model spread over devices (`model.device_map`) gives the archive it gives on one device.

On a CPU machine "spread" means part of the layers offloaded to disk by accelerate (their weights
read from disk for every call) and, to run the multi-device assembly code, the KV cache split into
several stacks. The references are the same spec run on one device, and the model's own eager
forward (tests/helpers/reference.py), never lmtrace's placement code. The CUDA tests skip without a GPU.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers.cli import assert_no_complete_run, assert_one_line_error, lmtrace, write
from tests.helpers.reference import Reference, check_sequence
from tests.helpers.runs import PROMPTS, run_spec

TOL = 1e-5
CAPTURE = {"lens": {"when": "inline"}, "prefill_attention": True}
OUTPUT = {"float_dtype": "float32"}  # float16 would round a 1e-6 difference into a 1e-3 one
# A 30 MB budget for a ~30 MB model: accelerate keeps the embedding and layers 0-1 on the CPU and
# offloads layers 2-3, the final norm and the unembedding to disk (asserted below).
BUDGET = {"cpu": "30MB"}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory):
    """A random 4-layer GQA Llama whose layers are large next to its embedding (d_ffn 2048), so a
    memory budget can split it between layers; the embedded model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmtrace.runner.models import load_tokenizer
    from lmtrace.spec.run_spec import ModelSpec

    tok = load_tokenizer(ModelSpec())
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    path = tmp_path_factory.mktemp("wide-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _run(tmp_path, model: dict, **extra):
    return run_spec(
        tmp_path,
        {
            "model": {"dtype": "float32", **model},
            "prompts": PROMPTS,
            "capture": CAPTURE,
            "output": OUTPUT,
            "generation": {"max_new_tokens": 5, "batch_size": 3},
            **extra,
        },
    )


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, wide_llama_dir):
    return _run(tmp_path_factory.mktemp("single"), {"ref": str(wide_llama_dir), "device": "cpu"})


def assert_same_archive(a, b) -> None:
    """Every array, token and per-layer scalar of run b equals run a's (floats within TOL)."""
    assert a.array_names() == b.array_names()
    for name in a.array_names():
        x, y = np.asarray(a.array(name)[:]), np.asarray(b.array(name)[:])
        assert x.shape == y.shape, name
        if x.dtype.kind == "f":
            np.testing.assert_allclose(y, x, atol=TOL, rtol=TOL, equal_nan=True, err_msg=name)
        else:
            np.testing.assert_array_equal(y, x, err_msg=name)
    ta, tb = a.tokens().to_pandas(), b.tokens().to_pandas()
    assert ta.token_id.tolist() == tb.token_id.tolist()
    np.testing.assert_allclose(tb.logprob.to_numpy(float), ta.logprob.to_numpy(float), atol=TOL, equal_nan=True)
    sa, sb = a.steps().to_pandas(), b.steps().to_pandas()
    assert list(sa.columns) == list(sb.columns)
    for column in sa.columns:
        np.testing.assert_allclose(
            sb[column].to_numpy(float), sa[column].to_numpy(float), atol=TOL, rtol=TOL, equal_nan=True, err_msg=column
        )


def _placed(run) -> dict[str, list[str]]:
    return {row["device"]: row["modules"] for row in run.manifest["model"]["placement"]["devices"]}


def test_disk_offload_gives_the_single_device_archive(tmp_path, wide_llama_dir, single_run):
    spread = _run(
        tmp_path,
        {
            "ref": str(wide_llama_dir),
            "device_map": "auto",
            "max_memory": BUDGET,
            "offload_folder": str(tmp_path / "offload"),
        },
    )
    placed = _placed(spread)
    assert placed["cpu"] == ["model.embed_tokens", "model.layers.0-1"], placed
    assert "model.layers.2-3" in placed["disk"] and "lm_head" in placed["disk"], placed
    assert spread.manifest["device"] == "cpu"
    assert_same_archive(single_run, spread)
    # and the offloaded run against the model's own eager forward, every captured quantity
    ref = Reference(str(wide_llama_dir))
    for seq in range(len(PROMPTS)):
        assert check_sequence(spread, ref, seq) == 5


def test_explicit_map_gives_the_single_device_archive(tmp_path, wide_llama_dir, single_run):
    device_map = {
        "model.embed_tokens": "disk",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "cpu",
        "model.layers.3": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "disk",
    }
    spread = _run(
        tmp_path, {"ref": str(wide_llama_dir), "device_map": device_map, "offload_folder": str(tmp_path / "offload")}
    )
    assert spread.manifest["model"]["placement"]["device_map"] == device_map
    assert_same_archive(single_run, spread)
    # commands that edit or differentiate the model run on one device: a spread run is refused in
    # one line before any model is loaded (explain loads it on one device with --device)
    from lmtrace.commands.intervene import run_intervene
    from lmtrace.exits.errors import SpecError
    from lmtrace.runner.models import load_run_model

    with pytest.raises(SpecError, match=r"model.device_map .* lmtrace intervene runs on one device only"):
        run_intervene(str(spread.path), [{"kind": "ablate_head", "layer": 1, "head": 0}])
    with pytest.raises(SpecError, match=r"the sweep runs on one device only; generate the run with model.device"):
        load_run_model(spread.manifest, spread.id, purpose="the sweep")
    with pytest.raises(SpecError, match=r"give --device DEVICE"):
        load_run_model(spread.manifest, spread.id, purpose="explain", overrides={"device": None})
    assert (
        load_run_model(spread.manifest, spread.id, purpose="explain", overrides={"device": "cpu"}).device.type == "cpu"
    )


def test_layers_in_several_kv_stacks_give_the_same_archive(tmp_path, wide_llama_dir, single_run, monkeypatch):
    """The per-device KV stacks, rows and column gathers, run on a CPU by splitting the layers over
    two stacks (interleaved, so the results must also be put back in layer order)."""
    from lmtrace.capture import kv_cache
    from lmtrace.capture.attention_rows import BatchedRows

    def split(config, prompt_len, max_new_tokens, device, layer_devices=None):
        return kv_cache.StackedCache(
            config, capacity_hint=prompt_len + max_new_tokens, groups=[(None, [0, 2]), (None, [1, 3])]
        )

    served = []
    rows = BatchedRows.rows

    def counting(self, device=None):
        served.append(len(self.kv.groups(sorted(self.queries))))
        return rows(self, device)

    monkeypatch.setattr(kv_cache.StackedCache, "for_generation", staticmethod(split))
    monkeypatch.setattr(BatchedRows, "rows", counting)
    run = _run(tmp_path, {"ref": str(wide_llama_dir), "device": "cpu"})
    # every decode step's rows came from two stacks (the prefill's, with prefill_attention, per layer)
    assert served == [0, 2, 2, 2, 2], served
    assert_same_archive(single_run, run)


def test_validate_reports_the_plan_without_weights(tmp_path, wide_llama_dir):
    """`lmtrace validate` plans from the config alone (this directory has no weights) and its plan is
    transformers' own planner's on an empty-weights model."""
    import shutil

    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.accelerate import _get_device_map

    from lmtrace.commands.validate import validate_spec

    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(wide_llama_dir / "config.json", config_only)
    spec = write(
        tmp_path / "spec.yaml",
        json.dumps(
            {
                "model": {
                    "ref": str(config_only),
                    "dtype": "float32",
                    "device_map": "sequential",
                    "max_memory": BUDGET,
                    "offload_folder": str(tmp_path / "off"),
                },
                "prompts": ["hi"],
            }
        ),
    )
    placement = validate_spec(spec, [])["placement"]
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_only), dtype=torch.float32)
    expected = _get_device_map(empty, "sequential", {"cpu": 30 * 10**6}, None)
    assert placement["device_map"] == {k: str(v) for k, v in expected.items()}
    on_disk = [row for row in placement["devices"] if row["device"] == "disk"][0]
    on_disk_modules = [m for m, d in expected.items() if d == "disk"]
    assert on_disk["bytes"] == sum(
        t.numel() * 4
        for n, t in [*empty.named_parameters(), *empty.named_buffers()]
        if any(n.startswith(m + ".") for m in on_disk_modules)
    )
    proc = lmtrace(tmp_path, "validate", str(spec))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert (
        "# placement (float32): cpu: model.embed_tokens, model.layers.0-1" in text and "disk: model.layers.2-3" in text
    )


BAD_MAPS = {
    "unknown_module": (
        {"device_map": {"model.embed_tokens": "cpu", "model.layer.0": "cpu", "": "cpu"}},
        ["unknown module 'model.layer.0'", "did you mean 'model.layers.0'"],
    ),
    "unplaced_module": (
        {"device_map": {"model.embed_tokens": "cpu", "model.layers": "cpu"}},
        ["does not place", "lm_head"],
    ),
    "device_not_present": ({"device_map": {"": "cuda:7"}}, ["cuda:7 is not present on this machine"]),
    "both_keys": ({"device": "cpu", "device_map": "auto"}, ["model.device (cpu) and model.device_map are exclusive"]),
    "bad_device": ({"device_map": {"": "gpu0"}}, ["model.device_map", "expected cpu, cuda:N"]),
}


@pytest.mark.parametrize("case", sorted(BAD_MAPS))
def test_bad_maps_are_one_line_usage_errors(tmp_path, wide_llama_dir, case):
    """In-process (the message) here; the real CLI's exit code and one line in the test below."""
    from lmtrace.commands.validate import validate_spec
    from lmtrace.exits.errors import SpecError

    if case == "device_not_present" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    model, fragments = BAD_MAPS[case]
    spec = write(
        tmp_path / "spec.yaml", json.dumps({"model": {"ref": str(wide_llama_dir), **model}, "prompts": ["hi"]})
    )
    with pytest.raises(SpecError) as err:
        validate_spec(spec, [])
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_bad_map_exits_2_from_the_cli(tmp_path, wide_llama_dir):
    spec = write(
        tmp_path / "spec.yaml",
        json.dumps(
            {
                "model": {"ref": str(wide_llama_dir), "device_map": {"": "cuda:7"}},
                "prompts": ["hi"],
                "generation": {"max_new_tokens": 2},
            }
        ),
    )
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert_one_line_error(lmtrace(tmp_path, "generate", str(spec), "--quiet"), 2, "cuda:7 is not present")
    assert_no_complete_run(tmp_path / "runs")


@pytest.mark.slow
def test_embedded_model_with_offloaded_layers(tmp_path):
    """The embedded GGUF model (converted to safetensors once) loads with part of its layers on disk."""
    base = {
        "prompts": ["Paris is the capital of"],
        "generation": {"max_new_tokens": 2},
        "output": OUTPUT,
        "capture": {"layers": [0, 29], "lens": {"when": "inline"}},
    }
    one = run_spec(tmp_path / "one", {**base, "model": {"device": "cpu", "dtype": "float32"}})
    spread = run_spec(
        tmp_path / "spread",
        {
            **base,
            "model": {
                "dtype": "float32",
                "device_map": "auto",
                "max_memory": {"cpu": "300MB"},
                "offload_folder": str(tmp_path / "off"),
            },
        },
    )
    placed = _placed(spread)
    assert any(m.startswith("model.layers.") for m in placed.get("disk", [])), placed
    assert_same_archive(one, spread)


# ---- CUDA: skipped on machines without a GPU --------------------------------------------------------
CUDA_TOL = {"float32": 1e-4, "bfloat16": 5e-2}  # vs the CPU float32 run (docs/devices.md)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_run_matches_the_cpu_run(tmp_path, wide_llama_dir, single_run, dtype):
    cuda = _run(tmp_path, {"ref": str(wide_llama_dir), "device": "cuda", "dtype": dtype})
    assert cuda.manifest["device"].startswith("cuda")
    assert set(cuda.manifest["timings"]["peak_gpu_memory_bytes"]) == {"cuda:0"}
    assert not torch.backends.cuda.matmul.allow_tf32
    a, b = single_run.tokens().to_pandas(), cuda.tokens().to_pandas()
    if dtype == "float32":
        assert a.token_id.tolist() == b.token_id.tolist()
    attn_a, attn_b = np.asarray(single_run.array("attn")[:, 0]), np.asarray(cuda.array("attn")[:, 0])
    np.testing.assert_allclose(attn_b, attn_a, atol=CUDA_TOL[dtype], equal_nan=True)


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_map_over_two_gpus_gives_the_single_device_archive(tmp_path, wide_llama_dir, single_run):
    device_map = {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.layers.2": 0,
        "model.layers.3": 1,
        "model.norm": 1,
        "model.rotary_emb": 0,
        "lm_head": 1,
    }
    spread = _run(tmp_path, {"ref": str(wide_llama_dir), "device_map": device_map})
    assert set(spread.manifest["timings"]["peak_gpu_memory_bytes"]) == {"cuda:0", "cuda:1"}
    a, b = single_run.tokens().to_pandas(), spread.tokens().to_pandas()
    assert a.token_id.tolist() == b.token_id.tolist()
    np.testing.assert_allclose(
        np.asarray(spread.array("attn")[:]),
        np.asarray(single_run.array("attn")[:]),
        atol=CUDA_TOL["float32"],
        equal_nan=True,
    )
