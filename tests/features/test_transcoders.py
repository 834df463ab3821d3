"""Transcoders read from SAELens directories (docs/features.md, "Transcoders"): encode, decode and the
output of every transcoder architecture against the test's own formula and against SAELens's own
classes (run in the separate SAELens environment, skipped where it is absent); a directory SAELens saved
itself is read; lmtrace's writer round-trips one; bad transcoders are refused in one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from lmtrace.exits.errors import SpecError
from lmtrace.features import read_sae, write_sae
from tests.helpers.cli import assert_one_line_error, lmtrace
from tests.helpers.saes import random_transcoder, transcode, write_saelens_dir

ARCHS = ["transcoder", "skip_transcoder", "jumprelu_transcoder", "jumprelu_skip_transcoder"]
D_IN, D_SAE, D_OUT = 16, 40, 12
SAELENS_PYTHON = Path("/work/venv-saelens/bin/python")


def _inputs(n: int = 64, d: int = D_IN) -> np.ndarray:
    return (np.random.default_rng(7).normal(size=(n, d)) * 2.0).astype(np.float32)


@pytest.mark.parametrize("arch", ARCHS)
def test_transcoder_encode_decode_and_output_equal_the_tests_own_formula(tmp_path, arch):
    cfg, w = random_transcoder(tmp_path / "tc", 1, D_IN, D_SAE, D_OUT, arch=arch, seed=len(arch), scale=3.0)
    tc = read_sae(tmp_path / "tc")
    x = _inputs()
    acts_want, out_want = transcode(cfg, w, x)
    assert 0 < (acts_want > 0).sum() < acts_want.size  # sparse, not empty
    acts = tc.encode(torch.from_numpy(x))
    np.testing.assert_allclose(acts.numpy(), acts_want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tc.forward(torch.from_numpy(x)).numpy(), out_want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(
        tc.decode(acts).numpy(), acts_want @ w["W_dec"].astype(np.float64) + w["b_dec"], rtol=1e-5, atol=1e-4
    )
    assert (tc.cfg.d_in, tc.cfg.d_out, tc.cfg.hook_name_out) == (D_IN, D_OUT, "blocks.1.hook_mlp_out")


_SAELENS_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, torch
    from sae_lens import SAE
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.saes.transcoder import JumpReLUSkipTranscoder, JumpReLUSkipTranscoderConfig
    root = sys.argv[1]
    x = torch.from_numpy(np.load(root + "/x.npy"))
    out = {}
    for arch in sys.argv[2:]:
        tc = SAE.load_from_disk(root + "/" + arch, device="cpu")
        with torch.no_grad():
            acts = tc.encode(x)
            out[arch + ":acts"], out[arch + ":out"] = acts.numpy(), tc(x).numpy()
            out[arch + ":decode"] = tc.decode(acts).numpy()
    cfg = JumpReLUSkipTranscoderConfig(d_in=8, d_sae=20, d_out=8, apply_b_dec_to_input=False)
    cfg.metadata = SAEMetadata(hook_name="blocks.1.ln2.hook_normalized", hook_name_out="blocks.1.hook_mlp_out")
    own = JumpReLUSkipTranscoder(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (own.W_enc, own.b_enc, own.W_dec, own.b_dec, own.W_skip, own.threshold):
            p.copy_(torch.rand(p.shape, generator=g) - 0.3)
        own.save_model(root + "/saved")
        y = torch.from_numpy(np.load(root + "/y.npy"))
        out["saved:acts"], out["saved:out"] = own.encode(y).numpy(), own(y).numpy()
    np.savez(root + "/ref.npz", **out)
    """
)


@pytest.mark.skipif(not SAELENS_PYTHON.exists(), reason="the SAELens environment (/work/venv-saelens) is absent")
def test_transcoders_equal_saelens_own_classes_and_a_directory_saelens_saved_is_read(tmp_path):
    for arch in ARCHS:
        random_transcoder(tmp_path / arch, 1, D_IN, D_SAE, D_OUT, arch=arch, seed=len(arch) + 1, scale=3.0)
    x, y = _inputs(), _inputs(32, 8)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    proc = subprocess.run(
        [str(SAELENS_PYTHON), "-c", _SAELENS_SCRIPT, str(tmp_path), *ARCHS], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ref = np.load(tmp_path / "ref.npz")
    for arch in ARCHS:
        tc = read_sae(tmp_path / arch)
        acts = tc.encode(torch.from_numpy(x))
        assert (ref[f"{arch}:acts"] > 0).any()
        np.testing.assert_allclose(acts.numpy(), ref[f"{arch}:acts"], rtol=1e-5, atol=1e-5, err_msg=arch)
        np.testing.assert_allclose(tc.decode(acts).numpy(), ref[f"{arch}:decode"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(tc.forward(torch.from_numpy(x)).numpy(), ref[f"{arch}:out"], rtol=1e-5, atol=1e-5)
    saved = read_sae(tmp_path / "saved")  # the cfg.json and weights SAELens's own save_model wrote
    assert (saved.cfg.architecture, saved.cfg.hook_name_out) == ("jumprelu_skip_transcoder", "blocks.1.hook_mlp_out")
    np.testing.assert_allclose(saved.encode(torch.from_numpy(y)).numpy(), ref["saved:acts"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(saved.forward(torch.from_numpy(y)).numpy(), ref["saved:out"], rtol=1e-5, atol=1e-5)


def test_a_written_transcoder_reads_back_identically_in_saelens_layout(tmp_path):
    random_transcoder(tmp_path / "tc", 2, D_IN, D_SAE, D_OUT, arch="jumprelu_skip_transcoder", seed=3)
    tc = read_sae(tmp_path / "tc")
    write_sae(tc, tmp_path / "copy")
    cfg = json.loads((tmp_path / "copy" / "cfg.json").read_text())
    assert (cfg["architecture"], cfg["d_out"], cfg["apply_b_dec_to_input"]) == (
        "jumprelu_skip_transcoder",
        D_OUT,
        False,
    )
    assert cfg["metadata"]["hook_name_out"] == "blocks.2.hook_mlp_out"
    again = read_sae(tmp_path / "copy")
    for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip"):
        assert torch.equal(getattr(again, name), getattr(tc, name)), name


def _bad_transcoders(tmp_path: Path) -> list[tuple[Path, str]]:
    cfg, w = random_transcoder(tmp_path / "good", 1, D_IN, D_SAE, D_OUT, arch="skip_transcoder")
    meta = cfg["metadata"]

    def variant(name, cfg_=None, w_=None):
        return write_saelens_dir(tmp_path / name, cfg_ or cfg, w_ or w)

    no_out = {**cfg, "metadata": {"hook_name": meta["hook_name"]}}
    no_d_out = {k: v for k, v in cfg.items() if k != "d_out"}
    return [
        (variant("no-out", no_out), "output hook point"),
        (variant("no-d-out", no_d_out), "needs whole numbers d_in and d_sae and d_out"),
        (variant("d-out", {**cfg, "d_out": D_OUT + 1}), f"W_dec has shape [{D_SAE}, {D_OUT}], expected"),
        (variant("skip", None, {**w, "W_skip": w["W_skip"].T}), f"W_skip has shape [{D_IN}, {D_OUT}], expected"),
        (variant("no-skip", None, {k: v for k, v in w.items() if k != "W_skip"}), "has no tensor W_skip"),
        (variant("b-dec", {**cfg, "apply_b_dec_to_input": True}), "apply_b_dec_to_input is true"),
        (variant("norm", {**cfg, "normalize_activations": "layer_norm"}), "not supported for a transcoder"),
        (
            variant("pair", {**cfg, "metadata": {**meta, "hook_name_out": "blocks.2.hook_mlp_out"}}),
            "a transcoder from blocks.1.ln2.hook_normalized to blocks.2.hook_mlp_out is not supported",
        ),
        (
            variant("resid", {**cfg, "metadata": {**meta, "hook_name": "blocks.1.hook_resid_pre"}}),
            "is not supported; supported (L one layer): blocks.L.ln2.hook_normalized -> blocks.L.hook_mlp_out",
        ),
        (
            variant("mid", {**cfg, "metadata": {**meta, "hook_name_out": "blocks.1.hook_resid_mid"}}),
            "output hook point): hook point 'blocks.1.hook_resid_mid' is not supported",
        ),
    ]


def test_bad_transcoder_directories_are_refused_in_one_line_exit_2(tmp_path):
    for i, (path, fragment) in enumerate(_bad_transcoders(tmp_path)):
        with pytest.raises(SpecError) as err:
            read_sae(path)
        assert fragment in str(err.value), (path.name, str(err.value))
        if i in (0, 3, 7):  # the command line too (each start costs seconds)
            assert_one_line_error(lmtrace(tmp_path, "sae", "show", str(path)), 2, fragment)
    good = lmtrace(tmp_path, "sae", "show", str(tmp_path / "good"), "--json")
    assert good.returncode == 0, good.stderr
    info = json.loads(good.stdout)
    assert (info["site"], info["site_out"], info["d_out"]) == ("mlp_in", "mlp_out", D_OUT)
