"""The run-directory protocol: who may write a run, and how a run starts, resumes and ends.

A run directory is written by one process per writer key (a shard), each holding its owner
lock for its whole life (liveness.OwnerLock); short flocks on the run's lock file guard the
manifest and array creation and the finalisation. `check_target` decides, without side effects,
whether an invocation starts, joins or resumes a run; `open_run_dir` takes ownership; failures
are recorded by `finish_failed`, which never claims `complete`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..exits.errors import Interrupted, LmtraceError, SpecError
from . import layout, parquet_io
from .runs import create_run_dir, locked, now_iso


@dataclass
class Shard:
    index: int = 0
    count: int = 1

    @property
    def key(self) -> str:
        return f"shard-{self.index}-of-{self.count}"

    def sequences_per_file(self, n: int, chunk_sequences: int) -> int:
        """Sequences of one shard file (`output.chunk_sequences`), fewer when the run is split over more
        processes than that leaves groups for: every process gets sequences to write."""
        return max(1, min(chunk_sequences, -(-n // self.count)))

    def sequences(self, n: int, group: int | None = None) -> list[int]:
        """The sequences of n this shard writes: whole groups of `group` sequences (one shard file's
        worth, so no two processes ever write one file), every `count`-th group from group `index`;
        without groups (a format-2 run), every `count`-th sequence."""
        if not group or self.count == 1:
            return list(range(self.index, n, self.count))
        return [
            s for g in range(self.index, -(-n // group), self.count) for s in range(g * group, min(n, (g + 1) * group))
        ]


def parse_shard(value: str | None) -> tuple[Shard, str | None]:
    """`I/N`, or `auto` from SLURM array variables. Returns the shard and a default run id."""
    import os

    if value is None:
        return Shard(), None
    if value == "auto":
        env = os.environ
        if "SLURM_ARRAY_TASK_ID" not in env:
            raise SpecError(
                "--shard auto needs SLURM_ARRAY_TASK_ID (run it inside a SLURM job array) or use --shard I/N"
            )
        task = int(env["SLURM_ARRAY_TASK_ID"])
        lo = int(env.get("SLURM_ARRAY_TASK_MIN", 0))
        hi = int(env.get("SLURM_ARRAY_TASK_MAX", task))
        count = int(env.get("SLURM_ARRAY_TASK_COUNT", hi - lo + 1))
        if hi - lo + 1 != count:
            raise SpecError(
                f"--shard auto needs a contiguous array (--array={lo}-{hi}); got {count} tasks in {lo}..{hi}"
            )
        job = env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID")
        return Shard(task - lo, count), (f"slurm-{job}" if job else None)
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise SpecError(f"--shard {value!r}: expected I/N (e.g. 0/4) or auto") from None
    if not (n >= 1 and 0 <= i < n):
        raise SpecError(f"--shard {value}: I must be in 0..N-1 and N >= 1")
    return Shard(i, n), None


_SPEC_IGNORED_ON_RESUME = ("output.run_id", "output.runs_dir")


def _first_difference(a, b, path="") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else str(key)
            if sub in _SPEC_IGNORED_ON_RESUME:
                continue
            diff = _first_difference(a.get(key), b.get(key), sub)
            if diff:
                return diff
        return None
    return None if a == b else path


class RunDir:
    """Opens a run directory for writing: new, joined by another shard, or resumed."""

    def __init__(self, path: Path, shard: Shard):
        self.path = path
        self.shard = shard

    def lock(self):
        """The run's short lock (manifest and array creation, finalisation)."""
        return locked(self.path / layout.LOCK)

    def shard_file(self, key: str | None = None) -> Path:
        return self.path / layout.SHARDS_DIR / f"{key or self.shard.key}.json"

    def set_shard_status(self, status: str, **fields) -> None:
        import os
        import socket

        from .runs import write_status

        self.shard_file().parent.mkdir(exist_ok=True)
        write_status(
            self.shard_file(),
            {
                "shard": self.shard.index,
                "of": self.shard.count,
                "status": status,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "updated": now_iso(),
                **fields,
            },
        )

    def other_shard_statuses(self) -> dict[str, str]:
        out = {}
        for i in range(self.shard.count):
            key = Shard(i, self.shard.count).key
            f = self.shard_file(key)
            if key != self.shard.key and f.is_file():
                out[key] = json.loads(f.read_text()).get("status")
        return out

    def shard_statuses(self) -> dict[int, str | None]:
        """Every shard's status by index (None where it has written none yet)."""
        out = {}
        for i in range(self.shard.count):
            f = self.shard_file(Shard(i, self.shard.count).key)
            out[i] = json.loads(f.read_text()).get("status") if f.is_file() else None
        return out

    def all_shards_complete(self) -> bool:
        return all(status == "complete" for status in self.shard_statuses().values())


def check_target(
    root: Path, spec, shard: Shard, resume: bool, owned: bool = False, kind: str = "generate"
) -> dict | None:
    """Decide, without side effects, whether this invocation starts, joins or resumes a run.

    Returns the existing manifest when resuming (or joining a sharded run), None for a new run.
    Called before the model is loaded (a quick refusal) and again once this process owns the
    writer key (`owned`: the answer can no longer change under it). `kind`: the kind of run this
    invocation writes (an intervene child is resumed by replaying its edits).
    """
    from .liveness import busy_message, live_writers
    from .runs import read_manifest

    run_id = spec.output.run_id
    if run_id is None or not (root / run_id / layout.MANIFEST).is_file():
        if resume:
            raise SpecError(f"no run {run_id!r} to resume in {root}; `lmtrace ls` lists runs")
        if run_id is not None and (root / run_id).exists() and shard.count == 1:
            # a process stopped before it wrote its manifest leaves only its lock files: the run id is free
            leftovers = [p.name for p in (root / run_id).iterdir() if p.name not in (layout.LOCK, layout.OWNERS_DIR)]
            if leftovers or not (root / run_id).is_dir():
                raise SpecError(f"{root / run_id} exists but is not an lmtrace run; choose another output.run_id")
        return None
    path = root / run_id
    existing = read_manifest(path)
    if existing.get("kind", "generate") != kind:
        raise SpecError(
            f"run {run_id} is an {existing.get('kind')} run, not a spec's own run; continue it with "
            f"`lmtrace generate --resume {run_id}`"
        )
    diff = _first_difference(existing["spec_resolved"], spec.model_dump(mode="json"))
    if diff:
        raise SpecError(
            f"run {run_id} exists with a different spec (differs at {diff}); use another run id, "
            f"or `lmtrace generate --resume {run_id}` to continue it as it was"
        )
    if existing.get("status") == "complete":
        raise SpecError(f"run {run_id} is already complete in {root}; nothing to resume")
    if existing.get("shards", 1) != shard.count:
        raise SpecError(
            f"run {run_id} is written by {existing.get('shards', 1)} shard(s); pass --shard I/"
            f"{existing.get('shards', 1)} (or leave out --workers and --shard: each shard is resumed)"
        )
    shard_file = path / layout.SHARDS_DIR / f"{shard.key}.json"
    if (
        shard_file.is_file()
        and json.loads(shard_file.read_text()).get("status") == "complete"
        and not RunDir(path, shard).all_shards_complete()
    ):
        # (when every shard is complete but the run is not, the finaliser was killed: rerunning finalises)
        raise SpecError(f"{shard.key} of run {run_id} is already complete; the run waits for its other shards")
    if not owned:  # (once owned, the lock is the answer)
        mine = [w for w in live_writers(path) if w["writer"] == shard.key]
        if mine:
            raise SpecError(busy_message(run_id, shard.key, mine[0]))
    return existing


def open_run_dir(root: Path, spec, shard: Shard, resume: bool, fresh: bool = False, kind: str = "generate"):
    """Create or reopen the run directory and take ownership of this writer's key in it.

    Returns (run_id, path, existing manifest or None, OwnerLock). Nothing is written into the
    directory before the lock is held; a directory is never removed (another writer could be
    about to lock it). A second writer of the same key gets exit 2 naming the holder. `fresh`
    (intervene's new children): the run id must not exist at all. `kind`: as for check_target.
    """
    from ..exits.faults import pause_after_owning
    from .liveness import OwnerLock

    run_id = spec.output.run_id
    if run_id is None or fresh:
        if shard.count > 1:
            raise SpecError(
                "a sharded run needs a shared run id: pass --run-id (with --shard auto it is slurm-<job id>)"
            )
        run_id, path = create_run_dir(root, run_id)  # an exclusive mkdir: nobody else has this id
    else:
        check_target(root, spec, shard, resume, kind=kind)  # refuse what can be refused before creating anything
        path = root / run_id
        try:
            path.mkdir(parents=True, exist_ok=True)  # every shard (or a restart) joins the same directory
        except OSError as err:
            raise SpecError(f"cannot create run directory {path} ({err.strerror})") from None
    owner = OwnerLock(path, shard.key, run_id).acquire()
    try:
        pause_after_owning()
        existing = (
            None
            if spec.output.run_id is None or fresh
            else check_target(root, spec, shard, resume, owned=True, kind=kind)
        )
    except BaseException:
        owner.release()
        raise
    return run_id, path, existing, owner


def archived_tokens(run_dir: Path, seq_ids: list[int], upto: int) -> dict[int, list[int]]:
    """Generated token ids of steps < upto for these sequences, from the committed table parts."""
    from .parts import live_parts

    files = [str(f) for f in live_parts(run_dir / layout.table_parts_dir("tokens"))]
    out = {s: [] for s in seq_ids}
    if not files:
        return out
    t = parquet_io.read_dataset(
        parquet_io.dataset(files), columns=["sequence", "step", "is_prompt", "token_id"]
    ).to_pandas()
    t = t[(~t.is_prompt) & t.sequence.isin(seq_ids) & (t.step < upto)].sort_values(["sequence", "step"])
    for seq, g in t.groupby("sequence"):
        out[int(seq)] = g.token_id.tolist()
    return out


def outcome(err: BaseException) -> tuple[str, str]:
    """(status, message) a failure is recorded with."""
    if isinstance(err, Interrupted):
        return "interrupted", str(err)
    if isinstance(err, OSError):
        from .files import space_note

        return "failed", space_note(Path("."), err)
    return "failed", str(err) if isinstance(err, LmtraceError) else f"{type(err).__name__}: {err}"


def finish_failed(writer, rd: RunDir, log, status, message) -> None:
    """Flush what can be flushed, then record the outcome; never claims `complete`."""
    if writer is not None:
        try:
            writer.drain()
        except BaseException as err:  # the original error is what the user needs to see
            message += f" (and flushing failed: {err})"
    message = message if len(message) <= 2000 else message[:2000] + "..."  # fits the status files' slack
    # Each record separately: on a full disk the status files are rewritten in place (write_status),
    # and the log, which needs space, may fail alone.
    for record in (
        lambda: rd.set_shard_status(status, error=message),
        lambda: _record_manifest(rd, status, message),
        lambda: log.event(status, error=message, shard=rd.shard.key),
    ):
        try:
            record()
        except (OSError, LmtraceError):
            pass


def _record_manifest(rd: RunDir, status: str, message: str) -> None:
    from .runs import read_manifest, write_status

    with rd.lock():
        manifest = read_manifest(rd.path)
        if manifest.get("status") != "complete":
            where = f" ({rd.shard.key})" if rd.shard.count > 1 else ""
            manifest.update(status=status, error=message + where, ended=now_iso())
            write_status(rd.path / layout.MANIFEST, manifest)
