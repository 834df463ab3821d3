"""A run's sweeps as `lmtrace serve` shows them: each finished sweep's effect heatmaps, read from its
effects.zarr with `archive.sweeps.read_effects` (the arrays `lmtrace sweep` writes from
`analysis.sweep.effects.cell_effects`, the numbers its terminal ranking prints), and one cell's
per-(sequence, step) rows of sweep.parquet, read with a filter on the cell's coordinates."""

from __future__ import annotations

import pyarrow.compute as pc

from ..analysis.sweep.cells import CELL_KEYS
from ..analysis.sweep.feature_cells import feature_label
from ..archive import parquet_io
from ..archive.columns import RENAMED, stored_name
from ..archive.reader import Run
from ..archive.sweeps import finished_sweeps, read_effects, read_sweep_info
from ..exits.errors import ArchiveError
from ..output.jsonout import strict
from ..viewdata.queries import NotFound, table_rows

# the API's name of a cell coordinate (a URL parameter and the frontend's, `head`) -> the tables' column
API_DIM = {new: old for old, new in RENAMED["sweeps"].items()}
CELL_ROW_LIMIT = 5000  # rows of one cell sent at most (a cell has one per measured (sequence, step))


def sweep_list(run: Run) -> list[dict]:
    """The run's finished sweeps: id, what they swept and measured (the manifest's entry)."""
    entries = {e.get("id"): e for e in run.manifest.get("sweeps") or []}
    out = []
    for d in finished_sweeps(run.path):
        e = entries.get(d.name, {})
        out.append(
            {
                "id": d.name,
                "over": e.get("over"),
                "edit": e.get("edit"),
                "metrics": e.get("metrics"),
                "n_cells": e.get("n_cells"),
                "created": e.get("created"),
            }
        )
    return out


def _sweep_dir(run: Run, sweep_id: str):
    for d in finished_sweeps(run.path):
        if d.name == sweep_id:
            return d
    raise NotFound(
        f"run {run.id} has no finished sweep {sweep_id!r} (its sweeps: "
        f"{', '.join(d.name for d in finished_sweeps(run.path)) or 'none'})"
    )


def sweep_heatmaps(run: Run, sweep_id: str) -> dict:
    """Per metric: effects.zarr's array (dims, coordinates, values; NaN -> null), as read by read_effects."""
    d = _sweep_dir(run, sweep_id)
    info = read_sweep_info(d)
    metrics = []
    sae = (info.get("features") or {}).get("sae")
    for e in read_effects(d, info):
        metrics.append(
            {
                "metric": e.metric,
                "dims": [API_DIM.get(x, x) for x in e.dims],
                "coords": {API_DIM.get(k, k): v for k, v in e.coords.items()},
                "values": _nested(e.values),
                # a feature sweep's cells by name: "feature 123 (sae-l10)"
                **({"labels": {"feature": [feature_label(f, sae) for f in e.coords["feature"]]}} if sae else {}),
            }
        )
    spec = info.get("spec") or {}
    return {
        "id": sweep_id,
        "over": spec.get("over"),
        "edit": spec.get("edit"),
        "semantics": info.get("semantics"),
        "sequences": info.get("sequences"),
        "n_cells": info.get("n_cells"),
        **({"sae": sae} if sae else {}),
        "metrics": metrics,
        "meaning": "mean over every measured (sequence, step) of the metric's value with the cell edited "
        "minus its unedited baseline",
    }


def _nested(values):
    if values.ndim == 0:
        return strict(float(values))
    return [_nested(v) for v in values] if values.ndim > 1 else [strict(float(v)) for v in values]


def cell_rows(run: Run, sweep_id: str, metric: str, coords: dict[str, int]) -> dict:
    """One cell's rows of sweep.parquet for `metric`: value, baseline and effect per (sequence, step),
    with the token the parent chose at that step. `coords` names the cell's layer/head/neuron/position;
    the cell keys it does not name are null in the table (a head cell has no neuron)."""
    d = _sweep_dir(run, sweep_id)
    names = [API_DIM.get(k, k) for k in CELL_KEYS] + ["feature"]  # a feature cell: its id in the neuron column
    unknown = set(coords) - set(names)
    if unknown:
        raise NotFound(f"a sweep cell has coordinates {', '.join(names[1:])}, not {', '.join(sorted(unknown))}")
    try:
        dataset = parquet_io.dataset(d / "sweep.parquet")
        where = pc.field("metric") == metric
        feature = coords.get("feature")
        if feature is not None:  # the SAE's layer is the same for every feature cell
            where = where & (pc.field("component") == "feature")
        for key in CELL_KEYS[1:]:
            column = pc.field(stored_name(dataset.schema.names, key, "sweeps"))  # `head` in a sweep of an older archive
            given = feature if key == "neuron" and feature is not None else coords.get(API_DIM.get(key, key))
            if key == "layer" and feature is not None:
                continue
            where = where & ((column == given) if given is not None else column.is_null())
        t = parquet_io.read_dataset(
            dataset, columns=["component", "sequence", "step", "value", "baseline", "effect"], filter=where
        )
    except OSError as err:
        raise ArchiveError(f"{d / 'sweep.parquet'} is unreadable ({err}); the sweep is damaged: run it again") from None
    if t.num_rows == 0:
        raise NotFound(f"sweep {sweep_id} measured no cell {coords} on {metric!r}")
    t = t.sort_by([("sequence", "ascending"), ("step", "ascending")])
    seqs = sorted(set(t.column("sequence").to_pylist()))
    tok = table_rows(
        run,
        "tokens",
        ["sequence", "step", "token_text"],
        where=pc.field("sequence").isin(seqs) & ~pc.field("is_prompt"),
    )
    text = {(s, st): x for s, st, x in zip(*(tok.column(c).to_pylist() for c in ("sequence", "step", "token_text")))}
    rows = [
        {
            "sequence": r["sequence"],
            "step": r["step"],
            "token": text.get((r["sequence"], r["step"])),
            "value": strict(r["value"]),
            "baseline": strict(r["baseline"]),
            "effect": strict(r["effect"]),
        }
        for r in t.slice(0, CELL_ROW_LIMIT).to_pylist()
    ]
    sae = (read_sweep_info(d).get("features") or {}).get("sae")
    return {
        "sweep": sweep_id,
        "metric": metric,
        "component": t.column("component")[0].as_py(),
        **({"label": feature_label(feature, sae)} if feature is not None and sae else {}),
        "coords": coords,
        "n_rows": t.num_rows,
        "rows": rows,
    }
