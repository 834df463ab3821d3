"""`lmtrace validate`: check a spec, resolve it, estimate the archive size. Loads no weights.

It makes the checks `lmtrace generate` makes before loading a model (runner/model_config.py,
`preflight`) and reads the model's sizes from its config the same way. Everything heavy (torch,
transformers) is imported only once the spec itself is known to be valid.
"""

from __future__ import annotations

from pathlib import Path

from ..archive.runs import human_bytes, runs_root
from ..exits.errors import SpecError
from ..runner.model_config import check_generation, check_layers, model_config, model_sizes
from ..spec.prompts import load_prompts
from ..spec.run_spec import ModelSpec, RunSpec, load_spec


def _free_bytes(root: Path) -> int | None:
    """Free bytes on the file system that holds (or will hold) `root`; None if unknown."""
    import shutil

    existing = root.absolute()
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free
    except OSError:
        return None


def planned_placement(model: ModelSpec) -> dict | None:
    """For `model.device_map`: the planned placement (which modules on which device, the bytes of
    their weights), planned by accelerate on an empty-weights model built from the config; None
    for a model on one device."""
    if model.device_map is None:
        return None
    from ..runner.models import load_config
    from ..runner.placement import plan, planning_dtype

    dtype = planning_dtype(model)
    placement = plan(model, load_config(model), dtype)
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "device_map": placement.device_map,
        "devices": placement.summary(),
        "text": placement.text(),
    }


def _run_shape(spec: RunSpec, cfg: dict, n_prompts: int, max_prompt: int, layers, resid_layers, sizes, n_steps: int):
    """The `RunShape` a run of `spec` would have with `n_steps` new tokens per prompt, from the model's
    config (`sizes` = (n_heads, d_model))."""
    from ..archive.layout import FeatureShape, RunShape

    n_heads, d_model = sizes
    cap = spec.capture
    return RunShape(
        n_sequences=n_prompts,
        n_steps=n_steps,
        max_prompt=max_prompt,
        layers=tuple(layers),
        resid_layers=tuple(resid_layers),
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or d_model // n_heads,
        d_model=d_model,
        d_ffn=cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * d_model,
        kv_head_of_head=(),
        k_attn=cap.attention.top_k,
        k_ffn=cap.ffn.top_k,
        k_lens=cap.lens.top_k,
        attention=cap.attention.enabled and bool(layers),
        prefill_attention=cap.prefill_attention,
        qkv=cap.qkv and bool(layers),
        ffn=cap.ffn.enabled and bool(layers),
        lens=cap.lens_inline and bool(layers),
        float_dtype=spec.output.float_dtype,
        resid_dtype=cap.residual.dtype,
        head_dla=cap.head_dla and bool(layers),
        # capture.features: the arrays' sizes need only top_k (the SAEs are read by generate)
        features=tuple(FeatureShape(f"sae{i}", f.top_k, f.prompt) for i, f in enumerate(cap.features)),
    )


def _space_warnings(spec: RunSpec, n_steps: int, total: int) -> list[str]:
    """A warning when the largest archive (`total` bytes) exceeds the free space under the runs directory."""
    warnings = []
    free = _free_bytes(runs_root(None, spec.output.runs_dir))
    if free is not None and total > free:
        warnings.append(
            f"if every prompt runs to max_new_tokens={n_steps}, the archive (~{human_bytes(total)}) "
            f"exceeds the {human_bytes(free)} free under the runs directory: the run would fail for lack of "
            f"space; capture less (capture.preset: light, capture.attention.top_k, capture.layers) or lower "
            f"generation.max_new_tokens, unless an eos token or a stop string ends it sooner"
        )
    return warnings


def validate_spec(path: Path, overrides: list[str]) -> dict:
    """Check and resolve the spec at `path` (with `overrides`), read the model's sizes from its config,
    and estimate the archive's size: what `lmtrace validate` reports."""
    spec, _, _ = load_spec(path, overrides)
    prompts = load_prompts(spec.prompts)
    kind, source, cfg = model_config(spec.model)
    n_layers, n_heads, d_model = model_sizes(cfg or {})
    if not (n_layers and n_heads and d_model):
        raise SpecError(f"model {spec.model.ref}: cannot read layer/head sizes from its config")
    layers, resid_layers = check_layers(spec, n_layers)
    check_generation(spec, cfg)

    # Prompt lengths are estimated from characters (3 per token) so no tokenizer is loaded.
    max_prompt = max(len(p) for p in prompts) // 3 + (32 if spec.prompts.chat else 1)
    cap = spec.capture

    def shape_for(n_steps: int):
        return _run_shape(spec, cfg, len(prompts), max_prompt, layers, resid_layers, (n_heads, d_model), n_steps)

    table_bytes_per_token = 120 + 12 * cap.alternatives + (40 * len(layers))
    # per run: vocab.parquet (~7.5 bytes a token id, measured 369 KB for SmolLM2's 49,152) and the
    # arrays' metadata and coordinates (~4 KB each)
    fixed = int(7.5 * (cfg.get("vocab_size") or 0)) + 4096 * (len(shape_for(1).arrays()) + 16)

    def size(shape) -> tuple[int, int, int]:
        per_step = shape.estimate_bytes_per_step(spec.output.chunk_steps, spec.output.chunk_keys)
        tensors = per_step * shape.n_sequences * shape.n_steps
        tables = table_bytes_per_token * shape.n_sequences * (shape.n_steps + max_prompt) + fixed
        return per_step, tensors, tables

    shape = shape_for(spec.generation.max_new_tokens)
    per_step, tensors, tables = size(shape)
    # The archive (and memory) grow with the tokens actually generated: a run that stops at an eos
    # token or a stop string after a few hundred tokens writes a tiny part of the maximum. Say both.
    first = min(spec.generation.max_new_tokens, 1000)
    _, first_tensors, first_tables = size(shape_for(first))
    summary = (
        f"{len(prompts)} prompt(s), up to {shape.n_steps} new tokens each, {len(layers)} of {n_layers} layers captured; "
        f"archive at most ~{human_bytes(tensors + tables)} before compression "
        f"({human_bytes(per_step)} of tensors per sequence-step)"
    )
    if first < spec.generation.max_new_tokens:
        summary += (
            f"; it grows with the tokens actually generated: ~{human_bytes(first_tensors + first_tables)} "
            f"if every prompt stops after {first} new tokens (at an eos token or a stop string), "
            f"the maximum only if every prompt runs to max_new_tokens={shape.n_steps}"
        )
    warnings = _space_warnings(spec, shape.n_steps, tensors + tables)
    budget = auto_budget_note(spec)
    if budget is not None:
        summary += f"; {budget['text']}"
    placement = planned_placement(spec.model)
    return {
        "resolved": spec.model_dump(mode="json"),
        "placement": placement,
        "model": {"kind": kind, "source": source, "layers": n_layers, "heads": n_heads, "d_model": d_model},
        "prompts": len(prompts),
        "estimate": {
            "bytes_per_sequence_step": per_step,
            "tensor_bytes_max": tensors,
            "table_bytes_max": tables,
            f"bytes_first_{first}_steps": first_tensors + first_tables,
        },
        "summary": summary,
        "memory_budget": budget,
        "warnings": warnings,
    }


def auto_budget_note(spec: RunSpec) -> dict | None:
    """What `batch_size: auto` without `generation.memory_budget` will choose (batching.memory_budget):
    the share of the memory free once the model is loaded, with what that share of the RAM available
    now comes to (the model is not loaded here, so a run's own figure is lower by the model's size)."""
    from ..runner.batching import AUTO_SHARE_CUDA, AUTO_SHARE_RAM, available_ram

    g = spec.generation
    if g.batch_size != "auto" or g.memory_budget is not None:
        return None
    free = available_ram()
    ram = f"{AUTO_SHARE_RAM:.0%} of the RAM available once the model is loaded" + (
        f" ({human_bytes(free)} available now, before the model is loaded)" if free is not None else ""
    )
    cuda = f"{AUTO_SHARE_CUDA:.0%} of the free memory of the GPUs it runs on"
    where = ram if spec.model.device == "cpu" else f"on CUDA {cuda}, on the CPU {ram}"
    return {
        "from": "auto",
        "share_ram": AUTO_SHARE_RAM,
        "share_cuda": AUTO_SHARE_CUDA,
        "ram_available_bytes": free,
        "text": f"batch_size: auto sizes the batches to {where}; generation.memory_budget (--memory-budget) "
        f"sets another",
    }
