"""`lmtrace validate`: check a spec, resolve it, estimate the archive size. Loads no weights."""

from __future__ import annotations

import json
from pathlib import Path

from .archive.layout import RunShape
from .errors import ModelLoadError, SpecError
from .models import cache_dir, locate
from .prompts import load_prompts
from .spec import load_spec, resolve_layers, resolve_vector_layers


def _model_config(kind: str, source: str, sha: str | None) -> dict | None:
    """The model's config.json without loading weights (None when only a GGUF header could tell)."""
    if kind in ("embedded", "gguf"):
        cached = cache_dir() / "models" / f"gguf-{(sha or '')[:24]}" / "config.json"
        if cached.is_file():
            return json.loads(cached.read_text())
        from transformers import AutoConfig

        path = Path(source)
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    if kind == "local":
        return json.loads((Path(source) / "config.json").read_text())
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(source, local_files_only=True).to_dict()
    except OSError:
        raise ModelLoadError(f"model {source!r} is not in the local Hugging Face cache (lmtrace never downloads)") from None


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PB"


def validate_spec(path: Path, overrides: list[str]) -> dict:
    spec, _, _ = load_spec(path, overrides)
    prompts = load_prompts(spec.prompts)
    kind, source, sha, _ = locate(spec.model)
    cfg = _model_config(kind, source, sha)
    cfg = cfg.get("text_config", cfg) or cfg
    n_layers = cfg["num_hidden_layers"] if "num_hidden_layers" in cfg else cfg.get("n_layer")
    n_heads = cfg.get("num_attention_heads") or cfg.get("n_head")
    d_model = cfg.get("hidden_size") or cfg.get("n_embd")
    if not (n_layers and n_heads and d_model):
        raise SpecError(f"model {spec.model.ref}: cannot read layer/head sizes from its config")
    layers = resolve_layers(spec.capture.layers, n_layers) if not spec.capture.forward_only else []
    resid_layers = resolve_vector_layers(spec.capture, n_layers)
    # Prompt lengths are estimated from characters (3 per token) so no tokenizer is loaded.
    max_prompt = max(len(p) for p in prompts) // 3 + (32 if spec.prompts.chat else 1)
    cap = spec.capture
    shape = RunShape(
        n_sequences=len(prompts), n_steps=spec.generation.max_new_tokens, max_prompt=max_prompt, layers=tuple(layers),
        resid_layers=tuple(resid_layers), n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or d_model // n_heads, d_model=d_model,
        d_ffn=cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * d_model, kv_head_of_head=(),
        k_attn=cap.attention.top_k, k_ffn=cap.ffn.top_k, k_lens=cap.lens.top_k, attention=cap.attention.enabled and bool(layers),
        prefill_attention=cap.prefill_attention, qkv=cap.qkv and bool(layers), ffn=cap.ffn.enabled and bool(layers),
        lens=cap.lens.enabled and bool(layers), float_dtype=spec.output.float_dtype,
    )
    per_step = shape.estimate_bytes_per_step()
    table_bytes_per_token = 120 + 12 * cap.alternatives + (40 * len(layers))
    tensors = per_step * shape.n_sequences * shape.n_steps
    tables = table_bytes_per_token * shape.n_sequences * (shape.n_steps + max_prompt)
    summary = (f"{len(prompts)} prompt(s), up to {shape.n_steps} new tokens each, {len(layers)} of {n_layers} layers captured; "
               f"archive at most ~{_human(tensors + tables)} before compression "
               f"({_human(per_step)} of tensors per sequence-step)")
    return {
        "resolved": spec.model_dump(mode="json"),
        "model": {"kind": kind, "source": source, "layers": n_layers, "heads": n_heads, "d_model": d_model},
        "prompts": len(prompts),
        "estimate": {"bytes_per_sequence_step": per_step, "tensor_bytes_max": tensors, "table_bytes_max": tables},
        "summary": summary,
    }
