"""Interventions are real edits of the forward: each kind equals an edit the test makes itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmtrace.archive.reader import Run
from lmtrace.commands.intervene import run_intervene
from lmtrace.exits.errors import SpecError
from lmtrace.runner.models import load_model
from lmtrace.spec.run_spec import ModelSpec
from tests.helpers.runs import PROMPTS, run_spec, with_lens


def _tiny_run(tmp, model_dir, batch_size: int, seed: int, **extra):
    """A sampled run of the tiny model over PROMPTS, 6 tokens, float32 arrays."""
    return run_spec(
        tmp,
        {
            "model": str(model_dir),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 6, "batch_size": batch_size, "temperature": 0.9, "seed": seed},
            "output": {"float_dtype": "float32"},
            **extra,
        },
    )


@pytest.fixture(scope="module")
def parent(tmp_path_factory, tiny_llama_dir):
    run = _tiny_run(
        tmp_path_factory.mktemp("parent"),
        tiny_llama_dir,
        batch_size=3,
        seed=4,
        # float32 residuals: patching the run with its own vectors is then exact; q/k/v for the rescore test
        capture={"residual": {"vectors_at": [1], "dtype": "float32"}, "qkv": True},
    )
    return with_lens(run)  # the deferred logit lens, computed: lens_probs is compared with children's


def _child(parent, entries, *, lens: bool = False, **kw):
    """The child run of an intervention (and its deferred logit lens, computed, when `lens`)."""
    result, effects = run_intervene(str(parent.path), entries, **kw)
    child = Run(result.run_dir)
    return (with_lens(child) if lens else child), effects.to_pandas()


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
    child, effects = _child(parent, [], lens=True)
    assert child.manifest["parent"]["run_id"] == parent.id and child.manifest["kind"] == "intervene"
    assert child.tokens().to_pandas().token_id.tolist() == parent.tokens().to_pandas().token_id.tolist()
    for name in ("attn", "q", "lens_probs", "resid"):
        np.testing.assert_array_equal(child.array(name)[:], parent.array(name)[:], err_msg=name)
    assert (effects.logprob_shift == 0).all() and (effects.kl_parent_child_topk == 0).all()


def test_regenerate_without_edits_reproduces_the_sampled_tokens(parent):
    child, _ = _child(parent, [], mode="regenerate", from_step=2)
    assert child.tokens().to_pandas().token_id.tolist() == parent.tokens().to_pandas().token_id.tolist()


def test_patching_a_run_with_itself_changes_nothing(parent):
    child, effects = _child(parent, [{"kind": "patch_residual", "layer": 1, "source_run": str(parent.path)}], lens=True)
    np.testing.assert_array_equal(child.array("lens_probs")[:], parent.array("lens_probs")[:])
    assert (effects.logprob_shift == 0).all()


def test_head_ablation_equals_zeroing_that_heads_slice_of_o_proj(parent, tiny_llama_dir):
    child, effects = _child(parent, [{"kind": "ablate_head", "layer": 2, "head": 1}])
    assert effects.logprob_shift.abs().max() > 1e-4  # the edit really changes the model

    def edit(model):
        d = model.config.hidden_size // model.config.num_attention_heads
        model.model.layers[2].self_attn.o_proj.weight.data[:, d : 2 * d] = 0

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
        return [
            layer.register_forward_pre_hook(
                lambda m, a, k: saved.__setitem__("x", a[0] if a else k["hidden_states"]), with_kwargs=True
            ),
            layer.register_forward_hook(lambda m, a, o: saved["x"]),
        ]

    _check_child_logprobs(parent, child, effects, tiny_llama_dir, edit=skip_layer)
    # what the child archives is the edited forward: layer 1 adds nothing to the residual
    steps = child.steps().to_pandas()
    assert steps[steps.layer == 1].delta_norm.abs().max() == 0.0
    assert steps[steps.layer == 0].delta_norm.min() > 0.0


def test_the_childs_capture_records_the_edited_outputs(parent):
    child, _ = _child(parent, [{"kind": "ablate_mlp", "layer": 2}, {"kind": "ablate_attention", "layer": 0}])
    steps = child.steps().to_pandas()
    assert steps[steps.layer == 2].mlp_norm.max() == 0.0 and steps[steps.layer == 2].attn_norm.min() > 0.0
    assert steps[steps.layer == 0].attn_norm.max() == 0.0 and steps[steps.layer == 0].mlp_norm.min() > 0.0


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
        return subprocess.run(
            [sys.executable, "-m", "lmtrace.cli", "intervene", str(parent.path), *args, "--json"],
            capture_output=True,
            text=True,
        )

    out = cli(
        "--ablate-head",
        "1.2",
        "--ablate-layer",
        "3:mean",
        "--ablate-neurons",
        "0:1,2",
        "--mask-positions",
        "0-1",
        "--from-step",
        "2",
    )
    assert out.returncode == 0, out.stderr
    child = Run(json.loads(out.stdout)["children"][0]["run_dir"])
    kinds = [(e["kind"], e.get("mode")) for e in child.manifest["interventions"]]
    assert kinds == [
        ("ablate_head", "zero"),
        ("ablate_layer", "mean"),
        ("ablate_neurons", "zero"),
        ("mask_positions", None),
    ]
    assert all(e["steps"] == {"from": 2} for e in child.manifest["interventions"])
    effects = __import__("pandas").read_parquet(child.path / "effects.parquet")
    assert (effects[effects.step < 2].logprob_shift == 0).all()  # nothing is edited before --from-step
    out = cli("--temperatures", "0.5,2.0")
    assert out.returncode == 0, out.stderr
    assert [c["temperature"] for c in json.loads(out.stdout)["children"]] == [0.5, 2.0]
    bad = cli("--ablate-head", "1")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --ablate-head")
    bad = cli("--mask-positions", "system")  # a chat span of a run that was not chat-templated
    assert bad.returncode == 2 and bad.stderr.strip().startswith(
        "error: interventions[0] (mask_positions): span system"
    )
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


# --- mean ablation --------------------------------------------------------------------------------
def _tests_own_means(model_dir, run, layer, head):
    """The test's own means over every position of the run's final sequences, each run alone."""
    model = load_model(ModelSpec(ref=str(model_dir), attn_implementation="eager")).model
    block = model.model.layers[layer]
    d = model.config.hidden_size // model.config.num_attention_heads
    rows: dict[str, list] = {k: [] for k in ("head", "attn", "mlp", "ffn", "layer")}
    saved = {}
    hooks = [
        block.self_attn.o_proj.register_forward_pre_hook(
            lambda m, a: rows["head"].append(a[0][0, :, head * d : (head + 1) * d])
        ),
        block.self_attn.register_forward_hook(lambda m, a, o: rows["attn"].append(o[0][0])),
        block.mlp.register_forward_hook(lambda m, a, o: rows["mlp"].append(o[0])),
        block.mlp.down_proj.register_forward_pre_hook(lambda m, a: rows["ffn"].append(a[0][0])),
        block.register_forward_pre_hook(
            lambda m, a, k: saved.__setitem__("x", (a[0] if a else k["hidden_states"])[0]), with_kwargs=True
        ),
        block.register_forward_hook(
            lambda m, a, o: rows["layer"].append((o[0] if isinstance(o, tuple) else o)[0] - saved["x"])
        ),
    ]
    with torch.inference_mode():
        for seq in range(3):
            model(torch.tensor([_sequence_ids(run, seq)]))
    for h in hooks:
        h.remove()
    return {k: torch.cat(v).double().mean(0).float() for k, v in rows.items()}


def test_mean_ablation_of_every_kind_equals_the_tests_own_mean_edit(parent, tiny_llama_dir):
    layer, head, neurons = 1, 2, [5, 9, 77]
    means = _tests_own_means(tiny_llama_dir, parent, layer, head)
    d = 16

    def head_edit(model):
        def hook(m, a):
            x = a[0].clone()
            x[..., head * d : (head + 1) * d] = means["head"]
            return (x,)

        return [model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(hook)]

    def attn_edit(model):
        return [
            model.model.layers[layer].self_attn.register_forward_hook(
                lambda m, a, o: (torch.zeros_like(o[0]) + means["attn"], *o[1:])
            )
        ]

    def mlp_edit(model):
        return [model.model.layers[layer].mlp.register_forward_hook(lambda m, a, o: torch.zeros_like(o) + means["mlp"])]

    def neuron_edit(model):
        def hook(m, a):
            x = a[0].clone()
            x[..., neurons] = means["ffn"][neurons]
            return (x,)

        return [model.model.layers[layer].mlp.down_proj.register_forward_pre_hook(hook)]

    def layer_edit(model):
        block, saved = model.model.layers[layer], {}
        return [
            block.register_forward_pre_hook(
                lambda m, a, k: saved.__setitem__("x", a[0] if a else k["hidden_states"]), with_kwargs=True
            ),
            block.register_forward_hook(lambda m, a, o: saved["x"] + means["layer"]),
        ]

    cases = [
        ({"kind": "ablate_head", "head": head}, head_edit),
        ({"kind": "ablate_attention"}, attn_edit),
        ({"kind": "ablate_mlp"}, mlp_edit),
        ({"kind": "ablate_neurons", "neurons": neurons}, neuron_edit),
        ({"kind": "ablate_layer"}, layer_edit),
    ]
    for entry, edit in cases:
        child, effects = _child(parent, [{**entry, "layer": layer, "mode": "mean"}])
        assert effects.logprob_shift.abs().max() > 1e-4, entry  # the edit really changes the model
        _check_child_logprobs(parent, child, effects, tiny_llama_dir, edit=edit)
        assert child.manifest["interventions"][0]["mode"] == "mean"


# --- patching one head from another run ---------------------------------------------------------------
@pytest.fixture(scope="module")
def other(tmp_path_factory, tiny_llama_dir):
    """Same model and prompts, another seed and another batch composition (2 + 1)."""
    return _tiny_run(tmp_path_factory.mktemp("other"), tiny_llama_dir, batch_size=2, seed=11)


def test_patching_a_head_with_its_own_run_is_bit_identical(parent):
    child, effects = _child(
        parent, [{"kind": "patch_head", "layer": 2, "head": 1, "source_run": str(parent.path)}], lens=True
    )
    # bit-identical: the source's values are recomputed by the same KV-cached loop over the same batches
    for name in ("lens_probs", "attn", "resid"):
        np.testing.assert_array_equal(child.array(name)[:], parent.array(name)[:], err_msg=name)
    assert (effects.logprob_shift == 0).all()
    # the values really are substituted: sequence 0's head everywhere leaves sequence 0 unchanged, not the others
    child, effects = _child(
        parent, [{"kind": "patch_head", "layer": 2, "head": 1, "source_run": str(parent.path), "source_sequence": 0}]
    )
    shift = effects.groupby("sequence").logprob_shift.apply(lambda x: x.abs().max())
    assert shift[0] == 0 and shift[1] > 1e-4 and shift[2] > 1e-4


def test_patching_a_head_from_another_run_equals_the_tests_own_replacement(parent, other, tiny_llama_dir):
    layer, head, d = 2, 1, 16
    assert _sequence_ids(other, 0) != _sequence_ids(parent, 0)
    child, effects = _child(
        parent, [{"kind": "patch_head", "layer": layer, "head": head, "source_run": str(other.path)}]
    )
    assert effects.logprob_shift.abs().max() > 1e-4
    # the test's own source values: a full forward over each source sequence
    model = load_model(ModelSpec(ref=str(tiny_llama_dir), attn_implementation="eager")).model
    o_proj = model.model.layers[layer].self_attn.o_proj
    src = {}
    for seq in range(3):
        got = {}
        h = o_proj.register_forward_pre_hook(
            lambda m, a: got.__setitem__("x", a[0][0, :, head * d : (head + 1) * d].clone())
        )
        with torch.inference_mode():
            model(torch.tensor([_sequence_ids(other, seq)]))
        h.remove()
        P = int(other.prompt_len()[seq])
        src[seq] = got["x"][P - 1 : P - 1 + int(other.generated_len()[seq])]  # query position of each step

    for seq in range(3):
        P = int(parent.prompt_len()[seq])

        def edit(m, seq=seq, P=P):
            def hook(mod, a):
                x = a[0].clone()
                n = min(src[seq].shape[0], x.shape[1] - P + 1)
                x[0, P - 1 : P - 1 + n, head * d : (head + 1) * d] = src[seq][:n]
                return (x,)

            return [m.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(hook)]

        ref = _reference_logprobs(tiny_llama_dir, _sequence_ids(parent, seq), edit=edit)
        for _, row in effects[effects.sequence == seq].iterrows():
            assert abs(row.child_logprob_of_parent_token - ref[P - 1 + row.step, row.parent_token].item()) < 1e-4


def test_patch_head_errors_say_what_is_missing(parent, other, tmp_path):
    import json
    import shutil

    with pytest.raises(SpecError, match=r"heads 0\.\.3"):
        run_intervene(str(parent.path), [{"kind": "patch_head", "layer": 1, "head": 7, "source_run": str(other.path)}])
    with pytest.raises(SpecError, match=r"source_sequence 5 is out of range: source run .* has sequences 0\.\.2"):
        run_intervene(
            str(parent.path),
            [{"kind": "patch_head", "layer": 1, "head": 0, "source_run": str(other.path), "source_sequence": 5}],
        )
    fake = tmp_path / "bf16-run"
    shutil.copytree(other.path, fake)
    manifest = json.loads((fake / "manifest.json").read_text())
    manifest["dtype"] = "bfloat16"
    (fake / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match="differs from parent run .* in dtype"):
        run_intervene(str(parent.path), [{"kind": "patch_head", "layer": 1, "head": 0, "source_run": str(fake)}])


# --- chat spans -----------------------------------------------------------------------------------------
SYSTEM = "Answer briefly and politely."


@pytest.fixture(scope="module")
def chat_parent(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("chat")
    return run_spec(
        tmp,
        {
            "model": str(tiny_llama_dir),
            "prompts": {"texts": PROMPTS, "chat": True, "system": SYSTEM},
            "generation": {"max_new_tokens": 4, "batch_size": 3, "temperature": 0.9, "seed": 4},
            "output": {"float_dtype": "float32"},
        },
    )


def _find(haystack, needle, last=False):
    starts = [i for i in range(len(haystack) - len(needle) + 1) if haystack[i : i + len(needle)] == needle]
    assert starts, (needle, haystack)
    return starts[-1] if last else starts[0]


def test_chat_span_masks_equal_the_tests_own_masks(chat_parent, tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for span in ("system", "user"):
        child, effects = _child(chat_parent, [{"kind": "mask_positions", "span": span}])
        assert effects.logprob_shift.abs().max() > 1e-4, span
        for seq in range(3):
            ids = _sequence_ids(chat_parent, seq)
            P = int(chat_parent.prompt_len()[seq])
            content = tok(SYSTEM if span == "system" else PROMPTS[seq], add_special_tokens=False)["input_ids"]
            start = _find(ids[:P], content, last=span == "user")  # the test's own span: the content's tokens
            mask = [1] * len(ids)
            for p in range(start, start + len(content)):
                mask[p] = 0
            ref = _reference_logprobs(tiny_llama_dir, ids, mask=mask)
            for _, row in effects[effects.sequence == seq].iterrows():
                assert abs(row.child_logprob_of_parent_token - ref[P - 1 + row.step, row.parent_token].item()) < 1e-4


def test_chat_spans_need_a_chat_run_with_a_system_prompt(parent, tmp_path, tiny_llama_dir):
    with pytest.raises(SpecError, match="needs a chat run, but parent run .* was not chat-templated"):
        run_intervene(str(parent.path), [{"kind": "mask_positions", "span": "user"}])
    no_system = run_spec(
        tmp_path,
        {
            "model": str(tiny_llama_dir),
            "prompts": {"texts": PROMPTS[:1], "chat": True},
            "generation": {"max_new_tokens": 1},
        },
    )
    with pytest.raises(SpecError, match="needs a system prompt, but parent run .* has none"):
        run_intervene(str(no_system.path), [{"kind": "mask_positions", "span": "system"}])


# --- MoE expert masking -----------------------------------------------------------------------------------
MOE = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4), "gate"),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64, mlp_only_layers=[1]),
        "gate",
    ),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, head_dim=16, sliding_window=4), "router"),
}


def _tests_own_routing(family, logits, k, config):
    """Each family's published rule (softmax -> top-k -> renormalise, or top-k -> softmax)."""
    if family == "gpt_oss":
        val, idx = logits.topk(k, dim=-1)
        return val.softmax(-1), idx
    probs = logits.float().softmax(-1)
    val, idx = probs.topk(k, dim=-1)
    if family == "mixtral" or config.norm_topk_prob:
        val = val / val.sum(-1, keepdim=True)
    return val, idx


@pytest.mark.parametrize("family", list(MOE))
def test_expert_masking_equals_the_tests_own_minus_infinity_router_logits(family, tmp_path, tiny_llama_dir):
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    name, extra, router_name = MOE[family]
    cfg = getattr(transformers, name)(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **extra,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    moe_parent = run_spec(
        tmp_path,
        {
            "model": str(tmp_path / "model"),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 4, "batch_size": 3, "temperature": 0.9, "seed": 2},
            "output": {"float_dtype": "float32"},
        },
    )
    masked = [1, 3]
    child, effects = _child(moe_parent, [{"kind": "mask_experts", "layer": 0, "experts": masked}])
    assert effects.logprob_shift.abs().max() > 1e-5
    # the parent used the experts at layer 0; the child's archive records the masked choice
    assert np.isin(moe_parent.array("router_topk_idx")[:, :, 0], masked).any()
    assert not np.isin(child.array("router_topk_idx")[:, :, 0], masked).any()

    def edit(model):
        router = getattr(model.model.layers[0].mlp, router_name)

        def forward(h):
            h = h.reshape(-1, router.weight.shape[1])
            logits = torch.nn.functional.linear(h, router.weight, getattr(router, "bias", None))
            logits[:, masked] = float("-inf")
            weights, idx = _tests_own_routing(family, logits, router.top_k, model.config)
            return logits, weights, idx

        router.forward = forward
        return []

    for seq in range(3):
        ids = _sequence_ids(moe_parent, seq)
        P = int(moe_parent.prompt_len()[seq])
        ref = _reference_logprobs(tmp_path / "model", ids, edit=edit)
        for _, row in effects[effects.sequence == seq].iterrows():
            assert abs(row.child_logprob_of_parent_token - ref[P - 1 + row.step, row.parent_token].item()) < 1e-4

    with pytest.raises(SpecError, match=r"experts 0\.\.3"):
        run_intervene(str(moe_parent.path), [{"kind": "mask_experts", "layer": 0, "experts": [4]}])
    with pytest.raises(SpecError, match="fewer than the 2 the router picks"):
        run_intervene(str(moe_parent.path), [{"kind": "mask_experts", "layer": 0, "experts": [0, 1, 2]}])
    if family == "qwen2_moe":
        with pytest.raises(SpecError, match="layer 1 .* is a dense layer without a router; layers with experts: 0"):
            run_intervene(str(moe_parent.path), [{"kind": "mask_experts", "layer": 1, "experts": [0]}])


def test_expert_masking_needs_experts(parent):
    with pytest.raises(SpecError, match="LlamaForCausalLM has no mixture-of-experts router"):
        run_intervene(str(parent.path), [{"kind": "mask_experts", "layer": 0, "experts": [0]}])


def test_shorthands_take_mean_and_span_names():
    from lmtrace.capture.interventions import shorthand_entries

    got = shorthand_entries(["1.2:mean", "0.1"], ["3:mean"], ["2"], ["1:mean"], ["0:4,6-7:mean"], ["user", "1-2"])
    assert got == [
        {"kind": "ablate_head", "layer": 1, "head": 2, "mode": "mean"},
        {"kind": "ablate_head", "layer": 0, "head": 1, "mode": "zero"},
        {"kind": "ablate_layer", "layer": 3, "mode": "mean"},
        {"kind": "ablate_mlp", "layer": 2, "mode": "zero"},
        {"kind": "ablate_attention", "layer": 1, "mode": "mean"},
        {"kind": "ablate_neurons", "layer": 0, "neurons": [4, 6, 7], "mode": "mean"},
        {"kind": "mask_positions", "span": "user"},
        {"kind": "mask_positions", "mask": [1, 2]},
    ]
    with pytest.raises(SpecError, match="zero or mean"):
        shorthand_entries([], ["3:avg"], [], [], [], [])


@pytest.mark.slow
def test_the_readme_tours_intervene_changes_the_demo_text_and_gives_the_child_its_lens(tmp_path):
    """The tour's intervene line, as written in the README, run on the demo spec (the embedded model):
    the child's text differs from its parent's and its logit lens is computed."""
    import os
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from lmtrace.archive.reader import lens_state

    repo = Path(__file__).resolve().parents[2]
    tour = (repo / "README.md").read_text().split("## A tour of the commands", 1)[1].split("```")[1]
    line = next(text for text in tour.splitlines() if text.startswith("lmtrace intervene "))
    args = ["demo" if word == "RUN" else word for word in shlex.split(line.split("#", 1)[0])[2:]]
    env = {**os.environ, "LMTRACE_RUNS_DIR": str(tmp_path / "runs")}

    def lmtrace(*args):
        done = subprocess.run(
            [sys.executable, "-m", "lmtrace.cli", *args, "-q"], env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, (args, done.stderr[-2000:])

    lmtrace("generate", str(repo / "configs" / "demo.yaml"), "--run-id", "demo")
    lmtrace("intervene", *args, "--run-id", "child")
    parent, child = Run(tmp_path / "runs" / "demo"), Run(tmp_path / "runs" / "child")
    texts = lambda run: run.sequences().column("generated_text").to_pylist()  # noqa: E731
    assert texts(child) != texts(parent), (line, texts(child))
    assert lens_state(child.manifest) == "ready", line


# --- one KL for intervene and compare ---------------------------------------------------------------
def _tests_own_stored_kl(parent_row, child_row) -> float | None:
    """KL(parent ‖ child), nats, on {each token id whose logprob both archived rows hold (top-k alternatives
    and the chosen token)} + {one tail bucket: 1 − the stored mass of those ids, floored at 1e-12}."""
    import math

    def known(row):
        k = {int(i): float(v) for i, v in zip(row.alt_ids, row.alt_logprobs) if int(i) >= 0}
        k[int(row.token_id)] = float(row.logprob)
        return k

    p, q = known(parent_row), known(child_row)
    common = sorted(set(p) & set(q))
    if not common:
        return None
    ps = [math.exp(p[i]) for i in common]
    qs = [math.exp(q[i]) for i in common]
    ps.append(max(1.0 - sum(ps), 0.0, 1e-12))
    qs.append(max(1.0 - sum(qs), 0.0, 1e-12))
    return sum(a * (math.log(a) - math.log(b)) for a, b in zip(ps, qs) if a > 0)


@pytest.mark.parametrize("mode", ["rescore", "regenerate"])
def test_intervene_and_compare_report_the_same_kl_the_tests_own_from_the_archived_tables(parent, tmp_path, mode):
    import json

    import pandas as pd
    from typer.testing import CliRunner

    from lmtrace.cli.main import app

    def cli(*args):
        out = CliRunner().invoke(app, [*map(str, args), "--json"])
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout.strip().splitlines()[-1])

    made = cli(
        "intervene",
        parent.path,
        "--ablate-layer",
        "1",
        "--ablate-head",
        "2.0",
        "--mode",
        mode,
        *(["--from-step", 2] if mode == "regenerate" else []),
        "--runs-dir",
        tmp_path,
    )["children"][0]
    child = Run(made["run_dir"])
    effects = pd.read_parquet(child.path / "effects.parquet")
    compared = pd.DataFrame(cli("compare", parent.path, child.path)["per_step"])
    pt, ct = pd.read_parquet(parent.path / "tokens.parquet"), pd.read_parquet(child.path / "tokens.parquet")
    checked = 0
    for _, e in effects.iterrows():
        (c,) = compared[
            (compared.seq_a == e.sequence) & (compared.seq_b == e.sequence) & (compared.step == e.step)
        ].kl_ab
        if not e.context_identical:  # a different context: neither side pairs the step
            assert pd.isna(e.kl_parent_child_topk) and pd.isna(c), (e.sequence, e.step)
            continue
        (p_row,) = [r for r in pt[(pt.sequence == e.sequence) & ~pt.is_prompt & (pt.step == e.step)].itertuples()]
        (c_row,) = [r for r in ct[(ct.sequence == e.sequence) & ~ct.is_prompt & (ct.step == e.step)].itertuples()]
        own = _tests_own_stored_kl(p_row, c_row)
        if own is None:  # no token stored on both sides: unknown for both
            assert pd.isna(e.kl_parent_child_topk) and pd.isna(c), (e.sequence, e.step)
            continue
        assert e.kl_parent_child_topk == c, (e.sequence, e.step, e.kl_parent_child_topk, c)
        assert abs(e.kl_parent_child_topk - own) <= 1e-12 * max(1.0, own), (e.sequence, e.step, own)
        checked += 1
    assert checked >= 6 and (effects.kl_parent_child_topk > 0).any()  # the edit changed the distributions
    for s in made["sequences"]:  # the printed / JSON summary: the largest of those KLs
        same = effects[(effects.sequence == s["sequence"]) & effects.context_identical]
        assert s["max_kl_topk"] == same.kl_parent_child_topk.max()
    if mode == "regenerate":
        assert (~effects.context_identical).any(), "no sequence diverged: the null case was not exercised"
