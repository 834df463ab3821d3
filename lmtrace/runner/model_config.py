"""A model's config read without loading its weights (the GGUF header, a checkpoint's config.json,
the local hub cache), and the checks `lmtrace generate` makes with it before it loads a model:
prompts, runs directory, layers, eos ids and context length (`preflight`), so a bad layer index,
prompt file or runs directory fails in a second instead of after a (long) model load.
Everything heavy (torch, transformers) is imported only where a config needs it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..exits.errors import ModelLoadError, SpecError
from ..spec.prompts import load_prompts
from ..spec.run_spec import ModelSpec, RunSpec, resolve_layers, resolve_vector_layers
from .context_length import check_context, model_positions

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


def gguf_config(path: Path) -> dict | None:
    """config.json-style sizes from a GGUF header, or None when the header does not say."""
    meta = _gguf_metadata(path)
    if not meta or "general.architecture" not in meta:
        return None
    arch = meta["general.architecture"]
    get = lambda key: meta.get(f"{arch}.{key}")  # noqa: E731
    cfg = {
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": get("attention.head_count"),
        "hidden_size": get("embedding_length"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "intermediate_size": get("feed_forward_length"),
        "head_dim": get("attention.key_length"),
        "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size") or meta.get("tokenizer.ggml.tokens#len"),
    }
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
        from .models import embedded_gguf

        return "embedded", str(embedded_gguf(ref.split(":", 1)[1]))
    path = Path(ref).expanduser()
    if ref.endswith(".gguf"):
        if path.is_file():
            return "gguf", str(path)
    elif path.is_dir():
        if (path / "config.json").is_file():
            return "local", str(path.resolve())
    elif not path.exists() and not ref.startswith((".", "/", "~")):
        return "hub", ref
    from .models import locate

    kind, source, _, _ = locate(model)
    return kind, source


def _hub_config(model: ModelSpec) -> dict:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model.ref)
    except HFValidationError:
        raise SpecError(
            f"model.ref: {model.ref!r} is neither an existing path nor a valid hub id (org/name); "
            f"give embedded:NAME, a .gguf file, a checkpoint directory or a hub id"
        ) from None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            model.ref, local_files_only=True, revision=model.revision, trust_remote_code=model.trust_remote_code
        ).to_dict()
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
        cfg = gguf_config(Path(source))
        if cfg is None:  # an unusual header: let transformers read it (slower, but it knows every arch)
            from transformers import AutoConfig

            try:
                path = Path(source)
                cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
            except Exception as err:  # noqa: BLE001 - any failure here means the file cannot be loaded
                raise ModelLoadError(
                    f"cannot read the GGUF file {source}: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
                ) from None
    elif kind == "local":
        config = Path(source) / "config.json"
        try:
            cfg = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ModelLoadError(
                f"cannot load model {model.ref}: {config} is not a readable JSON file ({err})"
            ) from None
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"cannot load model {model.ref}: {config} is not a JSON object")
    else:
        cfg = _hub_config(model)
    if cfg is not None:
        cfg = cfg.get("text_config") or cfg
    return kind, source, cfg


def model_sizes(cfg: dict) -> tuple[int | None, int | None, int | None]:
    n_layers = cfg["num_hidden_layers"] if "num_hidden_layers" in cfg else cfg.get("n_layer")
    n_heads = cfg.get("num_attention_heads") or cfg.get("n_head")
    d_model = cfg.get("hidden_size") or cfg.get("n_embd")
    return n_layers, n_heads, d_model


def check_layers(spec: RunSpec, n_layers: int) -> tuple[list[int], list[int]]:
    """The same layer checks `generate` makes once the model is loaded."""
    layers = resolve_layers(spec.capture.layers, n_layers)
    resid_layers = resolve_vector_layers(spec.capture, n_layers)
    return ([] if spec.capture.forward_only else layers), resid_layers


def check_generation(spec: RunSpec, cfg: dict) -> None:
    """What the config alone can refuse: eos ids outside the vocabulary, max_new_tokens past the
    model's positions (with a prompt of at least one token; `generate` checks the real prompts once
    they are tokenised, before it creates the run)."""
    vocab = cfg.get("vocab_size")
    eos = spec.generation.eos_token_id
    values = eos if isinstance(eos, list) else [eos] if eos is not None else []
    bad = [v for v in values if isinstance(vocab, int) and not 0 <= v < vocab]
    if bad:
        raise SpecError(
            f"generation.eos_token_id: {bad} outside the vocabulary 0..{vocab - 1} of model {spec.model.ref}"
        )
    check_context([1], spec.generation.max_new_tokens, model_positions(cfg), spec.model.ref, estimated=True)


def preflight(spec: RunSpec, runs_dir_flag: str | None = None) -> None:
    """Checks `generate` can make before loading the model: prompts, runs directory, model, layers,
    eos ids and context length."""
    from ..archive.runs import check_runs_root, runs_root

    load_prompts(spec.prompts)
    check_runs_root(runs_root(runs_dir_flag, spec.output.runs_dir))
    _, _, cfg = model_config(spec.model)
    n_layers = model_sizes(cfg)[0] if cfg else None
    if isinstance(n_layers, int) and n_layers > 0:
        check_layers(spec, n_layers)
    if cfg:
        check_generation(spec, cfg)
