"""Checksums of a complete run's committed files, and the checks that find a damaged archive.

At completion (and again after `lmtrace lens` adds its arrays) the writer records the size and
sha256 of every committed file — `spec.yaml`, every top-level `*.parquet` table, every file under
`tensors.zarr/` (chunk files and metadata) — in `checksums.json`, and the manifest records that
file's own sha256 under `checksums`. Files that change after completion by design (manifest,
log, progress, shard status, heartbeats, locks, `explain/`, `sweeps/`) are not covered.

- `verify` (`lmtrace verify RUN`) hashes everything: missing, truncated (another size) and
  changed (same size, another sha256) files.
- `quick_problem` only stats: what every reading command checks when it opens a complete run
  (missing and truncated files), in about a millisecond per thousand files.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import layout

CHECKSUMS = "checksums.json"


def committed_files(run_dir: Path) -> list[str]:
    """Relative paths of the files a complete run's checksums cover, sorted."""
    out = []
    for name in (layout.SPEC,):
        if (run_dir / name).is_file():
            out.append(name)
    out += sorted(p.name for p in run_dir.glob("*.parquet") if p.is_file())
    tensors = run_dir / layout.TENSORS
    for base, dirs, files in os.walk(tensors):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = os.path.relpath(base, run_dir)
        out += [os.path.join(rel, f) for f in files if not f.startswith(".")]
    return sorted(out)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def record(run_dir: Path) -> dict:
    """Write checksums.json for the run's committed files; returns the manifest's `checksums` entry."""
    from .writer import atomic_write_json

    files = {rel: [os.path.getsize(run_dir / rel), _sha256(run_dir / rel)] for rel in committed_files(run_dir)}
    atomic_write_json(run_dir / CHECKSUMS, {"algorithm": "sha256", "files": files})
    return {"file": CHECKSUMS, "sha256": _sha256(run_dir / CHECKSUMS), "n_files": len(files),
            "bytes": sum(size for size, _ in files.values())}


@dataclass
class Problem:
    path: str  # relative to the run directory
    kind: str  # missing | truncated | changed | unreadable | extra

    def __str__(self) -> str:
        return f"{self.path} is {self.kind}"


def _recorded(run_dir: Path, manifest: dict) -> tuple[dict | None, Problem | None]:
    """The recorded {path: [size, sha256]}, or the problem with checksums.json itself (None, None: not recorded)."""
    entry = manifest.get("checksums")
    if not entry:
        return None, None
    path = run_dir / entry.get("file", CHECKSUMS)
    try:
        data = json.loads(path.read_text())
        return data["files"], None
    except FileNotFoundError:
        return None, Problem(CHECKSUMS, "missing")
    except (OSError, ValueError, KeyError, TypeError):
        return None, Problem(CHECKSUMS, "unreadable")


# While a deferred lens is pending, `lmtrace lens` may have rewritten these (and been stopped before
# it recorded new checksums): they are not checked until the lens is recorded as computed.
LENS_REWRITES = ("steps.parquet", f"{layout.TENSORS}/zarr.json", f"{layout.TENSORS}/lens_")


def _skipped(manifest: dict) -> tuple[str, ...]:
    lens = manifest.get("lens") or {}
    pending = lens.get("when", "inline") == "deferred" and not lens.get("computed")
    return LENS_REWRITES if pending else ()


def _tables_listed(run_dir: Path, manifest: dict) -> list[Problem]:
    """Runs completed before checksums were recorded: the compacted tables the manifest counts rows of."""
    return [Problem(layout.table_file(t), "missing") for t in (manifest.get("table_rows") or {})
            if not (run_dir / layout.table_file(t)).is_file()]


def quick_problem(run_dir: Path, manifest: dict, prefix: str = "") -> Problem | None:
    """The first missing or truncated committed file of a complete run (stat only), or None."""
    if manifest.get("status") != "complete":
        return None
    files, problem = _recorded(run_dir, manifest)
    if problem is not None:
        return problem
    if files is None:
        listed = _tables_listed(run_dir, manifest)
        return listed[0] if listed else None
    skip = _skipped(manifest)
    for rel, (size, _) in files.items():
        if not rel.startswith(prefix) or rel.startswith(skip):
            continue
        try:
            if os.stat(run_dir / rel).st_size != size:
                return Problem(rel, "truncated" if os.stat(run_dir / rel).st_size < size else "changed")
        except FileNotFoundError:
            return Problem(rel, "missing")
        except OSError:
            return Problem(rel, "unreadable")
    return None


def verify(run_dir: Path, manifest: dict, prefix: str = "") -> tuple[list[Problem], int, bool]:
    """Every problem of a complete run's committed files (hashing them). Returns (problems,
    files checked, whether checksums were recorded)."""
    files, problem = _recorded(run_dir, manifest)
    if problem is not None:
        return [problem], 0, True
    if files is None:
        return _tables_listed(run_dir, manifest), 0, False
    entry = manifest["checksums"]
    if entry.get("sha256") and _sha256(run_dir / entry.get("file", CHECKSUMS)) != entry["sha256"]:
        return [Problem(CHECKSUMS, "changed")], 0, True
    problems, n = [], 0
    skip = _skipped(manifest)
    for rel, (size, digest) in files.items():
        if not rel.startswith(prefix) or rel.startswith(skip):
            continue
        n += 1
        path = run_dir / rel
        try:
            actual = os.stat(path).st_size
            if actual != size:
                problems.append(Problem(rel, "truncated" if actual < size else "changed"))
            elif _sha256(path) != digest:
                problems.append(Problem(rel, "changed"))
        except FileNotFoundError:
            problems.append(Problem(rel, "missing"))
        except OSError:
            problems.append(Problem(rel, "unreadable"))
    if not prefix:
        recorded = set(files)
        problems += [Problem(rel, "extra") for rel in committed_files(run_dir)
                     if rel not in recorded and rel.startswith(layout.TENSORS + "/") and "/c/" in rel
                     and not rel.startswith(skip)]
    return problems, n, True


def damaged_message(run_id: str, problem: Problem | str) -> str:
    return f"run {run_id} is damaged: {problem}; `lmtrace verify {run_id}`"
