"""The final norm and unembedding of a run's model, for a feature's logit effects
(`find.logit_effects_np`), kept in the cache directory once read, so that `lmtrace features RUN
--feature F` loads the model only the first time per model, and answers without importing torch.

What is kept are the tensors `capture.dla.FrozenFinalNorm` takes from the model and `logit_effects`
multiplies — the norm's kind and gain, the linear maps after it, the unembedding — as float32, so the
effects are the same numbers from the cache or the model. The file is named by the run's recorded
weights sha256 and dtype, the model the run was made with: a run whose manifest has no weights sha256
always loads the model. `$LMTRACE_CACHE_DIR/unembedding/` (`make clean-cache` clears it with the
converted weights). Also the SAE's decoder row, read without torch (its weights' sha256: `lmtrace.digest`).
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FOLDER = "unembedding"
WEIGHTS = "sae_weights.safetensors"  # features.format.WEIGHTS (that module imports torch)


@dataclass
class FinalUnembedding:
    """What `find.logit_effects_np` reads, float32 arrays: kind ("layer", "rms" or None), gain [d] or
    None, linear_params [{"weight"}] (the maps after the norm), unembed [vocab, d]."""

    kind: str | None
    gain: np.ndarray | None
    linear_params: list[dict]
    unembed: np.ndarray

    @classmethod
    def of(cls, final) -> FinalUnembedding:
        """From a `capture.dla.FrozenFinalNorm`: its tensors as float32 (what `logit_effects` multiplies)."""

        def arr(t):
            return None if t is None else t.detach().float().cpu().numpy()

        return cls(
            final.kind, arr(final.gain), [{"weight": arr(p["weight"])} for p in final.linear_params], arr(final.unembed)
        )

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"unembed": self.unembed}
        if self.gain is not None:
            out["gain"] = self.gain
        out.update({f"linear.{i}.weight": p["weight"] for i, p in enumerate(self.linear_params)})
        return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}

    @classmethod
    def from_arrays(cls, kind: str | None, n_linear: int, t: dict) -> FinalUnembedding:
        return cls(kind, t.get("gain"), [{"weight": t[f"linear.{i}.weight"]} for i in range(n_linear)], t["unembed"])


def cache_path(manifest: dict) -> Path | None:
    """The cache file of the run's model, or None when the manifest records no weights sha256."""
    sha = (manifest.get("model") or {}).get("weights_sha256")
    if not sha:
        return None
    given = (manifest.get("spec_resolved") or {}).get("model") or {}
    key = json.dumps({"weights_sha256": sha, "dtype": str(given.get("dtype"))}, sort_keys=True)
    return _cache_dir() / FOLDER / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"


def _cache_dir() -> Path:
    """runner.models.cache_dir, without importing torch (which that module does)."""
    if os.environ.get("LMTRACE_CACHE_DIR"):
        return Path(os.environ["LMTRACE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lmtrace"


def read_cached(path: Path | None) -> FinalUnembedding | None:
    if path is None or not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()}
        if meta.get("crc32") != _crc32(arrays):  # a changed byte: recomputed, never shown as an effect
            return None
        return FinalUnembedding.from_arrays(meta.get("kind") or None, int(meta.get("linear", "0")), arrays)
    except Exception:  # noqa: BLE001 - an unreadable cache file is only a cache miss
        return None


def _crc32(arrays: dict[str, np.ndarray]) -> str:
    """The crc32 of the arrays' bytes, in name order: what the cache file's metadata records of its data."""
    crc = 0
    for name in sorted(arrays):
        crc = zlib.crc32(np.ascontiguousarray(arrays[name]).tobytes(), crc)
    return f"{crc:08x}"


def write_cached(path: Path | None, final: FinalUnembedding) -> None:
    """Written whole or not at all (a temporary name, then renamed); a failure to write is ignored."""
    if path is None:
        return
    from safetensors.numpy import save_file

    arrays = final.arrays()
    meta = {"kind": final.kind or "", "linear": str(len(final.linear_params)), "crc32": _crc32(arrays)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(arrays, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError:
        pass


def final_unembedding(manifest: dict, run_id: str, device: str | None, purpose: str) -> FinalUnembedding:
    """The run's model's final norm and unembedding: from the cache, else from the model (loaded and
    checked against the run as every command loads it, then cached)."""
    path = cache_path(manifest)
    cached = read_cached(path)
    if cached is not None:
        return cached
    from ...capture.arch import adapter_for
    from ...capture.dla import FrozenFinalNorm
    from ...runner.models import load_run_model

    loaded = load_run_model(manifest, run_id, purpose=purpose, overrides={"device": device}, spread_ok=True)
    final = FinalUnembedding.of(FrozenFinalNorm(adapter_for(loaded.model), "feature logit effects"))
    write_cached(path, final)
    return final


def decoder_row(sae_dir: Path, feature: int) -> np.ndarray:
    """W_dec[feature] of an SAE directory as float32, read alone from its safetensors file (no torch);
    weights numpy cannot hold (bfloat16) through `features.read_sae`."""
    from safetensors import safe_open

    try:
        with safe_open(str(Path(sae_dir) / WEIGHTS), "np") as f:
            return np.asarray(f.get_slice("W_dec")[feature : feature + 1], dtype=np.float32)[0]
    except (TypeError, ValueError, KeyError):
        from ...features import read_sae

        return read_sae(sae_dir).W_dec[feature].float().numpy()
