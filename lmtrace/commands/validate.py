"""`lmtrace validate`: check a spec, resolve it, estimate the archive size. Loads no weights.

`preflight` runs the same checks for `lmtrace generate` before it loads a model, so a bad layer
index, prompt file or runs directory fails in a second instead of after a (long) model load.
Everything heavy (torch, transformers) is imported only once the spec itself is known to be valid.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..exits.errors import ModelLoadError, SpecError
from ..spec.prompts import load_prompts
from ..archive.runs import human_bytes, runs_root
from ..runner.context_length import check_context, model_positions
from ..spec.run_spec import ModelSpec, RunSpec, load_spec, resolve_layers, resolve_vector_layers

# GGUF metadata value types (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_metadata(path: Path) -> dict | None:
    """The scalar key/values of a GGUF header (arrays such as the vocabulary are skipped).

    transformers' GGUF config loader parses the whole tokenizer and tensor table (seconds); this
    reads only what the size estimate needs. None when the file is not a little-endian GGUF v2+.
    """

    def read(fh, fmt):
        size = struct.calcsize(fmt)
        raw = fh.read(size)
        if len(raw) != size:
            raise EOFError
        return struct.unpack(fmt, raw)[0]

    def skip_value(fh, vtype):
        if vtype in _GGUF_SCALARS:
            fh.seek(struct.calcsize(_GGUF_SCALARS[vtype]), 1)
        elif vtype == _GGUF_STRING:
            fh.seek(read(fh, "<Q"), 1)
        elif vtype == _GGUF_ARRAY:
            skip_array(fh, read(fh, "<I"), read(fh, "<Q"))
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")

    def skip_array(fh, etype: int, count: int) -> None:
        if etype in _GGUF_SCALARS:
            fh.seek(struct.calcsize(_GGUF_SCALARS[etype]) * count, 1)
        else:
            for _ in range(count):
                skip_value(fh, etype)

    try:
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF" or read(fh, "<I") not in (2, 3):
                return None
            read(fh, "<Q")  # tensor count
            n_kv = read(fh, "<Q")
            out = {}
            for _ in range(n_kv):
                key = fh.read(read(fh, "<Q")).decode("utf-8", "replace")
                vtype = read(fh, "<I")
                if vtype in _GGUF_SCALARS:
                    out[key] = read(fh, _GGUF_SCALARS[vtype])
                elif vtype == _GGUF_STRING:
                    out[key] = fh.read(read(fh, "<Q")).decode("utf-8", "replace")
                elif vtype == _GGUF_ARRAY:  # skipped, but its length kept (the vocabulary's size)
                    etype, count = read(fh, "<I"), read(fh, "<Q")
                    out[f"{key}#len"] = count
                    skip_array(fh, etype, count)
                else:
                    skip_value(fh, vtype)
            return out
    except (OSError, EOFError, ValueError, struct.error):
        return None


def _gguf_config(path: Path) -> dict | None:
    """config.json-style sizes from a GGUF header, or None when the header does not say."""
    meta = _gguf_metadata(path)
    if not meta or "general.architecture" not in meta:
        return None
    arch = meta["general.architecture"]
    get = lambda key: meta.get(f"{arch}.{key}")  # noqa: E731
    cfg = {"num_hidden_layers": get("block_count"), "num_attention_heads": get("attention.head_count"),
           "hidden_size": get("embedding_length"), "num_key_value_heads": get("attention.head_count_kv"),
           "intermediate_size": get("feed_forward_length"), "head_dim": get("attention.key_length"),
           "max_position_embeddings": get("context_length"),
           "vocab_size": get("vocab_size") or meta.get("tokenizer.ggml.tokens#len")}
    if not (cfg["num_hidden_layers"] and cfg["num_attention_heads"] and cfg["hidden_size"]):
        return None
    return {k: v for k, v in cfg.items() if v is not None}


def classify_model(model: ModelSpec) -> tuple[str, str]:
    """(kind, source) as `models.locate` gives them, without hashing the weights.

    The plain cases are recognised here; every other case is handed to `locate`, which raises the
    canonical error for it (before any hashing) or, should the rules ever differ, decides itself.
    """
    ref = model.ref
    if ref.startswith("embedded:"):
        from ..runner.models import _embedded_gguf

        return "embedded", str(_embedded_gguf(ref.split(":", 1)[1]))
    path = Path(ref).expanduser()
    if ref.endswith(".gguf"):
        if path.is_file():
            return "gguf", str(path)
    elif path.is_dir():
        if (path / "config.json").is_file():
            return "local", str(path.resolve())
    elif not path.exists() and not ref.startswith((".", "/", "~")):
        return "hub", ref
    from ..runner.models import locate

    kind, source, _, _ = locate(model)
    return kind, source


def _hub_config(model: ModelSpec) -> dict:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model.ref)
    except HFValidationError:
        raise SpecError(f"model.ref: {model.ref!r} is neither an existing path nor a valid hub id (org/name); "
                        f"give embedded:NAME, a .gguf file, a checkpoint directory or a hub id") from None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model.ref, local_files_only=True, revision=model.revision,
                                          trust_remote_code=model.trust_remote_code).to_dict()
    except OSError:
        raise ModelLoadError(
            f"model {model.ref!r} is not a local path and not in the local Hugging Face cache (lmtrace never "
            f"downloads); download it first (`hf download {model.ref}`) or give a local directory or .gguf file"
        ) from None
    except ValueError as err:
        raise ModelLoadError(f"cannot load the config of model {model.ref}: {str(err).splitlines()[0]}") from None


def model_config(model: ModelSpec) -> tuple[str, str, dict | None]:
    """(kind, source, config dict or None when only loading the model could tell). Loads no weights."""
    kind, source = classify_model(model)
    if kind in ("embedded", "gguf"):
        cfg = _gguf_config(Path(source))
        if cfg is None:  # an unusual header: let transformers read it (slower, but it knows every arch)
            from transformers import AutoConfig

            try:
                path = Path(source)
                cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
            except Exception as err:  # noqa: BLE001 - any failure here means the file cannot be loaded
                raise ModelLoadError(f"cannot read the GGUF file {source}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    elif kind == "local":
        config = Path(source) / "config.json"
        try:
            cfg = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ModelLoadError(f"cannot load model {model.ref}: {config} is not a readable JSON file ({err})") from None
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"cannot load model {model.ref}: {config} is not a JSON object")
    else:
        cfg = _hub_config(model)
    if cfg is not None:
        cfg = cfg.get("text_config") or cfg
    return kind, source, cfg


def _sizes(cfg: dict) -> tuple[int | None, int | None, int | None]:
    n_layers = cfg["num_hidden_layers"] if "num_hidden_layers" in cfg else cfg.get("n_layer")
    n_heads = cfg.get("num_attention_heads") or cfg.get("n_head")
    d_model = cfg.get("hidden_size") or cfg.get("n_embd")
    return n_layers, n_heads, d_model


def _check_layers(spec: RunSpec, n_layers: int) -> tuple[list[int], list[int]]:
    """The same layer checks `generate` makes once the model is loaded."""
    layers = resolve_layers(spec.capture.layers, n_layers)
    resid_layers = resolve_vector_layers(spec.capture, n_layers)
    return ([] if spec.capture.forward_only else layers), resid_layers


def _check_generation(spec: RunSpec, cfg: dict) -> None:
    """What the config alone can refuse: eos ids outside the vocabulary, max_new_tokens past the
    model's positions (with a prompt of at least one token; `generate` checks the real prompts once
    they are tokenised, before it creates the run)."""
    vocab = cfg.get("vocab_size")
    eos = spec.generation.eos_token_id
    values = eos if isinstance(eos, list) else [eos] if eos is not None else []
    bad = [v for v in values if isinstance(vocab, int) and not 0 <= v < vocab]
    if bad:
        raise SpecError(f"generation.eos_token_id: {bad} outside the vocabulary 0..{vocab - 1} of model {spec.model.ref}")
    check_context([1], spec.generation.max_new_tokens, model_positions(cfg), spec.model.ref, estimated=True)


def preflight(spec: RunSpec, runs_dir_flag: str | None = None) -> None:
    """Checks `generate` can make before loading the model: prompts, runs directory, model, layers,
    eos ids and context length."""
    from ..archive.runs import check_runs_root, runs_root

    load_prompts(spec.prompts)
    check_runs_root(runs_root(runs_dir_flag, spec.output.runs_dir))
    _, _, cfg = model_config(spec.model)
    n_layers = _sizes(cfg)[0] if cfg else None
    if isinstance(n_layers, int) and n_layers > 0:
        _check_layers(spec, n_layers)
    if cfg:
        _check_generation(spec, cfg)


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
    return {"dtype": str(dtype).replace("torch.", ""), "device_map": placement.device_map,
            "devices": placement.summary(), "text": placement.text()}


def validate_spec(path: Path, overrides: list[str]) -> dict:
    spec, _, _ = load_spec(path, overrides)
    prompts = load_prompts(spec.prompts)
    kind, source, cfg = model_config(spec.model)
    n_layers, n_heads, d_model = _sizes(cfg or {})
    if not (n_layers and n_heads and d_model):
        raise SpecError(f"model {spec.model.ref}: cannot read layer/head sizes from its config")
    layers, resid_layers = _check_layers(spec, n_layers)
    _check_generation(spec, cfg)
    from ..archive.layout import RunShape

    # Prompt lengths are estimated from characters (3 per token) so no tokenizer is loaded.
    max_prompt = max(len(p) for p in prompts) // 3 + (32 if spec.prompts.chat else 1)
    cap = spec.capture

    def shape_for(n_steps: int) -> RunShape:
        return RunShape(
            n_sequences=len(prompts), n_steps=n_steps, max_prompt=max_prompt, layers=tuple(layers),
            resid_layers=tuple(resid_layers), n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or d_model // n_heads, d_model=d_model,
            d_ffn=cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * d_model, kv_head_of_head=(),
            k_attn=cap.attention.top_k, k_ffn=cap.ffn.top_k, k_lens=cap.lens.top_k,
            attention=cap.attention.enabled and bool(layers), prefill_attention=cap.prefill_attention,
            qkv=cap.qkv and bool(layers), ffn=cap.ffn.enabled and bool(layers),
            lens=cap.lens_inline and bool(layers), float_dtype=spec.output.float_dtype,
            resid_dtype=cap.residual.dtype, head_dla=cap.head_dla and bool(layers),
        )

    table_bytes_per_token = 120 + 12 * cap.alternatives + (40 * len(layers))
    # per run: vocab.parquet (~7.5 bytes a token id, measured 369 KB for SmolLM2's 49,152) and the
    # arrays' metadata and coordinates (~4 KB each)
    fixed = int(7.5 * (cfg.get("vocab_size") or 0)) + 4096 * (len(shape_for(1).arrays()) + 16)

    def size(shape: RunShape) -> tuple[int, int, int]:
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
    summary = (f"{len(prompts)} prompt(s), up to {shape.n_steps} new tokens each, {len(layers)} of {n_layers} layers captured; "
               f"archive at most ~{human_bytes(tensors + tables)} before compression "
               f"({human_bytes(per_step)} of tensors per sequence-step)")
    warnings = []
    if first < spec.generation.max_new_tokens:
        summary += (f"; it grows with the tokens actually generated: ~{human_bytes(first_tensors + first_tables)} "
                    f"if every prompt stops after {first} new tokens (at an eos token or a stop string), "
                    f"the maximum only if every prompt runs to max_new_tokens={shape.n_steps}")
    free = _free_bytes(runs_root(None, spec.output.runs_dir))
    if free is not None and tensors + tables > free:
        warnings.append(f"if every prompt runs to max_new_tokens={shape.n_steps}, the archive (~{human_bytes(tensors + tables)}) "
                        f"exceeds the {human_bytes(free)} free under the runs directory: the run would fail for lack of "
                        f"space; capture less (capture.preset: light, capture.attention.top_k, capture.layers) or lower "
                        f"generation.max_new_tokens, unless an eos token or a stop string ends it sooner")
    budget = auto_budget_note(spec)
    if budget is not None:
        summary += f"; {budget['text']}"
    placement = planned_placement(spec.model)
    return {
        "resolved": spec.model_dump(mode="json"),
        "placement": placement,
        "model": {"kind": kind, "source": source, "layers": n_layers, "heads": n_heads, "d_model": d_model},
        "prompts": len(prompts),
        "estimate": {"bytes_per_sequence_step": per_step, "tensor_bytes_max": tensors, "table_bytes_max": tables,
                     f"bytes_first_{first}_steps": first_tensors + first_tables},
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
    ram = (f"{AUTO_SHARE_RAM:.0%} of the RAM available once the model is loaded"
           + (f" ({human_bytes(free)} available now, before the model is loaded)" if free is not None else ""))
    cuda = f"{AUTO_SHARE_CUDA:.0%} of the free memory of the GPUs it runs on"
    where = ram if spec.model.device == "cpu" else f"on CUDA {cuda}, on the CPU {ram}"
    return {"from": "auto", "share_ram": AUTO_SHARE_RAM, "share_cuda": AUTO_SHARE_CUDA, "ram_available_bytes": free,
            "text": f"batch_size: auto sizes the batches to {where}; generation.memory_budget (--memory-budget) "
                    f"sets another"}
