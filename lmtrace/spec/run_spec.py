"""The run spec: YAML loading, `--set key=value` overrides, a one-line error for a spec that does
not validate.

The schema is in `sections` (one pydantic model per section), device and memory values in
`devices`, the error wording in `validation_errors`, layer resolution in `layers`; their public
names are importable from here too, as `lmtrace.spec.run_spec` is the run spec's one entry point.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..exits.errors import SpecError
from .devices import DEVICE_MAP_PLANNERS, DEVICES, check_device_option, is_device, memory_bytes, placement_device
from .layers import resolve_layers, resolve_vector_layers
from .sections import (
    CAPTURE_PRESETS,
    DEFAULT_MODEL,
    AttentionCapture,
    CaptureSpec,
    FfnCapture,
    GenerationSpec,
    LayerStride,
    LensCapture,
    ModelSpec,
    OutputSpec,
    PromptsSpec,
    ResidualCapture,
    RunSpec,
    forward_only_capture,
)
from .validation_errors import format_validation_error

__all__ = [
    "CAPTURE_PRESETS",
    "DEFAULT_MODEL",
    "DEVICES",
    "DEVICE_MAP_PLANNERS",
    "AttentionCapture",
    "CaptureSpec",
    "FfnCapture",
    "GenerationSpec",
    "LayerStride",
    "LensCapture",
    "ModelSpec",
    "OutputSpec",
    "PromptsSpec",
    "ResidualCapture",
    "RunSpec",
    "apply_override",
    "build_spec",
    "check_device_option",
    "forward_only_capture",
    "format_validation_error",
    "is_device",
    "load_spec",
    "memory_bytes",
    "placement_device",
    "resolve_layers",
    "resolve_vector_layers",
]


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
        raise SpecError(
            f"--set {assignment!r}: the key before '=' is empty; expected KEY=VALUE, e.g. --set generation.seed=3"
        )
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
            raise SpecError(
                f"--set {key}: {where} is {child!r} in the spec, not a section with keys; "
                f"set it as a whole (--set {where}=...) or change the spec"
            )
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

    A relative `prompts.file` (or `capture.features[].sae`) is resolved against the spec's own directory (specs are portable),
    except when it was given with `--set`, where it is relative to the current directory like
    any other path typed on the command line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(
            f"{path}: spec file not found; check the path (a YAML run spec, e.g. configs/demo.yaml)"
        ) from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a directory; give the path of a YAML spec file") from None
    except UnicodeDecodeError as err:
        raise SpecError(
            f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start}); a spec is a YAML file"
        ) from None
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
    for feature in spec.capture.features:  # an SAE directory: as prompts.file
        sae = Path(feature.sae).expanduser()
        if not sae.is_absolute():
            from_command_line = any(_override_key(o).startswith("capture") for o in overrides)
            sae = ((Path.cwd() if from_command_line else path.parent) / sae).resolve()
        feature.sae = str(sae)
    return spec, text, data
