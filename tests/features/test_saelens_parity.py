"""lmtrace's SAE encode/decode against SAELens's: its own `SAE.load_from_disk(...).encode/decode` on the
same directory where `sae-lens` is installed (the optional extra `saelens`; skipped otherwise), and, in
every installation, a TopK SAE saved with `rescale_acts_by_decoder_norm` against that formula written out
here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmtrace.features import read_sae
from tests.helpers.saes import write_saelens_dir

D_IN, D_SAE, K = 16, 48, 6


def _weights(seed: int, jumprelu: bool) -> dict:
    """Random weights whose decoder rows are far from unit norm (so a decoder-norm rescale matters)."""
    rng = np.random.default_rng(seed)
    w = {
        "W_enc": rng.normal(size=(D_IN, D_SAE)) / np.sqrt(D_IN),
        "b_enc": rng.normal(size=D_SAE) * 0.1,
        "W_dec": rng.normal(size=(D_SAE, D_IN)) * rng.uniform(0.2, 3.0, size=(D_SAE, 1)) / np.sqrt(D_IN),
        "b_dec": rng.normal(size=D_IN) * 0.3,
    }
    if jumprelu:
        w["threshold"] = rng.uniform(0.0, 0.6, size=D_SAE)
    return {k: v.astype(np.float32) for k, v in w.items()}


def _cfg(arch: str, apply_b_dec: bool, rescale: bool = False) -> dict:
    cfg = {
        "architecture": arch,
        "d_in": D_IN,
        "d_sae": D_SAE,
        "dtype": "float32",
        "apply_b_dec_to_input": apply_b_dec,
        "normalize_activations": "none",
        "metadata": {"hook_name": "blocks.3.hook_resid_post", "sae_lens_version": "6.0.0"},  # the SAELens 6 layout
    }
    if arch == "topk":
        cfg["k"] = K
        cfg["rescale_acts_by_decoder_norm"] = rescale
    return cfg


def _inputs() -> np.ndarray:
    return (np.random.default_rng(5).normal(size=(96, D_IN)) * 2.5).astype(np.float32)


CASES = [
    ("standard", False),
    ("jumprelu", False),
    ("topk", False),
    ("topk", True),  # SAELens 6 trains TopK SAEs with rescale_acts_by_decoder_norm
]


@pytest.mark.parametrize("apply_b_dec", [True, False])
@pytest.mark.parametrize("arch,rescale", CASES)
def test_encode_and_decode_equal_sae_lens_own_sae(tmp_path, arch, rescale, apply_b_dec):
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens not installed (pip install -e '.[saelens]')")
    cfg = _cfg(arch, apply_b_dec, rescale)
    path = write_saelens_dir(tmp_path / "sae", cfg, _weights(seed=len(arch) + 3 * rescale, jumprelu=arch == "jumprelu"))
    theirs = sae_lens.SAE.load_from_disk(str(path), device="cpu")
    ours = read_sae(path)
    x = torch.from_numpy(_inputs())
    with torch.no_grad():
        acts_ref = theirs.encode(x)
        out_ref = theirs.decode(acts_ref)
    acts = ours.encode(x)
    assert (acts_ref > 0).sum() > 0 and ((acts_ref > 0).sum(-1) < D_SAE).all()  # sparse, not empty
    torch.testing.assert_close(acts, acts_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.decode(acts_ref), out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.reconstruct(x), theirs(x).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("apply_b_dec", [True, False])
def test_topk_sae_with_decoder_norm_rescale_encodes_as_saelens_formula(tmp_path, apply_b_dec):
    """SAELens's TopKSAE with rescale_acts_by_decoder_norm: pre = ((x − b_dec) W_enc + b_enc) · ‖W_dec[i]‖,
    acts = ReLU of the k largest pre, x̂ = (acts / ‖W_dec[i]‖) W_dec + b_dec; written out in float64."""
    cfg = _cfg("topk", apply_b_dec, rescale=True)
    w = _weights(seed=11, jumprelu=False)
    sae = read_sae(write_saelens_dir(tmp_path / "sae", cfg, w))
    x = _inputs()
    W_enc, b_enc, W_dec, b_dec = (w[n].astype(np.float64) for n in ("W_enc", "b_enc", "W_dec", "b_dec"))
    norms = np.linalg.norm(W_dec, axis=-1)
    pre = ((x - b_dec * apply_b_dec) @ W_enc + b_enc) * norms
    acts_ref = np.zeros_like(pre)
    for i, row in enumerate(pre):
        top = np.argsort(-row, kind="stable")[:K]
        acts_ref[i, top] = np.maximum(row[top], 0)
    out_ref = (acts_ref / norms) @ W_dec + b_dec
    # the rescale changes which latents win: without it the top k would differ on some tokens
    plain = (x - b_dec * apply_b_dec) @ W_enc + b_enc
    assert any(set(np.argsort(-p)[:K]) != set(np.argsort(-q)[:K]) for p, q in zip(plain, pre))
    acts = sae.encode(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(acts, acts_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sae.reconstruct(torch.from_numpy(x)).numpy(), out_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["jumprelu", "topk"])
def test_an_sae_saved_by_sae_lens_reads_back_with_the_same_encode(tmp_path, arch):
    """What `SAE.from_pretrained(release, id).save_model(DIR)` writes (the way to bring a release here)."""
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens not installed (pip install -e '.[saelens]')")
    cfg = _cfg(arch, True, rescale=arch == "topk")
    src = write_saelens_dir(tmp_path / "src", cfg, _weights(seed=3, jumprelu=arch == "jumprelu"))
    theirs = sae_lens.SAE.load_from_disk(str(src), device="cpu")
    theirs.save_model(str(tmp_path / "saved"))
    x = torch.from_numpy(_inputs())
    with torch.no_grad():
        acts_ref = theirs.encode(x)
    torch.testing.assert_close(read_sae(tmp_path / "saved").encode(x), acts_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("command", ["sae show", "generate"])
def test_a_saelens_release_id_is_refused_in_one_line_saying_how_to_download_it(tmp_path, tiny_llama_dir, command):
    import subprocess
    import sys

    ref = "gemma-scope-2b-pt-res-canonical:layer_12/width_16k/canonical"
    if command == "generate":  # the spec's --sae paths are made absolute first
        (tmp_path / "spec.yaml").write_text(
            f'model: "{tiny_llama_dir}"\nprompts:\n  texts: ["hi"]\ngeneration:\n  max_new_tokens: 1\n'
        )
        args = ["generate", "spec.yaml", "--sae", ref]
    else:
        args = ["sae", "show", ref]
    proc = subprocess.run([sys.executable, "-m", "lmtrace.cli", *args], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error")]
    assert len(lines) == 1 and proc.stderr.strip().endswith(lines[0])
    assert "SAE.from_pretrained('gemma-scope-2b-pt-res-canonical', 'layer_12/width_16k/canonical')" in lines[0]
    assert ".save_model('DIR')" in lines[0]
