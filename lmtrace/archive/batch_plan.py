"""Which sequences ran in which batch, and what each batch committed: the writers' plan files
(`progress/<shard>.plan.jsonl`) and progress files (`progress/<shard>.json`).

Before a batch runs, its sequences are appended to its writer's plan file (with `from_step`: steps
its sequences committed in the batch they were split from); `runner/batching.py` decides the batches,
this module is their record in the archive, read by the reader, `ls` and resume.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import layout

PLAN_SUFFIX = ".plan.jsonl"


@dataclass
class Batch:
    seqs: list[int]
    from_step: int = 0  # steps committed for these sequences in the batch they were split from

    @property
    def key(self) -> int:
        return self.seqs[0]


def plan_path(run_dir: Path, shard_key: str) -> Path:
    return run_dir / layout.PROGRESS_DIR / f"{shard_key}{PLAN_SUFFIX}"


def read_plan(run_dir: Path) -> dict[int, Batch]:
    """The batches recorded in every shard's plan file: key -> Batch. A later record takes its
    sequences from the batches recorded before it (a split's second half, recorded first, leaves the
    first half under the batch's key; the last record of a key wins). A torn last line (a kill) is ignored."""
    out: dict[int, Batch] = {}
    folder = run_dir / layout.PROGRESS_DIR
    for f in sorted(folder.glob(f"*{PLAN_SUFFIX}")) if folder.is_dir() else []:
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
                batch = Batch([int(s) for s in rec["sequences"]], int(rec.get("from_step", 0)))
            except (ValueError, KeyError, TypeError):
                continue
            if not batch.seqs:
                continue
            taken = set(batch.seqs)
            for key, other in list(out.items()):
                other.seqs = [s for s in other.seqs if s not in taken]
                if not other.seqs:
                    del out[key]
            out[batch.key] = batch
    return out


def merged_progress(run_dir: Path) -> dict:
    """Committed steps per batch, merged over every writer (shard): {"batches": {batch: {...}}}."""
    merged: dict = {"batches": {}}
    folder = run_dir / layout.PROGRESS_DIR
    for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            merged["batches"].update(json.loads(f.read_text())["batches"])
        except (OSError, json.JSONDecodeError, KeyError):
            continue
    return merged


def batch_plan(run_dir: Path, manifest: dict) -> tuple[dict[int, int], dict[int, int]]:
    """sequence -> its batch, and batch -> steps it inherited from the batch it was split from:
    from the writers' plan files (batching.py), else (runs from before them) the fixed batch size."""
    batch_of, from_step = {}, {}
    for key, batch in read_plan(run_dir).items():
        from_step[key] = batch.from_step
        for s in batch.seqs:
            batch_of[s] = key
    if batch_of:
        return batch_of, from_step
    size = manifest.get("spec_resolved", {}).get("generation", {}).get("batch_size", 1)
    if not isinstance(size, int):
        return {}, {}
    n, shards = manifest.get("shape", {}).get("n_sequences", 0), manifest.get("shards", 1)
    for shard in range(shards):
        seqs = list(range(shard, n, shards))
        for i in range(0, len(seqs), size):
            for s in seqs[i : i + size]:
                batch_of[s] = seqs[i]
    return batch_of, from_step


def sequences_done(run_dir: Path, manifest: dict) -> int:
    """Sequences whose batch is committed as done, over every writer (shard)."""
    batch_of, _ = batch_plan(run_dir, manifest)
    batches = merged_progress(run_dir)["batches"]
    return sum(1 for b in batch_of.values() if batches.get(str(b), {}).get("done"))


def record_batch(path: Path, batch: Batch) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps({"batch": batch.key, "sequences": batch.seqs, "from_step": batch.from_step}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
