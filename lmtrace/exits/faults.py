"""Fault injection for the fault suite (tests/test_faults.py and its neighbours): the one place
lmtrace reads a test's request to kill, pause or fail it at a named point. Production code calls
these few functions where a fault can be asked for; with none of the variables below set, each
returns at once and does nothing.

| variable | effect |
|---|---|
| `LMTRACE_TEST_KILL_AT=NAME[@N]` | `kill_point(NAME)` SIGKILLs the process (the N-th time it gets there): finalisation, `lmtrace lens`, a table part's merge, a committed block |
| `LMTRACE_TEST_PAUSE_AT=NAME:SECONDS` | `pause_point(NAME)` (and `kill_point(NAME)`, before it would kill) prints `paused at NAME` on stderr and waits, so a test sends a signal at a known point (`recorded`: a command's work just recorded; `exit`: the process about to exit) |
| `LMTRACE_TEST_PAUSE_AFTER_CREATE=SECONDS` | `pause_after_owning()` waits after a writer has taken a run's ownership, so two writers race deterministically |
| `LMTRACE_TEST_OOM_AT=STEP:SIZE` | `oom_at()`: a batch of more than SIZE sequences runs out of memory after step STEP (runner/batching.py) |
"""

from __future__ import annotations

import os
import signal
import sys
import time

_kill_point_reached: dict[str, int] = {}


def kill_point(name: str) -> None:
    """SIGKILL here when LMTRACE_TEST_KILL_AT names this point (NAME@N: the N-th time)."""
    pause_point(name)  # a signal sent while paused here lands before the commit that follows
    wanted = os.environ.get("LMTRACE_TEST_KILL_AT")
    if wanted is None or wanted.split("@")[0] != name:
        return
    _kill_point_reached[name] = _kill_point_reached.get(name, 0) + 1
    if "@" not in wanted or int(wanted.split("@")[1]) == _kill_point_reached[name]:
        os.kill(os.getpid(), signal.SIGKILL)


def pause_point(name: str) -> None:
    """Wait here when LMTRACE_TEST_PAUSE_AT names this point, after saying so on stderr."""
    wanted = os.environ.get("LMTRACE_TEST_PAUSE_AT")
    if not wanted or wanted.rsplit(":", 1)[0] != name:
        return
    print(f"paused at {name}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + float(wanted.rsplit(":", 1)[1])
    while time.monotonic() < deadline:  # (a handler that returns lets the sleep go on; one that raises ends it)
        time.sleep(max(0.0, deadline - time.monotonic()))


def pause_after_owning() -> None:
    """Wait LMTRACE_TEST_PAUSE_AFTER_CREATE seconds (a writer has just taken ownership of a run)."""
    pause = os.environ.get("LMTRACE_TEST_PAUSE_AFTER_CREATE")
    if pause:
        time.sleep(float(pause))


def oom_at() -> tuple[int, int] | None:
    """(STEP, SIZE) of LMTRACE_TEST_OOM_AT, or None."""
    value = os.environ.get("LMTRACE_TEST_OOM_AT")
    if not value:
        return None
    step, size = (int(x) for x in value.split(":"))
    return step, size
