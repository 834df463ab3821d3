"""What a new run's manifest.json records (documented in docs/archive.md, "Manifest")."""

from __future__ import annotations

import yaml

from ..capture.lens import CANDIDATES as LENS_CANDIDATES
from . import layout
from .layout import RunShape
from .runs import host_info, now_iso, package_versions


def lens_manifest(cap) -> dict | None:
    """The manifest's `lens` entry; `computed` is filled in by `lmtrace lens` for a deferred lens."""
    if not (cap.lens_inline or cap.lens_deferred):
        return None
    return {
        "when": cap.lens.when,
        "dtype": cap.lens.dtype,
        "method": {
            "float32": "float32 logits over the whole vocabulary",
            "bfloat16": f"bfloat16 ranking, top {LENS_CANDIDATES} per row re-scored in float32 (see docs/archive.md)",
        }[cap.lens.dtype],
        "input": "resid (float32) at every captured layer" if cap.lens_deferred else None,
        "computed": {"by": "lmtrace generate"} if cap.lens_inline else None,
    }


def manifest_base(
    spec,
    given_text: str,
    loaded,
    adapter,
    shape: RunShape,
    inner_attn: str,
    run_id: str,
    prompts: list[str],
    eager_reason: str | None = None,
) -> dict:
    model = loaded.model
    return {
        "format_version": layout.FORMAT_VERSION,
        "run_id": run_id,
        "kind": "generate",
        "status": "running",
        "created": now_iso(),
        "spec_given": yaml.safe_load(given_text),
        "spec_resolved": spec.model_dump(mode="json"),
        "model": {
            "reference": loaded.reference,
            "kind": loaded.kind,
            "source": loaded.source,
            "weights_sha256": loaded.weights_sha256,
            "class": type(model).__name__,
            "architecture_family": adapter.family.name,
            "config": model.config.to_dict(),
            **loaded.extra,
        },
        "tokenizer": {
            "class": type(loaded.tokenizer).__name__,
            "vocab_size": len(loaded.tokenizer),
            "pad_token_id": loaded.tokenizer.pad_token_id,
            "padding_side": "left",
            "sha256": loaded.tokenizer_sha256,
        },
        "seed": spec.generation.seed,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "attention": {
            "kernel": inner_attn,
            "kernel_reason": eager_reason,
            "probabilities": (
                None
                if not shape.attention
                else "returned by the model's own eager attention kernel, which the forward ran"
                if inner_attn == "eager"
                else "recomputed from the captured post-rotary query and keys with the model's own eager attention "
                "(row_method says how; see docs/archive.md)"
            ),
            "qkv_rotary": "post-rotary" if shape.qkv else None,
            "layers": {},  # per captured layer: scaling/softcap/sliding_window/sinks the kernel was called with
        },
        "lens": lens_manifest(spec.capture),
        "not_captured": adapter.not_captured(),
        "shape": {
            "n_sequences": shape.n_sequences,
            "n_steps": shape.n_steps,
            "max_prompt": shape.max_prompt,
            "max_len": shape.max_len,
            "layers": list(shape.layers),
            "resid_layers": list(shape.resid_layers),
            "n_heads": shape.n_heads,
            "n_kv_heads": shape.n_kv_heads,
            "head_dim": shape.head_dim,
            "d_model": shape.d_model,
            "d_ffn": shape.d_ffn,
            "kv_head_of_head": list(shape.kv_head_of_head),
            "k_router": shape.k_router,
        },
        "arrays": {s.name: {"dims": list(s.dims), "dtype": s.dtype} for s in shape.arrays()},
        "packages": package_versions(),
        "host": host_info(),
        "parent": None,
        "timings": {},
        "n_prompts": len(prompts),
    }
