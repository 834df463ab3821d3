"""Errors that reach the user as one line and a documented exit code.

Exit codes (also in the README):
  0  success
  1  the run failed (model could not be loaded, generation or writing failed)
  2  bad usage or bad spec (malformed YAML, unknown key, wrong type, missing file, unknown run)
  3  interrupted by SIGINT/SIGTERM: a run can be resumed; any other command recorded nothing as done
  4  this shard finished, but another shard of the run failed or was interrupted (resume that one)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 3
EXIT_PARTIAL_SHARDS = 4


class LmtraceError(Exception):
    """Base class: `str(err)` is the one line shown to the user."""

    exit_code = EXIT_RUN_FAILED


class SpecError(LmtraceError):
    """The spec, an override or a command-line argument is wrong."""

    exit_code = EXIT_USAGE


class RunNotFoundError(LmtraceError):
    exit_code = EXIT_USAGE


class ModelLoadError(LmtraceError):
    exit_code = EXIT_RUN_FAILED


class UnsupportedArchitectureError(LmtraceError):
    exit_code = EXIT_RUN_FAILED


class ArchiveError(LmtraceError):
    """An archive is missing, unreadable or not in the expected state."""

    exit_code = EXIT_USAGE


class ArchiveDamaged(ArchiveError):
    """A file of a run failed its checksum, is missing or truncated, or does not decode.

    `path` names the file relative to the run directory (never where the runs live on disk), so a
    server can say which file without showing its own paths; `run_dir` is the run's directory."""

    def __init__(self, message: str, *, path: str | None = None, run_dir=None):
        super().__init__(message)
        self.path = path
        self.run_dir = run_dir


class Interrupted(BaseException):
    """SIGINT/SIGTERM stopped the command: `str(err)` is the one line shown, exit 3.

    Not an `Exception` (like KeyboardInterrupt): the signal handler raises it wherever the command
    happens to be, also inside a `try: ... except Exception` that turns a library's failure into
    a one-line error, which must not turn a signal into a failure."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self, message: str, signum: int | None = None, resumable: bool = False):
        super().__init__(message)
        self.signum = signum
        self.resumable = resumable  # the message already says how to continue


def signal_name(signum: int | None) -> str:
    import signal

    try:
        return f"signal {signum} ({signal.Signals(signum).name})"
    except ValueError:
        return f"signal {signum}"
