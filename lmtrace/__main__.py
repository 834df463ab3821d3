"""`python -m lmtrace ...`, the same as the `lmtrace` script."""

from .cli.main import run

run()
