"""Interventions are real edits of the forward: each kind equals an edit the test makes itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PROMPTS, run_spec
from lmtrace.archive.reader import Run
from lmtrace.errors import SpecError
from lmtrace.intervene import run_intervene
from lmtrace.models import load_model
from lmtrace.spec import ModelSpec


@pytest.fixture(scope="module")
def parent(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("parent")
    return run_spec(tmp, {
        "model": str(tiny_llama_dir), "prompts": PROMPTS,
        "generation": {"max_new_tokens": 6, "batch_size": 3, "temperature": 0.9, "seed": 4},
        "capture": {"residual": {"vectors_at": [1]}}, "output": {"float_dtype": "float32"},
    })


def _child(parent, entries, **kw):
    result, effects = run_intervene(str(parent.path), entries, **kw)
    return Run(result.run_dir), effects.to_pandas()


def _sequence_ids(run, seq):
    t = run.tokens().to_pandas()
    return t[t.sequence == seq].sort_values("position").token_id.tolist()


def _reference_logprobs(model_dir, ids, mask=None, edit=None):
    """Log-probs of every next token from the test's own full forward, optionally on an edited copy."""
    model = load_model(ModelSpec(ref=str(model_dir), attn_implementation="eager")).model
    handles = edit(model) if edit is not None else []
    with torch.inference_mode():
        kwargs = {"attention_mask": torch.tensor([mask])} if mask is not None else {}
        out = model(torch.tensor([ids]), **kwargs)
    for h in handles or []:
        h.remove()
    return out.logits[0].float().log_softmax(-1)


def _check_child_logprobs(parent, child, effects, model_dir, mask_fn=None, edit=None, atol=1e-4):
    for seq in range(3):
        ids = _sequence_ids(parent, seq)
        P = int(parent.prompt_len()[seq])
        mask = mask_fn(len(ids)) if mask_fn else None
        ref = _reference_logprobs(model_dir, ids, mask, edit)
        e = effects[effects.sequence == seq].sort_values("step")
        for _, row in e.iterrows():
            expected = ref[P - 1 + row.step, row.parent_token].item()
            assert abs(row.child_logprob_of_parent_token - expected) < atol, (seq, row.step)


def test_no_edit_rescore_reproduces_the_parent_exactly(parent):
    child, effects = _child(parent, [])
    assert child.manifest["parent"]["run_id"] == parent.id and child.manifest["kind"] == "intervene"
    assert child.tokens().to_pandas().token_id.tolist() == parent.tokens().to_pandas().token_id.tolist()
    for name in ("attn", "q", "lens_probs", "resid"):
        np.testing.assert_array_equal(child.array(name)[:], parent.array(name)[:], err_msg=name)
    assert (effects.logprob_shift == 0).all() and (effects.kl_parent_child_topk == 0).all()


def test_regenerate_without_edits_reproduces_the_sampled_tokens(parent):
    child, _ = _child(parent, [], mode="regenerate", from_step=2)
    assert child.tokens().to_pandas().token_id.tolist() == parent.tokens().to_pandas().token_id.tolist()


def test_patching_a_run_with_itself_changes_nothing(parent):
    child, effects = _child(parent, [{"kind": "patch_residual", "layer": 1, "source_run": str(parent.path)}])
    np.testing.assert_array_equal(child.array("lens_probs")[:], parent.array("lens_probs")[:])
    assert (effects.logprob_shift == 0).all()


def test_head_ablation_equals_zeroing_that_heads_slice_of_o_proj(parent, tiny_llama_dir):
    child, effects = _child(parent, [{"kind": "ablate_head", "layer": 2, "head": 1}])
    assert effects.logprob_shift.abs().max() > 1e-4  # the edit really changes the model

    def edit(model):
        d = model.config.hidden_size // model.config.num_attention_heads
        model.model.layers[2].self_attn.o_proj.weight.data[:, d: 2 * d] = 0
    _check_child_logprobs(parent, child, effects, tiny_llama_dir, edit=edit)
    # layers before the ablated one are untouched while contexts are identical
    np.testing.assert_array_equal(child.array("attn")[:, :, :2], parent.array("attn")[:, :, :2])


def test_neuron_and_layer_ablation_equal_the_tests_own_edits(parent, tiny_llama_dir):
    child, effects = _child(parent, [{"kind": "ablate_neurons", "layer": 0, "neurons": [3, 17, 40]}])

    def zero_neurons(model):
        model.model.layers[0].mlp.down_proj.weight.data[:, [3, 17, 40]] = 0
    _check_child_logprobs(parent, child, effects, tiny_llama_dir, edit=zero_neurons)

    child, effects = _child(parent, [{"kind": "ablate_layer", "layer": 1}])

    def skip_layer(model):
        layer = model.model.layers[1]
        saved = {}
        return [layer.register_forward_pre_hook(lambda m, a, k: saved.__setitem__("x", a[0] if a else k["hidden_states"]), with_kwargs=True),
                layer.register_forward_hook(lambda m, a, o: saved["x"])]
    _check_child_logprobs(parent, child, effects, tiny_llama_dir, edit=skip_layer)


def test_position_masking_equals_a_forward_with_the_tests_own_mask(parent, tiny_llama_dir):
    child, effects = _child(parent, [{"kind": "mask_positions", "mask": [1, 2]}])

    def mask_fn(n):
        m = [1] * n
        m[1] = m[2] = 0
        return m
    _check_child_logprobs(parent, child, effects, tiny_llama_dir, mask_fn=mask_fn)


def test_steering_adds_the_vector_to_the_residual(parent, tiny_llama_dir, tmp_path):
    v = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    np.save(tmp_path / "v.npy", v)
    child, effects = _child(parent, [{"kind": "steer", "layer": 1, "alpha": 2.0, "vector": str(tmp_path / "v.npy")}])

    def steer(model):
        return [model.model.layers[1].register_forward_hook(lambda m, a, o: o + 2.0 * torch.from_numpy(v))]
    _check_child_logprobs(parent, child, effects, tiny_llama_dir, edit=steer)


def test_out_of_range_edits_name_the_valid_range(parent):
    with pytest.raises(SpecError, match=r"layers 0\.\.3"):
        run_intervene(str(parent.path), [{"kind": "ablate_layer", "layer": 9}])
    with pytest.raises(SpecError, match=r"heads 0\.\.3"):
        run_intervene(str(parent.path), [{"kind": "ablate_head", "layer": 0, "head": 4}])
    with pytest.raises(SpecError, match="kinds:"):
        run_intervene(str(parent.path), [{"kind": "add_noise", "layer": 0}])


def test_cli_shorthands_write_a_linked_child_and_a_temperature_sweep(parent, tmp_path):
    import json
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "lmtrace.cli", "intervene", str(parent.path), *args, "--json"],
                              capture_output=True, text=True)
    out = cli("--ablate-head", "1.2", "--ablate-neurons", "0:1,2", "--mask-positions", "0-1", "--from-step", "2")
    assert out.returncode == 0, out.stderr
    child = Run(json.loads(out.stdout)["children"][0]["run_dir"])
    kinds = [e["kind"] for e in child.manifest["interventions"]]
    assert kinds == ["ablate_head", "ablate_neurons", "mask_positions"]
    assert all(e["steps"] == {"from": 2} for e in child.manifest["interventions"])
    effects = __import__("pandas").read_parquet(child.path / "effects.parquet")
    assert (effects[effects.step < 2].logprob_shift == 0).all()  # nothing is edited before --from-step
    out = cli("--temperatures", "0.5,2.0")
    assert out.returncode == 0, out.stderr
    assert [c["temperature"] for c in json.loads(out.stdout)["children"]] == [0.5, 2.0]
    bad = cli("--ablate-head", "1")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --ablate-head")
