"""glibc's allocator told to keep freed memory for the next allocation instead of returning it.

A capture step allocates and frees the same large buffers every step: the logits and their
statistics ([batch, vocab] float32, 6 MB at batch 32), the FFN activations of every layer, the
step's arrays, a block's buffers. glibc serves a block above its mmap threshold (128 KiB at first,
raised as such blocks are freed) with a fresh mapping and unmaps it when freed, and gives the top of
its heap back once more than its trim threshold is free there. Either way the next step's buffer is
new memory: every 4 KiB page of it faults and is zeroed by the kernel before torch writes it. At batch
32 on the embedded model that was ~1.7 million page faults in a 128-prompt run (~180,000 with this),
and `exp` of a step's logits took 1.5 ms into a new buffer against 0.3 ms into a reused one
(docs/performance.md).

With both thresholds raised, freed blocks stay in the heap and are reused, and up to TRIM_THRESHOLD
of freed memory stays with the process instead of going back between steps: its peak RSS is higher
(1280 against 1147 MiB at batch 32; flat in the number of prompts). Commands that run a model call
this once (runner/models.py); `serve` and the readers do not. glibc's own settings win: with any of
MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or a malloc tunable in GLIBC_TUNABLES in the
environment nothing is changed, and on another C library (macOS, musl) neither.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 256 << 20  # blocks below this come from the heap (glibc's M_MMAP_THRESHOLD)
TRIM_THRESHOLD = 256 << 20  # free memory kept at the top of the heap (M_TRIM_THRESHOLD)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>

_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); whether they were set."""
    global _done
    if _done:
        return True
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _glibc()
    if libc is None:
        return False
    _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _done


def _glibc():
    """The process's C library when it is glibc (it has `mallopt` and `gnu_get_libc_version`), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
