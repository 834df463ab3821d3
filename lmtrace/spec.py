"""The run spec: schema, YAML loading, `--set key=value` overrides, readable errors.

Pydantic does the validation (types, ranges, unknown keys) because it reports *where* a value is
wrong (`generation.top_k`) and why, which is exactly what a one-line error needs; hand-written
checks would drift from the schema.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import SpecError

DEFAULT_MODEL = "embedded:smollm2-135m"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(_Strict):
    ref: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    revision: str | None = None
    trust_remote_code: bool = False

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        ok = v in ("auto", "cpu", "cuda", "mps") or (v.startswith("cuda:") and v[5:].isdigit())
        if not ok:
            raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps (got {v!r})")
        return v


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
    batch_size: int = Field(8, ge=1, le=4096)


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


class LensCapture(_Strict):
    enabled: bool = True
    top_k: int = Field(5, ge=2)
    dtype: Literal["float32", "bfloat16"] = "float32"


class CaptureSpec(_Strict):
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

    @property
    def forward_only(self) -> bool:
        return not (
            self.attention.enabled or self.prefill_attention or self.qkv or self.ffn.enabled
            or self.component_norms or self.lens.enabled or self.residual.vectors_at
            or self.margin_contributions
        )


def forward_only_capture() -> CaptureSpec:
    return CaptureSpec(
        attention=AttentionCapture(enabled=False), qkv=False, ffn=FfnCapture(enabled=False),
        component_norms=False, lens=LensCapture(enabled=False), margin_contributions=False,
    )


class OutputSpec(_Strict):
    runs_dir: str | None = None
    run_id: str | None = None
    chunk_steps: int = Field(16, ge=1, le=4096)
    codec: Literal["zstd", "blosc", "none"] = "zstd"
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
        if data.get("capture") == "none":
            data["capture"] = forward_only_capture().model_dump()
        return data


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(f"{source}: malformed YAML{where}: {problem}") from None


def apply_override(data: dict, assignment: str) -> dict:
    """Apply one `dotted.key=value` override; the value is parsed as YAML (`3`, `true`, `[1,2]`)."""
    if "=" not in assignment:
        raise SpecError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set generation.seed=3")
    key, raw = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise SpecError(f"--set {assignment!r}: empty key")
    value = _parse_yaml(raw, f"--set {key}")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if isinstance(child, str) and part == "model":  # expand the `model: ref` shorthand
            child = {"ref": child}
        if isinstance(child, list) and part == "prompts":
            child = {"texts": child}
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise SpecError(f"--set {key}: {part!r} is not a section")
        node[part] = child
        node = child
    node[parts[-1]] = value
    return data


def format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("function-", "literal[")))
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key (check the spelling; see `lmtrace validate --help` and docs/spec.md)"
    elif first["type"] == "missing":
        msg = "required key is missing"
    got = first.get("input")
    shown = "" if first["type"] in ("extra_forbidden", "missing") or isinstance(got, (dict, list)) else f" (got {got!r})"
    more = f" [+{len(err.errors()) - 1} more]" if len(err.errors()) > 1 else ""
    where = f"{loc}: " if loc else ""
    return f"{source}: {where}{msg}{shown}{more}"


def build_spec(data: Any, source: str) -> RunSpec:
    if data is None:
        raise SpecError(f"{source}: the spec is empty; it needs at least a `prompts:` section")
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the spec must be a YAML mapping (key: value), got {type(data).__name__}")
    try:
        return RunSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, source)) from None


def load_spec(path: str | Path, overrides: list[str] = ()) -> tuple[RunSpec, str, dict]:
    """Read and validate a spec file. Returns (spec, text as given, data after overrides)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"{path}: spec file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"{path}: cannot read spec ({err.__class__.__name__}: {err})") from None
    data = _parse_yaml(text, str(path))
    data = copy.deepcopy(data) if data is not None else data
    for assignment in overrides:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            break
        data = apply_override(data, assignment)
    spec = build_spec(data, str(path))
    # Resolve a relative prompt file against the spec's own directory so specs are portable.
    if spec.prompts.file is not None and not Path(spec.prompts.file).is_absolute():
        spec.prompts.file = str((path.parent / spec.prompts.file).resolve())
    return spec, text, data


def resolve_layers(layers: Literal["all"] | list[int] | LayerStride, n_layers: int) -> list[int]:
    """Turn `capture.layers` into a sorted list of layer indices, checked against the model."""
    if layers == "all":
        return list(range(n_layers))
    if isinstance(layers, LayerStride):
        if layers.start >= n_layers:
            raise SpecError(f"capture.layers.start={layers.start} is out of range: the model has layers 0..{n_layers - 1}")
        return list(range(layers.start, n_layers, layers.stride))
    bad = [i for i in layers if not -n_layers <= i < n_layers]
    if bad:
        raise SpecError(f"capture.layers: {bad} out of range: the model has layers 0..{n_layers - 1}")
    if not layers:
        raise SpecError("capture.layers is empty: use `all`, a list of layer indices or {stride: N}")
    return sorted({i % n_layers for i in layers})


def resolve_vector_layers(spec: CaptureSpec, n_layers: int) -> list[int]:
    v = spec.residual.vectors_at
    if v == "all":
        return list(range(n_layers))
    bad = [i for i in v if not -n_layers <= i < n_layers]
    if bad:
        raise SpecError(f"capture.residual.vectors_at: {bad} out of range: the model has layers 0..{n_layers - 1}")
    return sorted({i % n_layers for i in v})
