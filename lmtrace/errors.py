"""Errors that reach the user as one line and a documented exit code.

Exit codes (also in the README):
  0  success
  1  the run failed (model could not be loaded, generation or writing failed)
  2  bad usage or bad spec (malformed YAML, unknown key, wrong type, missing file, unknown run)
  3  the run was interrupted by SIGINT/SIGTERM and can be resumed
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


class Interrupted(LmtraceError):
    exit_code = EXIT_INTERRUPTED
