"""Who is writing a run: pid + host + heartbeat, so a live writer is never disturbed by a resume.

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

from .archive.writer import atomic_write_json

HEARTBEAT_DIR = "heartbeats"
HEARTBEAT_S = 5.0
STALE_S = 60.0


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
    """Heartbeats of processes that are still writing this run (excluding `ignore`)."""
    out = []
    folder = run_dir / HEARTBEAT_DIR
    if not folder.is_dir():
        return out
    me = socket.gethostname()
    for f in folder.glob("*.json"):
        if f.stem == ignore:
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


class Heartbeat:
    """Context manager: keep this process's heartbeat fresh while it writes; removed on a clean exit."""

    def __init__(self, run_dir: Path, writer: str):
        self.path = run_dir / HEARTBEAT_DIR / f"{writer}.json"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmtrace-heartbeat", daemon=True)

    def _beat(self) -> None:
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
