"""`python -m lmtrace.cli ...`, the same as the `lmtrace` script."""

from .main import run

run()
