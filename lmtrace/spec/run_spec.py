"""The run spec: schema, YAML loading, `--set key=value` overrides, readable errors.

Pydantic does the validation (types, ranges, unknown keys) because it reports *where* a value is
wrong (`generation.top_k`) and why, which is exactly what a one-line error needs; hand-written
checks would drift from the schema.
"""

from __future__ import annotations

import copy
import difflib
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..exits.errors import SpecError

DEFAULT_MODEL = "embedded:smollm2-135m"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        """An empty section (`generation:` with every line under it commented out) means its defaults."""
        if isinstance(data, dict) and any(v is None for v in data.values()):
            data = {k: v for k, v in data.items()
                    if not (v is None and k in cls.model_fields and _section_class(cls.model_fields[k].annotation)
                            and k != "capture")}
        return data


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside a field annotation (`X`, `X | None`, `Literal[..] | list | X`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_class(arg)
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
                    raise ValueError(f"{name}: expected a size such as 20GiB, 512MB or a number of bytes (got {size!r})")
            elif size <= 0:
                raise ValueError(f"{name}: the size must be positive (got {size})")
            out[name] = size
        return out

    @model_validator(mode="after")
    def _placement(self) -> "ModelSpec":
        if self.device_map is not None and self.device != "auto":
            raise ValueError(f"model.device ({self.device}) and model.device_map are exclusive: give device for one "
                             f"device, device_map to spread the model over several")
        if self.device_map is None:
            for key in ("max_memory", "offload_folder"):
                if getattr(self, key) is not None:
                    raise ValueError(f"model.{key} needs model.device_map (auto, balanced, sequential or a map)")
        elif isinstance(self.device_map, dict):
            if self.max_memory is not None:
                raise ValueError("model.max_memory applies to device_map auto, balanced or sequential; an explicit "
                                 "{module: device} map places every module itself")
            if "disk" in self.device_map.values() and not self.offload_folder:
                raise ValueError("model.device_map puts modules on disk: give model.offload_folder (a directory "
                                 "for the offloaded weights)")
        return self


DEVICE_MAP_PLANNERS = ("auto", "balanced", "sequential")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def memory_bytes(size: str | int) -> int | None:
    """A `max_memory` size (20GiB, 512MB, 1.5GB, or bytes) in bytes; None when it is not one."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


DEVICES = "auto, cpu, cuda, cuda:N or mps"  # what `model.device` and a command's --device accept


def is_device(value: str) -> bool:
    """Whether `value` names a single device lmtrace can load a model on (one of DEVICES)."""
    return value in ("auto", "cpu", "cuda", "mps") or (value.startswith("cuda:") and value[5:].isdigit())


def check_device_option(value: str | None, option: str = "--device") -> str | None:
    """A command's --device value, refused in one line (exit 2) before any work when it names no device."""
    if value is not None and not is_device(value):
        raise SpecError(f"{option} {value!r}: not a device; expected {DEVICES}")
    return value


def placement_device(value: Any, what: str, *, disk: bool) -> str:
    """A device of `device_map` / `max_memory` in canonical form: cpu, mps, cuda:N (an integer N
    means GPU N, as in accelerate; cuda means cuda:0), and disk where offloading is meant."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"cuda:{value}"
    if isinstance(value, str):
        if value == "cuda":
            return "cuda:0"
        if value in ("cpu", "mps") or (value.startswith("cuda:") and value[5:].isdigit()) or (disk and value == "disk"):
            return value
    allowed = "cpu, cuda:N, N (GPU N), mps" + (" or disk" if disk else "")
    raise ValueError(f"{what}: expected {allowed} (got {value!r})")


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
    batch_size: int | Literal["auto"] = Field(8, description="prompts run together, or auto: sized to memory_budget "
                                                              "(without one, to a share of the memory free once the "
                                                              "model is loaded)")
    memory_budget: str | int | None = Field(None, description="memory the batches may take beyond the model, "
                                                                "e.g. 8GiB (docs/batch.md, auto batching)")

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
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16: ranking in bfloat16, top re-scored in float32 (lmtrace.capture.lens)


# What each `capture.preset` sets; keys given in the spec override it (docs/spec.md, "Capture presets").
CAPTURE_PRESETS: dict[str, dict] = {
    # tokens, alternatives, per-layer norms and margin contributions, the 8 strongest keys of each
    # attention row; no vectors, no lens
    "light": {"attention": {"top_k": 8}, "qkv": False, "ffn": {"enabled": False}, "lens": {"enabled": False},
              "residual": {"dtype": "float16"}},
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
            self.attention.enabled or self.prefill_attention or self.qkv or self.ffn.enabled
            or self.component_norms or self.lens.enabled or self.residual.vectors_at
            or self.margin_contributions or self.head_dla
        )


def forward_only_capture() -> CaptureSpec:
    return CaptureSpec(
        attention=AttentionCapture(enabled=False), qkv=False, ffn=FfnCapture(enabled=False),
        component_norms=False, lens=LensCapture(enabled=False), margin_contributions=False, head_dla=False,
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
            raise ValueError("capture is empty: remove the key for the default capture, "
                             "or write `capture: none` to capture nothing (forward only)")
        return data

    @model_validator(mode="after")
    def _dla_on_one_device(self) -> "RunSpec":
        # direct logit attribution reads o_proj and unembedding weights itself, which a model spread
        # by device_map may hold offloaded (placeholders): not supported together yet
        if self.capture.head_dla and self.model.device_map is not None:
            raise ValueError("capture.head_dla with model.device_map is not supported yet: capture direct logit "
                             "attribution with the model on one device (model.device)")
        return self


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        if "'\\t'" in problem:
            hint = "indent with spaces, not tabs"
        elif "mapping values" in problem:
            hint = "check the indentation there, and quote a value that contains ': '"
        else:
            hint = "check the indentation, brackets and quotes there"
        raise SpecError(f"{source}: malformed YAML{where}: {problem} ({hint})") from None


def apply_override(data: dict, assignment: str) -> dict:
    """Apply one `dotted.key=value` override; the value is parsed as YAML (`3`, `true`, `[1,2]`)."""
    if "=" not in assignment:
        raise SpecError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set generation.seed=3")
    key, raw = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise SpecError(f"--set {assignment!r}: the key before '=' is empty; expected KEY=VALUE, e.g. --set generation.seed=3")
    value = _parse_yaml(raw, f"--set {key}")
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if isinstance(child, str) and part == "model":  # expand the `model: ref` shorthand
            child = {"ref": child}
        if isinstance(child, list) and part == "prompts":
            child = {"texts": child}
        if child is None:
            child = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise SpecError(f"--set {key}: {where} is {child!r} in the spec, not a section with keys; "
                            f"set it as a whole (--set {where}=...) or change the spec")
        node[part] = child
        node = child
    node[parts[-1]] = value
    # The prompts come from one source: setting one clears the other, so that
    # `--set prompts.file=more.txt` replaces a spec's inline texts (and the other way round).
    if parts[:1] == ["prompts"] and len(parts) == 2 and parts[1] in _PROMPT_SOURCES:
        for other in _PROMPT_SOURCES:
            if other != parts[1]:
                node.pop(other, None)
    return data


_PROMPT_SOURCES = ("texts", "file")


# Messages for values that match none of a union's alternatives (pydantic would list each alternative).
_UNION_HINTS = {
    "capture.layers": "expected `all`, a list of layer indices like [0, 5, -1], or {stride: N, start: M}",
    "capture.residual.vectors_at": "expected `all` or a list of layer indices like [0, 15, -1]",
    "generation.eos_token_id": "expected a token id or a list of token ids",
}
_SECTION_HINTS = {
    "model": "expected a model reference (embedded:NAME, a path or a hub id) or a section with ref:",
    "prompts": "expected a list of prompts, or a section with texts: [...] or file: PATH",
}


def _field_names(cls: type[BaseModel], seen: set | None = None) -> set[str]:
    seen = set() if seen is None else seen
    if cls in seen:
        return set()
    seen.add(cls)
    names = set(cls.model_fields)
    for f in cls.model_fields.values():
        sub = _section_class(f.annotation)
        if sub is not None:
            names |= _field_names(sub, seen)
    return names


def _is_tag(part: Any, names: set[str]) -> bool:
    """pydantic puts the union alternative (`list[int]`, `LayerStride`, `function-after[..]`) into `loc`."""
    return isinstance(part, str) and part not in names


def _clean(loc: tuple, names: set[str], keep_last: bool = False) -> tuple:
    last = len(loc) - 1
    return tuple(p for i, p in enumerate(loc) if not _is_tag(p, names) or (keep_last and i == last))


def _valid_keys(path: tuple) -> list[str]:
    cls: type[BaseModel] | None = RunSpec
    for part in path:
        if cls is None or not isinstance(part, str) or part not in cls.model_fields:
            return []
        cls = _section_class(cls.model_fields[part].annotation)
    return list(cls.model_fields) if cls is not None else []


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line for the first problem: the dotted path, what is wrong, what was given."""
    names = _field_names(RunSpec)
    errors = err.errors()
    first = errors[0]
    loc = tuple(first["loc"])
    group = [first]
    union_root = None
    tag_at = next((i for i, p in enumerate(loc) if _is_tag(p, names) and not
                   (first["type"] == "extra_forbidden" and i == len(loc) - 1)), None)
    if tag_at is not None:
        # A value matched none of a union's alternatives: report the alternative it got furthest into.
        union_root = loc[:tag_at]
        group = [e for e in errors if tuple(e["loc"][:tag_at]) == union_root and len(e["loc"]) > tag_at
                 and _is_tag(e["loc"][tag_at], names)] or [first]
        first = max(group, key=lambda e: (len(e["loc"]), e["type"] == "extra_forbidden"))
        if len(first["loc"]) > tag_at + 1:
            union_root = None
    kind = first["type"]
    path = _clean(tuple(first["loc"]), names, keep_last=kind == "extra_forbidden")
    dotted = ".".join(str(p) for p in path)
    got = first.get("input")
    msg = first["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    if union_root is not None:
        dotted = ".".join(str(p) for p in _clean(union_root, names))
        msg = _UNION_HINTS.get(dotted) or "expected one of: " + "; ".join(dict.fromkeys(e["msg"] for e in group))
    elif kind == "extra_forbidden":
        key = str(path[-1])
        valid = _valid_keys(path[:-1])
        close = difflib.get_close_matches(key, valid, n=1)
        msg = "unknown key" + (f"; did you mean {close[0]!r}?" if close else "")
        if valid:
            msg += f" (valid keys {'under ' + '.'.join(map(str, path[:-1])) if len(path) > 1 else 'at the top level'}: {', '.join(valid)})"
    elif kind == "missing":
        msg = "required key is missing" + (f": {_SECTION_HINTS[dotted]}" if dotted in _SECTION_HINTS else "")
    elif kind in ("model_type", "dict_type"):
        msg = _SECTION_HINTS.get(dotted, "expected a section (a mapping of key: value)")
    shown = ""
    if kind not in ("extra_forbidden", "missing") and not isinstance(got, (dict, list)) and "(got " not in msg:
        shown = f" (got {_shown(got)})"
    others = {_clean(tuple(e["loc"]), names, keep_last=e["type"] == "extra_forbidden")
              for e in errors if e not in group}
    others.discard(path)
    more = f" [+{len(others)} more problem{'s' if len(others) > 1 else ''}]" if others else ""
    # a model-level check already names its keys ("prompts.system needs prompts.chat: true")
    where = f"{dotted}: " if dotted and not msg.startswith(dotted + ".") else ""
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


def _override_key(assignment: str) -> str:
    return ".".join(p for p in assignment.split("=", 1)[0].strip().split(".") if p)


def load_spec(path: str | Path, overrides: list[str] = ()) -> tuple[RunSpec, str, dict]:
    """Read and validate a spec file. Returns (spec, text as given, data after overrides).

    A relative `prompts.file` is resolved against the spec's own directory (specs are portable),
    except when it was given with `--set`, where it is relative to the current directory like
    any other path typed on the command line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: spec file not found; check the path (a YAML run spec, e.g. configs/demo.yaml)") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a directory; give the path of a YAML spec file") from None
    except UnicodeDecodeError as err:
        raise SpecError(f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start}); a spec is a YAML file") from None
    except OSError as err:
        raise SpecError(f"{path}: cannot read spec ({err.strerror or err})") from None
    data = _parse_yaml(text, str(path))
    data = copy.deepcopy(data) if data is not None else data
    file_from_command_line = False
    for assignment in overrides:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            break
        data = apply_override(data, assignment)
        if _override_key(assignment) in ("prompts", "prompts.file"):
            file_from_command_line = True
    spec = build_spec(data, str(path))
    if spec.prompts.file is not None:
        file = Path(spec.prompts.file).expanduser()
        if not file.is_absolute():
            base = Path.cwd() if file_from_command_line else path.parent
            file = (base / file).resolve()
        spec.prompts.file = str(file)
    return spec, text, data


def resolve_layers(layers: Literal["all"] | list[int] | LayerStride, n_layers: int) -> list[int]:
    """Turn `capture.layers` into a sorted list of layer indices, checked against the model."""
    if layers == "all":
        return list(range(n_layers))
    if isinstance(layers, LayerStride):
        if layers.start >= n_layers:
            raise SpecError(f"capture.layers.start={layers.start} is out of range: the model has layers 0..{n_layers - 1}")
        return list(range(layers.start, n_layers, layers.stride))
    if not layers:
        raise SpecError("capture.layers is empty: use `all`, a list of layer indices or {stride: N}")
    bad = [i for i in layers if not -n_layers <= i < n_layers]
    if bad:
        raise SpecError(f"capture.layers: {bad} out of range: the model has layers 0..{n_layers - 1} "
                        f"(negative indices count from the end, down to -{n_layers})")
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
        raise SpecError(f"capture.residual.vectors_at: {bad} out of range: the model has layers 0..{n_layers - 1} "
                        f"(negative indices count from the end, down to -{n_layers})")
    return sorted({i % n_layers for i in v})
