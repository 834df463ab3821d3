"""Sparse autoencoders (docs/features.md): the SAELens directory format read against SAELens's own
encode/decode formula written out here in numpy, a write/read round trip, SAELens hook names against
the tiny models' own modules, `lmtrace sae train` end to end with its metrics recomputed here from the
saved weights, and bad input refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lmtrace.exits.errors import SpecError
from lmtrace.features import parse_hook_name, read_sae, write_sae
from lmtrace.features.sites import Site, at_site
from tests.helpers.runs import PROMPTS, run_spec


# --- SAELens's formula, independently ----------------------------------------------------------
def saelens_encode_decode(cfg: dict, w: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SAELens (sae_lens/saes/*.py) at inference, for x [n, d_in] in float64: normalise the input,
    subtract b_dec when apply_b_dec_to_input, W_enc/b_enc, the architecture's activation, W_dec/b_dec,
    undo the normalisation."""
    x = x.astype(np.float64)
    W_enc, b_enc, W_dec, b_dec = (w[n].astype(np.float64) for n in ("W_enc", "b_enc", "W_dec", "b_dec"))
    norm = cfg.get("normalize_activations", "none")
    if norm == "constant_norm_rescale":
        coeff = np.sqrt(x.shape[-1]) / np.linalg.norm(x, axis=-1, keepdims=True)
        xin = x * coeff
    elif norm == "layer_norm":
        mu = x.mean(-1, keepdims=True)
        std = (x - mu).std(-1, ddof=1, keepdims=True)
        xin = (x - mu) / (std + 1e-5)
    else:  # none; expected_average_only_in is the identity in SAELens's inference SAE
        xin = x
    if cfg.get("apply_b_dec_to_input", True):
        xin = xin - b_dec
    pre = xin @ W_enc + b_enc
    arch = cfg.get("architecture", "standard")
    act_fn = cfg.get("activation_fn_str", cfg.get("activation_fn", "relu"))
    if arch == "jumprelu":
        acts = np.maximum(pre, 0) * (pre > w["threshold"].astype(np.float64))
    elif arch == "topk" or act_fn == "topk":
        k = cfg.get("k") or cfg["activation_fn_kwargs"]["k"]
        acts = np.zeros_like(pre)
        for i, row in enumerate(pre):
            top = np.argsort(-row, kind="stable")[:k]
            acts[i, top] = np.maximum(row[top], 0)
    else:
        acts = np.maximum(pre, 0)
    out = acts @ W_dec + b_dec
    if norm == "constant_norm_rescale":
        out = out / coeff
    elif norm == "layer_norm":
        out = out * std + mu
    return acts, out


def write_saelens_dir(path: Path, cfg: dict, weights: dict) -> Path:
    """An SAE directory written the way SAELens writes one, without lmtrace's writer."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "cfg.json").write_text(json.dumps(cfg))
    save_file(
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
        str(path / "sae_weights.safetensors"),
    )
    return path


def random_weights(d_in: int, d_sae: int, seed: int, jumprelu: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    w = {
        "W_enc": rng.normal(size=(d_in, d_sae)) / np.sqrt(d_in),
        "b_enc": rng.normal(size=d_sae) * 0.1,
        "W_dec": rng.normal(size=(d_sae, d_in)) / np.sqrt(d_sae),
        "b_dec": rng.normal(size=d_in) * 0.3,
    }
    if jumprelu:
        w["threshold"] = rng.uniform(0.0, 0.6, size=d_sae)
    return {k: v.astype(np.float32) for k, v in w.items()}


ARCH_CFGS = {
    "standard": {"architecture": "standard"},
    "jumprelu": {"architecture": "jumprelu"},
    "topk": {"architecture": "topk", "k": 5},
    # SAELens < 6: a TopK SAE was `standard` with activation_fn_str topk and its k in activation_fn_kwargs
    "legacy-topk": {"architecture": "standard", "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 5}},
}


@pytest.mark.parametrize("norm", ["none", "expected_average_only_in", "constant_norm_rescale", "layer_norm"])
@pytest.mark.parametrize("apply_b_dec", [True, False])
@pytest.mark.parametrize("arch", list(ARCH_CFGS))
def test_encode_and_decode_equal_saelens_formula(tmp_path, arch, apply_b_dec, norm):
    d_in, d_sae = 12, 40
    cfg = {
        **ARCH_CFGS[arch],
        "d_in": d_in,
        "d_sae": d_sae,
        "apply_b_dec_to_input": apply_b_dec,
        "normalize_activations": norm,
        "metadata": {"hook_name": "blocks.2.hook_resid_post"},
    }
    w = random_weights(d_in, d_sae, seed=len(arch) + 7 * apply_b_dec, jumprelu=arch == "jumprelu")
    sae = read_sae(write_saelens_dir(tmp_path / "sae", cfg, w))
    x = np.random.default_rng(1).normal(size=(64, d_in)).astype(np.float32) * 3
    acts_ref, out_ref = saelens_encode_decode(cfg, w, x)
    acts = sae.encode(torch.from_numpy(x)).numpy()
    out = sae.reconstruct(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(acts, acts_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, out_ref, rtol=1e-4, atol=1e-4)
    if arch == "jumprelu":  # the thresholds matter here: some positive pre-activations are cut
        pre = (
            x.astype(np.float64) - (w["b_dec"] if apply_b_dec and norm in ("none", "expected_average_only_in") else 0)
        ) @ w["W_enc"] + w["b_enc"]
        if norm in ("none", "expected_average_only_in"):
            assert ((pre > 0) & (pre <= w["threshold"])).any()
    if "topk" in arch:
        assert ((acts > 0).sum(-1) <= 5).all()


def test_pre_6_config_with_hook_point_and_boolean_normalisation(tmp_path):
    cfg = {"d_in": 8, "d_sae": 16, "hook_point": "blocks.0.hook_mlp_out", "normalize_activations": False}
    sae = read_sae(write_saelens_dir(tmp_path / "old", cfg, random_weights(8, 16, 3)))
    assert (sae.cfg.architecture, sae.cfg.hook_name, sae.cfg.normalize_activations) == (
        "standard",
        "blocks.0.hook_mlp_out",
        "none",
    )


@pytest.mark.parametrize("arch", ["topk", "jumprelu"])
def test_written_sae_reads_back_identically_in_saelens_layout(tmp_path, arch):
    cfg = {
        "architecture": arch,
        "d_in": 10,
        "d_sae": 24,
        "apply_b_dec_to_input": False,
        "normalize_activations": "constant_norm_rescale",
        "metadata": {"hook_name": "blocks.3.attn.hook_z", "model_name": "tiny", "context_size": 128},
    }
    if arch == "topk":
        cfg["k"] = 3
    w = random_weights(10, 24, 5, jumprelu=arch == "jumprelu")
    first = read_sae(write_saelens_dir(tmp_path / "a", cfg, w))
    write_sae(first, tmp_path / "b")
    from safetensors.numpy import load_file

    saved = load_file(str(tmp_path / "b" / "sae_weights.safetensors"))
    assert set(saved) == set(w)
    for name in w:
        np.testing.assert_array_equal(saved[name], w[name])
    written = json.loads((tmp_path / "b" / "cfg.json").read_text())
    assert written["architecture"] == arch and written["d_in"] == 10 and written["d_sae"] == 24
    assert written["apply_b_dec_to_input"] is False and written["normalize_activations"] == "constant_norm_rescale"
    assert written["reshape_activations"] == "hook_z"  # SAELens flattens hook_z's heads
    assert written["metadata"]["hook_name"] == "blocks.3.attn.hook_z" and written["metadata"]["context_size"] == 128
    assert written.get("k") == (3 if arch == "topk" else None)
    second = read_sae(tmp_path / "b")
    x = torch.randn(20, 10)
    torch.testing.assert_close(second.reconstruct(x), first.reconstruct(x), rtol=0, atol=0)


# --- hook names and the models' own modules ------------------------------------------------------
def _tiny(family: str):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=96, attn_implementation="eager")
    if family == "llama":
        cfg = tf.LlamaConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
        model = tf.LlamaForCausalLM(cfg)
        block = lambda i: model.model.layers[i]  # noqa: E731
        own = {
            "attn_out": ("self_attn", "out"),
            "mlp_out": ("mlp", "out"),
            "mlp_in": ("post_attention_layernorm", "out"),
            "attn_z": ("self_attn.o_proj", "in"),
            "mlp_post": ("mlp.down_proj", "in"),
        }
    elif family == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_layer=3, n_head=4, n_positions=64, **common)
        model = tf.GPT2LMHeadModel(cfg)
        block = lambda i: model.transformer.h[i]  # noqa: E731
        own = {
            "attn_out": ("attn", "out"),
            "mlp_out": ("mlp", "out"),
            "mlp_in": ("ln_2", "out"),
            "attn_z": ("attn.c_proj", "in"),
            "mlp_post": ("mlp.c_proj", "in"),
        }
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            max_position_embeddings=64,
            **common,
        )
        model = tf.GPTNeoXForCausalLM(cfg)
        block = lambda i: model.gpt_neox.layers[i]  # noqa: E731
        own = {
            "attn_out": ("attention", "out"),
            "mlp_out": ("mlp", "out"),
            "mlp_in": ("post_attention_layernorm", "out"),
            "attn_z": ("attention.dense", "in"),
            "mlp_post": ("mlp.dense_4h_to_h", "in"),
        }
    else:  # opt: no MLP module; fc1/fc2 on the block
        cfg = tf.OPTConfig(
            hidden_size=32,
            ffn_dim=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            max_position_embeddings=64,
            **common,
        )
        model = tf.OPTForCausalLM(cfg)
        block = lambda i: model.model.decoder.layers[i]  # noqa: E731
        own = {"attn_out": ("self_attn", "out"), "mlp_out": ("fc2", "out"), "mlp_post": ("fc2", "in")}
    return model.eval(), block, own


def _module(root, path):
    for part in path.split("."):
        root = getattr(root, part)
    return root


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "opt"])
def test_hook_names_reach_the_tensors_the_models_own_modules_compute(family):
    from lmtrace.capture.arch import adapter_for

    model, block, own = _tiny(family)
    adapter = adapter_for(model)
    ids = torch.randint(0, 96, (2, 7))
    layer = 1
    refs: dict[str, torch.Tensor] = {}
    handles = []
    for kind, (path, side) in own.items():
        mod = _module(block(layer), path)
        if side == "out":
            handles.append(
                mod.register_forward_hook(
                    lambda m, a, o, kind=kind: refs.__setitem__(kind, (o[0] if isinstance(o, tuple) else o).detach())
                )
            )
        else:
            handles.append(mod.register_forward_pre_hook(lambda m, a, kind=kind: refs.__setitem__(kind, a[0].detach())))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    for h in handles:
        h.remove()
    refs["resid_pre"], refs["resid_post"] = hidden[layer], hidden[layer + 1]  # layer 1 of 3: not the normed last
    for kind, ref in refs.items():
        site = parse_hook_name(Site(layer, kind).hook_name)
        assert site == Site(layer, kind)
        seen = []
        with at_site(adapter, site, lambda t: seen.append(t.detach())), torch.no_grad():
            model(ids)
        got = seen[0].reshape(-1, seen[0].shape[-1])
        torch.testing.assert_close(got, ref.reshape(-1, ref.shape[-1]))
        assert got.shape[-1] == site.width(adapter), (family, kind)
    if family == "opt":
        with pytest.raises(SpecError, match="OPT models have no MLP module"):
            Site(layer, "mlp_in").check(adapter, 32, "SAE")


def test_unsupported_hook_points_and_widths_are_refused_in_one_line(tmp_path):
    from lmtrace.capture.arch import adapter_for

    for name in ("blocks.1.hook_resid_mid", "blocks.1.attn.hook_q", "blocks.x.hook_resid_post", "hook_embed"):
        with pytest.raises(SpecError) as err:
            parse_hook_name(name)
        assert "is not supported" in str(err.value) and "blocks.L.hook_resid_post" in str(err.value)
        assert "\n" not in str(err.value)
    model, _, _ = _tiny("llama")
    adapter = adapter_for(model)
    with pytest.raises(
        SpecError,
        match=r"d_in 48 does not match blocks.1.hook_resid_post of this model, which has "
        r"width 32",
    ):
        Site(1, "resid_post").check(adapter, 48, "SAE x")
    with pytest.raises(SpecError, match=r"layer 3 is out of range: the model has layers 0..2"):
        Site(3, "resid_post").check(adapter, 32, "SAE x")
    Site(1, "mlp_post").check(adapter, 48, "SAE x")  # the FFN width
    Site(1, "attn_z").check(adapter, 32, "SAE x")  # 4 heads × 8


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "lmtrace.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd
    )


def test_bad_sae_directories_get_one_line_and_exit_2(tmp_path):
    good_cfg = {
        "architecture": "topk",
        "k": 2,
        "d_in": 4,
        "d_sae": 6,
        "metadata": {"hook_name": "blocks.0.hook_resid_post"},
    }
    w = random_weights(4, 6, 0)
    cases = {"missing": (tmp_path / "nowhere", "no such directory")}
    only_cfg = tmp_path / "only-cfg"
    only_cfg.mkdir()
    (only_cfg / "cfg.json").write_text(json.dumps(good_cfg))
    cases["no weights"] = (only_cfg, "sae_weights.safetensors is missing")
    cases["gated"] = (
        write_saelens_dir(tmp_path / "gated", {**good_cfg, "architecture": "gated"}, w),
        "unknown architecture 'gated'; supported: standard, jumprelu, topk",
    )
    cases["shape"] = (
        write_saelens_dir(tmp_path / "shape", {**good_cfg, "d_sae": 7}, w),
        "W_enc has shape [4, 6], expected [4, 7]",
    )
    cases["nan"] = (
        write_saelens_dir(tmp_path / "nan", good_cfg, {**w, "b_dec": np.full(4, np.nan, np.float32)}),
        "b_dec holds NaN or infinite values",
    )
    cases["hook"] = (
        write_saelens_dir(tmp_path / "hook", {**good_cfg, "metadata": {"hook_name": "blocks.0.hook_resid_mid"}}, w),
        "hook point 'blocks.0.hook_resid_mid' is not supported",
    )
    cases["jumprelu without threshold"] = (
        write_saelens_dir(tmp_path / "jr", {**good_cfg, "architecture": "jumprelu"}, w),
        "has no tensor threshold",
    )
    cases["transcoder"] = (
        write_saelens_dir(tmp_path / "tc", {**good_cfg, "architecture": "transcoder"}, w),
        "a transcoder needs its output hook point",
    )
    for what, (path, text) in cases.items():
        with pytest.raises(SpecError) as err:
            read_sae(path)
        assert str(err.value).startswith(f"SAE {path}: ") and text in str(err.value), what
        assert "\n" not in str(err.value) and err.value.exit_code == 2
    for what in ("missing", "shape"):  # and through the command line
        path, text = cases[what]
        r = _cli("sae", "show", path)
        assert r.returncode == 2, (what, r.stderr)
        assert r.stderr.startswith("error: SAE ") and text in r.stderr and r.stderr.count("\n") == 1, (what, r.stderr)
    ok = _cli("sae", "show", write_saelens_dir(tmp_path / "ok", good_cfg, w), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["site"] == "resid_post"


# --- training ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def train_run(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("sae-train")
    prompts = PROMPTS + ["It was a dark and stormy night", "Hello world, this is", "A B C D E F G"]
    return run_spec(
        root, {"model": str(tiny_llama_dir), "prompts": prompts, "generation": {"max_new_tokens": 6, "seed": 1}}
    )


def _sequences(run) -> dict[int, list[int]]:
    tokens = run.tokens().to_pandas().sort_values(["sequence", "position"])
    return {int(s): t.token_id.tolist() for s, t in tokens.groupby("sequence")}


def _ce(logits: torch.Tensor, ids: list[int]) -> tuple[float, int]:
    logp = torch.log_softmax(logits[0, :-1].double(), -1)
    target = torch.tensor(ids[1:])
    return float(-logp[torch.arange(len(target)), target].sum()), len(target)


def test_sae_train_replay_metrics_equal_the_saved_weights_on_the_models_own_forward(
    train_run, tiny_llama_dir, tmp_path
):
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sae"
    r = _cli(
        "sae",
        "train",
        train_run.path,
        "--layer",
        1,
        "--latents",
        32,
        "--k",
        4,
        "--out",
        out,
        "--source",
        "replay",
        "--epochs",
        8,
        "--batch",
        32,
        "--heldout",
        0.34,
        "--json",
    )
    assert r.returncode == 0, r.stderr
    card = json.loads(r.stdout)
    assert card == {**json.loads((out / "training_card.json").read_text()), "path": str(out)}
    assert card["data"]["source"] == "replay" and card["hook_name"] == "blocks.1.hook_resid_post"
    cfg = json.loads((out / "cfg.json").read_text())
    assert cfg["architecture"] == "topk" and cfg["k"] == 4 and cfg["d_sae"] == 32
    w = load_file(str(out / "sae_weights.safetensors"))
    held = card["data"]["heldout_sequences"]
    assert len(held) == 2 and card["data"]["training_sequences"] == 4
    seqs = _sequences(train_run)
    assert card["data"]["tokens"] == sum(len(s) - 1 for i, s in seqs.items() if i not in held)

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    xs, ce = [], {"orig": [0.0, 0], "sae": [0.0, 0], "zero": [0.0, 0]}
    for i in held:
        ids = seqs[i]
        with torch.no_grad():
            out_h = model(torch.tensor([ids]), output_hidden_states=True)
            x = out_h.hidden_states[2][0, 1:].numpy()  # after layer 1, every position but the first
        xs.append(x)
        _, recon = saelens_encode_decode(cfg, w, x)
        for how, fill in (("orig", None), ("sae", recon), ("zero", np.zeros_like(x))):

            def hook(m, a, o, fill=fill):
                h = (o[0] if isinstance(o, tuple) else o).clone()
                h[0, 1:] = torch.from_numpy(fill).float()
                return (h,) + tuple(o[1:]) if isinstance(o, tuple) else h

            handle = model.model.layers[1].register_forward_hook(hook) if fill is not None else None
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits
            if handle:
                handle.remove()
            s, n = _ce(logits, ids)
            ce[how][0] += s
            ce[how][1] += n
    x = np.concatenate(xs).astype(np.float64)
    acts, recon = saelens_encode_decode(cfg, w, x)
    ev = 1 - ((x - recon) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    h = card["heldout"]
    assert h["tokens"] == len(x)
    assert h["explained_variance"] == pytest.approx(ev, abs=1e-4)
    assert h["mean_l0"] == pytest.approx((acts > 0).sum(-1).mean(), abs=1e-6)
    assert h["dead_fraction"] == pytest.approx(1 - (acts > 0).any(0).mean(), abs=1e-9)
    ce = {k: s / n for k, (s, n) in ce.items()}
    assert h["ce_orig"] == pytest.approx(ce["orig"], abs=1e-4)
    assert h["ce_sae"] == pytest.approx(ce["sae"], abs=1e-4)
    assert h["ce_zero_ablation"] == pytest.approx(ce["zero"], abs=1e-4)
    assert h["loss_recovered"] == pytest.approx((ce["zero"] - ce["sae"]) / (ce["zero"] - ce["orig"]), abs=1e-3)


def test_sae_train_reads_the_archived_residual_vectors_when_the_run_has_them(train_run, tmp_path):
    import zarr
    from safetensors.numpy import load_file

    out = tmp_path / "sae"
    r = _cli(
        "sae",
        "train",
        train_run.path,
        "--layer",
        2,
        "--latents",
        16,
        "--k",
        3,
        "--out",
        out,
        "--arch",
        "batchtopk",
        "--epochs",
        4,
        "--batch",
        16,
        "--heldout",
        0.34,
        "--json",
    )
    assert r.returncode == 0, r.stderr
    card = json.loads(r.stdout)
    assert card["data"]["source"] == "archive" and card["saved_architecture"] == "jumprelu"
    cfg = json.loads((out / "cfg.json").read_text())
    w = load_file(str(out / "sae_weights.safetensors"))
    assert cfg["architecture"] == "jumprelu" and w["threshold"].shape == (16,)
    group = zarr.open_group(str(train_run.path / "tensors.zarr"), mode="r")
    resid, lengths = group["resid"], group["generated_len"][:]
    layer_pos = list(train_run.manifest["shape"]["resid_layers"]).index(2)
    held = card["data"]["heldout_sequences"]
    assert card["data"]["tokens"] == int(sum(lengths[i] for i in range(len(lengths)) if i not in held))
    x = np.concatenate([np.asarray(resid[i, : lengths[i], layer_pos, :], dtype=np.float64) for i in held])
    acts, recon = saelens_encode_decode(cfg, w, x)
    ev = 1 - ((x - recon) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    assert card["heldout"]["explained_variance"] == pytest.approx(ev, abs=1e-4)
    assert card["heldout"]["mean_l0"] == pytest.approx((acts > 0).sum(-1).mean(), abs=1e-6)
    sae = read_sae(out)  # and lmtrace reads what it wrote: a BatchTopK SAE as a JumpReLU one
    assert sae.cfg.architecture == "jumprelu" and sae.cfg.hook_name == "blocks.2.hook_resid_post"
    np.testing.assert_allclose(sae.reconstruct(torch.from_numpy(x).float()).numpy(), recon, rtol=1e-4, atol=1e-4)


def test_sae_train_bad_input_gets_one_line_and_exit_2(train_run, tmp_path):
    from lmtrace.commands.sae import sae_train_command

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("")
    base = dict(latents=8, k=4, out=str(tmp_path / "new"), layer=1, site="resid_post")
    cases = [
        (dict(k=9), "--k must be in 1..--latents (8)"),
        (dict(site="resid_mid"), "unknown site 'resid_mid'"),
        (dict(layer=9), "layer 9 is out of range: the model has layers 0..3"),
        (dict(site="mlp_out", source="archive"), "not blocks.1.hook_mlp_out"),
        (dict(out=str(taken)), "exists and is not an empty directory"),
        (dict(heldout=1.5), "--heldout must be a fraction"),
    ]
    for extra, text in cases:
        with pytest.raises(SpecError) as err:
            sae_train_command(str(train_run.path), **{**base, **extra}, quiet=True)
        assert text in str(err.value) and "\n" not in str(err.value) and err.value.exit_code == 2, extra
    r = _cli("sae", "train", train_run.path, "--latents", 8, "--k", 9, "--layer", 1, "--out", tmp_path / "new")
    assert r.returncode == 2 and r.stderr == "error: --k must be in 1..--latents (8) (got 9)\n"
    assert not (tmp_path / "new").exists()


def test_weights_are_refused_for_one_infinity_or_nan_but_read_when_only_their_sum_overflows(tmp_path):
    cfg = {"architecture": "standard", "d_in": 4, "d_sae": 6, "metadata": {"hook_name": "blocks.0.hook_resid_post"}}
    w = random_weights(4, 6, 0)
    for bad in (np.inf, -np.inf, np.nan):
        w_enc = w["W_enc"].copy()
        w_enc[2, 3] = bad
        path = write_saelens_dir(tmp_path / f"bad-{bad}", cfg, {**w, "W_enc": w_enc})
        with pytest.raises(SpecError, match="W_enc holds NaN or infinite values"):
            read_sae(path)
    big = np.full((6, 4), 3e38, np.float32)  # finite, but their float32 sum is infinite
    sae = read_sae(write_saelens_dir(tmp_path / "big", cfg, {**w, "W_dec": big}))
    assert float(sae.W_dec.max()) == pytest.approx(3e38)
