"""lmtrace: a command-line batch tracer for causal language models."""

__version__ = "0.1.0"

__all__ = ["Run", "open_run", "__version__"]


def __getattr__(name: str):
    # The reader pulls in zarr, pyarrow's datasets and pandas (~1 s): imported on first use, so that
    # the CLI (`lmtrace --help`, `ls`, `validate`) does not pay for it on every start.
    if name in ("Run", "open_run"):
        from .archive import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'lmtrace' has no attribute {name!r}")
