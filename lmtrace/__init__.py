"""lmtrace: a command-line batch tracer for causal language models."""

__version__ = "0.1.0"

from .archive.reader import Run, open_run  # noqa: E402

__all__ = ["Run", "open_run", "__version__"]
