"""Signals: how a command stops when asked to (SIGINT/SIGTERM), with exit code 3.

Two ways, one for each phase of a command: before any loop (imports, model load, setup) a signal
raises `Interrupted` at once (`interrupt_on_signals`); inside a loop that writes an archive, a
`StopFlag` is polled so the loop finishes the current step, flushes and records `interrupted`.

Once a command has recorded its work (`work_recorded`) a signal no longer interrupts it: it only
prints and exits, 0. In the `lmtrace` process the handler stays until the process exits (`until_exit`):
a signal after the command returned, while Python shuts down, leaves the command's exit code as it
is, never 143 (death by SIGTERM, which a scheduler reads as a failed job)."""

from __future__ import annotations

import signal
from contextlib import contextmanager

from .errors import Interrupted, signal_name
from .faults import pause_point

_state = {"recorded": False, "until_exit": False, "signal": None, "what": "the command"}


def until_exit() -> None:
    """The `lmtrace` process (cli.main.run): the handlers `interrupt_on_signals` installs are not
    put back when the command returns; from then on a signal is ignored (the exit code is the
    command's). A command run in-process (a test, a notebook) leaves its caller's handlers as they were."""
    _state["until_exit"] = True


def work_recorded() -> None:
    """The command's work is recorded (its files renamed into place, its manifest written): a signal
    from now on leaves it to finish (printing what it did) and exit 0. `work_started` undoes it for
    more work in the same command (the lens after `generate --lens`)."""
    _state["recorded"] = True
    pause_point("recorded")


def work_started() -> None:
    """More work begins: a signal interrupts again; one that came since the work was recorded stops
    the command here, before the new work (exit 3)."""
    _state["recorded"] = False
    signum, _state["signal"] = _state["signal"], None
    if signum is not None:
        raise Interrupted(
            f"interrupted by {signal_name(signum)}: {_state['what']} stopped before it finished "
            f"and recorded nothing more as done; run it again",
            signum,
        )


def _ignore(signum, frame) -> None:
    """After the command: the process exits with the command's code whatever signal comes."""


def interrupt_on_signals(command: str | None = None):
    """SIGINT/SIGTERM from now on raise `Interrupted` (exit 3), until a loop installs its own StopFlag.

    Installed for every command as it starts (the callback in cli/app.py). Whatever the command was writing
    is then either in place or not (every file is written to a temporary name and renamed), and
    nothing is recorded as done that is not: a run whose manifest exists is recorded `interrupted`
    (generation._write_run), a lens stays pending. While the command cleans up, a second SIGTERM is
    ignored; a second SIGINT aborts at once (KeyboardInterrupt, exit 130).

    Once the command calls `work_recorded`, a signal is ignored (the command finishes, exit 0).

    Returns a function that puts the previous handlers back (a command run in-process, by a test or
    a notebook, leaves its caller's handlers as they were); in the `lmtrace` process (`until_exit`)
    it installs one that ignores signals until the process has exited. Outside the main thread, where Python
    cannot install handlers, it changes nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    what = f"`lmtrace {command}`" if command else "the command"

    def handler(signum, frame):
        if _state["recorded"]:  # the work is recorded: the command finishes its output, exit 0
            _state["signal"] = signum  # (unless it starts more work: work_started)
            return
        if handler.raised:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        handler.raised = True
        raise Interrupted(
            f"interrupted by {signal_name(signum)}: {what} stopped before it finished and "
            f"recorded nothing as done; run it again",
            signum,
        )

    handler.raised = False
    _state.update(recorded=False, signal=None, what=what)
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, previous in old.items():
            signal.signal(sig, _ignore if _state["until_exit"] else previous)

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
