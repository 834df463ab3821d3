"""runner/allocator.py: a process that runs a model keeps the memory it frees for its next buffers,
measured as the page faults of allocating and filling the same large buffer again and again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# A fresh process: malloc a 64 MiB block, write every byte, free it, 8 times; the minor page faults of
# the last 7 (the first one faults in any case). glibc maps a block that large anew each time by
# default (above its largest dynamic mmap threshold, 32 MiB), so every page faults again: ~16,000 a round.
PROBE = """
import ctypes, json, resource, sys
from lmtrace.runner.allocator import keep_freed_memory
done = keep_freed_memory() if sys.argv[1] == "tuned" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"done": done, "faults": sum(faults[1:])}))
"""

PAGES = (64 << 20) // 4096


def _probe(mode: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_buffers_are_reused_without_page_faults():
    tuned = _probe("tuned")
    assert tuned["done"] is True
    assert tuned["faults"] < PAGES // 10, tuned  # 7 rounds of 16,384 pages each, nearly none faulted
    plain = _probe("plain")
    assert plain["faults"] > 3 * PAGES, plain  # the same rounds without it: the buffer faults every time


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_glibc_settings_in_the_environment_are_left_alone():
    assert _probe("tuned", MALLOC_TRIM_THRESHOLD_="131072")["done"] is False
    assert _probe("tuned", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072")["done"] is False
