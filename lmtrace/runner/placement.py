"""Where each module of a model lives when it is spread over devices (`model.device_map`).

The plan is made by accelerate and transformers, not here: for `auto`, `balanced` and `sequential`
transformers' own planner (`_get_device_map`: accelerate's `infer_auto_device_map` with
`max_memory`) runs on an empty-weights copy of the model built from its config, so no weight is
read. The load then passes that plan to `from_pretrained` as an explicit map, so the placement
`lmtrace validate` reports is the one `generate` uses. An explicit `{module: device}` map is
checked here (unknown modules, modules left unplaced, devices this machine lacks) so that a bad
map is a one-line usage error instead of a traceback from inside the load.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from ..archive.runs import human_bytes
from ..exits.errors import SpecError
from ..spec.run_spec import ModelSpec, memory_bytes


@dataclass
class Placement:
    """A planned placement: module -> device (cpu, cuda:N, mps, disk), in the model's module order."""

    device_map: dict[str, str]
    tensors_by_module: dict[str, dict[int, int]]  # module -> {id of a weight: its bytes}; tied weights share an id
    layers_path: str | None  # the decoder layers' module path (model.layers), when there is one

    @property
    def devices(self) -> list[str]:
        return list(dict.fromkeys(self.device_map.values()))

    @property
    def offloads_to_disk(self) -> bool:
        return "disk" in self.device_map.values()

    def for_transformers(self) -> dict[str, int | str]:
        """The map as `from_pretrained(device_map=...)` takes it: GPUs as integers."""
        return {module: _accelerate_device(device) for module, device in self.device_map.items()}

    def summary(self) -> list[dict]:
        """Per device: its modules (consecutive decoder layers as one range) and the bytes of their weights."""
        out = []
        for device in self.devices:
            modules = [m for m, d in self.device_map.items() if d == device]
            tensors = {i: n for m in modules for i, n in self.tensors_by_module.get(m, {}).items()}
            out.append(
                {"device": device, "modules": _ranges(modules, self.layers_path), "bytes": sum(tensors.values())}
            )
        return out

    def text(self) -> str:
        """One line: `cpu: model.embed_tokens, model.layers.0-13 (1.2 GB); disk: ...`."""
        return "; ".join(
            f"{row['device']}: {', '.join(row['modules'])} ({human_bytes(row['bytes'])})" for row in self.summary()
        )


def _accelerate_device(device: str) -> int | str:
    return int(device[5:]) if device.startswith("cuda:") else device


def _ranges(modules: list[str], layers_path: str | None) -> list[str]:
    """model.layers.0, model.layers.1, model.layers.2 -> model.layers.0-2; "" -> (whole model)."""
    out: list[str] = []
    run: list[int] = []

    def flush():
        if run:
            out.append(f"{layers_path}.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else ""))
            run.clear()

    for module in modules:
        index = module[len(layers_path) + 1 :] if layers_path and module.startswith(layers_path + ".") else ""
        if index.isdigit() and (not run or int(index) == run[-1] + 1):
            run.append(int(index))
            continue
        flush()
        if index.isdigit():
            run.append(int(index))
        else:
            out.append(module or "(whole model)")
    flush()
    return out


def _layers_path(model) -> str | None:
    """The path of the longest ModuleList of the model: its decoder layers."""
    import torch

    lists = [(len(m), name) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists)[1] if lists else None


def present_devices() -> dict[str, int]:
    """How many devices of each kind this machine has."""
    import torch

    mps = getattr(torch.backends, "mps", None)
    return {
        "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "mps": int(bool(mps is not None and mps.is_available())),
    }


def _check_present(device: str, where: str) -> None:
    have = present_devices()
    if device.startswith("cuda:") and int(device[5:]) >= have["cuda"]:
        raise SpecError(
            f"{where}: {device} is not present on this machine ({have['cuda']} CUDA device(s)); "
            f"use devices it has (cpu, disk" + (f", cuda:0..cuda:{have['cuda'] - 1}" if have["cuda"] else "") + ")"
        )
    if device == "mps" and not have["mps"]:
        raise SpecError(
            f"{where}: mps is not available on this machine; use cpu" + (", cuda:N" if have["cuda"] else "")
        )


def planning_dtype(spec: ModelSpec):
    """The dtype `auto` means for a spread model: bfloat16 when the model runs on CUDA, as for one device."""
    import torch

    if spec.dtype != "auto":
        return getattr(torch, spec.dtype)
    if isinstance(spec.device_map, dict):
        on_cuda = any(d.startswith("cuda") for d in spec.device_map.values())
    else:
        on_cuda = torch.cuda.is_available() and (
            spec.max_memory is None or any(k.startswith("cuda") for k in spec.max_memory)
        )
    return torch.bfloat16 if on_cuda and torch.cuda.is_bf16_supported() else torch.float32


def empty_model(config, dtype, trust_remote_code: bool = False):
    """The model of `config` with every weight on the meta device: its structure and sizes, no memory."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def _check_explicit(device_map: dict[str, str], model) -> None:
    """Unknown modules, modules no entry places, devices not present: one SpecError each."""
    modules = dict(model.named_modules())
    names = set(modules) | {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    for key in device_map:
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            top = [n for n in modules if n and n.count(".") <= 1]
            raise SpecError(
                f"model.device_map: unknown module {key!r}"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + f" (this model's modules include {', '.join(top[:8])})"
            )
    for key, device in device_map.items():
        _check_present(device, f"model.device_map: {key or '(whole model)'}")

    def placed(name: str) -> bool:
        return any(key == "" or name == key or name.startswith(key + ".") for key in device_map)

    unplaced = [n.rsplit(".", 1)[0] for n, _ in model.named_parameters() if not placed(n)]
    if unplaced:
        shown = list(dict.fromkeys(unplaced))
        raise SpecError(
            f"model.device_map does not place {', '.join(shown[:4])}"
            + (f" and {len(shown) - 4} more module(s)" if len(shown) > 4 else "")
            + ": give every module a device (a parent such as `model` places all its submodules)"
        )


def _max_memory(spec: ModelSpec) -> dict | None:
    if spec.max_memory is None:
        return None
    out = {}
    for device, size in spec.max_memory.items():
        _check_present(device, "model.max_memory")
        out[_accelerate_device(device)] = memory_bytes(size)
    return out


def _tensor_bytes(model, name: str, dtype) -> dict[int, int]:
    """The weights and buffers of module (or parameter) `name`, each once: {id: bytes in `dtype`}
    (floating-point ones in the load dtype, as from_pretrained casts them)."""
    modules = dict(model.named_modules())
    if name in modules:
        tensors = [*modules[name].parameters(), *modules[name].buffers()]
    else:
        tensors = [t for n, t in [*model.named_parameters(), *model.named_buffers()] if n == name]
    size = dtype.itemsize if hasattr(dtype, "itemsize") else 4
    return {id(t): t.numel() * (size if t.is_floating_point() else t.element_size()) for t in tensors}


def plan(spec: ModelSpec, config, dtype=None) -> Placement:
    """The placement of `spec.device_map` for the model of `config`, from an empty-weights model."""
    dtype = dtype if dtype is not None else planning_dtype(spec)
    model = empty_model(config, dtype, spec.trust_remote_code)
    if isinstance(spec.device_map, dict):
        _check_explicit(spec.device_map, model)
        device_map = dict(spec.device_map)
    else:
        from transformers.integrations.accelerate import _get_device_map

        try:
            planned = _get_device_map(model, spec.device_map, _max_memory(spec), None)
        except ValueError as err:
            raise SpecError(f"model.device_map={spec.device_map}: {' '.join(str(err).split())}") from None
        device_map = {module: (f"cuda:{d}" if isinstance(d, int) else str(d)) for module, d in planned.items()}
    placement = Placement(device_map, {m: _tensor_bytes(model, m, dtype) for m in device_map}, _layers_path(model))
    if placement.offloads_to_disk and not spec.offload_folder:
        on_disk = [row for row in placement.summary() if row["device"] == "disk"][0]["modules"]
        raise SpecError(
            f"model.device_map={spec.device_map if isinstance(spec.device_map, str) else '{...}'}: "
            f"the plan puts {', '.join(on_disk)} on disk (model.max_memory leaves no room for them); "
            f"give model.offload_folder, a directory for the offloaded weights, or raise max_memory"
        )
    return placement
