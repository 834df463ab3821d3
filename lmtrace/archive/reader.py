"""Typed read access to a run archive, complete or not (up to its last committed step)."""

from __future__ import annotations

import json
import warnings
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import zarr

from ..exits.errors import ArchiveDamaged, ArchiveError
from . import layout, parquet_io
from .columns import current_names, stored_names
from .damage import Problem, damaged_message
from .integrity import quick_problem, verify
from .parts import live_parts
from .runs import lens_state  # noqa: F401  (re-exported: readers ask a run for its lens state)

if TYPE_CHECKING:
    import pyarrow.dataset as ds

RELIST_TRIES = 5  # listings of a running run's parts a read tries (read_table_files)


class IncompleteRunWarning(UserWarning):
    pass


def table_files(run_dir: Path, name: str) -> list[Path]:
    """The Parquet files holding a table: its compacted file once the run has one, else the part
    files committed so far, each row in one of them (in order; a part being written has a hidden
    temporary name, and the parts a merged part covers are left out: archive/parts.py)."""
    full = run_dir / layout.table_file(name)
    if full.is_file():
        return [full]
    return live_parts(run_dir / layout.table_parts_dir(name))


def read_table_files(run_dir: Path, name: str, read):
    """`read(files)` over `table_files`, listed again when a part vanished while it was read: a
    running writer merged it into a larger part (or the run completed and compacted its tables)."""
    for _ in range(RELIST_TRIES - 1):
        files = table_files(run_dir, name)
        try:
            return read(files)
        except (OSError, pa.ArrowException):
            if all(f.exists() for f in files):
                raise  # not a merge: a real error
    return read(table_files(run_dir, name))


class Run:
    """One run directory. Arrays are zarr arrays (lazy); tables are pyarrow Tables."""

    def __init__(self, path: Path, *, require_complete: bool = False, check: bool = True, consolidated: bool = True):
        """`consolidated`: read a complete run's array metadata from the consolidated `tensors.zarr/zarr.json`
        (one file); False reads each array's own (what `lmtrace lens` trusts: it regenerates the first)."""
        from .runs import read_manifest

        self.path = Path(path)
        self.consolidated = consolidated
        self.manifest = read_manifest(self.path)
        if check:  # a complete run's committed files are all there, at their recorded sizes (stat only)
            problem = quick_problem(self.path, self.manifest)
            if problem is not None:
                raise ArchiveDamaged(damaged_message(self.id, problem), path=problem.path, run_dir=self.path)
        if self.status != "complete":
            if require_complete:
                raise ArchiveError(self._not_complete())
            warnings.warn(
                f"run {self.id} is {self.status}, not complete: only committed steps are readable",
                IncompleteRunWarning,
                stacklevel=2,
            )

    def _not_complete(self) -> str:
        """Why a command that needs a complete run refuses this one, and what finishes it."""
        from .liveness import shown_status

        status = shown_status(self.path, self.manifest)
        if status == "running":
            return f"run {self.id} is running, not complete: wait until it completes (`lmtrace ls` shows its status)"
        return (
            f"run {self.id} is {status}, not complete: finish it first with `lmtrace generate --resume {self.id}`, "
            f"then run this again"
        )

    # ---- manifest ----------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.manifest["run_id"]

    @property
    def status(self) -> str:
        return self.manifest.get("status", "unknown")

    @property
    def shape(self) -> dict:
        return self.manifest["shape"]

    @property
    def layers(self) -> list[int]:
        return self.shape["layers"]

    @property
    def progress(self) -> dict:
        """Committed steps per batch, merged over every writer (shard): {"batches": {batch: {...}}}."""
        from .batch_plan import merged_progress

        return merged_progress(self.path)

    def committed_steps(self, generated_len: np.ndarray | None = None) -> dict[int, int]:
        """sequence -> steps readable: generated_len when its batch is done, else the batch's committed steps
        (from the run's progress records; `generated_len`: the array, when the caller has read it)."""
        out: dict[int, int] = {}
        lengths = self.generated_len() if generated_len is None else generated_len
        batch_of, from_step = self.batch_plan()
        batches = self.progress["batches"]
        for seq in range(len(lengths)):
            batch = batch_of.get(seq, -1)
            entry = batches.get(str(batch))
            if entry is not None and entry.get("done"):
                out[seq] = int(lengths[seq])
            else:
                out[seq] = max(int(entry["committed_steps"]) if entry else 0, from_step.get(batch, 0))
        return out

    def steps_ready(self, seq: int, generated_len: np.ndarray | None = None) -> int:
        """Steps of `seq` whose arrays are committed: every generated one of a complete run (its
        generated_len), else `committed_steps`. The one count every reader of a run uses
        (`ready_steps`: all sequences); `generated_len`: the array, when the caller holds it."""
        lengths = self.generated_len() if generated_len is None else generated_len
        if self.status == "complete":
            return int(lengths[seq])
        return self.committed_steps(lengths).get(seq, 0)

    def ready_steps(self, generated_len: np.ndarray | None = None) -> dict[int, int]:
        """sequence -> `steps_ready`, for every sequence. A run that wrote no tensors (`capture: none`)
        counts its generated rows of the tokens table instead (a complete run: every sequence)."""
        if not (self.path / layout.TENSORS).exists():
            t = self.table("tokens", columns=["sequence", "is_prompt"])
            n = self.shape.get("n_sequences") or 0
            counts: dict[int, int] = {s: 0 for s in range(n)} if self.status == "complete" else {}
            for s, is_prompt in zip(t.column("sequence").to_pylist(), t.column("is_prompt").to_pylist()):
                counts[s] = counts.get(s, 0) + (not is_prompt)
            return counts
        lengths = self.generated_len() if generated_len is None else generated_len
        if self.status == "complete":
            return {seq: int(n) for seq, n in enumerate(lengths)}
        return self.committed_steps(lengths)

    def batch_plan(self) -> tuple[dict[int, int], dict[int, int]]:
        from .batch_plan import batch_plan

        return batch_plan(self.path, self.manifest)

    @property
    def shard_status(self) -> dict[str, dict]:
        folder = self.path / layout.SHARDS_DIR
        out = {}
        for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                out[f.stem] = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                out[f.stem] = {"status": "unreadable"}
        return out

    # ---- arrays ------------------------------------------------------------------------------
    @cached_property
    def tensors(self) -> zarr.Group:
        path = self.path / layout.TENSORS
        if not path.exists():
            raise ArchiveError(f"{path} is missing: the run wrote no tensors")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return zarr.open_group(
                str(path), mode="r", use_consolidated=self.consolidated and self.status == "complete"
            )

    def array_names(self) -> list[str]:
        return sorted(self.tensors.array_keys())

    def array(self, name: str) -> zarr.Array:
        if name not in self.tensors and name in LENS_ARRAY_NAMES and lens_state(self.manifest) == "pending":
            raise ArchiveError(f"run {self.id}: " + LENS_NOT_COMPUTED.format(run_id=self.id))
        if name not in self.tensors:
            raise ArchiveError(
                f"run {self.id} has no array {name!r} (captured: {', '.join(self.array_names())}); "
                f"enable the probe in the spec's capture section"
            )
        array = self.tensors[name]
        return CheckedArray(array._async_array, run=self) if isinstance(array, zarr.Array) else array

    def damaged(self, prefix: str, err: BaseException, candidates: list[str] = ()) -> ArchiveDamaged:
        """The error for a file under `prefix` that failed to read: names the damaged file when its own
        checksums (`candidates`: the files the read touched, relative to the run) or the run's
        recorded ones find it."""
        from .shards import chunk_problem

        for rel in candidates:
            if chunk_problem(self.path / rel) is not None:
                return ArchiveDamaged(damaged_message(self.id, Problem(rel, "changed")), path=rel, run_dir=self.path)
        if self.status == "complete":
            problems, _, _ = verify(self.path, self.manifest, prefix=prefix)
            if problems:
                return ArchiveDamaged(damaged_message(self.id, problems[0]), path=problems[0].path, run_dir=self.path)
        first = parquet_io.first_line(err, self.path)
        return ArchiveDamaged(
            damaged_message(self.id, f"{prefix.rstrip('/')} is unreadable ({first})"),
            path=prefix.rstrip("/"),
            run_dir=self.path,
        )

    def layer_index(self, layer: int) -> int:
        """Position of a model layer along the archive's `layer` dim."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise ArchiveError(f"layer {layer} was not captured in run {self.id} (captured: {self.layers})") from None

    def generated_len(self) -> np.ndarray:
        return self.array("generated_len")[:]

    def prompt_len(self) -> np.ndarray:
        return self.array("prompt_len")[:]

    def attention_row(self, sequence: int, step: int, layer: int) -> np.ndarray:
        """[head, key] attention of the query position at `step`, trimmed to the context length."""
        n_keys = int(self.prompt_len()[sequence]) + step
        return self.array("attn")[sequence, step, self.layer_index(layer), :, :n_keys]

    # ---- tables ------------------------------------------------------------------------------
    def table(self, name: str, columns: list[str] | None = None, sequences: list[int] | None = None) -> pa.Table:
        """A table, from the compacted file of a complete run or the part files of an unfinished one,
        with today's column names (an older archive's `rank` of tokens reads as `token_rank`);
        `columns` (today's names): only those are read; `sequences`: only those sequences' rows (the
        compacted table has a row group per block, so only their batches' row groups are read)."""
        return current_names(self._stored_table(name, columns, sequences), name)

    def _stored_table(
        self, name: str, columns: list[str] | None = None, sequences: list[int] | None = None
    ) -> pa.Table:
        full = self.path / layout.table_file(name)
        if full.is_file():
            try:
                return self._read(parquet_io.dataset(full), name, columns, sequences)
            except (OSError, pa.ArrowException) as err:
                raise self.damaged(layout.table_file(name), err) from None
        if self.status == "complete" and name in (self.manifest.get("table_rows") or {}):
            raise ArchiveError(damaged_message(self.id, f"{layout.table_file(name)} is missing"))
        return read_table_files(self.path, name, lambda files: self._parts_table(name, files, columns, sequences))

    def _parts_table(
        self, name: str, files: list[Path], columns: list[str] | None = None, sequences: list[int] | None = None
    ) -> pa.Table:
        """A table from its committed part files (there is no compacted file)."""
        if not files:
            if name in EMPTY_SCHEMAS:  # nothing committed yet: an empty table with the documented columns
                empty = EMPTY_SCHEMAS[name]().empty_table()
                return empty if columns is None else empty.select(columns)
            raise ArchiveError(f"run {self.id} has no {name} table yet")
        return self._read(parquet_io.dataset(files), name, columns, sequences)

    @staticmethod
    def _read(dataset: ds.Dataset, name: str, columns: list[str] | None, sequences: list[int] | None) -> pa.Table:
        import pyarrow.dataset as ds  # on the first table read (archive/parquet_io.py says why)

        stored = dataset.schema.names
        return parquet_io.read_dataset(
            dataset,
            columns=None if columns is None else stored_names(stored, columns, name),
            filter=None if sequences is None else ds.field("sequence").isin(list(sequences)),
        )

    def tokens(self) -> pa.Table:
        return self.table("tokens")

    def steps(self) -> pa.Table:
        return self.table("steps")

    def sequences(self) -> pa.Table:
        return self.table("sequences")

    # ---- token texts -------------------------------------------------------------------------
    @cached_property
    def vocabulary(self) -> "Vocabulary":
        """The texts of token ids: vocab.parquet, or for a run made before it existed, the texts its
        tokens table holds (ids it never saw read `<id N>`)."""
        stored = Vocabulary.read(self.path)
        if stored is not None:
            return stored
        try:
            t = self.tokens().select(["token_id", "token_text"])
        except ArchiveDamaged:
            raise
        except ArchiveError:
            return Vocabulary([], complete=False)
        ids = t.column("token_id").to_numpy()
        texts = t.column("token_text").to_pylist()
        size = int(ids.max()) + 1 if len(ids) else 0
        known = [None] * size
        for i, text in zip(ids.tolist(), texts):
            known[i] = text
        return Vocabulary(known, complete=False)

    @property
    def vocab_size(self) -> int | None:
        """Rows of vocab.parquet (len(tokenizer) when the run was made); None for a run without it."""
        v = self.vocabulary
        return len(v) if v.complete else None

    def text(self, ids) -> list[str]:
        """The text of each token id, as `tokenizer.decode([id])` gave it when the run was made.

        `ids`: a sequence or array of ids (any shape: nested lists come back for 2-D and more; a
        single id gives a list of one). Fill values (ids < 0, NaN) give ""; an id the run's vocabulary does not hold gives `<id N>`."""
        return self.vocabulary.text(ids)

    def generated_ids(self, sequence: int) -> list[int]:
        t = self.tokens().to_pandas()
        t = t[(t.sequence == sequence) & (~t.is_prompt)].sort_values("step")
        return t.token_id.tolist()

    def __repr__(self) -> str:
        return f"Run({self.id!r}, status={self.status!r}, path={str(self.path)!r})"


class Vocabulary:
    """Token id -> text, from a run's vocab.parquet (`complete`) or what its tokens table saw."""

    def __init__(self, texts: list[str | None], complete: bool):
        # one object array, and "" for fill values at index len(texts): a lookup is one take()
        self._texts = np.empty(len(texts) + 1, dtype=object)
        self._texts[:-1] = [f"<id {i}>" if t is None else t for i, t in enumerate(texts)]
        self._texts[-1] = ""
        self.complete = complete

    @classmethod
    def read(cls, run_dir: Path) -> "Vocabulary | None":
        path = Path(run_dir) / layout.VOCAB
        if not path.is_file():
            return None
        t = parquet_io.read_table(path, columns=["id", "text"])
        ids = t.column("id").to_numpy()
        if not np.array_equal(ids, np.arange(len(ids))):
            raise ArchiveError(f"{path}: ids are not 0..{len(ids) - 1} in order; the file is damaged")
        return cls(t.column("text").to_pylist(), complete=True)

    def __len__(self) -> int:
        return len(self._texts) - 1

    def text(self, ids) -> list:
        arr = np.atleast_1d(np.asarray(ids))
        if arr.dtype.kind not in "iuf":
            arr = np.atleast_1d(np.asarray(ids, dtype=float))  # e.g. a list with None: like NaN
        if arr.dtype.kind == "f":
            arr = np.where(np.isnan(arr), -1, arr)
        arr = arr.astype(np.int64)
        n = len(self)
        out = self._texts[np.where(arr < 0, n, np.minimum(arr, n))]  # fancy indexing: a copy
        beyond = arr >= n
        if beyond.any():
            out[beyond] = [f"<id {i}>" for i in arr[beyond].tolist()]
        return out.tolist()


class CheckedArray(zarr.Array):
    """A zarr array of a run whose reads name the damaged chunk file instead of a codec's error."""

    def __init__(self, async_array, run: "Run"):
        super().__init__(async_array)
        object.__setattr__(self, "_run", run)

    def __getitem__(self, selection):
        try:
            return super().__getitem__(selection)
        except ArchiveError:
            raise
        except Exception as err:  # noqa: BLE001 - any decoding failure of a chunk is reported as damage
            from .shards import chunk_files

            prefix = f"{layout.TENSORS}/{self.basename}/"
            raise self._run.damaged(prefix, err, [prefix + key for key in chunk_files(self, selection)]) from None


# Tables of a run with no committed block yet read as empty tables with these columns.
EMPTY_SCHEMAS = {"tokens": layout.token_schema, "sequences": layout.sequence_schema}

LENS_ARRAY_NAMES = {s.name for s in layout.LENS_ARRAYS}
LENS_NOT_COMPUTED = "its logit lens is deferred and not computed yet: run `lmtrace lens {run_id}`"


def open_run(path_or_id: str | Path, runs_dir: str | Path | None = None, *, require_complete: bool = False) -> Run:
    """Open a run by directory path or by id (prefix) under `runs_dir` / $LMTRACE_RUNS_DIR / ./runs."""
    from .runs import find_run, runs_root

    root = Path(runs_dir) if runs_dir is not None else runs_root()
    return Run(find_run(str(path_or_id), root), require_complete=require_complete)
