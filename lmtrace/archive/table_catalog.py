"""What `lmtrace query` (and `stats`, over one run) can see: every run of a runs directory, and for
each SQL view the committed Parquet files that hold its rows, with the run (and sweep) each file
belongs to.

Reads manifests and lists files; opens no table. A damaged run (a missing or truncated committed
file, an unreadable manifest: what `lmtrace ls` shows as `damaged`) is left out and named in
`Catalog.skipped`, so one bad archive does not hide every other run; query/check.py then checks the
bytes of the files a query reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .explanations import EXPLAIN_DIR, SCORES_PARTS
from .heads import ANALYSIS_DIR, HEADS_FILE, PER_SEQUENCE_FILE
from .reader import table_files
from .runs import list_runs
from .summary import summary_or_damaged
from .sweeps import finished_sweeps

# view name -> what one row is (the documented tables: docs/archive.md, docs/heads.md, docs/sweep.md, docs/explain.md)
VIEWS = {
    "runs": "one row per run: its manifest's fields, status as `lmtrace ls` shows it",
    "sequences": "sequences.parquet: one row per sequence (prompt metadata columns included)",
    "tokens": "tokens.parquet: one row per token",
    "steps": "steps.parquet: one row per (sequence, step, layer)",
    "effects": "effects.parquet of intervene children: per-step effects",
    "heads": "analysis/heads.parquet: per-head scores and labels (`lmtrace heads`)",
    "heads_per_sequence": "analysis/heads_per_sequence.parquet (`lmtrace heads --per-sequence`)",
    "heads_by": "analysis/heads_by_<COLUMN>.parquet (`lmtrace heads --by COLUMN`): per group and head",
    "sweeps": "sweeps/<id>/sweep.parquet of finished sweeps, with a sweep_id column",
    "explain": "explain/scores.parts/*.parquet: attribution scores (`lmtrace explain`)",
    "features": "feat_<sae>_idx/_val arrays (capture.features, `lmtrace features`): one row per active SAE latent "
    "of a token",
}


@dataclass(frozen=True)
class TableFile:
    """One Parquet file of a view: where it is and whose rows it holds."""

    path: Path
    run_id: str
    sweep_id: str | None = None


@dataclass
class Catalog:
    """The readable runs of a runs directory: their `runs` rows, and the runs left out as damaged."""

    root: Path
    runs: list[dict] = field(default_factory=list)  # run_summary rows (without the size walk)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (run id, why)
    listed: set[Path] = field(default_factory=set)  # every file `files` gave since the last `vanished`

    def files(self, view: str) -> list[TableFile]:
        """The committed files of `view` over every readable run, in run order."""
        out: list[TableFile] = []
        for row in self.runs:
            out += view_files(Path(row["path"]), row["run_id"], view)
        self.listed.update(f.path for f in out)
        return out

    def vanished(self) -> bool:
        """Whether a file listed since the last call is gone: a running run merged its table parts
        (or completed) meanwhile, so a read error is no damage and listing again reads the run."""
        gone = any(not p.exists() for p in self.listed)
        self.listed = set()
        return gone

    def skip(self, run_id: str, why: str) -> None:
        """Leave a run out from now on (a file found damaged while reading it)."""
        self.runs = [r for r in self.runs if r["run_id"] != run_id]
        self.skipped.append((run_id, why))


def read_catalog(root: Path) -> Catalog:
    """Every run under `root`, as `lmtrace ls` sees it (status included); damaged ones set aside."""
    catalog = Catalog(root)
    for path in list_runs(root):
        row = summary_or_damaged(path, size=False)
        if row["status"] == "damaged":
            catalog.skipped.append((row["run_id"], row.get("error") or "damaged"))
        else:
            catalog.runs.append(row)
    return catalog


def view_files(run_dir: Path, run_id: str, view: str) -> list[TableFile]:
    """The committed files of one run that hold rows of `view` (none when the run lacks it)."""
    if view == "features":  # Zarr arrays, not Parquet files: read by archive/feature_rows.py
        return []
    if view in ("tokens", "steps", "sequences", "effects"):
        paths = table_files(run_dir, view)
    elif view == "heads":
        paths = [p for p in [run_dir / ANALYSIS_DIR / HEADS_FILE] if p.is_file()]
    elif view == "heads_per_sequence":
        paths = [p for p in [run_dir / ANALYSIS_DIR / PER_SEQUENCE_FILE] if p.is_file()]
    elif view == "heads_by":
        folder = run_dir / ANALYSIS_DIR
        paths = sorted(p for p in folder.glob("heads_by_*.parquet") if p.is_file()) if folder.is_dir() else []
    elif view == "explain":
        folder = run_dir / EXPLAIN_DIR / SCORES_PARTS
        paths = sorted(folder.glob("[!.]*.parquet")) if folder.is_dir() else []
    elif view == "sweeps":
        return [
            TableFile(d / "sweep.parquet", run_id, d.name)
            for d in finished_sweeps(run_dir)
            if (d / "sweep.parquet").is_file()
        ]
    else:
        raise KeyError(view)
    return [TableFile(p, run_id) for p in paths]
