"""What a steer or patch_residual entry reads from other runs' archives: the steering vector (a .npy
file, or the difference of two runs' mean residuals) and the archived residual a patch puts in place."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...exits.errors import SpecError
from .entries import PatchResidual, Steer


def load_steer_vector(e: Steer, d_model: int, open_run) -> torch.Tensor:
    if e.vector is not None:
        path = Path(e.vector)
        if not path.is_file():
            raise SpecError(f"steer.vector: {path} does not exist")
        v = np.load(path)
    else:
        means = []
        for ref in e.from_runs:
            r = open_run(ref)
            if "resid" not in r.array_names() or e.layer not in r.shape["resid_layers"]:
                raise SpecError(
                    f"steer.from_runs: run {r.id} has no residual vectors at layer {e.layer} "
                    f"(set capture.residual.vectors_at to include {e.layer})"
                )
            ri = r.shape["resid_layers"].index(e.layer)
            arr = r.array("resid")[:, :, ri]
            means.append(np.nanmean(arr.reshape(-1, arr.shape[-1]), axis=0))
        v = means[0] - means[1]
    v = np.asarray(v, dtype=np.float32).reshape(-1)
    if v.shape[0] != d_model:
        raise SpecError(f"steer vector has {v.shape[0]} values; the model's residual stream has {d_model}")
    return torch.from_numpy(v)


def patch_source(e: PatchResidual, open_run):
    """(sequence, step) -> archived residual vector after e.layer at that step's query position."""
    src = open_run(e.source_run)
    if "resid" not in src.array_names() or e.layer not in src.shape["resid_layers"]:
        raise SpecError(
            f"patch_residual: source run {src.id} has no residual vectors at layer {e.layer}; "
            f"rerun it with capture.residual.vectors_at including {e.layer}"
        )
    ri = src.shape["resid_layers"].index(e.layer)
    arr = src.array("resid")
    lengths = src.generated_len()

    def get(seq: int, step: int):
        s = e.source_sequence if e.source_sequence is not None else seq
        if s >= arr.shape[0] or step >= lengths[s]:
            return None
        return np.asarray(arr[s, step, ri], dtype=np.float32)  # float16 in runs of the default capture

    return get
