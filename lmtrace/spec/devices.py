"""Device and memory values a spec or a command line names: `model.device` and `--device`, the
devices of `model.device_map` / `model.max_memory`, and memory sizes (20GiB, 512MB, or bytes)."""

from __future__ import annotations

import re
from typing import Any

from ..exits.errors import SpecError

DEVICE_MAP_PLANNERS = ("auto", "balanced", "sequential")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


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
