"""The command line: `main` defines the typer app and every command's options; `intervene` and
`sweep` hold those two commands' glue (reading edit files, printing their summaries)."""

from .main import app, run

__all__ = ["app", "run"]
