"""`capture.layers` and `capture.residual.vectors_at` resolved against a model's layer count."""

from __future__ import annotations

from typing import Literal

from ..exits.errors import SpecError
from .sections import CaptureSpec, LayerStride


def resolve_layers(layers: Literal["all"] | list[int] | LayerStride, n_layers: int) -> list[int]:
    """Turn `capture.layers` into a sorted list of layer indices, checked against the model."""
    if layers == "all":
        return list(range(n_layers))
    if isinstance(layers, LayerStride):
        if layers.start >= n_layers:
            raise SpecError(
                f"capture.layers.start={layers.start} is out of range: the model has layers 0..{n_layers - 1}"
            )
        return list(range(layers.start, n_layers, layers.stride))
    if not layers:
        raise SpecError("capture.layers is empty: use `all`, a list of layer indices or {stride: N}")
    bad = [i for i in layers if not -n_layers <= i < n_layers]
    if bad:
        raise SpecError(
            f"capture.layers: {bad} out of range: the model has layers 0..{n_layers - 1} "
            f"(negative indices count from the end, down to -{n_layers})"
        )
    return sorted({i % n_layers for i in layers})


def resolve_vector_layers(spec: CaptureSpec, n_layers: int) -> list[int]:
    """Layers whose full residual vector is archived: `residual.vectors_at`, plus every captured
    layer when the logit lens is deferred (its input)."""
    v = spec.residual.vectors_at
    if v == "all":
        return list(range(n_layers))
    if spec.lens_deferred:
        v = list(v) + resolve_layers(spec.layers, n_layers)
    bad = [i for i in v if not -n_layers <= i < n_layers]
    if bad:
        raise SpecError(
            f"capture.residual.vectors_at: {bad} out of range: the model has layers 0..{n_layers - 1} "
            f"(negative indices count from the end, down to -{n_layers})"
        )
    return sorted({i % n_layers for i in v})
