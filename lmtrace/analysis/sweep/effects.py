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

from ...archive.groups import GROUP_VALUE, group_order, plain_value
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
        out.append(
            {
                k: (
                    None
                    if isinstance(r[k], float) and np.isnan(r[k])
                    else int(r[k])
                    if k in ("layer", "q_head", "neuron", "position")
                    else r[k]
                )
                for k in CELL_KEYS
            }
            | {"value": float(r.value), "baseline": float(r.baseline), "effect": float(r.effect)}
        )
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
    """The mean of value, baseline and effect (and a patching sweep's source_value and normalised)
    over the steps of each (cell, sequence, metric), with n_steps (and the pair's id)."""
    df = table.to_pandas()
    patch = "normalised" in df.columns
    keys = [*CELL_KEYS, "sequence", *(["pair", "source_sequence"] if patch else []), "metric"]
    mean = (
        df.groupby(keys, dropna=False)[MEANS + (["source_value", "normalised"] if patch else [])].mean().reset_index()
    )
    mean["n_steps"] = df.groupby(keys, dropna=False).step.count().values
    return pa.Table.from_pandas(mean, preserve_index=False)


BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0


def bootstrap_weights(n: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, n]: how often each of n sequences is drawn in each resample, from
    `np.random.default_rng(seed).integers(0, n, size=(resamples, n))` (row r = resample r)."""
    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    weights = np.zeros((resamples, n))
    np.add.at(weights, (np.arange(resamples)[:, None], draws), 1)
    return weights


def grouped_effects(
    table: pa.Table, metric: str, groups: dict, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> pd.DataFrame:
    """Per (group, cell) of `metric`: the mean effect over the group's (sequence, step) rows of the cell
    (`cell_effects`' reduction, on the group's sequences), n_sequences, n_rows, and a 95 % bootstrap
    interval over sequences (`low`, `high`: the 2.5th and 97.5th percentiles of the mean over
    `resamples` resamples of the group's sequences with replacement, each resample's mean again over
    every row of the sequences drawn).

    The draws: per group, its sequences in ascending order, `bootstrap_weights(n, resamples, seed)`
    (the same resamples for every cell of the group: intervals of two cells are paired). groups:
    sequence -> group value (sequences missing from it form the group None). Columns: group_value (a
    plain Python value, None for the null group), CELL_KEYS, effect, low, high, n_sequences, n_rows;
    groups in the column's order (`archive.groups.group_order`), null last, cells by layer."""
    df = table.select([*CELL_KEYS, "sequence", "metric", "effect"]).to_pandas()
    df = df[df.metric == metric]
    # grouped by the index of each value in `values`: pandas would turn the values of an int column with
    # a null into floats, a bool into numpy's
    values = list(dict.fromkeys(groups.get(int(s)) for s in df.sequence.unique()))
    index = {v: i for i, v in enumerate(values)}
    df = df.assign(_g=df.sequence.map(lambda s: index[groups.get(int(s))]))
    keys = list(CELL_KEYS)
    out = []
    for code, rows in df.groupby("_g", sort=False):
        seqs = np.sort(rows.sequence.unique())
        per = rows.groupby([*keys, "sequence"], dropna=False).effect.agg(["sum", "count"])
        sums = per["sum"].unstack("sequence").reindex(columns=seqs).fillna(0.0)
        counts = per["count"].unstack("sequence").reindex(columns=seqs).fillna(0.0)
        w = bootstrap_weights(len(seqs), resamples, seed)  # [B, n]
        with np.errstate(invalid="ignore", divide="ignore"):
            boot = (sums.to_numpy() @ w.T) / (counts.to_numpy() @ w.T)  # [cells, B]
        low, high = np.nanpercentile(boot, [2.5, 97.5], axis=1)
        cells = sums.index.to_frame(index=False)
        cells.insert(0, GROUP_VALUE, pd.Series([plain_value(values[code])] * len(cells), dtype=object))
        cells["effect"] = sums.sum(axis=1).to_numpy() / counts.sum(axis=1).to_numpy()
        cells["low"], cells["high"] = low, high
        cells["n_sequences"] = (counts.to_numpy() > 0).sum(axis=1)
        cells["n_rows"] = counts.sum(axis=1).to_numpy().astype(int)
        out.append(cells)
    result = pd.concat(out, ignore_index=True)
    order = result[GROUP_VALUE].map(group_order)
    return (
        result.assign(_o=order).sort_values(["_o", *keys[1:]], kind="stable").drop(columns="_o").reset_index(drop=True)
    )


def normalised_effect(value: np.ndarray, baseline: np.ndarray, source: np.ndarray) -> np.ndarray:
    """The normalised patching effect (value - baseline) / (source - baseline), elementwise.

    In `sweep CORRUPT --source CLEAN`: value = the metric with the cell patched from the clean run,
    baseline = the corrupted run's own (unedited) metric, source = the clean run's own metric; 1 = the
    patch restores the clean behaviour, 0 = no effect. NaN where source == baseline (nothing to restore)
    or the source value is unknown."""
    with np.errstate(invalid="ignore", divide="ignore"):
        denominator = source - baseline
        out = (value - baseline) / np.where(denominator == 0, np.nan, denominator)
    return out


def normalised_cells(
    table: pa.Table, metric: str, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> pd.DataFrame:
    """Per cell of a patching sweep on `metric`: the mean normalised effect over every (pair, step)
    row where it is defined, with a 95 % bootstrap interval over pairs (`grouped_effects` on the
    `normalised` column, every pair one group's sequence): columns CELL_KEYS, effect, low, high,
    n_pairs, n_rows. A pair is a row of the patched run (`sequence`), so resampling sequences
    resamples pairs."""
    t = table.select([*CELL_KEYS, "sequence", "metric", "normalised"]).to_pandas()
    t = (
        t[(t.metric == metric) & t.normalised.notna()]
        .drop(columns="effect", errors="ignore")
        .rename(columns={"normalised": "effect"})
    )
    if t.empty:
        return pd.DataFrame(columns=[*CELL_KEYS, "effect", "low", "high", "n_pairs", "n_rows"])
    frame = grouped_effects(pa.Table.from_pandas(t, preserve_index=False), metric, {}, resamples=resamples, seed=seed)
    return frame.drop(columns=GROUP_VALUE).rename(columns={"n_sequences": "n_pairs"})


def cell_records(frame: pd.DataFrame, ints: tuple[str, ...], keep: tuple[str, ...] = ()) -> list[dict]:
    """A frame of cells as plain dicts: NaN and None as None, the columns `ints` as int, effect / low /
    high as float, the columns in `keep` as they are."""
    return [
        {
            k: (
                v
                if k in keep
                else None
                if v is None or (isinstance(v, float) and np.isnan(v))
                else int(v)
                if k in ints
                else float(v)
                if k in ("effect", "low", "high")
                else v
            )
            for k, v in r.items()
        }
        for r in frame.to_dict("records")
    ]


def patching_summary(
    table: pa.Table, clean: str, corrupted: str, n_pairs: int, pairs: dict, metric: str, pair_by: str | None
) -> dict:
    """sweep.json's `patching`: which run is clean and which corrupted, the pairs (`pairs`: corrupted
    sequence -> (clean sequence, pair id)), and per cell the mean normalised effect on `metric` across
    pairs with its 95 % bootstrap interval over pairs (`normalised_cells`)."""
    cells = cell_records(
        normalised_cells(table, metric), ("layer", "q_head", "neuron", "position", "n_pairs", "n_rows")
    )
    cells.sort(key=lambda c: -abs(c["effect"]))
    return {
        "clean": clean,
        "corrupted": corrupted,
        "pair_by": pair_by or "index",
        "n_pairs": n_pairs,
        "pairs": [{"pair": pair, "sequence": s, "source_sequence": t} for s, (t, pair) in pairs.items()],
        "metric": metric,
        "formula": "(patched - corrupted) / (clean - corrupted), per (pair, step); "
        "mean over the (pair, step) rows where clean != corrupted",
        "resamples": BOOTSTRAP_RESAMPLES,
        "seed": BOOTSTRAP_SEED,
        "interval": "95 % percentile bootstrap over pairs",
        "cells": cells,
    }
