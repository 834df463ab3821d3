"""Run directories: where runs live, unique run ids, the manifest and the event log."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import secrets
import socket
import sys
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from ..exits.errors import LmtraceError, RunNotFoundError, SpecError
from . import layout

PACKAGES = (
    "lmtrace",
    "torch",
    "transformers",
    "zarr",
    "numcodecs",
    "pyarrow",
    "numpy",
    "tokenizers",
    "gguf",
    "typer",
    "pydantic",
)


def runs_root(flag: str | None = None, spec_value: str | None = None) -> Path:
    """Precedence: --runs-dir flag, then output.runs_dir in the spec, then $LMTRACE_RUNS_DIR, then ./runs."""
    for value in (flag, spec_value, os.environ.get("LMTRACE_RUNS_DIR")):
        if value:
            return Path(value).expanduser()
    return Path("runs")


def require_runs_root(root: Path) -> Path:
    """`root` when it is a directory, else one line naming it, where it came from and how to fix it.

    What every command that reads runs calls before it looks inside the runs directory (`find_run`
    for a run id, `list_runs`): a mistyped --runs-dir or $LMTRACE_RUNS_DIR is an error, never an
    empty answer. Only `generate` (and the children `intervene` and `sweep` write) creates a runs
    directory that does not exist yet."""
    if root.is_dir():
        return root
    if root.exists():
        raise SpecError(f"runs directory {root} is not a directory; pass --runs-dir or set LMTRACE_RUNS_DIR")
    env = os.environ.get("LMTRACE_RUNS_DIR")
    if env and Path(env).expanduser() == root:
        where = " ($LMTRACE_RUNS_DIR)"
    elif root == Path("runs"):
        where = f" (the default, ./runs under {Path.cwd()}; no --runs-dir or $LMTRACE_RUNS_DIR given)"
    else:
        where = ""
    raise SpecError(
        f"runs directory {root} does not exist{where}; pass the directory that holds your runs with "
        f"--runs-dir or $LMTRACE_RUNS_DIR (`lmtrace generate SPEC` creates it with a first run)"
    )


def check_runs_root(root: Path, run_id: str | None = None) -> None:
    """Fail early (before a model is loaded) if runs cannot be created under `root`; creates nothing."""
    existing = root
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        what = "is a file" if existing == root else f"cannot be created: {existing} is a file, not a directory"
        raise SpecError(f"runs directory {root} {what}; pass another --runs-dir or set LMTRACE_RUNS_DIR")
    if existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
        raise SpecError(
            f"runs directory {root} is not writable ({existing} is read-only for this user); "
            f"pass another --runs-dir or set LMTRACE_RUNS_DIR"
        )
    # An existing run id is not an error here: the same spec and run id again resumes the run
    # (archive.rundir.check_target decides, before the model is loaded).


def new_run_id() -> str:
    """Sortable by creation time and unique across concurrent processes (random suffix + exclusive mkdir)."""
    now = dt.datetime.now(dt.timezone.utc)
    return now.strftime("%Y%m%d-%H%M%S-") + f"{now.microsecond // 1000:03d}" + secrets.token_hex(3)


def create_run_dir(root: Path, run_id: str | None) -> tuple[str, Path]:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpecError(
            f"runs directory {root} cannot be created ({err.strerror}); pass --runs-dir or set LMTRACE_RUNS_DIR"
        ) from None
    if not os.access(root, os.W_OK):
        raise SpecError(f"runs directory {root} is not writable; pass --runs-dir or set LMTRACE_RUNS_DIR")
    for _ in range(5):
        rid = run_id or new_run_id()
        path = root / rid
        try:
            path.mkdir()  # exclusive: two processes can never share a run directory by accident
            return rid, path
        except FileExistsError:
            if run_id:
                raise SpecError(f"run {run_id} already exists in {root}; choose another output.run_id") from None
        except OSError as err:
            raise SpecError(f"cannot create run directory {path} ({err.strerror})") from None
    raise LmtraceError(f"could not allocate a unique run id in {root}")


def package_versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def host_info() -> dict:
    import torch

    info = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    slurm = {
        k: v
        for k, v in os.environ.items()
        if k.startswith("SLURM_")
        and k
        in (
            "SLURM_JOB_ID",
            "SLURM_ARRAY_JOB_ID",
            "SLURM_ARRAY_TASK_ID",
            "SLURM_ARRAY_TASK_COUNT",
            "SLURM_JOB_NAME",
            "SLURM_NODELIST",
            "SLURM_CLUSTER_NAME",
        )
    }
    if slurm:
        info["slurm"] = slurm
    return info


@contextmanager
def locked(path: Path):
    """An exclusive flock on `path` (created if missing) for the block's duration.

    The kernel releases it when the holder dies, so a killed process cannot leave a run locked.
    Without advisory locks (Windows) it is a no-op: the callers re-read what they rewrite just
    before writing, which narrows the window."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class RunLog:
    """Structured events, one JSON object per line, flushed as they happen."""

    def __init__(self, path: Path):
        self.path = path

    def event(self, kind: str, **fields) -> None:
        rec = {"time": time.time(), "event": kind, **fields}
        with self.path.open("a") as fh:
            fh.write(json.dumps(rec, default=str) + "\n")


def write_manifest(run_dir: Path, manifest: dict) -> None:
    from .files import STATUS_SLACK, atomic_write_json

    atomic_write_json(run_dir / layout.MANIFEST, manifest, slack=STATUS_SLACK)


def write_status(path: Path, obj: dict) -> None:
    """Record a final status (manifest or shard file): atomically, or, when that fails for lack of
    space, in place within the file's reserved slack."""
    import errno

    from .files import STATUS_SLACK, atomic_write_json, rewrite_in_place

    try:
        atomic_write_json(path, obj, slack=STATUS_SLACK)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT) or not path.is_file():
            raise
        rewrite_in_place(path, obj)


def read_manifest(run_dir: Path) -> dict:
    path = run_dir / layout.MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RunNotFoundError(f"{run_dir} is not an lmtrace run (no {layout.MANIFEST})") from None
    except (json.JSONDecodeError, OSError) as err:
        raise RunNotFoundError(f"{path} is unreadable ({err}); the run archive is damaged") from None


def lens_state(manifest: dict) -> str:
    """none (no lens captured) | pending (deferred, not computed yet) | ready."""
    lens = manifest.get("lens")
    if not lens:
        return "none"
    if lens.get("when", "inline") == "deferred" and not lens.get("computed"):
        return "pending"
    return "ready"


def find_run(ref: str, root: Path | None = None) -> Path:
    """A run given as a path, or as an id (or a unique prefix of one) under the runs root."""
    if not ref.strip():
        raise RunNotFoundError(
            "no run given: pass a run id, a unique prefix of one, or a run directory; `lmtrace ls` lists runs"
        )
    path = Path(ref).expanduser()
    if (path / layout.MANIFEST).is_file():
        return path
    root = require_runs_root(root or runs_root())
    candidate = root / ref
    if (candidate / layout.MANIFEST).is_file():
        return candidate
    matches = sorted(p for p in root.iterdir() if p.name.startswith(ref) and (p / layout.MANIFEST).is_file())
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise RunNotFoundError(
            f"run id prefix {ref!r} is ambiguous in {root}: {', '.join(m.name for m in matches[:5])}"
        )
    raise RunNotFoundError(f"no run {ref!r} in {root} (nor a run directory at that path); `lmtrace ls` lists runs")


def list_runs(root: Path) -> list[Path]:
    """Run directories under `root`, oldest first; a `root` that does not exist is an error (`require_runs_root`)."""
    require_runs_root(root)
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and (p / layout.MANIFEST).is_file())
    except OSError as err:
        raise SpecError(f"cannot list runs directory {root} ({err.strerror or err})") from None


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KB' (binary multiples), for sizes shown to people."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PB"


def dir_size(path: Path) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(base, f))
            except OSError:
                pass
    return total
