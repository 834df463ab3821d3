"""Files written whole or not at all (write-to-temp, fsync, rename), the in-place rewrite that records
a failure on a full disk, and the one-line note that says where the space ran out. Shared by the
writer, the run directory's manifest, owner locks, checksums and every command that writes a file
into a run; it imports neither zarr nor the writer, so `lmtrace ls` can use it."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import threading
from pathlib import Path

import pyarrow as pa

# JSON files whose status may have to change on a full disk (manifest, shard status) are written
# with this much trailing whitespace, so `rewrite_in_place` can record `failed` in the blocks the
# file already has.
STATUS_SLACK = 4096


def atomic_write_json(path: Path, obj, slack: int = 0) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n" + " " * slack)


def atomic_write_text(path: Path, text: str) -> None:
    """Write-to-temp + fsync + rename: readers see the old file or the new one, never a part."""
    # a unique temporary name: several writers (shards, explain) may replace the same file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with tmp.open("w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a temporary file behind (a full disk, a signal)
        raise


def _syncfs():
    """libc's syncfs(2) (Linux), or None where the C library has none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int]
    return fn


_SYNCFS = _syncfs()


def flush_filesystem(path: Path) -> None:
    """Everything written so far to the filesystem that holds `path` is on disk when this returns.

    syncfs(2) flushes that one filesystem; `os.sync()`, the fallback where there is no syncfs, flushes
    every filesystem of the machine, which on a node shared with other jobs' I/O can take long."""
    if _SYNCFS is None:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs failed: {os.strerror(err)}", str(path))
    finally:
        os.close(fd)


def atomic_write_parquet(table: pa.Table, path: Path) -> None:
    """Write a Parquet file whole or not at all: a temporary name of this process, then a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        from .parquet_io import write_table  # pyarrow.dataset only where a table is written

        write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave a temporary file behind (a full disk, a signal)
        raise


def rewrite_in_place(path: Path, obj) -> None:
    """Overwrite a JSON file within its current length (padding with spaces): needs no free space.

    Not atomic, so only the fallback when `atomic_write_json` fails for lack of space: the status
    change to `failed` must not itself need free space."""
    text = json.dumps(obj, default=str).encode()
    size = os.path.getsize(path)
    if len(text) > size:
        raise OSError(28, f"{path.name} has no room left for the new status ({len(text)} > {size} bytes)", str(path))
    with open(path, "r+b") as fh:
        fh.write(text + b" " * (size - len(text)))
        fh.flush()
        os.fsync(fh.fileno())


def space_note(path: Path, err: OSError) -> str:
    """'No space left on device writing PATH; N bytes free there' for an OSError."""
    import errno

    target = getattr(err, "filename", None) or path
    probe = Path(target)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
        where = f"; {free} bytes free there"
    except OSError:
        where = ""
    # (pyarrow's own words around the errno's are long: "Error writing bytes to file. Detail: ...")
    reason = os.strerror(err.errno) if err.errno in (errno.ENOSPC, errno.EDQUOT) else err.strerror or err
    return f"{reason} writing {target}{where}"
