"""SAEs for the feature tests: a SAELens directory written without lmtrace's writer, random weights,
and the SAE applied by the test's own numpy formula (SAELens's inference encode, no normalisation)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_saelens_dir(path: Path, cfg: dict, weights: dict) -> Path:
    """An SAE directory as SAELens writes one (cfg.json + sae_weights.safetensors, float32)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "cfg.json").write_text(json.dumps(cfg))
    save_file(
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
        str(path / "sae_weights.safetensors"),
    )
    return path


def random_sae(
    path: Path,
    hook_name: str,
    d_in: int,
    d_sae: int,
    *,
    arch: str = "standard",
    k: int = 8,
    seed: int = 0,
    scale: float = 1.0,
) -> tuple[dict, dict]:
    """Write a random SAE whose latents are active on a fair share of tokens; returns (cfg, weights)."""
    rng = np.random.default_rng(seed)
    w = {
        "W_enc": rng.normal(size=(d_in, d_sae)) * scale / np.sqrt(d_in),
        "b_enc": rng.normal(size=d_sae) * 0.05,
        "W_dec": rng.normal(size=(d_sae, d_in)) / np.sqrt(d_in),
        "b_dec": rng.normal(size=d_in) * 0.01,
    }
    if arch == "jumprelu":
        w["threshold"] = rng.uniform(0.0, 0.2, size=d_sae)
    cfg = {
        "architecture": arch,
        "d_in": d_in,
        "d_sae": d_sae,
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "metadata": {"hook_name": hook_name},
    }
    if arch == "topk":
        cfg["k"] = k
    write_saelens_dir(path, cfg, w)
    return cfg, {n: v.astype(np.float32) for n, v in w.items()}


def encode(cfg: dict, w: dict, x: np.ndarray) -> np.ndarray:
    """x [n, d_in] -> activations [n, d_sae] (float64): ReLU / JumpReLU / TopK of (x − b_dec) W_enc + b_enc."""
    pre = (x.astype(np.float64) - w["b_dec"]) @ w["W_enc"].astype(np.float64) + w["b_enc"]
    if cfg["architecture"] == "jumprelu":
        return np.maximum(pre, 0) * (pre > w["threshold"])
    if cfg["architecture"] == "topk":
        out = np.zeros_like(pre)
        for i, row in enumerate(pre):
            top = np.argsort(-row, kind="stable")[: cfg["k"]]
            out[i, top] = np.maximum(row[top], 0)
        return out
    return np.maximum(pre, 0)


def dense(idx: np.ndarray, val: np.ndarray, d_sae: int) -> np.ndarray:
    """Archived top-k (idx, val) [..., k] -> dense activations [..., d_sae] (0 where not archived)."""
    out = np.zeros((*idx.shape[:-1], d_sae))
    flat_i, flat_v, flat_o = idx.reshape(-1, idx.shape[-1]), val.reshape(-1, val.shape[-1]), out.reshape(-1, d_sae)
    for r in range(len(flat_i)):
        keep = flat_i[r] >= 0
        flat_o[r, flat_i[r][keep]] = flat_v[r][keep]
    return out


def top_of(acts: np.ndarray, k: int) -> np.ndarray:
    """Dense activations [..., d_sae] with all but each row's k largest positive ones set to 0."""
    out = np.zeros_like(acts)
    flat, flat_o = acts.reshape(-1, acts.shape[-1]), out.reshape(-1, acts.shape[-1])
    for r, row in enumerate(flat):
        top = np.argsort(-row, kind="stable")[:k]
        top = top[row[top] > 0]
        flat_o[r, top] = row[top]
    return out


def random_transcoder(
    path: Path,
    layer: int,
    d_in: int,
    d_sae: int,
    d_out: int,
    *,
    arch: str = "transcoder",
    seed: int = 0,
    scale: float = 1.0,
    cfg_extra: dict | None = None,
) -> tuple[dict, dict]:
    """Write a random MLP transcoder (blocks.L.ln2.hook_normalized -> blocks.L.hook_mlp_out) as SAELens
    writes one; returns (cfg, weights)."""
    rng = np.random.default_rng(seed)
    w = {
        "W_enc": rng.normal(size=(d_in, d_sae)) * scale / np.sqrt(d_in),
        "b_enc": rng.normal(size=d_sae) * 0.05,
        "W_dec": rng.normal(size=(d_sae, d_out)) / np.sqrt(d_out),
        "b_dec": rng.normal(size=d_out) * 0.1,
    }
    if "jumprelu" in arch:
        w["threshold"] = rng.uniform(0.0, 0.2, size=d_sae)
    if "skip" in arch:
        w["W_skip"] = rng.normal(size=(d_out, d_in)) / np.sqrt(d_in)
    cfg = {
        "architecture": arch,
        "d_in": d_in,
        "d_sae": d_sae,
        "d_out": d_out,
        "dtype": "float32",
        "apply_b_dec_to_input": False,
        "normalize_activations": "none",
        "metadata": {
            "hook_name": f"blocks.{layer}.ln2.hook_normalized",
            "hook_name_out": f"blocks.{layer}.hook_mlp_out",
        },
        **(cfg_extra or {}),
    }
    write_saelens_dir(path, cfg, w)
    return cfg, {n: v.astype(np.float32) for n, v in w.items()}


def transcode(cfg: dict, w: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [n, d_in] -> (activations [n, d_sae], output [n, d_out]) (float64), as SAELens's transcoders compute
    them: pre = x W_enc + b_enc (b_dec never subtracted), ReLU (JumpReLU: 0 where pre <= threshold),
    output acts W_dec + b_dec (+ x W_skip^T for a skip transcoder)."""
    x = x.astype(np.float64)
    pre = x @ w["W_enc"].astype(np.float64) + w["b_enc"]
    acts = np.maximum(pre, 0)
    if "jumprelu" in cfg["architecture"]:
        acts = acts * (pre > w["threshold"])
    out = acts @ w["W_dec"].astype(np.float64) + w["b_dec"]
    if "skip" in cfg["architecture"]:
        out = out + x @ w["W_skip"].astype(np.float64).T
    return acts, out
