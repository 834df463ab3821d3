"""The run spec's schema: one pydantic model per section (model, prompts, generation, capture,
output) and `RunSpec` holding them, with the capture presets.

Pydantic does the validation (types, ranges, unknown keys) because it reports *where* a value is
wrong (`generation.top_k`) and why, which is exactly what a one-line error needs; hand-written
checks would drift from the schema. Loading a file and `--set` overrides are in `run_spec`, the
wording of a validation error in `validation_errors`.
"""

from __future__ import annotations

import copy
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .devices import DEVICE_MAP_PLANNERS, DEVICES, is_device, memory_bytes, placement_device

DEFAULT_MODEL = "embedded:smollm2-135m"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        """An empty section (`generation:` with every line under it commented out) means its defaults."""
        if isinstance(data, dict) and any(v is None for v in data.values()):
            data = {
                k: v
                for k, v in data.items()
                if not (
                    v is None
                    and k in cls.model_fields
                    and section_class(cls.model_fields[k].annotation)
                    and k != "capture"
                )
            }
        return data


def section_class(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside a field annotation (`X`, `X | None`, `Literal[..] | list | X`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = section_class(arg)
        if found is not None:
            return found
    return None


class ModelSpec(_Strict):
    ref: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    revision: str | None = None
    trust_remote_code: bool = False

    # Placement over several devices (docs/devices.md): accelerate's planner (auto | balanced |
    # sequential) or an explicit {module: device} map, optional per-device memory caps, and the
    # folder for weights offloaded to disk. `device` (other than its default, auto) is the
    # single-device alternative.
    device_map: Any = None
    max_memory: Any = None
    offload_folder: str | None = None
    tf32: bool = False  # TensorFloat-32 matrix products on CUDA: faster, ~1e-3 relative error

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not is_device(v):
            raise ValueError(f"device must be {DEVICES} (got {v!r})")
        return v

    @field_validator("device_map", mode="before")
    @classmethod
    def _device_map(cls, v: Any) -> Any:
        if v is None or v in DEVICE_MAP_PLANNERS:
            return v
        if isinstance(v, dict):
            if not v:
                raise ValueError("an explicit map needs at least one `module: device` entry")
            out = {}
            for module, device in v.items():
                if not isinstance(module, str):
                    raise ValueError(f"module names are strings such as model.layers.0 (got {module!r})")
                out[module] = placement_device(device, f"device of {module or '(whole model)'!r}", disk=True)
            return out
        raise ValueError(f"expected {', '.join(DEVICE_MAP_PLANNERS)} or a mapping {{module: device}} (got {v!r})")

    @field_validator("max_memory", mode="before")
    @classmethod
    def _max_memory(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, dict) or not v:
            raise ValueError(f"expected a mapping {{device: size}}, e.g. {{cuda:0: 20GiB, cpu: 64GiB}} (got {v!r})")
        out = {}
        for device, size in v.items():
            name = placement_device(device, f"device {device!r}", disk=False)
            if not isinstance(size, int) or isinstance(size, bool):
                if not isinstance(size, str) or memory_bytes(size) is None:
                    raise ValueError(
                        f"{name}: expected a size such as 20GiB, 512MB or a number of bytes (got {size!r})"
                    )
            elif size <= 0:
                raise ValueError(f"{name}: the size must be positive (got {size})")
            out[name] = size
        return out

    @model_validator(mode="after")
    def _placement(self) -> "ModelSpec":
        if self.device_map is not None and self.device != "auto":
            raise ValueError(
                f"model.device ({self.device}) and model.device_map are exclusive: give device for one "
                f"device, device_map to spread the model over several"
            )
        if self.device_map is None:
            for key in ("max_memory", "offload_folder"):
                if getattr(self, key) is not None:
                    raise ValueError(f"model.{key} needs model.device_map (auto, balanced, sequential or a map)")
        elif isinstance(self.device_map, dict):
            if self.max_memory is not None:
                raise ValueError(
                    "model.max_memory applies to device_map auto, balanced or sequential; an explicit "
                    "{module: device} map places every module itself"
                )
            if "disk" in self.device_map.values() and not self.offload_folder:
                raise ValueError(
                    "model.device_map puts modules on disk: give model.offload_folder (a directory "
                    "for the offloaded weights)"
                )
        return self


class PromptsSpec(_Strict):
    texts: list[str] | None = None
    file: str | None = None
    column: str | None = None
    chat: bool = False
    system: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "PromptsSpec":
        if (self.texts is None) == (self.file is None):
            raise ValueError("give either prompts.texts (an inline list) or prompts.file, not both or neither")
        if self.texts is not None and len(self.texts) == 0:
            raise ValueError("prompts.texts is empty: give at least one prompt")
        if self.system is not None and not self.chat:
            raise ValueError("prompts.system needs prompts.chat: true")
        return self


class GenerationSpec(_Strict):
    max_new_tokens: int = Field(32, ge=1, le=1_000_000)
    temperature: float = Field(0.0, ge=0.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k filtering")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = Field(0, ge=0, lt=2**63)
    eos_token_id: int | list[int] | None = None
    stop: list[str] = Field(default_factory=list)
    batch_size: int | Literal["auto"] = Field(
        8,
        description="prompts run together, or auto: sized to memory_budget "
        "(without one, to a share of the memory free once the "
        "model is loaded)",
    )
    memory_budget: str | int | None = Field(
        None, description="memory the batches may take beyond the model, e.g. 8GiB (docs/batch.md, auto batching)"
    )

    @field_validator("batch_size", mode="before")
    @classmethod
    def _batch_size(cls, v: Any) -> Any:
        if isinstance(v, str) and v != "auto":
            raise ValueError(f"expected a number of prompts (1-4096) or auto (got {v!r})")
        if isinstance(v, int) and not isinstance(v, bool) and not 1 <= v <= 4096:
            raise ValueError(f"expected 1-4096 prompts, or auto (got {v})")
        return v

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _memory_budget(cls, v: Any) -> Any:
        if v is None:
            return v
        size = memory_bytes(v) if isinstance(v, (str, int)) and not isinstance(v, bool) else None
        if size is None or size <= 0:
            raise ValueError(f"expected a size such as 8GiB, 512MB or a number of bytes (got {v!r})")
        return v

    @property
    def budget_bytes(self) -> int | None:
        return None if self.memory_budget is None else memory_bytes(self.memory_budget)


class LayerStride(_Strict):
    stride: int = Field(ge=1)
    start: int = Field(0, ge=0)


class AttentionCapture(_Strict):
    enabled: bool = True
    top_k: int | None = Field(None, ge=1, description="null keeps full rows")


class FfnCapture(_Strict):
    enabled: bool = True
    top_k: int = Field(32, ge=1)


class ResidualCapture(_Strict):
    vectors_at: list[int] | Literal["all"] = Field(default_factory=list)
    # storage dtype of the `resid` array (these vectors and the deferred lens's input): float16 halves
    # the largest array of the default capture; its measured lens error is in docs/archive.md
    dtype: Literal["float32", "float16"] = "float16"


class LensCapture(_Strict):
    enabled: bool = True
    top_k: int = Field(5, ge=2)
    # deferred: generation archives every captured layer's residual (float32, `resid`) and
    # `lmtrace lens RUN` computes the lens from it later, exactly as inline would; inline: per step
    # during generation (~20 ms a step on a 2-core CPU, see docs/archive.md "Cost").
    when: Literal["deferred", "inline"] = "deferred"
    dtype: Literal["float32", "bfloat16"] = (
        "float32"  # bfloat16: ranking in bfloat16, top re-scored in float32 (lmtrace.capture.lens)
    )


class FeatureCapture(_Strict):
    """One SAE applied during generation (docs/features.md): its directory (SAELens format), how
    many of each token's active latents are archived, and whether the prompt's positions are too."""

    sae: str = Field(min_length=1, description="an SAE directory: cfg.json + sae_weights.safetensors")
    top_k: int = Field(32, ge=1, le=4096)
    prompt: bool = False


# What each `capture.preset` sets; keys given in the spec override it (docs/spec.md, "Capture presets").
CAPTURE_PRESETS: dict[str, dict] = {
    # tokens, alternatives, per-layer norms and margin contributions, the 8 strongest keys of each
    # attention row; no vectors, no lens
    "light": {
        "attention": {"top_k": 8},
        "qkv": False,
        "ffn": {"enabled": False},
        "lens": {"enabled": False},
        "residual": {"dtype": "float16"},
    },
    # full attention rows, FFN top-k, the deferred lens from float16 residuals; no q/k/v
    "standard": {"qkv": False, "residual": {"dtype": "float16"}},
    # everything, residuals in float32 (the deferred lens then equals the inline one bit for bit)
    "full": {"qkv": True, "residual": {"dtype": "float32"}},
}


def _under(defaults: dict, given: dict) -> dict:
    """`given` with `defaults` filled in wherever it does not say otherwise (nested mappings merged)."""
    out = dict(given)
    for key, value in defaults.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _under(value, out[key])
        elif key not in out:
            out[key] = copy.deepcopy(value)
    return out


class CaptureSpec(_Strict):
    preset: Literal["light", "standard", "full"] = "standard"
    layers: Literal["all"] | list[int] | LayerStride = "all"
    attention: AttentionCapture = Field(default_factory=AttentionCapture)
    prefill_attention: bool = False
    qkv: bool = True
    ffn: FfnCapture = Field(default_factory=FfnCapture)
    residual: ResidualCapture = Field(default_factory=ResidualCapture)
    component_norms: bool = True
    lens: LensCapture = Field(default_factory=LensCapture)
    alternatives: int = Field(10, ge=2, le=1000)
    margin_contributions: bool = True
    # per-head direct logit attribution with the final norm frozen (lmtrace/capture/dla.py)
    head_dla: bool = False
    # sparse autoencoders applied at their hook in the same forward: each token's top-k latents
    # archived as feat_<name>_idx / _val (lmtrace/capture/feature_probe.py)
    features: list[FeatureCapture] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        """The preset's values for every capture key the spec does not give."""
        if not isinstance(data, dict):
            return data
        preset = CAPTURE_PRESETS.get(data.get("preset", "standard"))
        return data if preset is None else _under(preset, data)  # an unknown preset: the field's own error

    @property
    def lens_inline(self) -> bool:
        return self.lens.enabled and self.lens.when == "inline" and not self.forward_only

    @property
    def lens_deferred(self) -> bool:
        return self.lens.enabled and self.lens.when == "deferred" and not self.forward_only

    @property
    def forward_only(self) -> bool:
        return not (
            self.attention.enabled
            or self.prefill_attention
            or self.qkv
            or self.ffn.enabled
            or self.component_norms
            or self.lens.enabled
            or self.residual.vectors_at
            or self.margin_contributions
            or self.head_dla
            or self.features
        )


def forward_only_capture() -> CaptureSpec:
    return CaptureSpec(
        attention=AttentionCapture(enabled=False),
        qkv=False,
        ffn=FfnCapture(enabled=False),
        component_norms=False,
        lens=LensCapture(enabled=False),
        margin_contributions=False,
        head_dla=False,
    )


class OutputSpec(_Strict):
    runs_dir: str | None = None
    run_id: str | None = None
    chunk_steps: int = Field(16, ge=1, le=4096)
    # attention rows are also chunked along their keys: a block writes only the key chunks its
    # context reaches, the rest of the padded row is never written (docs/archive.md)
    chunk_keys: int = Field(64, ge=1, le=1 << 20)
    # sequences per shard file: a file holds this many sequences × one block of steps of an array
    # (Zarr sharding, inner chunks of one sequence), so files grow with bytes, not sequences
    chunk_sequences: int = Field(32, ge=1, le=1 << 20)
    # auto: zstd for arrays that compress, none for dense float activations (archive/layout.py)
    codec: Literal["auto", "zstd", "blosc", "none"] = "auto"
    level: int = Field(1, ge=0, le=22)
    float_dtype: Literal["float16", "float32"] = "float16"

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        if v is not None and (not v or "/" in v or v.startswith(".") or not v.isprintable()):
            raise ValueError(f"run_id must be a plain name without '/' or a leading '.' (got {v!r})")
        return v


class RunSpec(_Strict):
    model: ModelSpec = Field(default_factory=ModelSpec)
    prompts: PromptsSpec
    generation: GenerationSpec = Field(default_factory=GenerationSpec)
    capture: CaptureSpec = Field(default_factory=CaptureSpec)
    output: OutputSpec = Field(default_factory=OutputSpec)

    @model_validator(mode="before")
    @classmethod
    def _shorthands(cls, data: Any) -> Any:
        """`model: <ref>`, `prompts: [..]` and `capture: none` are accepted as shorthands."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("model"), str):
            data["model"] = {"ref": data["model"]}
        if isinstance(data.get("prompts"), list):
            data["prompts"] = {"texts": data["prompts"]}
        capture = data.get("capture")
        if isinstance(capture, str) and capture.strip().lower() == "none":
            data["capture"] = forward_only_capture().model_dump()
        elif "capture" in data and capture is None:
            raise ValueError(
                "capture is empty: remove the key for the default capture, "
                "or write `capture: none` to capture nothing (forward only)"
            )
        return data

    @model_validator(mode="after")
    def _dla_on_one_device(self) -> "RunSpec":
        # direct logit attribution reads o_proj and unembedding weights itself, which a model spread
        # by device_map may hold offloaded (placeholders): not supported together yet
        if self.capture.head_dla and self.model.device_map is not None:
            raise ValueError(
                "capture.head_dla with model.device_map is not supported yet: capture direct logit "
                "attribution with the model on one device (model.device)"
            )
        return self
