"""A sweep's effects: its long table (one row per cell, sequence, step and metric) reduced per cell.

`cell_effects` is the one reduction: the mean of `value`, `baseline` and `effect` of one metric
over every (sequence, step) row of a cell, so a sequence that measured more steps weighs more,
exactly as a row does. Everything that shows a cell's effect goes through it: the terminal's
ranking (`ranking`), `effects.zarr` (`effect_array`, which the report draws), and `lmtrace heads`'
sweep ranking. `sequence_means` is the other, documented table (`sweep_mean.parquet`): the mean
over the steps of each (cell, sequence), for a look at single sequences.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from .cells import CELL_KEYS

MEANS = ["value", "baseline", "effect"]


def cell_effects(table: pa.Table, metric: str) -> pd.DataFrame:
    """One row per cell measured on `metric`: the CELL_KEYS (NaN where a coordinate does not apply),
    the means of value, baseline and effect over the cell's (sequence, step) rows, and n_rows.

    table: the sweep's long table (`sweep.parquet`'s columns; at least CELL_KEYS, metric, value,
    baseline, effect)."""
    df = table.select([*CELL_KEYS, "metric", *MEANS]).to_pandas()
    df = df[df.metric == metric]
    groups = df.groupby(list(CELL_KEYS), dropna=False)
    out = groups[MEANS].mean().reset_index()
    out["n_rows"] = groups.size().to_numpy()
    return out


def ranking(table: pa.Table, metric: str, top: int) -> list[dict]:
    """The `top` cells by |mean effect| on `metric` (`cell_effects`), largest first, as plain dicts."""
    g = cell_effects(table, metric)
    g = g.reindex(g.effect.abs().sort_values(ascending=False).index).head(top)
    out = []
    for _, r in g.iterrows():
        out.append({k: (None if isinstance(r[k], float) and np.isnan(r[k]) else
                        int(r[k]) if k in ("layer", "q_head", "neuron", "position") else r[k]) for k in CELL_KEYS}
                   | {"value": float(r.value), "baseline": float(r.baseline), "effect": float(r.effect)})
    return out


def effect_array(effects: pd.DataFrame) -> tuple[list[str], dict[str, list[int]], np.ndarray]:
    """`cell_effects` of one metric as an array over the cells' coordinates: (names, coords, effect).

    names: the coordinates the cells have, in the order layer, q_head, neuron, position (heads ->
    [layer, q_head], attn -> [layer], resid -> [layer, position], ...); coords: name -> sorted values;
    effect: float32 of shape [len(coords[n]) for n in names], NaN where no cell was measured."""
    names = [n for n in ("layer", "q_head", "neuron", "position") if effects[n].notna().any()] or ["position"]
    coords = {n: sorted(int(v) for v in effects[n].dropna().unique()) for n in names}
    index = {n: {v: i for i, v in enumerate(coords[n])} for n in names}
    arr = np.full(tuple(len(coords[n]) for n in names), np.nan, dtype=np.float32)
    for key, value in zip(effects[names].itertuples(index=False, name=None), effects.effect):
        if any(pd.isna(k) for k in key):
            continue
        arr[tuple(index[n][int(k)] for n, k in zip(names, key))] = value
    return names, coords, arr


def sequence_means(table: pa.Table) -> pa.Table:
    """The mean of value, baseline and effect over the steps of each (cell, sequence, metric), with n_steps."""
    df = table.to_pandas()
    keys = [*CELL_KEYS, "sequence", "metric"]
    mean = df.groupby(keys, dropna=False)[MEANS].mean().reset_index()
    mean["n_steps"] = df.groupby(keys, dropna=False).step.count().values
    return pa.Table.from_pandas(mean, preserve_index=False)

