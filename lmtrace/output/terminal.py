"""Plain lines that fit the terminal: wrapped at its width when stdout is one, left whole when piped
(a script reading the output gets one line per item, as before)."""

from __future__ import annotations

import shutil
import sys
import textwrap


def terminal_width() -> int | None:
    """The terminal's columns when stdout is one, else None."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def fitted(text: str, indent: str = "  ", width: int | None = None) -> str:
    """`text` wrapped between words at `width` (the terminal's when not given; unwrapped when piped),
    continuation lines indented by `indent`."""
    width = width if width is not None else terminal_width()
    return textwrap.fill(text, width, subsequent_indent=indent, break_on_hyphens=False) if width else text
