"""Hashing files: the sha256 of a file's bytes, read a block at a time. Imports nothing of lmtrace (nor
torch), so every layer can use it: the model weights' fingerprint (runner), a run's checksums
(archive), an SAE's weights (features; the torch-free logit effects in analysis/features)."""

from __future__ import annotations

import hashlib
from pathlib import Path

BLOCK = 1 << 20  # bytes read at a time


def file_sha256(path: Path | str, block: int = BLOCK) -> str:
    """The sha256 of the file at `path`, as 64 hex digits."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()
