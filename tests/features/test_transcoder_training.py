"""`lmtrace sae train --transcoder` (docs/features.md, "Training a transcoder"): a transcoder of one layer's
MLP trained on a replay of a run's prompts, saved as SAELens's jumprelu_transcoder and read back by lmtrace
as a transcoder; its held-out metrics recomputed here from the saved weights (tests/helpers/saes.py
`transcode`) and the model's own MLP input and output, the loss recovered from this test's own forwards
with the MLP's output replaced; bad input refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from lmtrace.exits.errors import SpecError
from lmtrace.features import read_sae, write_sae
from tests.helpers.runs import PROMPTS, run_spec
from tests.helpers.saes import transcode

LAYER = 1


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lmtrace.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def tc_run(tmp_path_factory, sharp_llama_dir):
    root = tmp_path_factory.mktemp("tc-train")
    prompts = PROMPTS + ["It was a dark and stormy night", "Hello world, this is", "A B C D E F G"]
    return run_spec(
        root, {"model": str(sharp_llama_dir), "prompts": prompts, "generation": {"max_new_tokens": 24, "seed": 1}}
    )


def _sequences(run) -> dict[int, list[int]]:
    tokens = run.tokens().to_pandas().sort_values(["sequence", "position"])
    return {int(s): t.token_id.tolist() for s, t in tokens.groupby("sequence")}


def _mlp_io(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """The layer's MLP input and output at every position but the first, and the clean logits."""
    mlp = model.model.layers[LAYER].mlp
    seen = {}
    h_in = mlp.register_forward_pre_hook(lambda m, a: seen.__setitem__("in", a[0][0, 1:].clone()))
    h_out = mlp.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o[0, 1:].clone()))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
    finally:
        h_in.remove()
        h_out.remove()
    return seen["in"].double().numpy(), seen["out"].double().numpy(), logits


def _ce_with_mlp_out(model, ids: list[int], fill: np.ndarray) -> tuple[float, int]:
    """Summed next-token cross-entropy with the MLP's output at positions 1.. replaced by `fill`."""

    def hook(m, a, o):
        o = o.clone()
        o[0, 1:] = torch.from_numpy(fill).to(o.dtype)
        return o

    handle = model.model.layers[LAYER].mlp.register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits
    finally:
        handle.remove()
    return _ce(logits, ids)


def _ce(logits: torch.Tensor, ids: list[int]) -> tuple[float, int]:
    logp = torch.log_softmax(logits[0, :-1].double(), -1)
    target = torch.tensor(ids[1:])
    return float(-logp[torch.arange(len(target)), target].sum()), len(target)


def test_transcoder_training_saves_a_jumprelu_transcoder_whose_metrics_are_the_mlps_own(
    tc_run, sharp_llama_dir, tmp_path
):
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "tc"
    args = ["--latents", 64, "--k", 6, "--epochs", 10, "--batch", 32, "--heldout", 0.34, "--lr", 3e-3]
    r = _cli("sae", "train", tc_run.path, "--layer", LAYER, "--transcoder", "--out", out, *args, "--json")
    assert r.returncode == 0, r.stderr
    card = json.loads(r.stdout)
    assert card == {**json.loads((out / "training_card.json").read_text()), "path": str(out)}
    assert card["transcoder"] is True and card["data"]["source"] == "replay"
    assert card["hook_name"] == f"blocks.{LAYER}.ln2.hook_normalized"
    assert card["hook_name_out"] == f"blocks.{LAYER}.hook_mlp_out"
    assert card["saved_architecture"] == "jumprelu_transcoder" and card["d_out"] == 64
    cfg = json.loads((out / "cfg.json").read_text())
    assert cfg["architecture"] == "jumprelu_transcoder" and cfg["apply_b_dec_to_input"] is False
    assert cfg["metadata"]["hook_name_out"] == card["hook_name_out"]
    w = load_file(str(out / "sae_weights.safetensors"))
    assert w["W_dec"].shape == (64, 64) and w["threshold"].shape == (64,)
    # the BatchTopK inference threshold: the running threshold of training, one value for every latent
    np.testing.assert_allclose(w["threshold"], card["training"]["batchtopk_threshold"], rtol=1e-6)
    tc = read_sae(out)  # lmtrace reads it as a transcoder
    assert tc.cfg.transcoder and tc.cfg.hook_name_out == card["hook_name_out"]

    held = card["data"]["heldout_sequences"]
    seqs = _sequences(tc_run)
    assert len(held) == 2 and card["data"]["tokens"] == sum(len(s) - 1 for i, s in seqs.items() if i not in held)
    model = AutoModelForCausalLM.from_pretrained(sharp_llama_dir, attn_implementation="eager").eval()
    xs, ys, ce = [], [], {"orig": [0.0, 0], "tc": [0.0, 0], "zero": [0.0, 0]}
    for i in held:
        x, y, logits = _mlp_io(model, seqs[i])
        xs.append(x)
        ys.append(y)
        _, pred = transcode(cfg, w, x)
        for how, (s, n) in (
            ("orig", _ce(logits, seqs[i])),
            ("tc", _ce_with_mlp_out(model, seqs[i], pred)),
            ("zero", _ce_with_mlp_out(model, seqs[i], np.zeros_like(y))),
        ):
            ce[how][0] += s
            ce[how][1] += n
    x, y = np.concatenate(xs), np.concatenate(ys)
    acts, pred = transcode(cfg, w, x)
    ev = 1 - ((y - pred) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
    h = card["heldout"]
    assert h["tokens"] == len(x)
    assert h["explained_variance"] == pytest.approx(ev, abs=1e-3)
    assert h["mean_l0"] == pytest.approx((acts > 0).sum(-1).mean(), abs=1e-6)
    assert h["dead_fraction"] == pytest.approx(1 - (acts > 0).any(0).mean(), abs=1e-9)
    ce = {k: s / n for k, (s, n) in ce.items()}
    assert h["ce_orig"] == pytest.approx(ce["orig"], abs=1e-4)
    assert h["ce_sae"] == pytest.approx(ce["tc"], abs=1e-4)
    assert h["ce_zero_ablation"] == pytest.approx(ce["zero"], abs=1e-4)
    assert h["loss_recovered"] == pytest.approx((ce["zero"] - ce["tc"]) / (ce["zero"] - ce["orig"]), abs=1e-3)


def test_transcoder_trainer_learns_a_sparse_map_from_one_space_to_another(tmp_path):
    """Inputs and outputs written by the same sparse latents through two different dictionaries (and
    offsets, and very different scales): the trained transcoder's output, computed here from its saved
    weights, explains most of the held-out outputs' variance."""
    from safetensors.numpy import load_file

    from lmtrace.analysis.features.activations import ActivationStore
    from lmtrace.analysis.features.train import Target, TrainSettings, train_sae

    g = torch.Generator().manual_seed(0)
    n, d_in, d_out, f = 6000, 16, 24, 32
    z = torch.rand(n, f, generator=g) * (torch.rand(n, f, generator=g) < 0.1)
    x = z @ torch.randn(f, d_in, generator=g) + 0.5
    y = z @ torch.randn(f, d_out, generator=g) * 0.01 - 0.02
    store = ActivationStore(tmp_path, d_in + d_out, 5000)
    store.fill([torch.cat([x, y], 1)[:5000]])
    settings = TrainSettings(d_sae=32, k=3, architecture="batchtopk", epochs=30, batch=128, lr=3e-3)
    hooks = ("blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out")
    tc, log = train_sae(store, settings, hooks[0], target=Target(hooks[1], d_out))
    store.close()
    write_sae(tc, tmp_path / "tc")
    cfg = json.loads((tmp_path / "tc" / "cfg.json").read_text())
    assert cfg["architecture"] == "jumprelu_transcoder" and cfg["d_in"] == d_in and cfg["d_out"] == d_out
    acts, pred = transcode(cfg, load_file(str(tmp_path / "tc" / "sae_weights.safetensors")), x[5000:].numpy())
    held = y[5000:].double().numpy()
    ev = 1 - ((held - pred) ** 2).sum() / ((held - held.mean(0)) ** 2).sum()
    assert ev > 0.6, (ev, log)
    assert 1 <= (acts > 0).sum(-1).mean() <= 6  # about k active on average, as BatchTopK keeps


def test_transcoder_training_bad_input_gets_one_line_and_exit_2(tc_run, tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from lmtrace.commands.sae import sae_train_command
    from tests.helpers.architectures import BY_ID, build_tiny

    base = dict(latents=8, k=4, out=str(tmp_path / "new"), layer=1, site=None, transcoder=True, quiet=True)
    cases = [
        (dict(site="resid_post"), "--transcoder reads the MLP's input (mlp_in)"),
        (dict(arch="topk"), "SAELens has no TopK transcoder"),
        (dict(source="archive"), "runs never archive"),
        (dict(k=9), "--k must be in 1..--latents (8)"),
        (dict(layer=7), "layer 7 is out of range"),
    ]
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    opt = build_tiny(BY_ID["opt"], tok, tmp_path / "opt")
    opt_run = run_spec(
        tmp_path / "opt-run", {"model": str(opt), "prompts": PROMPTS[:2], "generation": {"max_new_tokens": 2}}
    )
    for run, extra, text in [(tc_run, *c) for c in cases] + [(opt_run, {}, "OPT models have no MLP module")]:
        with pytest.raises(SpecError) as err:
            sae_train_command(str(run.path), **{**base, **extra})
        assert text in str(err.value) and "\n" not in str(err.value) and err.value.exit_code == 2, extra
    r = _cli(
        "sae",
        "train",
        tc_run.path,
        "--transcoder",
        "--site",
        "mlp_out",
        "--latents",
        8,
        "--layer",
        1,
        "--out",
        tmp_path / "new",
    )
    assert r.returncode == 2 and r.stderr.startswith("error: --transcoder reads") and r.stderr.count("\n") == 1, (
        r.stderr
    )
    assert not (tmp_path / "new").exists()
