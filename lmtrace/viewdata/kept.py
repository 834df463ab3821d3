"""What a long-lived reader (the server) keeps between requests, so that selecting a token reads only its own slices.

Opening a zarr array, listing a run's arrays, reading its per-sequence lengths and scanning a
Parquet file's footer cost a few milliseconds each on every request otherwise (several per
selected token). A complete run's archive no longer changes (a new manifest, e.g. after `lmtrace
lens`, opens a new Run in the Catalog), so these are kept per Run object, dropped with it; a
running run's are read every time. Its quick integrity check is repeated at most every RECHECK_S
seconds instead of on every run header. Parquet datasets are kept by their files' (path, mtime,
size), so a new part file or a rewritten table is a new key. None of this holds array data but
`latest`'s values (a latent's occurrences), of which only a bounded number are kept per run.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import zarr

from ..archive import parquet_io
from ..archive.damage import Problem
from ..archive.integrity import quick_problem
from ..archive.reader import Run

DATASETS = 64  # Parquet datasets kept (footers and schemas only)
# A complete run's quick integrity check (a stat of each committed file: ~5,000 files, 0.1-0.2 s for
# a 1.7 GB run) is trusted this long; reading a damaged chunk or table fails with its one line anyway.
RECHECK_S = 30.0

_per_run: weakref.WeakKeyDictionary[Run, dict] = weakref.WeakKeyDictionary()
_datasets: OrderedDict[tuple, ds.Dataset] = OrderedDict()
_lock = threading.Lock()


def _once(run: Run, key, compute):
    """compute() once per complete run; every time for one still being written."""
    if run.status != "complete":
        return compute()
    with _lock:
        store = _per_run.setdefault(run, {})
        if key in store:
            return store[key]
    value = compute()
    with _lock:
        store[key] = value
    return value


def latest(run: Run, group: str, key, compute, limit: int):
    """compute() once per complete run and key, keeping only the `limit` keys of `group` last asked for
    (values that hold array data); every time for a run still being written."""
    if run.status != "complete":
        return compute()
    with _lock:
        store = _per_run.setdefault(run, {}).setdefault(("latest", group), OrderedDict())
        if key in store:
            store.move_to_end(key)
            return store[key]
    value = compute()
    with _lock:
        store[key] = value
        while len(store) > limit:
            store.popitem(last=False)
    return value


def array_names(run: Run) -> frozenset[str]:
    return _once(run, "names", lambda: frozenset(run.array_names()))


def array(run: Run, name: str) -> zarr.Array:
    """The run's array `name` (opened lazily: reading a slice reads only the chunks holding it)."""
    return _once(run, ("array", name), lambda: run.array(name))


def lengths(run: Run, name: str) -> np.ndarray:
    """`prompt_len` or `generated_len`, one value per sequence."""
    return _once(run, ("lengths", name), lambda: run.array(name)[:])


def dataset(files: list[Path]) -> ds.Dataset:
    """A Parquet dataset over `files`, kept while none of them changes."""
    key = tuple((str(f), st.st_mtime_ns, st.st_size) for f in files for st in (f.stat(),))
    with _lock:
        found = _datasets.get(key)
        if found is not None:
            _datasets.move_to_end(key)
            return found
    made = parquet_io.dataset(files)
    with _lock:
        _datasets[key] = made
        while len(_datasets) > DATASETS:
            _datasets.popitem(last=False)
    return made


def checked(run: Run) -> None:
    """The run passed its quick check just now (Run() checks a complete run when opened)."""
    with _lock:
        _per_run.setdefault(run, {})["checked"] = (time.monotonic(), None)


def integrity_problem(run: Run) -> Problem | None:
    """`quick_problem` of the run, run again when the last one is older than RECHECK_S."""
    now = time.monotonic()
    with _lock:
        last = _per_run.setdefault(run, {}).get("checked")
    if last is not None and now - last[0] < RECHECK_S:
        return last[1]
    problem = quick_problem(run.path, run.manifest)
    with _lock:
        _per_run.setdefault(run, {})["checked"] = (now, problem)
    return problem


def once(run: Run, key, compute):
    """compute() kept per complete run (an analysis over the whole run, such as its groups' numbers);
    computed every time for a run still being written."""
    return _once(run, key, compute)
