"""The final norm and unembedding of a run's model, for a feature's logit effects (`find.logit_effects`),
kept in the cache directory once read, so that `lmtrace features RUN --feature F` loads the model only
the first time per model.

What is kept are the tensors `capture.dla.FrozenFinalNorm` takes from the model and `logit_effects`
reads — the norm's kind and gain, the linear maps after it, the unembedding — unchanged (same dtype), so
the effects are the same numbers either way. The file is named by the run's recorded weights sha256 and
dtype, the model the run was made with: a run whose manifest has no weights sha256 always loads the
model. `$LMTRACE_CACHE_DIR/unembedding/` (`make clean-cache` clears it with the converted weights).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

FOLDER = "unembedding"


@dataclass
class FinalUnembedding:
    """What `find.logit_effects` reads of a `FrozenFinalNorm`: kind ("layer", "rms" or None), gain
    [d] or None, linear_params [{weight, bias?}], unembed [vocab, d]."""

    kind: str | None
    gain: torch.Tensor | None
    linear_params: list[dict]
    unembed: torch.Tensor

    @classmethod
    def of(cls, final) -> FinalUnembedding:
        return cls(final.kind, final.gain, [dict(p) for p in final.linear_params], final.unembed)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"unembed": self.unembed}
        if self.gain is not None:
            out["gain"] = self.gain
        for i, params in enumerate(self.linear_params):
            out.update({f"linear.{i}.{k}": v for k, v in params.items() if v is not None})
        return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}

    @classmethod
    def from_tensors(cls, kind: str | None, n_linear: int, t: dict) -> FinalUnembedding:
        linears = [{k.split(".")[-1]: v for k, v in t.items() if k.startswith(f"linear.{i}.")} for i in range(n_linear)]
        return cls(kind, t.get("gain"), linears, t["unembed"])


def cache_path(manifest: dict) -> Path | None:
    """The cache file of the run's model, or None when the manifest records no weights sha256."""
    from ...runner.models import cache_dir

    sha = (manifest.get("model") or {}).get("weights_sha256")
    if not sha:
        return None
    given = (manifest.get("spec_resolved") or {}).get("model") or {}
    key = json.dumps({"weights_sha256": sha, "dtype": str(given.get("dtype"))}, sort_keys=True)
    return cache_dir() / FOLDER / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"


def read_cached(path: Path | None) -> FinalUnembedding | None:
    if path is None or not path.is_file():
        return None
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
        kind = meta.get("kind") or None
        return FinalUnembedding.from_tensors(kind, int(meta.get("linear", "0")), tensors)
    except Exception:  # noqa: BLE001 - an unreadable cache file is only a cache miss
        return None


def write_cached(path: Path | None, final: FinalUnembedding) -> None:
    """Written whole or not at all (a temporary name, then renamed); a failure to write is ignored."""
    if path is None:
        return
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(
            final.tensors(), str(tmp), metadata={"kind": final.kind or "", "linear": str(len(final.linear_params))}
        )
        os.replace(tmp, path)
    except OSError:
        pass


def final_unembedding(manifest: dict, run_id: str, device: str | None, purpose: str) -> FinalUnembedding:
    """The run's model's final norm and unembedding: from the cache, else from the model (loaded and
    checked against the run as every command loads it, then cached). With `device` the model is always
    loaded there (the cache holds CPU tensors)."""
    path = cache_path(manifest)
    if device is None:
        cached = read_cached(path)
        if cached is not None:
            return cached
    from ...capture.arch import adapter_for
    from ...capture.dla import FrozenFinalNorm
    from ...runner.models import load_run_model

    loaded = load_run_model(manifest, run_id, purpose=purpose, overrides={"device": device}, spread_ok=True)
    final = FinalUnembedding.of(FrozenFinalNorm(adapter_for(loaded.model), "feature logit effects"))
    if device is None:
        write_cached(path, final)
    return final
