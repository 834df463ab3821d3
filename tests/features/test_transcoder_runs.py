"""Transcoders in runs (docs/features.md, "Transcoders"): archived latents (generate, and the deferred
`lmtrace features`) equal the transcoder applied by the test's own formula to the model's own full-forward
MLP input (the test's own hook on the post-attention norm); `features --feature` logit effects are the
decoder row through the final norm and unembedding; a feature edit's child has at the MLP's output the
test's own out + decode(f') − decode(f), on Llama and GPT-2; a transcoder whose output site the model lacks,
and the commands that do not take transcoders, are refused in one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmtrace.archive.reader import Run
from lmtrace.commands.intervene import run_intervene
from lmtrace.exits.errors import SpecError
from tests.helpers.architectures import BY_ID, build_tiny
from tests.helpers.cli import assert_one_line_error, lmtrace
from tests.helpers.runs import PROMPTS, run_spec
from tests.helpers.saes import dense, random_transcoder, top_of, transcode

D_SAE, TOP_K, LAYER = 48, 6, 1
# family -> (the post-attention norm whose output is the MLP's input, the MLP)
MODULES = {
    "llama": ("model.layers.1.post_attention_layernorm", "model.layers.1.mlp"),
    "gpt2": ("transformer.h.1.ln_2", "transformer.h.1.mlp"),
}
ARCH = {"llama": "skip_transcoder", "gpt2": "jumprelu_transcoder"}


def _module(root, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory, sharp_llama_dir) -> dict[str, Path]:
    from lmtrace.runner.models import load_model
    from lmtrace.spec.run_spec import ModelSpec

    tok = load_model(ModelSpec()).tokenizer
    gpt2 = build_tiny(BY_ID["gpt2"], tok, tmp_path_factory.mktemp("tc-models") / "gpt2")
    return {"llama": sharp_llama_dir, "gpt2": gpt2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, models):
    """Per family: a transcoder at layer 1 and a run archiving its latents (prompt positions too) and
    layer 1's residual output; for Llama also the same run without the latents."""
    root = tmp_path_factory.mktemp("tc-runs")
    out = {}
    for family, model in models.items():
        d = json.loads((model / "config.json").read_text())
        width = d.get("hidden_size") or d.get("n_embd")
        sae = root / f"tc-{family}"
        cfg, w = random_transcoder(sae, LAYER, width, D_SAE, width, arch=ARCH[family], seed=2, scale=3.0)
        spec = {
            "model": str(model),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 5, "batch_size": 3},
            "output": {"float_dtype": "float32"},
            "capture": {"residual": {"vectors_at": [LAYER], "dtype": "float32"}},
        }
        features = {"features": [{"sae": str(sae), "top_k": TOP_K, "prompt": True}]}
        run = run_spec(root / family, {**spec, "capture": {**spec["capture"], **features}})
        out[family] = {"run": run, "sae": sae, "cfg": cfg, "w": w, "model": model}
    llama = {**spec, "model": str(models["llama"])}
    out["plain"] = run_spec(root / "plain", llama)
    return out


@torch.inference_mode()
def _mlp_inputs(model_dir: Path, family: str, ids: list[int]) -> np.ndarray:
    """[T, d]: the post-attention norm's output at layer 1 (the MLP's input), the model's own eager
    full forward in float32 with the test's own hook."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    seen = []
    handle = _module(model, MODULES[family][0]).register_forward_hook(lambda m, a, o: seen.append(o))
    model(torch.tensor([ids]))
    handle.remove()
    return seen[0][0].numpy()


def _sequences(run) -> dict[int, tuple[list[int], list[int]]]:
    t = run.tokens().to_pandas().sort_values(["sequence", "position"])
    return {
        int(s): (g[g.is_prompt].token_id.tolist(), g[~g.is_prompt].token_id.tolist()) for s, g in t.groupby("sequence")
    }


@pytest.mark.parametrize("family", list(MODULES))
def test_archived_transcoder_latents_equal_the_transcoder_on_the_models_own_mlp_input(runs, family):
    r = runs[family]
    run, name = r["run"], r["sae"].name
    idx, val = run.array(f"feat_{name}_idx")[:], run.array(f"feat_{name}_val")[:]
    p_idx, p_val = run.array(f"prompt_feat_{name}_idx")[:], run.array(f"prompt_feat_{name}_val")[:]
    checked = 0
    for seq, (prompt, generated) in _sequences(run).items():
        acts, _ = transcode(r["cfg"], r["w"], _mlp_inputs(r["model"], family, prompt + generated))
        want = top_of(acts, TOP_K)
        steps = [len(prompt) - 1 + s for s in range(len(generated))]
        got = dense(idx[seq, : len(generated)], val[seq, : len(generated)], D_SAE)
        np.testing.assert_allclose(got, want[steps], atol=2e-4, rtol=1e-3)
        got_prompt = dense(p_idx[seq, : len(prompt)], p_val[seq, : len(prompt)], D_SAE)
        np.testing.assert_allclose(got_prompt, want[: len(prompt)], atol=2e-4, rtol=1e-3)
        checked += int((idx[seq, : len(generated)] >= 0).sum())
    assert checked > 10
    entry = run.manifest["features"][0]
    assert (entry["hook_name"], entry["site"], entry["hook_name_out"], entry["site_out"]) == (
        "blocks.1.ln2.hook_normalized",
        "mlp_in",
        "blocks.1.hook_mlp_out",
        "mlp_out",
    )
    assert (entry["architecture"], entry["d_out"]) == (ARCH[family], r["cfg"]["d_out"])


def test_deferred_transcoder_latents_equal_the_inline_ones_by_replay(runs, tmp_path):
    import shutil

    from lmtrace.commands.features import compute_features

    plain = tmp_path / "runs" / runs["plain"].path.name
    shutil.copytree(runs["plain"].path, plain)
    sae = runs["llama"]["sae"]
    assert_one_line_error(  # the MLP's input is not among the archived residual vectors
        lmtrace(tmp_path, "features", str(plain), "--sae", str(sae), "--source", "archive"),
        2,
        "not blocks.1.ln2.hook_normalized",
    )
    out = compute_features(str(plain), str(sae), top_k=TOP_K, prompt=True)
    assert (out["computed"], out["source"]) == (True, "replay")
    inline, deferred = runs["llama"]["run"], Run(plain)
    for p in ("", "prompt_"):
        a_i = inline.array(f"{p}feat_{sae.name}_idx")[:]
        a_v = inline.array(f"{p}feat_{sae.name}_val")[:]
        b_i = deferred.array(f"{p}feat_{sae.name}_idx")[:]
        b_v = deferred.array(f"{p}feat_{sae.name}_val")[:]
        np.testing.assert_allclose(dense(b_i, b_v, D_SAE), dense(a_i, a_v, D_SAE), atol=2e-4, rtol=1e-3)
    entry = deferred.manifest["features"][0]
    assert (entry["hook_name_out"], entry["site_out"], entry["computed"]["source"]) == (
        "blocks.1.hook_mlp_out",
        "mlp_out",
        "replay",
    )


def test_transcoder_logit_effects_are_its_decoder_row_through_the_final_norm_and_unembedding(runs, capsys):
    from transformers import AutoModelForCausalLM

    from lmtrace.commands.feature_find import features_find_command

    r = runs["llama"]
    idx = r["run"].array(f"feat_{r['sae'].name}_idx")[:]
    feature = int(np.bincount(idx[idx >= 0]).argmax())
    out = features_find_command(str(r["run"].path), r["sae"].name, feature=feature, by=None, top=2, n_tokens=4)
    model = AutoModelForCausalLM.from_pretrained(r["model"], dtype=torch.float32)
    effects = model.lm_head.weight.detach().double().numpy() @ (
        r["w"]["W_dec"][feature].astype(np.float64) * model.model.norm.weight.detach().double().numpy()
    )
    top, bottom = np.argsort(-effects)[:4], np.argsort(effects)[:4]
    assert [t["id"] for t in out["logit_effects"]["promoted"]] == top.tolist()
    assert [t["id"] for t in out["logit_effects"]["suppressed"]] == bottom.tolist()
    np.testing.assert_allclose([t["effect"] for t in out["logit_effects"]["promoted"]], effects[top], rtol=1e-4)


def _own_mlp_edit(cfg: dict, w: dict, kind: str, feature: int, value: float):
    """(MLP input x, MLP output out) -> out + decode(f') − decode(f) with f the transcoder's latents of x
    (steer: out + C·W_dec[F]), from the weights by the test's own formula (`transcode`), float64."""

    def edit(x, out):
        if kind == "steer":
            return (out.double() + value * torch.from_numpy(w["W_dec"][feature]).double()).to(out.dtype)
        acts, _ = transcode(cfg, w, x.double().numpy().reshape(-1, x.shape[-1]))
        edited = acts.copy()
        edited[:, feature] = 0.0 if kind == "ablate" else value
        delta = (edited - acts) @ w["W_dec"].astype(np.float64)
        return (out.double() + torch.from_numpy(delta).reshape(out.shape)).to(out.dtype)

    return edit


@pytest.mark.parametrize(
    "family, kind, value", [("llama", "ablate", 0.0), ("llama", "steer", 3.0), ("gpt2", "clamp", 8.0)]
)
def test_a_transcoder_edit_adds_the_decoder_change_to_the_mlps_own_output(runs, family, kind, value):
    from transformers import AutoModelForCausalLM

    r = runs[family]
    parent = r["run"]
    idx = parent.array(f"feat_{r['sae'].name}_idx")[:]
    feature = int(np.bincount(idx[idx >= 0]).argmax())
    entry = {"kind": f"{kind}_feature", "sae": str(r["sae"]), "feature": feature}
    if kind != "ablate":
        entry["value" if kind == "clamp" else "coefficient"] = value
    result, effects = run_intervene(str(parent.path), [entry])
    effects, child = effects.to_pandas(), Run(result.run_dir)
    assert effects.logprob_shift.abs().max() > 1e-3  # the edit really changes the model
    edit = _own_mlp_edit(r["cfg"], r["w"], kind, feature, value)
    model = AutoModelForCausalLM.from_pretrained(r["model"], dtype=torch.float32, attn_implementation="eager").eval()
    kept = {}

    def hook(module, args, out):
        return edit(args[0], out)

    block = _module(model, MODULES[family][1].rsplit(".", 1)[0])
    handles = [
        _module(model, MODULES[family][1]).register_forward_hook(hook),
        block.register_forward_hook(
            lambda m, a, o: kept.__setitem__("resid", (o[0] if isinstance(o, tuple) else o)[0])
        ),
    ]
    ri = parent.shape["resid_layers"].index(LAYER)
    resid_child = child.array("resid")[:, :, ri]
    try:
        for seq, (prompt, generated) in _sequences(parent).items():
            with torch.inference_mode():
                ref = model(torch.tensor([prompt + generated])).logits[0].float().log_softmax(-1)
            for _, row in effects[effects.sequence == seq].iterrows():
                pos = len(prompt) - 1 + row.step
                assert abs(row.child_logprob_of_parent_token - ref[pos, row.parent_token].item()) < 1e-4
                np.testing.assert_allclose(resid_child[seq, row.step], kept["resid"][pos].numpy(), rtol=2e-5, atol=1e-4)
    finally:
        for h in handles:
            h.remove()


def test_transcoders_the_model_cannot_serve_and_commands_without_transcoders_are_refused(runs, tmp_path):
    from lmtrace.commands.explain import explain_run
    from lmtrace.commands.sweep import run_sweep
    from lmtrace.spec.sweep_spec import SweepSpec

    parent = runs["llama"]["run"]
    random_transcoder(tmp_path / "narrow-out", LAYER, 64, 8, 32)  # the MLP's output is 64 wide
    random_transcoder(tmp_path / "deep", 9, 64, 8, 64)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        json.dumps({"model": str(runs["llama"]["model"]), "prompts": ["a b"], "generation": {"max_new_tokens": 2}})
    )
    proc = lmtrace(tmp_path, "generate", str(spec), "--sae", str(tmp_path / "narrow-out"), "-q")
    assert_one_line_error(proc, 2, "d_out 32 does not match blocks.1.hook_mlp_out")
    before = sorted(p.name for p in parent.path.parent.iterdir())
    for sae, fragment in [("narrow-out", "d_out 32 does not match"), ("deep", "layer 9 is out of range")]:
        with pytest.raises(SpecError, match=fragment):
            run_intervene(str(parent.path), [{"kind": "ablate_feature", "sae": str(tmp_path / sae), "feature": 1}])
    assert sorted(p.name for p in parent.path.parent.iterdir()) == before
    sae = str(runs["llama"]["sae"])
    with pytest.raises(SpecError, match="sweep --over features does not support transcoders"):
        run_sweep(str(parent.path), SweepSpec(over="features", sae=sae, features="1", metrics=["logprob"]))
    with pytest.raises(SpecError, match="explain does not support transcoders"):
        explain_run(parent.path, "1", sequence=0, methods=["grad_x_input"], saes=[sae])


def test_the_views_name_a_transcoders_input_and_output_hook_points(runs, tmp_path):
    from lmtrace.commands.show import step_features
    from lmtrace.viewdata.features import feature_page, token_features

    run, name = runs["llama"]["run"], runs["llama"]["sae"].name
    both = "blocks.1.ln2.hook_normalized → blocks.1.hook_mlp_out"
    (tok,) = token_features(run, 0, 0)
    assert (tok["hook"], tok["hook_name_out"]) == (both, "blocks.1.hook_mlp_out")
    feature = tok["features"][0]["feature"]
    assert feature_page(run, name, feature)["hook"] == both
    (listed,) = step_features(run, 0, 0)
    assert listed["hook_name_out"] == "blocks.1.hook_mlp_out"
    out = lmtrace(tmp_path, "show", str(run.path), "--step", "0", env={"COLUMNS": "200"})
    assert f"features of SAE {name} ({both}): " in out.stdout
    out = lmtrace(tmp_path, "features", str(run.path), "--sae", name, "--feature", str(feature))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{run.path.name}: SAE {name} ({both}) feature {feature}: "), out.stdout
