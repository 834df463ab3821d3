"""The runs a server may show: run ids checked against the runs directory's own listing, opened
runs cached while their manifest is unchanged, and the runs list with its filters and search.

A run's address is its directory's name, in the list, its links and every route: a copy of a run
under another name is a run of its own (its manifest may still name the original: `manifest_run_id`).
A symlink to a run the list already holds is listed once, on that run's row (`links`); its name
still opens the run."""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from pathlib import Path

import pyarrow as pa

from ..archive import layout, parquet_io
from ..archive.liveness import live
from ..archive.reader import IncompleteRunWarning, Run, table_files
from ..archive.runs import list_runs
from ..archive.summary import summary_or_damaged
from ..exits.errors import ArchiveDamaged, ArchiveError, RunNotFoundError
from ..viewdata import kept

OPEN_RUNS = 16  # runs kept open (manifest, zarr group, vocabulary); each holds no array data


class Catalog:
    """Run directories under one root, by id. Safe to call from many threads."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._real_root = self.root.resolve()
        self._runs: OrderedDict[tuple, Run] = OrderedDict()
        self._lock = threading.Lock()
        # runs a request found damaged (a checksum that failed): resolved run directory -> (the file
        # relative to it, that file's (mtime, size) then, the one-line message)
        self._damaged: dict[Path, tuple[str, tuple | None, str]] = {}

    # ---- which directories are runs ----------------------------------------------------------
    def run_dirs(self) -> list[Path]:
        """Run directories directly under the root that resolve inside it (a symlink out of it is not a run here)."""
        return [p for p in list_runs(self.root) if not p.name.startswith(".") and self._inside(p)]

    def listed(self) -> list[tuple[Path, list[str]]]:
        """The runs of the list, each directory once: (its path, the names of the symlinks to it). A run
        reached by several names is listed under its real directory's name (or the first link's, when
        the directory itself is not directly under the root)."""
        groups: dict[Path, list[Path]] = {}
        for p in self.run_dirs():
            try:
                groups.setdefault(p.resolve(), []).append(p)
            except OSError:
                continue
        out = []
        for paths in groups.values():
            real = [p for p in paths if not p.is_symlink()]
            main = (real or paths)[0]
            out.append((main, sorted(p.name for p in paths if p != main)))
        return sorted(out, key=lambda x: x[0].name)

    def _inside(self, path: Path) -> bool:
        try:
            return path.resolve().is_relative_to(self._real_root)
        except OSError:
            return False

    def path_of(self, run_id: str) -> Path:
        """The directory of run `run_id`: only a name the root's own listing holds (never a path, `..`
        or a prefix), resolving inside the root."""
        for p in self.run_dirs():
            if p.name == run_id:
                return p
        raise RunNotFoundError(f"no run {run_id!r} in the runs directory")

    # ---- opened runs -------------------------------------------------------------------------
    def open(self, run_id: str) -> Run:
        """The run, opened once per manifest version (a damaged run raises its one-line ArchiveError)."""
        path = self.path_of(run_id)
        found = self.known_damage(path)
        if found is not None:  # a read found damaged bytes: every route of the run says so, as the runs list does
            raise ArchiveDamaged(found[1], path=found[0], run_dir=path)
        try:
            key = (run_id, (path / layout.MANIFEST).stat().st_mtime_ns)
        except OSError as err:
            raise RunNotFoundError(f"run {run_id}: its manifest is unreadable ({err.strerror})") from None
        with self._lock:
            run = self._runs.get(key)
            if run is not None:
                self._runs.move_to_end(key)
                return run
        with warnings.catch_warnings():  # a running run is shown up to its committed steps, on purpose
            warnings.simplefilter("ignore", IncompleteRunWarning)
            run = Run(path)  # checks a complete run's files (stat only): damaged raises here
        kept.checked(run)
        with self._lock:
            for old in [k for k in self._runs if k[0] == run_id]:
                del self._runs[old]
            self._runs[key] = run
            while len(self._runs) > OPEN_RUNS:
                self._runs.popitem(last=False)
        return run

    # ---- damage found by reads ----------------------------------------------------------------
    def note_damage(self, err: ArchiveDamaged) -> None:
        """Remember that a request read damaged bytes of a run (its runs-list row and pages then say
        `damaged`) until the damaged file changes (restored from a copy, or the run rewritten)."""
        if err.run_dir is None or not err.path:
            return
        run_dir = Path(err.run_dir)
        with self._lock:
            self._damaged[run_dir.resolve()] = (err.path, _stat_key(run_dir / err.path), str(err))

    def known_damage(self, path: Path) -> tuple[str, str] | None:
        """(file, message) of the damage a request found in the run at `path`, while that file is unchanged."""
        if not self._damaged:
            return None
        where = path.resolve()
        with self._lock:
            entry = self._damaged.get(where)
        if entry is None:
            return None
        rel, stat, message = entry
        if _stat_key(path / rel) != stat:
            with self._lock:
                self._damaged.pop(where, None)
            return None
        return rel, message

    # ---- the runs list -----------------------------------------------------------------------
    def rows(
        self, *, kind: str | None = None, status: str | None = None, model: str | None = None, query: str | None = None
    ) -> list[dict]:
        """One row per run (as `lmtrace ls --json` has it, plus `live`, `sequences`, `children`),
        filtered; `query` matches the run id or any prompt's text (case-insensitive)."""
        rows = []
        for path, links in self.listed():
            row = summary_or_damaged(path)
            found = self.known_damage(path)
            if found is not None:  # bytes a request read failed their checksum
                row["status"], row["error"] = "damaged", found[1]
            row.pop("path", None)  # where the runs live on disk is not the page's business
            if isinstance(row.get("parent"), dict):
                row["parent"] = {k: v for k, v in row["parent"].items() if k != "path"}
            if row.get("run_id") != path.name:  # a copy (or a renamed run): its address is its directory
                row["manifest_run_id"] = row.get("run_id")
            row["run_id"] = path.name
            row["links"] = links
            row["sequences"] = row.get("prompts")
            row["live"] = live(path, row.get("status"))
            rows.append(row)
        # a parent is named by its manifest's id: link to the directory of that name, else to one whose
        # manifest has that id
        by_manifest: dict[str, str] = {}
        for r in rows:
            by_manifest.setdefault(r.get("manifest_run_id") or r["run_id"], r["run_id"])
        names = {r["run_id"] for r in rows}
        children: dict[str, list[str]] = {}
        for r in rows:
            if r.get("parent_id"):
                if r["parent_id"] not in names:
                    r["parent_id"] = by_manifest.get(r["parent_id"], r["parent_id"])
                children.setdefault(r["parent_id"], []).append(r["run_id"])
        for r in rows:
            r["children"] = children.get(r["run_id"], [])
        if kind:
            rows = [r for r in rows if r.get("kind") == kind]
        if status:
            rows = [r for r in rows if str(r.get("status", "")).split(" ")[0] == status]
        if model:
            rows = [r for r in rows if r.get("model") == model]
        if query:
            q = query.lower()
            rows = [r for r in rows if q in r["run_id"].lower() or self._prompts_match(r["run_id"], q)]
        return rows

    def _prompts_match(self, run_id: str, q: str) -> bool:
        """Whether a prompt of the run contains `q`: reads only the `prompt` column of its sequences table."""
        path = self.path_of(run_id)
        for f in table_files(path, "sequences"):
            try:
                prompts = parquet_io.read_table(f, columns=["prompt"]).column("prompt").to_pylist()
            except (OSError, pa.ArrowException, KeyError, ArchiveError):
                continue  # a damaged or foreign table: its run still matches by id, and shows its damage
            if any(q in (p or "").lower() for p in prompts):
                return True
        return False


def _stat_key(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
