"""A sweep's files in a run: `RUN/sweeps/<id>/` and its unfinished `RUN/sweeps/.partial-<id>/`.

  .partial-<id>/plan.json      the sweep spec and shard count (the partial directory appears with it)
  .partial-<id>/blocks/*.parquet  one committed block (a batch of cells of one sequence) each
  <id>/sweep.parquet           the long table: one row per (cell, sequence, step, metric)
  <id>/sweep_mean.parquet      mean over the measured steps per (cell, sequence, metric)
  <id>/effects.zarr/           effect_<metric>: the mean effect per cell, named dims, coordinate arrays
  <id>/sweep.json              provenance, spec, metrics, timings, the ranked top cells

Every file appears whole or not at all (temporary name, then rename); `<id>/` is assembled in a
temporary directory and renamed. What the tables hold is computed by `analysis.sweep`; this module
only writes and reads them (docs/sweep.md, "Output").
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..exits.errors import ArchiveError
from . import layout, parquet_io
from .columns import current_names
from .files import atomic_write_json, atomic_write_parquet
from .runs import locked, read_manifest

SWEEPS_DIR = "sweeps"


def writer_key(sweep_id: str, index: int, count: int) -> str:
    """The owner-lock key (`RUN/owners/<key>.lock`, liveness.OwnerLock) of one process of a sweep:
    one per sweep id and shard, so a second process of the same sweep and shard is refused while the
    shards of one sweep run side by side."""
    return f"sweep-{sweep_id}" + (f"-shard-{index}-of-{count}" if count > 1 else "")


PAIR_COLUMNS = [
    ("pair", pa.string()),
    ("source_sequence", pa.int32()),
    ("source_value", pa.float64()),
    ("normalised", pa.float64()),
]


def block_schema(patch: bool = False) -> pa.Schema:
    """The long table's columns; a patching sweep's rows also name their pair (`PAIR_COLUMNS`)."""
    return pa.schema(
        [
            ("component", pa.string()),
            ("layer", pa.int32()),
            ("q_head", pa.int32()),
            ("neuron", pa.int32()),
            ("position", pa.int32()),
            ("sequence", pa.int32()),
            ("step", pa.int32()),
            ("metric", pa.string()),
            ("value", pa.float64()),
            ("baseline", pa.float64()),
            ("effect", pa.float64()),
            *(PAIR_COLUMNS if patch else []),
        ]
    )


@dataclass
class PairColumns:
    """A patching block's pair: its id (the --pair-by value, or the sequence index), the source
    sequence, and the source's own value of each metric per measured step (metric -> [S])."""

    pair: str
    source_sequence: int
    source_values: dict


def block_table(
    cells: list,
    seq: int,
    steps: list[int],
    values: dict,
    baseline: dict,
    pair: PairColumns | None = None,
    normalised: dict | None = None,
) -> pa.Table:
    """The long-table rows of one block: cells (with component, layer, head -> q_head, neuron, position),
    values metric -> [len(cells), len(steps)], baseline metric -> [len(steps)]. A patching block also
    has its `pair` and `normalised` metric -> [len(cells), len(steps)] (the normalised patching effect,
    `analysis.sweep.effects.normalised_effect`)."""
    S = len(steps)
    schema = block_schema(pair is not None)
    cols: dict[str, list] = {f.name: [] for f in schema}
    for name, v in values.items():
        b = baseline[name]  # [S]
        for r, c in enumerate(cells):
            n = S
            cols["component"] += [c.component] * n
            cols["layer"] += [c.layer] * n
            cols["q_head"] += [c.head] * n
            cols["neuron"] += [c.neuron] * n
            cols["position"] += [c.position] * n
            cols["sequence"] += [seq] * n
            cols["step"] += steps
            cols["metric"] += [name] * n
            cols["value"] += v[r].tolist()
            cols["baseline"] += b.tolist()
            cols["effect"] += (v[r] - b).tolist()
            if pair is not None:
                src = pair.source_values[name]
                cols["pair"] += [pair.pair] * n
                cols["source_sequence"] += [pair.source_sequence] * n
                cols["source_value"] += src.tolist()
                cols["normalised"] += normalised[name][r].tolist()
    return pa.table(cols, schema=schema)


def write_block(table: pa.Table, path: Path) -> None:
    """Commit one block's part file (whole or not at all)."""
    atomic_write_parquet(table, path)


def create_partial(partial: Path, plan: dict) -> None:
    """Create `.partial-<id>/` with its plan.json and an empty blocks/ in one rename (call under the sweeps lock)."""
    tmp = partial.with_name(f".plan-{partial.name.removeprefix('.partial-')}.{os.getpid()}")
    tmp.mkdir()
    atomic_write_json(tmp / "plan.json", plan)
    (tmp / "blocks").mkdir()
    os.replace(tmp, partial)


def read_blocks(partial: Path) -> pa.Table:
    """Every committed block of an unfinished sweep, in file-name order (sequence, then block)."""
    return pa.concat_tables(
        [current_names(parquet_io.read_table(f), "sweeps") for f in sorted((partial / "blocks").glob("*.parquet"))]
    )


@dataclass
class EffectArray:
    """One metric's `effects.zarr` array: dims (e.g. [layer, q_head]), coords per dim, values."""

    metric: str
    dims: list[str]
    coords: dict[str, list[int]]
    values: np.ndarray  # float32, NaN where no cell was measured


def effect_array_name(metric: str, bases: list[str]) -> str:
    """effects.zarr's name for a metric: `effect_<metric>`; where a sweep measures several
    `logit_diff:A,B`, each is `effect_logit_diff_A_B` (token ids), so none overwrites another."""
    base = metric.split(":")[0]
    if bases.count(base) > 1:
        return "effect_" + metric.replace(":", "_").replace(",", "_")
    return "effect_" + base


def write_sweep(final: Path, table: pa.Table, sequence_means: pa.Table, effects: list[EffectArray], info: dict) -> None:
    """Assemble `<id>/` (sweep.parquet, sweep_mean.parquet, effects.zarr, sweep.json) in a temporary
    directory and rename it into place."""
    import zarr

    from .zarr_arrays import checked_array

    tmp = final.with_name(f".final-{final.name}")
    tmp.mkdir()
    parquet_io.write_table(table, tmp / "sweep.parquet")
    parquet_io.write_table(sequence_means, tmp / "sweep_mean.parquet")
    group = zarr.open_group(str(tmp / "effects.zarr"), mode="w", zarr_format=3)
    arrays = {}
    bases = [e.metric.split(":")[0] for e in effects]
    for e in effects:
        for dim in e.dims:
            if dim not in group:
                c = np.asarray(e.coords[dim], dtype=np.int32)
                ca = checked_array(group, dim, shape=c.shape, dtype="int32", chunks=c.shape, dimension_names=(dim,))
                ca[...] = c
        name = effect_array_name(e.metric, bases)
        a = checked_array(
            group,
            name,
            shape=e.values.shape,
            dtype="float32",
            chunks=e.values.shape,
            dimension_names=tuple(e.dims),
            fill_value=np.nan,
        )
        a[...] = e.values
        a.attrs.update({"metric": e.metric, "meaning": "mean over sequences and steps of value - baseline"})
        arrays[e.metric] = {"array": f"effects.zarr/{name}", "dims": e.dims}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(tmp / "effects.zarr"))
    info = {**info, "arrays": arrays}
    (tmp / "sweep.json").write_text(json.dumps(info, indent=2, default=str))
    os.replace(tmp, final)


def record_sweep(run_dir: Path, entry: dict) -> None:
    """Append a finished sweep's entry to the run's manifest (`sweeps`), under the run's lock."""
    with locked(run_dir / layout.LOCK):
        manifest = read_manifest(run_dir)
        manifest.setdefault("sweeps", []).append(entry)
        atomic_write_json(run_dir / layout.MANIFEST, manifest)
    from ..exits.interrupts import work_recorded

    work_recorded()  # the sweep is recorded: a signal now leaves the exit code at 0


def read_sweep(run, sweep_id: str | None = None) -> pa.Table:
    """A sweep's long table (the latest sweep of the run when no id is given); run: a `Run` or its directory."""
    path = Path(run.path if hasattr(run, "path") else run)
    entries = json.loads((path / layout.MANIFEST).read_text()).get("sweeps") or []
    if not entries:
        raise ArchiveError(f"{path} has no sweeps yet; run `lmtrace sweep`")
    entry = entries[-1] if sweep_id is None else next((e for e in entries if e["id"] == sweep_id), None)
    if entry is None:
        raise ArchiveError(f"{path} has no sweep {sweep_id}")
    return current_names(parquet_io.read_table(path / entry["path"] / "sweep.parquet"), "sweeps")


def finished_sweeps(run_dir: Path) -> list[Path]:
    """The finished sweep directories of a run (`sweeps/<id>/`, not the hidden partial ones), by name."""
    folder = Path(run_dir) / SWEEPS_DIR
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def read_sweep_info(sweep_dir: Path) -> dict:
    """A finished sweep's sweep.json."""
    path = sweep_dir / "sweep.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ArchiveError(f"{path} is unreadable ({err}); the sweep is damaged: run it again") from None


def read_effects(sweep_dir: Path, info: dict | None = None) -> list[EffectArray]:
    """A finished sweep's effects.zarr arrays, in the sweep's metric order (sweep.json `arrays`)."""
    import zarr

    info = read_sweep_info(sweep_dir) if info is None else info
    out = []
    for metric in info.get("metrics") or []:
        where = (info.get("arrays") or {}).get(metric)
        if where is None:
            continue
        path = sweep_dir / where["array"]
        try:
            group = zarr.open_group(str(sweep_dir / "effects.zarr"), mode="r")
            values = np.asarray(zarr.open_array(str(path), mode="r")[...], dtype=np.float32)
            coords = {d: [int(v) for v in group[d][...]] for d in where["dims"]}
        except (OSError, ValueError, LookupError, RuntimeError) as err:  # zarr's ways to say missing or damaged
            raise ArchiveError(
                f"{path} is unreadable ({type(err).__name__}: {err}); the sweep is damaged: run it again"
            ) from None
        out.append(EffectArray(metric, list(where["dims"]), coords, values))
    return out
