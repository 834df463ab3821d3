"""Small files a reading command keeps in a complete run for the views (`lmtrace features --feature`'s
logit effects, analysis/feature_logit_effects_<sae>.json), recorded in the run's checksums like its
committed files, so a changed byte is damage that readers report and `lmtrace verify` names.

- `update_recorded`: read, change and rewrite one such file under the run's lock (the flock `lmtrace
  lens` and `lmtrace features RUN --sae DIR` hold to add to a complete run), then re-record its
  checksum with `integrity.record_update` (every other file keeps the checksum it had). Two commands
  adding to the same file one after the other both end up in it. In a run that is not complete (its
  checksums are recorded at completion, and cover only its committed files) the file is rewritten
  under the same lock and not recorded.
- `read_recorded`: the file's bytes, checked against the recorded sha256 (a file never recorded is
  read as it is); ArchiveDamaged naming it when it differs, is missing or does not read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..exits.errors import ArchiveDamaged
from . import layout
from .damage import damaged_message
from .integrity import bytes_problem

READ_TRIES = 5  # a reader re-reads while a writer rewrites the manifest around its reads


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def read_recorded(run_dir: Path, rel: str) -> bytes | None:
    """The bytes of the run's file `rel` (None: there is none, and none was recorded), checked against
    the recorded sha256; ArchiveDamaged (naming `rel`) when they differ. The manifest is read before
    and after: a verdict stands only when no writer rewrote it meanwhile."""
    from .runs import read_manifest

    run_dir = Path(run_dir)
    for _ in range(READ_TRIES):
        before = _read(run_dir / layout.MANIFEST)
        manifest = read_manifest(run_dir)
        data = _read(run_dir / rel)
        problem = bytes_problem(run_dir, manifest, rel, data)
        if _read(run_dir / layout.MANIFEST) == before:
            break
    if problem is not None:
        raise ArchiveDamaged(
            damaged_message(manifest.get("run_id", run_dir.name), problem), path=problem.path, run_dir=run_dir
        )
    return data


def update_recorded(run_dir: Path, rel: str, update: Callable[[bytes | None], str]) -> None:
    """Rewrite the run's file `rel` as `update(its current bytes, or None)` under the run's lock, and
    record its checksum in a complete run. A current file that fails its checksum raises ArchiveDamaged
    (it is left as it is, for `lmtrace verify` to name); OSError when the run cannot be written."""
    from .files import atomic_write_text
    from .integrity import record_update
    from .runs import locked, read_manifest, write_manifest

    run_dir = Path(run_dir)
    path = run_dir / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(run_dir / layout.LOCK):
        manifest = read_manifest(run_dir)  # under the lock: the latest record
        data = _read(path)
        problem = bytes_problem(run_dir, manifest, rel, data)
        if problem is not None:
            raise ArchiveDamaged(damaged_message(manifest.get("run_id", run_dir.name), problem), path=problem.path)
        text = update(data)
        if manifest.get("status") != "complete":
            atomic_write_text(path, text)
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
        try:
            atomic_write_text(tmp, text)
            manifest["checksums"] = record_update(
                run_dir, manifest, (), {rel: tmp}, lambda m: write_manifest(run_dir, m)
            )
        finally:
            tmp.unlink(missing_ok=True)  # (moved into place unless the recording failed)
        write_manifest(run_dir, manifest)
