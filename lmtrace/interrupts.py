"""Signals: how a command stops when asked to (SIGINT/SIGTERM), with exit code 3.

Two ways, one for each phase of a command: before any loop (imports, model load, setup) a signal
raises `Interrupted` at once (`interrupt_on_signals`); inside a loop that writes an archive, a
`StopFlag` is polled so the loop finishes the current step, flushes and records `interrupted`."""

from __future__ import annotations

import signal
from contextlib import contextmanager

from .errors import Interrupted, signal_name


def interrupt_on_signals(command: str | None = None):
    """SIGINT/SIGTERM from now on raise `Interrupted` (exit 3), until a loop installs its own StopFlag.

    Installed for every command as it starts (the callback in cli/app.py). Whatever the command was writing
    is then either in place or not (every file is written to a temporary name and renamed), and
    nothing is recorded as done that is not: a run whose manifest exists is recorded `interrupted`
    (generation._write_run), a lens stays pending. While the command cleans up, a second SIGTERM is
    ignored; a second SIGINT aborts at once (KeyboardInterrupt, exit 130).

    Returns a function that puts the previous handlers back (a command run in-process, by a test or
    a notebook, leaves its caller's handlers as they were). Outside the main thread, where Python
    cannot install handlers, it changes nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    what = f"`lmtrace {command}`" if command else "the command"

    def handler(signum, frame):
        if handler.raised:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        handler.raised = True
        raise Interrupted(f"interrupted by {signal_name(signum)}: {what} stopped before it finished and "
                          f"recorded nothing as done; run it again", signum)

    handler.raised = False
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, previous in old.items():
            signal.signal(sig, previous)
    return restore


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
