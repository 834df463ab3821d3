"""The command line. `app` (the typer app, its callback and the error mapping) is in `app.py`;
`main` defines generate and validate and registers `archive_commands` (ls, show, verify),
`edit_commands` (intervene, sweep) and `analysis_commands` (explain, lens, heads, compare,
report, serve); `intervene` and `sweep` hold those two commands' glue (reading edit files,
printing their summaries)."""

from . import sae_commands  # noqa: E402,F401,I001  (`lmtrace sae ...`)
from .main import app, run

__all__ = ["app", "run"]
