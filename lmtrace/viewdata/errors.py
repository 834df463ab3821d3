"""The errors of a page's data: what is asked for is not there, or a parameter cannot be read.
serve answers them 404 and 400 (serve/errors.py); the CLI, like any SpecError, exits 2."""

from __future__ import annotations

from ..exits.errors import SpecError


class NotFound(SpecError):
    """A run, sequence, step, layer, head or address that is not there (answered 404)."""


class BadParameter(SpecError):
    """A query parameter that cannot be read (answered 400)."""
