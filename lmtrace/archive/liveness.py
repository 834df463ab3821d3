"""Who is writing a run: an owner lock per writer, plus pid + host + heartbeat.

Ownership: each writer (one per shard key) holds an exclusive `flock` on
`owners/<writer>.lock` for its whole life, taken right after the run directory is created or
found and before anything is written into it. The kernel releases it when the process dies (even
by SIGKILL), so it can neither be stolen nor go stale; a second writer or resumer of the same
key cannot take it and exits 2 naming the holder's pid (written into the lock file).

Each writing process (one per shard) keeps `heartbeats/<writer>.json` fresh every
`HEARTBEAT_S` seconds from a daemon thread. Another process judges a writer alive when it is on
the same host and its pid still runs lmtrace, or, on another host, when its heartbeat is younger
than `STALE_S` (a SIGKILLed writer stops beating at once).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from ..exits.errors import LmtraceError, SpecError
from . import layout

HEARTBEAT_DIR = "heartbeats"
HEARTBEAT_S = 5.0
STALE_S = 60.0
# A probe (`lock_holder`) holds a writer's lock for microseconds; a writer that meets one retries
# for this long before it concludes another writer owns the key.
ACQUIRE_RETRY_S = 0.5


class OwnerLock:
    """An exclusive flock on `owners/<writer>.lock`, held from `acquire` until `release` or exit.

    The file holds the owner's pid, host and start time (rewritten by each owner). It is never
    deleted, nor is the run directory it lives in: a directory a writer could hold a lock in is
    never removed (an unlinked lock file would let a second writer lock a new one).
    """

    def __init__(self, run_dir: Path, writer: str, run_id: str):
        self.path = run_dir / layout.OWNERS_DIR / f"{writer}.lock"
        self.writer = writer
        self.run_id = run_id
        self._fh = None

    def acquire(self) -> "OwnerLock":
        import fcntl

        self.path.parent.mkdir(exist_ok=True)
        fh = open(self.path, "a+")
        deadline = time.monotonic() + ACQUIRE_RETRY_S
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    fh.close()
                    raise SpecError(busy_message(self.run_id, self.writer, holder_info(self.path))) from None
                time.sleep(0.02)
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}))
        fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # closing the only descriptor releases the flock
            self._fh = None


def holder_info(path: Path) -> dict:
    """What the lock file says about its owner (it writes this just after taking the lock)."""
    for _ in range(20):
        try:
            info = json.loads(path.read_text() or "null")
        except (OSError, json.JSONDecodeError):
            info = None
        if isinstance(info, dict) and info.get("pid"):
            return info
        time.sleep(0.02)
    return {}


def busy_message(run_id: str, writer: str, info: dict) -> str:
    who = f"pid {info['pid']} on {info.get('host', '?')}" if info.get("pid") else "another process"
    return (
        f"run {run_id} ({writer}) is being written by {who}; not touching it (wait for it, or stop that process first)"
    )


def lock_holder(run_dir: Path, writer: str) -> dict | None:
    """The owner of a writer key when a live process holds its lock, else None (a momentary probe)."""
    import fcntl

    path = run_dir / layout.OWNERS_DIR / f"{writer}.lock"
    try:
        fh = open(path, "r")
    except OSError:
        return None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder_info(path)
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None


def _pid_runs_lmtrace(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: a live pid is all we can know
    return b"lmtrace" in cmdline


def live_writers(run_dir: Path, ignore: str | None = None) -> list[dict]:
    """Processes that are still writing this run (excluding `ignore`): owner locks held, and heartbeats."""
    out = []
    owners = run_dir / layout.OWNERS_DIR
    for f in sorted(owners.glob("*.lock")) if owners.is_dir() else []:
        if f.stem != ignore:
            info = lock_holder(run_dir, f.stem)
            if info is not None:
                out.append({"pid": None, "host": None, **info, "writer": f.stem})
    folder = run_dir / HEARTBEAT_DIR
    if not folder.is_dir():
        return out
    me = socket.gethostname()
    locked = {w["writer"] for w in out}
    for f in folder.glob("*.json"):
        if f.stem == ignore or f.stem in locked:
            continue
        try:
            beat = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if beat.get("host") == me:
            alive = beat.get("pid") != os.getpid() and _pid_runs_lmtrace(int(beat.get("pid", -1)))
        else:
            alive = time.time() - float(beat.get("time", 0)) < STALE_S
        if alive:
            out.append({**beat, "writer": f.stem})
    return out


def shown_status(run_dir: Path, manifest: dict) -> str:
    """The status to show for a run: the manifest's, except `killed` for a run it says is `running`
    that no live process writes (SIGKILL, a lost node, a time limit without a signal): nothing can
    record that, so readers decide it from the owner locks and heartbeats. A sharded run whose
    shards are all finished or not started yet (a SLURM array still pending) stays `running`."""
    status = manifest.get("status")
    if status != "running" or live_writers(run_dir):
        return status
    if manifest.get("shards", 1) > 1:
        folder = run_dir / layout.SHARDS_DIR
        for f in folder.glob("*.json") if folder.is_dir() else []:
            try:
                if json.loads(f.read_text()).get("status") == "running":
                    return "killed"
            except (OSError, json.JSONDecodeError):
                continue
        return status
    return "killed"


class Heartbeat:
    """Context manager: keep this process's heartbeat fresh while it writes; removed on a clean exit."""

    def __init__(self, run_dir: Path, writer: str):
        self.path = run_dir / HEARTBEAT_DIR / f"{writer}.json"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmtrace-heartbeat", daemon=True)

    def _beat(self) -> None:
        from .files import atomic_write_json  # (here: `lmtrace ls` asks who is alive without importing zarr)

        atomic_write_json(self.path, {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()})

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except OSError:
                pass  # a full disk shows up in the writer, which fails the run

    def __enter__(self):
        self.path.parent.mkdir(exist_ok=True)
        self._beat()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        try:
            self.path.unlink()
        except OSError:
            pass
        return False


def live(path: Path, status: str | None) -> bool | None:
    """For a run shown `running`: whether a process is writing it now (None when that cannot be
    told, and for a run in any other status)."""
    if not str(status or "").startswith("running"):
        return None
    try:
        return bool(live_writers(path))
    except (OSError, LmtraceError):
        return None
