"""Signals: how a command stops when asked to (SIGINT/SIGTERM), with exit code 3.

Two ways, one for each phase of a command: before any loop (imports, model load, setup) a signal
raises `Interrupted` at once (`interrupt_on_signals`); inside a loop that writes an archive, a
`StopFlag` is polled so the loop finishes the current step, flushes and records `interrupted`."""

from __future__ import annotations

import signal
from contextlib import contextmanager

from .errors import Interrupted


def interrupt_on_signals() -> None:
    """SIGINT/SIGTERM from now on raise `Interrupted` (exit 3), until a loop installs its own StopFlag.

    Nothing has been written by then, or the run is recorded `interrupted` (generation._start_run)."""

    def handler(signum, frame):
        raise Interrupted(f"interrupted by signal {signum} outside the generation loop (loading, starting or finishing)")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


class StopFlag:
    """SIGINT/SIGTERM ask the loop to finish the current step, flush and exit as interrupted."""

    def __init__(self):
        self.signal: int | None = None

    def __call__(self) -> bool:
        return self.signal is not None

    @contextmanager
    def installed(self):
        def handler(signum, frame):
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C aborts at once
            self.signal = signum

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)
