"""Attributions in the run archive (`lmtrace explain`'s output): per invocation
`explain/<id>/{scores.zarr, explain.json}` (written to a temporary directory and renamed, so it
appears whole or not at all), one Parquet part `explain/scores.parts/<id>.parquet` of the long
table every invocation shares, and one entry per method appended to `manifest["explain"]` under
the run's lock; `read_explanations` reads the table back (docs/explain.md, docs/archive.md)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..exits.errors import ArchiveDamaged, ArchiveError
from ..output.jsonout import strict
from . import layout, parquet_io
from .damage import Problem, damaged_message
from .reader import Run
from .runs import locked, now_iso, read_manifest

EXPLAIN_DIR = "explain"
SCORES_PARTS = "scores.parts"  # explain/scores.parts/<explain_id>.parquet: one Parquet dataset for all invocations


@dataclass
class StepExplanation:
    """One method's scores of one (sequence, step): a score per context position."""

    method: str
    sequence: int
    step: int
    chosen_id: int
    runner_up_id: int
    positions: np.ndarray
    token_ids: list[int]
    token_texts: list[str]
    is_prompt: list[bool]
    scores: np.ndarray
    info: dict
    target_text: str = ""
    runner_up_text: str = ""
    components: dict = field(default_factory=dict)  # name -> array (lrp: attention/mlp [layer], heads [layer, head])
    latents: dict = field(default_factory=dict)  # attribution to an SAE: ids, scores [position, top], error, inputs
    #                                              [position] (LATENT_ARRAYS)


@dataclass(frozen=True)
class MethodRecord:
    """What the manifest entry of one method of an invocation records besides its scores."""

    name: str
    settings: dict  # the settings that define its result
    target: str | None  # None for methods without a target quantity (attention rollout)
    quantity: str | None
    model: dict | None  # the model it ran (None when it needs none)
    sae: dict | None = None  # attribution to an SAE's latents: the SAE (name, path, sha256, hook, ...)


def scores_schema() -> pa.Schema:
    i32 = pa.int32()
    return pa.schema(
        [
            ("explain_id", pa.string()),
            ("method", pa.string()),
            ("sequence", i32),
            ("step", i32),
            ("target", pa.string()),
            ("quantity", pa.string()),
            ("target_token_id", i32),
            ("runner_up_token_id", i32),
            ("position", i32),
            ("token_id", i32),
            ("token_text", pa.string()),
            ("is_prompt", pa.bool_()),
            ("score", pa.float32()),
        ]
    )


def write_explanation(
    run: Run,
    explain_id: str,
    methods: list[MethodRecord],
    steps: list[int],
    sequence: int,
    explanations: list[StepExplanation],
) -> list[dict]:
    """explain/<id>/{scores.zarr, explain.json} + explain/scores.parts/<id>.parquet, then the manifest entries
    (returned)."""
    root = run.path / EXPLAIN_DIR
    root.mkdir(exist_ok=True)
    tmp = root / f".{explain_id}.tmp"  # explain ids are unique; mkdir honours the umask (mkdtemp would not)
    tmp.mkdir()
    try:
        entries = _write_files(run, tmp, explain_id, methods, steps, sequence, explanations)
        os.replace(tmp, root / explain_id)  # the directory appears complete or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    parts = root / SCORES_PARTS
    parts.mkdir(exist_ok=True)
    part_tmp = parts / f".{explain_id}.tmp"
    try:
        parquet_io.write_table(_table(explain_id, methods, explanations), part_tmp)
        os.replace(part_tmp, parts / f"{explain_id}.parquet")
    except BaseException:  # (a full disk, a signal): no half-written part, no directory the manifest never names
        part_tmp.unlink(missing_ok=True)
        shutil.rmtree(root / explain_id, ignore_errors=True)
        raise
    record_entries(run.path, entries)
    return entries


def _write_files(
    run: Run,
    tmp: Path,
    explain_id: str,
    methods: list[MethodRecord],
    steps: list[int],
    sequence: int,
    explanations: list[StepExplanation],
) -> list[dict]:
    """scores.zarr and explain.json of an invocation in `tmp`; returns the manifest entries (one per method)."""
    import zarr

    created = now_iso()
    rel = f"{EXPLAIN_DIR}/{explain_id}"
    table_rel = f"{EXPLAIN_DIR}/{SCORES_PARTS}/{explain_id}.parquet"
    group = zarr.open_group(str(tmp / "scores.zarr"), mode="w", zarr_format=3)
    _write_score_arrays(group, methods, steps, explanations)
    components = _write_components(group, methods, steps, explanations)
    latents = _write_latents(group, methods, steps, explanations)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(tmp / "scores.zarr"))
    entries = [
        _method_entry(m, explain_id, sequence, steps, created, rel, table_rel, components, explanations, latents)
        for m in methods
    ]
    _atomic_json(
        tmp / "explain.json", strict({"id": explain_id, "run_id": run.id, "created": created, "entries": entries})
    )
    return entries


def _write_score_arrays(group, methods: list[MethodRecord], steps: list[int], explanations: list[StepExplanation]):
    """scores.zarr's `step` and `position` axes and one array per method, [step, position], NaN beyond each step's
    context."""
    from .zarr_arrays import checked_array

    max_n = max(len(e.scores) for e in explanations)
    st = checked_array(
        group,
        "step",
        shape=(len(steps),),
        dtype="int32",
        chunks=(max(1, len(steps)),),
        dimension_names=("step",),
        fill_value=-1,
    )
    st[...] = np.asarray(steps, dtype=np.int32)
    pos = checked_array(
        group, "position", shape=(max_n,), dtype="int32", chunks=(max_n,), dimension_names=("position",), fill_value=-1
    )
    pos[...] = np.arange(max_n, dtype=np.int32)
    for m in methods:
        data = np.full((len(steps), max_n), np.nan, dtype=np.float32)
        for e in explanations:
            if e.method == m.name:
                data[steps.index(e.step), : len(e.scores)] = e.scores
        arr = checked_array(
            group,
            m.name,
            shape=data.shape,
            dtype="float32",
            chunks=data.shape,
            dimension_names=("step", "position"),
            fill_value=np.nan,
        )
        arr[...] = data


def _method_entry(
    m: MethodRecord,
    explain_id: str,
    sequence: int,
    steps: list[int],
    created: str,
    rel: str,
    table_rel: str,
    components: dict[str, dict[str, str]],
    explanations: list[StepExplanation],
    latents: dict[str, dict[str, str]] | None = None,
) -> dict:
    """The manifest entry of one method of an invocation: its settings, where its scores are, its per-step
    results and, when its steps report them, whether all converged (integrated gradients) or conserved (lrp)."""
    entry = {
        "id": explain_id,
        "method": m.name,
        "settings": m.settings,
        "sequence": sequence,
        "steps": steps,
        "target": m.target,
        "quantity": m.quantity,
        "created": created,
        "path": rel,
        "table": table_rel,
        "array": f"{rel}/scores.zarr/{m.name}",
        "model": m.model,
        **(
            {"components": {c: f"{rel}/scores.zarr/{path}" for c, path in components[m.name].items()}}
            if components.get(m.name)
            else {}
        ),
        **(
            {"sae": {**m.sae, "arrays": {k: f"{rel}/scores.zarr/{path}" for k, path in latents[m.name].items()}}}
            if m.sae is not None and (latents or {}).get(m.name)
            else {}
        ),
        "results": [
            {
                "step": e.step,
                "target_token_id": e.chosen_id,
                "runner_up_token_id": e.runner_up_id,
                **{k: strict(v) for k, v in e.info.items()},
            }
            for e in explanations
            if e.method == m.name
        ],
    }
    flags = [e.info["converged"] for e in explanations if e.method == m.name and "converged" in e.info]
    if flags:  # integrated gradients: did every step meet completeness within --ig-tolerance?
        entry["converged"] = all(flags)
    flags = [e.info["conserved"] for e in explanations if e.method == m.name and "conserved" in e.info]
    if flags:  # lrp: did every step conserve f (relative error within its tolerance)?
        entry["conserved"] = all(flags)
    return entry


COMPONENT_DIMS = {1: ("layer",), 2: ("layer", "head")}  # the axes of a component array after its step axis


def _write_components(
    group, methods: list[MethodRecord], steps: list[int], explanations: list[StepExplanation]
) -> dict[str, dict[str, str]]:
    """scores.zarr/<method>_<component> [step, layer(, head)] per component a method returned (lrp: attention,
    mlp, heads, attention_bias); returns {method: {component: array name}}."""
    from .zarr_arrays import checked_array

    out: dict[str, dict[str, str]] = {}
    for m in methods:
        mine = [e for e in explanations if e.method == m.name and e.components]
        for name in mine[0].components if mine else {}:
            shape = np.asarray(mine[0].components[name]).shape
            data = np.full((len(steps), *shape), np.nan, dtype=np.float32)
            for e in mine:
                data[steps.index(e.step)] = e.components[name]
            arr = checked_array(
                group,
                f"{m.name}_{name}",
                shape=data.shape,
                dtype="float32",
                chunks=data.shape,
                dimension_names=("step", *COMPONENT_DIMS[len(shape)]),
                fill_value=np.nan,
            )
            arr[...] = data
            out.setdefault(m.name, {})[name] = f"{m.name}_{name}"
    return out


# an SAE result's arrays: name -> (axes after the step axis, dtype, fill)
LATENT_ARRAYS = {
    "ids": (("position", "latent"), "int32", -1),
    "scores": (("position", "latent"), "float32", np.nan),
    "error": (("position",), "float32", np.nan),
    "inputs": (("position",), "float32", np.nan),
}


def _write_latents(
    group, methods: list[MethodRecord], steps: list[int], explanations: list[StepExplanation]
) -> dict[str, dict[str, str]]:
    """scores.zarr/<method>_latent_ids, _latent_scores [step, position, latent] (the top latents per position,
    −1 / NaN past a position's count and beyond each step's context), <method>_error and <method>_inputs
    [step, position] of every SAE result; returns {method: {ids|scores|error|inputs: array name}}."""
    from .zarr_arrays import checked_array

    out: dict[str, dict[str, str]] = {}
    for m in methods:
        mine = [e for e in explanations if e.method == m.name and e.latents]
        if not mine:
            continue
        max_n = max(len(e.scores) for e in mine)
        top = max(np.asarray(e.latents["ids"]).shape[1] for e in mine)
        for key, (dims, dtype, fill) in LATENT_ARRAYS.items():
            shape = (len(steps), max_n, top) if len(dims) == 2 else (len(steps), max_n)
            data = np.full(shape, fill, dtype=dtype)
            for e in mine:
                values = np.asarray(e.latents[key], dtype=dtype)
                data[(steps.index(e.step),) + tuple(slice(0, d) for d in values.shape)] = values
            name = f"{m.name}_latent_{key}" if len(dims) == 2 else f"{m.name}_{key}"
            arr = checked_array(
                group, name, shape=shape, dtype=dtype, chunks=shape, dimension_names=("step", *dims), fill_value=fill
            )
            arr[...] = data
            out.setdefault(m.name, {})[key] = name
    return out


def read_latents(run: Run, entry: dict, step: int) -> dict[str, np.ndarray]:
    """An SAE result's arrays (a manifest `explain` entry with `sae`) at one of its steps: ids, scores
    [position, latent] and error, inputs [position], cut to that step's context."""
    out = {}
    n = None
    row = entry["steps"].index(step)
    for key, path in entry["sae"]["arrays"].items():
        values = _read_row(run, path, row)
        out[key] = values
        if key == "error":
            n = int(np.isfinite(values).sum())
    return {k: v[:n] for k, v in out.items()}


def _table(explain_id: str, methods: list[MethodRecord], explanations: list[StepExplanation]) -> pa.Table:
    """The long table: one row per (method, step, context position)."""
    by_name = {m.name: m for m in methods}
    cols: dict[str, list] = {f.name: [] for f in scores_schema()}
    for e in explanations:
        n = len(e.scores)
        cols["explain_id"] += [explain_id] * n
        cols["method"] += [e.method] * n
        cols["sequence"] += [e.sequence] * n
        cols["step"] += [e.step] * n
        cols["target"] += [by_name[e.method].target] * n
        cols["quantity"] += [by_name[e.method].quantity] * n
        cols["target_token_id"] += [e.chosen_id] * n
        cols["runner_up_token_id"] += [e.runner_up_id] * n
        cols["position"] += e.positions.tolist()
        cols["token_id"] += list(e.token_ids)
        cols["token_text"] += list(e.token_texts)
        cols["is_prompt"] += list(e.is_prompt)
        cols["score"] += e.scores.tolist()
    return pa.table(cols, schema=scores_schema())


def _atomic_json(path: Path, obj) -> None:
    """Write-to-unique-temp + fsync + rename (a unique name: concurrent writers never share a temp file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600: keep the file's existing mode, else the usual umask-derived one
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=2, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def record_entries(run_dir: Path, entries: list[dict]) -> None:
    """Append entries to manifest["explain"]: under a lock file, re-reading the manifest just before an atomic write.
    Nothing else in the manifest (status included) is changed."""
    (run_dir / EXPLAIN_DIR).mkdir(exist_ok=True)
    with locked(run_dir / layout.LOCK):  # the same flock generate takes to rewrite the manifest
        manifest = read_manifest(run_dir)
        manifest.setdefault("explain", []).extend(entries)
        _atomic_json(run_dir / layout.MANIFEST, manifest)
    from ..exits.interrupts import work_recorded

    work_recorded()  # the explanation is recorded: a signal now leaves the exit code at 0


def read_explanations(run: Run | str | Path, *, sequence: int | None = None, step: int | None = None) -> pa.Table:
    """Every explain invocation's scores of a run as one table (explain/scores.parts/*.parquet); with
    `sequence` / `step`, only those rows (each part read with a row filter)."""
    path = run.path if isinstance(run, Run) else Path(run)
    files = sorted((path / EXPLAIN_DIR / SCORES_PARTS).glob("*.parquet"))
    if not files:
        raise ArchiveError(f"{path} has no explanations yet; run `lmtrace explain`")
    filters = [(k, "==", v) for k, v in (("sequence", sequence), ("step", step)) if v is not None] or None
    return pa.concat_tables([parquet_io.read_table(f, filters=filters).cast(scores_schema()) for f in files])


def read_component(run: Run, entry: dict, name: str, step: int | None = None) -> np.ndarray:
    """One component array of a manifest `explain` entry that archived some (lrp: `entry["components"]`,
    name -> its path in the run), as float32: [step, layer(, head)] over the entry's `steps`, or with
    `step` (one of them) that step's [layer(, head)]. `lmtrace serve` and the report both read them here."""
    row = None if step is None else entry["steps"].index(step)
    return np.asarray(_read_row(run, entry["components"][name], row), dtype=np.float32)


def _read_row(run: Run, rel: str, row: int | None) -> np.ndarray:
    """An explain array of the run (`rel`: its path in the run), whole or one step's row; a chunk that fails
    its checksum, or an array that does not read, is a damaged run, named."""
    import zarr

    try:
        array = zarr.open_array(str(run.path / rel), mode="r")
        return np.asarray(array[...] if row is None else array[row])
    except (OSError, ValueError, LookupError, RuntimeError) as err:  # zarr's ways to say missing or damaged
        kind = "changed" if "checksum" in str(err) else "unreadable"
        raise ArchiveDamaged(damaged_message(run.id, Problem(rel, kind)), path=rel, run_dir=run.path) from None
