"""Capture on a model spread over devices (`model.device_map`, docs/devices.md).

accelerate runs each module on its *execution device*: the device its weights live on, or, for
weights offloaded to the CPU or to disk, the main device, where a hook brings them for each call
(their parameters meanwhile are stand-ins on the `meta` device). The probes therefore ask where a
module computes (`execution_device`), read offloaded weights through accelerate (`resident`), and
combine per-layer tensors that live on different devices with one stack and one copy per device
(`stack_on`). On a model on one device all of this reduces to one stack (numpy's, on the CPU).
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

_CPU = torch.device("cpu")
_NUMPY_DTYPES = {torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool}


def _hook_device(module: torch.nn.Module) -> torch.device | None:
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):  # SequentialHook holds several
        device = getattr(h, "execution_device", None)
        if device is not None and not isinstance(device, dict):
            return torch.device(device)
    return None


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes: its (or its first hooked submodule's) accelerate execution device,
    else the device of its first real (non-meta) parameter or buffer; cpu for a module without any."""
    for m in module.modules():
        device = _hook_device(m)
        if device is not None:
            return device
    for t in chain(module.parameters(), module.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def is_spread(model: torch.nn.Module) -> bool:
    """Whether accelerate dispatched the model (several devices, or weights offloaded)."""
    return getattr(model, "hf_device_map", None) is not None and any(
        getattr(m, "_hf_hook", None) is not None for m in model.modules()
    )


def layer_devices(adapter) -> list[torch.device] | None:
    """The execution device of each decoder layer's attention (where its keys and values are made),
    or None for a model on one device."""
    if not is_spread(adapter.model):
        return None
    return [execution_device(adapter.attn(i)) for i in range(adapter.n_layers)]


def resident(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s own parameters as real tensors on its execution device: the parameters themselves,
    or, where accelerate offloaded them (meta stand-ins), copies read through its hook."""
    params = dict(module.named_parameters(recurse=False))
    if all(p.device.type != "meta" for p in params.values()):
        return {name: p.detach() for name, p in params.items()}
    from accelerate.utils import align_module_device

    with align_module_device(module):
        return {name: p.detach().clone() for name, p in module.named_parameters(recurse=False)}


def stack_on(tensors: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """torch.stack(tensors) on `device` (default: where they are, when all on one device). Tensors
    on several devices are stacked per device and copied once per device, then put back in order."""
    devices = {t.device for t in tensors}
    dtypes = {t.dtype for t in tensors}
    if (
        devices == {_CPU}
        and device in (None, _CPU)
        and len(dtypes) == 1
        and dtypes <= _NUMPY_DTYPES
        and not any(t.requires_grad for t in tensors)
    ):
        # the same bytes, copied by numpy on this thread: torch's stack is a parallel copy that waits
        # for torch's other threads, which a CPU shared with other work turns into a long wait (a
        # step's 6 MB of FFN activations at batch 32: 0.5 ms either way on an idle core; under a
        # load average of 18 on 2 cores, 545 ms on average with torch against 7 ms with numpy)
        return torch.from_numpy(np.stack([t.numpy() for t in tensors], 0))
    if len(devices) == 1:
        out = torch.stack(tensors, 0)
        return out if device is None or out.device == device else out.to(device)
    if device is None:
        raise ValueError("stack_on: tensors on several devices need a target device")
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    order = [i for indices in by_device.values() for i in indices]
    out = torch.cat([torch.stack([tensors[i] for i in indices], 0).to(device) for indices in by_device.values()], 0)
    if order == sorted(order):
        return out
    return out[torch.tensor(order, device=device).argsort()]


def cuda_devices(model: torch.nn.Module, input_device: torch.device) -> list[torch.device]:
    """The CUDA devices the model computes on (for the peak-memory record)."""
    found = {input_device} | {execution_device(m) for m in model.modules() if getattr(m, "_hf_hook", None) is not None}
    found |= {p.device for p in model.parameters()}
    return sorted((d for d in found if d.type == "cuda"), key=lambda d: d.index or 0)


def reset_peak_memory(devices: list[torch.device]) -> None:
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)


def peak_memory(devices: list[torch.device]) -> dict[str, int]:
    """Bytes of tensors allocated at the peak since `reset_peak_memory`, per CUDA device."""
    return {str(d): int(torch.cuda.max_memory_allocated(d)) for d in devices}
