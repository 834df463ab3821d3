"""The process's resident set size (RSS), and its peak over a stretch of work: what a batch on the
CPU takes, for `batch_size: auto` (batching.Footprint calibrates from it).

The kernel's high-water mark (VmHWM, `ru_maxrss`) never goes down, and resetting it
(/proc/self/clear_refs) would also erase the process's true peak that `/usr/bin/time`, SLURM and
`getrusage` report. So the peak over a stretch is the larger of two readings: RSS sampled by a
thread every few milliseconds, and, when the high-water mark rose during the stretch, the new mark
(it was reached within the stretch: exact even for a transient the samples missed).
"""

from __future__ import annotations

import sys
import threading

import psutil

try:
    import resource  # Unix
except ImportError:  # Windows: the samples alone
    resource = None

SAMPLE_S = 0.005


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def high_water_bytes() -> int | None:
    """The process's peak RSS so far (ru_maxrss: KiB on Linux, bytes on macOS); None without getrusage.
    On Linux it can start at the peak of the parent that started this process (carried over an exec)."""
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class PeakRss:
    """`with PeakRss() as p: work()`; then `p.peak`: the process's largest RSS during the work, and
    `p.start`: its RSS when the work started, bytes."""

    def __init__(self, sample_s: float = SAMPLE_S):
        self.sample_s, self.start, self.peak, self.samples = sample_s, 0, 0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mark_before: int | None = None

    def _sample(self) -> None:
        process = psutil.Process()
        while not self._stop.wait(self.sample_s):
            self.peak = max(self.peak, process.memory_info().rss)
            self.samples += 1

    def __enter__(self) -> "PeakRss":
        self._mark_before = high_water_bytes()
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, name="lmtrace-peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        mark = high_water_bytes()
        if mark is not None and self._mark_before is not None and mark > self._mark_before:
            self.peak = max(self.peak, mark)
