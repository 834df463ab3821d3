"""`lmtrace sweep --method attribution`: the estimate's blocks and `--verify N` (docs/sweep.md).

A block is one sequence (or pair) with every cell: one forward with gradients and one backward per
measured (step, metric) give every cell's estimate (`analysis.sweep.attribution.estimate`). The
blocks are the exact sweep's tables with the estimate in `value` / `effect` (so ranking, `--by`,
normalised effects and effects.zarr carry it) plus `method` = "attribution", `graddrop` (AtP*'s
GradDrop magnitude, null without --graddrop), and `exact_value` / `exact_effect`, filled by
`--verify N` for the N cells the estimate ranks first (null for the others).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from ...archive.sweeps import PairColumns, block_table, write_block
from ...exits.errors import Interrupted, SpecError
from ...exits.interrupts import StopFlag
from .checks import SweepError
from .effects import cell_effects, normalised_effect

EXTRA = ("method", "graddrop", "exact_value", "exact_effect")
# sequences of one layout are estimated together, at most MAX_PACK and PACK_TOKENS token positions a forward
MAX_PACK = 16
PACK_TOKENS = 4096


def check(spec, metrics) -> None:
    """Refuse what the estimate cannot do (before the model is loaded)."""
    from .attribution import DIFFERENTIABLE

    if spec.method == "exact":
        if spec.verify is not None or spec.graddrop:
            raise SpecError(f"--{'verify' if spec.verify is not None else 'graddrop'} is for --method attribution")
        return
    if metrics[0].name not in DIFFERENTIABLE:
        raise SpecError(
            f"--method attribution: the first metric ranks the cells and {metrics[0].key} has no gradient "
            f"estimate (kl's gradient is 0 at the unedited forward, rank is piecewise constant); put "
            f"logprob, prob or logit_diff:A,B first"
        )
    if spec.over.strip().startswith("positions") and spec.from_step:
        raise SpecError(
            "--method attribution --over positions: --from-step is not supported; drop it or use --method exact"
        )


def run_blocks(inp, spec, engine, adapter, mine: list, partial: Path, sweep_id: str, note) -> dict:
    """Estimate and commit this shard's blocks (one per sequence) not committed yet."""
    from .attribution import estimate

    view = inp.view
    tol = 1e-3 if inp.parent.manifest.get("dtype") == "float32" else 5e-2
    stop = StopFlag()
    baseline_check, source_baseline, n_done = {}, {}, 0
    pending = [(s, j, cells) for s, j, cells in mine if not _path(partial, s, j).exists()]
    wanted = _source_components(inp.cells, inp.features)
    packs = _layout_packs(inp, pending)
    with stop.installed():
        for pack in packs:
            (P, steps), cells = pack[0][0], pack[0][1][2]
            seqs = [blk[0] for _, blk in pack]
            T = P + max(steps)
            sids, sources, src_logits = {}, None, None
            if spec.edit == "patch":
                sids, sources, src_logits = _patch_sources(inp, adapter, seqs, T, wanted, steps)
            ests = estimate(
                adapter,
                [view.prompt_ids[s] + view.generated[s] for s in seqs],
                P,
                steps,
                [view.generated[s] for s in seqs],
                cells,
                inp.metrics,
                spec.edit,
                means=engine.means,
                sources=sources,
                from_step=inp.from_step,
                graddrop=spec.graddrop,
                features=inp.features,
                value=spec.value,
            )
            for k, (s, est) in enumerate(zip(seqs, ests)):
                baseline_check[s] = _baseline_diff(inp, s, est.base_logits, steps, tol)
                source = None if src_logits is None else (src_logits, k, len(sids[s]) >= T)
                table = _block_table(inp, engine, s, steps, cells, est, source, source_baseline)
                write_block(table, _path(partial, s, pack[k][1][1]))
                n_done += 1
            note(
                f"block {n_done}/{len(pending)} ({len(cells)} cells estimated on {len(seqs)} sequence(s) from "
                f"{seqs[0]})"
            )
            if stop.signal is not None:
                raise Interrupted(
                    f"interrupted by signal {stop.signal}; {n_done} block(s) committed; continue "
                    f"with the same command and --run-id {sweep_id} --resume"
                )
    return {"n_done": n_done, "baseline_check": baseline_check, "source_baseline": source_baseline}


def _source_components(cells, features=None) -> set:
    """The (kind, layer) components a patch source is captured at for `cells` (a `layer` cell: its residual;
    feature cells: ("feature", the SAE's Site))."""
    from .attribution import COMPONENT_KIND

    if features is not None:
        return {("feature", features.site)}
    wanted = {
        ("layer" if c.component == "layer" else COMPONENT_KIND[c.component], c.layer)
        for c in cells
        if c.component != "position"
    }
    return {("resid", layer) if kind == "layer" else (kind, layer) for kind, layer in wanted}


def _layout_packs(inp, pending: list) -> list[list]:
    """The pending blocks grouped into packs of consecutive sequences of one layout (prompt length, steps),
    each estimated in one forward: at most MAX_PACK sequences and PACK_TOKENS positions (one with positions)."""
    positions = any(c.component == "position" for c in inp.cells)
    packs: list[list] = []
    for blk in pending:
        s = blk[0]
        layout = (len(inp.view.prompt_ids[s]), inp.seq_steps[s])
        last = packs[-1] if packs else None
        limit = 1 if positions else max(1, min(MAX_PACK, PACK_TOKENS // (layout[0] + max(layout[1]))))
        if last and len(last) < limit and last[0][0] == layout:
            last.append((layout, blk))
        else:
            packs.append([(layout, blk)])
    return packs


def _patch_sources(inp, adapter, seqs: list[int], T: int, wanted: set, steps) -> tuple[dict, list, torch.Tensor]:
    """(sequence -> its source's token ids, each sequence's SourceValues, the sources' logits) of a pack: the
    pair sources captured together, or one at a time when a source is shorter than T."""
    from .engine import capture_source

    sids = {s: inp.source_view.prompt_ids[inp.pairs[s][0]] + inp.source_view.generated[inp.pairs[s][0]] for s in seqs}
    found = (
        [capture_source(adapter, [sids[s][:T]], wanted, max(steps) + 1) for s in seqs]
        if any(len(sids[s]) < T for s in seqs)
        else [capture_source(adapter, [sids[s][:T] for s in seqs], wanted, max(steps) + 1)]
    )
    sources = [src for srcs, _ in found for src in srcs]
    return sids, sources, torch.cat([lg for _, lg in found])


def _baseline_diff(inp, s: int, base: torch.Tensor, steps, tol: float) -> float:
    """The largest difference between the unedited forward's log-probs (`base`, row st: step st) of sequence s's
    tokens and the archived ones; a SweepError when over `tol`."""
    tokens = inp.view.generated[s]
    lp = base.log_softmax(-1)
    diff = max(abs(float(lp[st, tokens[st]]) - inp.view.logprob[s][st]) for st in steps)
    if diff > tol:
        raise SweepError(
            f"sequence {s}: the unedited forward's log-probs differ from the archived ones by "
            f"{diff:.2e} (> {tol}); the model or its settings do not reproduce run "
            f"{inp.parent.id}"
        )
    return diff


def _block_table(inp, engine, s: int, steps, cells, est, source, source_baseline: dict) -> pa.Table:
    """Sequence s's block with the attribution columns. source: None without --edit patch, else (the pack's
    source logits, s's row in them, whether s's source covers every position); a full source's own metrics go
    into `source_baseline`."""
    tokens = inp.view.generated[s]
    base = est.base_logits  # row st: step st
    base_metrics = {key: v[0] for key, v in engine.measure(base[None], base, steps, tokens, 0).items()}
    pair = normalised = None
    if source is not None:
        src_logits, k, full = source
        t, pair_id = inp.pairs[s]
        if full:
            own = {key: v[0] for key, v in engine.measure(src_logits[k][None], base, steps, tokens, 0).items()}
            source_baseline[str(s)] = {m.key: own[m.key].tolist() for m in inp.metrics if m.tokens}
        else:
            own = {m.key: np.full(len(steps), np.nan) for m in inp.metrics}
        pair = PairColumns(pair_id, t, own)
        normalised = {
            key: normalised_effect(v, base_metrics[key][None], own[key][None]) for key, v in est.values.items()
        }
    table = block_table(cells, s, steps, est.values, base_metrics, pair, normalised)
    drop = (
        np.concatenate([est.graddrop[m.key].reshape(-1) for m in inp.metrics])
        if est.graddrop is not None
        else np.full(table.num_rows, np.nan)
    )
    return with_extra(table, drop)


def _path(partial: Path, s: int, j: int) -> Path:
    return partial / "blocks" / f"s{s:05d}-b{j:06d}.parquet"


def with_extra(table: pa.Table, graddrop: np.ndarray) -> pa.Table:
    """A block's table with the attribution columns (exact_* null until --verify fills them)."""
    n = table.num_rows
    table = table.append_column("method", pa.array(["attribution"] * n, pa.string()))
    table = table.append_column("graddrop", pa.array(graddrop, pa.float64(), mask=np.isnan(graddrop)))
    nulls = pa.nulls(n, pa.float64())
    return table.append_column("exact_value", nulls).append_column("exact_effect", nulls)


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None for fewer than 2 finite pairs or a constant side."""
    import pandas as pd

    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 2:
        return None
    ra, rb = pd.Series(a[ok]).rank().to_numpy(), pd.Series(b[ok]).rank().to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def verify(inp, spec, engine, adapter, table: pa.Table, n: int, note, exact_sweep) -> tuple[pa.Table, dict]:
    """Patch the top n cells (by |mean estimated effect| on the first metric) exactly, with the exact
    sweep's engine; fill their rows' exact_value / exact_effect and return the per-metric comparison.
    exact_sweep: the exact sweep's (pack_sequences, plan_sequences, prepare_pack) of analysis/sweep/packs.py."""
    import pandas as pd

    from .cells import Cell

    _packs, _plan_sequences, _prepare_pack = exact_sweep
    metric_keys = [m.key for m in inp.metrics]
    g = cell_effects(table, metric_keys[0])
    g = g.reindex(g.effect.abs().sort_values(ascending=False).index).head(n)
    as_int = lambda v: None if pd.isna(v) else int(v)  # noqa: E731
    top = [
        Cell(r.component, as_int(r.layer), as_int(r.q_head), as_int(r.neuron), as_int(r.position))
        for r in g.itertuples()
    ]
    cells = sorted(
        top, key=lambda c: (c.start_layer(), c.head or 0, c.neuron or 0, -1 if c.position is None else c.position)
    )
    note(f"--verify: patching the estimate's top {len(cells)} cells exactly")
    exact = {}  # (sequence, cell) -> metric -> [steps]
    exact_spec = spec.model_copy(update={"method": "exact"})
    for pack in _packs(_plan_sequences(inp, exact_spec, engine, inp.seqs), 1):
        seq_in = _prepare_pack(inp, exact_spec, engine, adapter, pack, {}, {})
        q = pack[0]
        for i in range(0, len(cells), spec.batch):
            chunk = cells[i : i + spec.batch]
            logits = engine.run_cells(seq_in, chunk, [q.source] if spec.edit == "patch" else None)
            values = engine.measure(logits, q.base, q.steps, inp.view.generated[q.s], seq_in.first_step)
            for r, c in enumerate(chunk):
                exact[(q.s, c)] = {k: v[r] for k, v in values.items()}
    df = table.to_pandas()
    ev, ee = df.exact_value.to_numpy(dtype=float).copy(), df.exact_effect.to_numpy(dtype=float).copy()
    step_index = {s: {st: j for j, st in enumerate(inp.seq_steps[s])} for s in inp.seqs}
    key = lambda v: None if pd.isna(v) else int(v)  # noqa: E731
    for i, r in enumerate(df.itertuples()):
        c = Cell(r.component, key(r.layer), key(r.q_head), key(r.neuron), key(r.position))
        got = exact.get((int(r.sequence), c))
        if got is not None:
            ev[i] = got[r.metric][step_index[int(r.sequence)][int(r.step)]]
            ee[i] = ev[i] - r.baseline
    names = table.column_names
    table = table.set_column(names.index("exact_value"), "exact_value", pa.array(ev, pa.float64(), mask=np.isnan(ev)))
    table = table.set_column(names.index("exact_effect"), "exact_effect", pa.array(ee, pa.float64(), mask=np.isnan(ee)))
    return table, verify_summary(table, cells, metric_keys)


def verify_summary(table: pa.Table, cells, metric_keys: list[str]) -> dict:
    """Per metric: the verified cells' mean estimated and exact effects over every (sequence, step) row,
    and Spearman's rank correlation between them."""
    df = table.to_pandas()
    df = df[df.exact_effect.notna()]
    keys = ["component", "layer", "q_head", "neuron", "position"]
    out = {"n": len(cells), "ranked_by": metric_keys[0], "metrics": {}}
    for metric in metric_keys:
        d = df[df.metric == metric]
        if d.empty or d.effect.isna().all():
            out["metrics"][metric] = {"spearman": None, "cells": [], "note": "not estimated"}
            continue
        g = d.groupby(keys, dropna=False)[["effect", "exact_effect"]].mean().reset_index()
        rows = [
            {
                k: (None if isinstance(r[k], float) and np.isnan(r[k]) else r[k] if k == "component" else int(r[k]))
                for k in keys
            }
            | {"estimate": float(r["effect"]), "exact": float(r["exact_effect"])}
            for r in g.to_dict("records")
        ]
        rows.sort(key=lambda r: -abs(r["estimate"]))
        out["metrics"][metric] = {
            "spearman": spearman(g.effect.to_numpy(float), g.exact_effect.to_numpy(float)),
            "cells": rows,
        }
    return out
