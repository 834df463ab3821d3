"""Report sections for analyses stored in a run: `lmtrace heads` (analysis/heads.parquet) and
`lmtrace sweep` (sweeps/<id>/effects.zarr, written by the sweep from `analysis.sweep.effects`, the
same reduction as its terminal ranking). Read from those files only, through their documented
columns and arrays (docs/heads.md, docs/sweep.md)."""

from __future__ import annotations

import numpy as np

from ..analysis.heads import LABELS as HEAD_LABELS
from ..analysis.heads import SCORES
from ..analysis.sweep.cells import OVER_SIMPLE
from ..analysis.sweep.feature_cells import feature_label
from ..archive import parquet_io
from ..archive.columns import current_names
from ..archive.heads import ANALYSIS_DIR, HEADS_FILE
from ..archive.sweeps import EffectArray, finished_sweeps, read_effects, read_sweep_info
from . import figures as F
from .blobs import Blobs
from .run_data import RunData
from .sections import Section, esc


def _discrete_scale(colours: list[str]) -> list[list]:
    """A Plotly colour scale with one flat band per category 0..n-1 (zmin 0, zmax n-1)."""
    n = len(colours)
    scale = []
    for i, c in enumerate(colours):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


_HEAD_SCORES = (*SCORES, "importance")


def _is_number(v) -> bool:
    """A score heads.parquet holds for this head: a number, not None and not NaN."""
    return isinstance(v, (int, float)) and v == v


def _head_cells(rows: list[dict], row: dict[int, int], n_heads: int):
    """The label grid of heads.parquet's rows, as (label [layer row, q_head] float32: the label's
    index in HEAD_LABELS, NaN where none; text: its first four letters; custom: the hover's label
    and scores)."""
    label = np.full((len(row), n_heads), np.nan, dtype=np.float32)
    text = np.full(label.shape, "", dtype=object)
    custom = np.full(label.shape, "", dtype=object)
    for r in rows:
        i, h = row[r["layer"]], r["q_head"]
        label[i, h] = HEAD_LABELS.index(r["label"]) if r["label"] in HEAD_LABELS else np.nan
        text[i, h] = (r["label"] or "")[:4]
        custom[i, h] = f"<b>{esc(r['label'])}</b><br>" + "<br>".join(
            f"{k}: {r[k]:.3f}" for k in _HEAD_SCORES if _is_number(r.get(k))
        )
    return label, text, custom


def _heads_legend() -> str:
    """The colour of each head label, above the figure."""
    return (
        "<p class='legend'>colour = label: "
        + ", ".join(
            f"<span class='tok' style='background:{c}'>&nbsp;{esc(n)}&nbsp;</span>"
            for n, c in zip(HEAD_LABELS, F.CATEGORICAL)
        )
        + "; hover a cell for its scores (docs/heads.md).</p>"
    )


def _score_variants(rows: list[dict], row: dict[int, int], shape: tuple[int, int], blobs: Blobs) -> list[dict]:
    """One view per score some head holds: its [layer row, q_head] grid (NaN where absent), from 0 to
    the largest value, each cell written with two decimals."""
    variants = []
    for key in _HEAD_SCORES:
        if not any(_is_number(r.get(key)) for r in rows):
            continue
        grid = np.full(shape, np.nan, dtype=np.float32)
        for r in rows:
            if isinstance(r.get(key), (int, float)):
                grid[row[r["layer"]], r["q_head"]] = r[key]
        top = float(np.nanmax(grid)) if np.isfinite(grid).any() else 1.0
        variants.append(
            {
                "label": key,
                "z": blobs.add(f"heads_{key}", grid, "float32"),
                "text": blobs.add(
                    f"heads_{key}_text", np.vectorize(lambda v: "" if v != v else f"{v:.2f}", otypes=[object])(grid)
                ),
                "colorscale": F.SEQUENTIAL,
                "zmin": 0,
                "zmax": max(top, 1e-9),
            }
        )
    return variants


def heads_section(data: RunData, blobs: Blobs) -> Section:
    """analysis/heads.parquet as a layer × head heatmap coloured by label, one view per score; a note
    naming `lmtrace heads` when the run has none yet."""
    sec = Section("heads", "What each head does (lmtrace heads)")
    path = data.run.path / ANALYSIS_DIR / HEADS_FILE
    if not path.is_file():
        sec.notes.append(f"no head classification yet: `lmtrace heads {data.run.id}` computes it from the archive")
        return sec
    t = current_names(parquet_io.read_table(path), "heads").to_pylist()  # `head` in an older archive
    layers = sorted({r["layer"] for r in t})
    n_heads = max(r["q_head"] for r in t) + 1
    row = {layer: i for i, layer in enumerate(layers)}
    label, text, custom = _head_cells(t, row, n_heads)
    ylabels = blobs.add_texts("heads_layers", [f"L{layer}" for layer in layers])
    xlabels = blobs.add_texts("heads_heads", [f"H{h}" for h in range(n_heads)])
    z = blobs.add("heads_label", label, "float32")
    sec.html = _heads_legend()
    variants = [
        {
            "label": "label",
            "z": z,
            "text": blobs.add("heads_text", text),
            "colorscale": _discrete_scale(F.CATEGORICAL[: len(HEAD_LABELS)]),
            "zmin": 0,
            "zmax": len(HEAD_LABELS) - 1,
        }
    ]
    variants += _score_variants(t, row, label.shape, blobs)
    fig = F.heatmap(
        "heads",
        "heads by label (and each score as a view)",
        z,
        xlabels,
        ylabels,
        customdata=blobs.add("heads_custom", custom),
        text=variants[0]["text"],
        n_rows=len(layers),
        xtitle="head",
        ytitle="layer",
        hover="%{y}.%{x}<br>%{customdata}",
        variants=variants,
    )
    fig["data"][0].update(colorscale=variants[0]["colorscale"], zmin=0, zmax=len(HEAD_LABELS) - 1, showscale=False)
    sec.figures.append(fig)
    return sec


def _sweep_grid(effect: EffectArray, component: str, sae: str | None = None):
    """One metric's effects.zarr array as a 2-D grid: (grid [rows, cols], row labels, col labels).

    [layer, q_head | neuron | position] -> layers × the other coordinate; [layer] or [position] ->
    one row; [layer, q_head | neuron, position] -> one row per (layer, head or neuron) × positions;
    a feature sweep's [feature] -> one row (the SAE), [feature, position] -> a row per feature, each
    feature named 'feature 123 (sae-l10)'."""
    dims, values = effect.dims, effect.values
    prefix = {"q_head": "H", "neuron": "N", "position": "pos ", "layer": "L"}
    labels = {
        d: [feature_label(v, sae) if d == "feature" else f"{prefix[d]}{v}" for v in effect.coords[d]] for d in dims
    }
    if len(dims) == 1:
        return values[None, :], [sae or component], labels[dims[0]]
    if len(dims) == 2:
        return values, labels[dims[0]], labels[dims[1]]
    rows = [f"{a} {b}" for a in labels[dims[0]] for b in labels[dims[1]]]
    return values.reshape(len(rows), -1), rows, labels[dims[2]]


def sweeps_section(data: RunData, blobs: Blobs) -> Section | None:
    """Per finished sweep a heatmap of its effects.zarr: each cell's mean effect over every (sequence,
    step) row, as `analysis.sweep.effects.cell_effects` computed it for the terminal's ranking too."""
    done = finished_sweeps(data.run.path)
    if not done:
        return None
    sec = Section("sweeps", "Sweeps (lmtrace sweep)")
    for n, d in enumerate(done):
        info = read_sweep_info(d)
        spec = info.get("spec") or {}
        over = spec.get("over", "")
        component = OVER_SIMPLE.get(over, over.split(":")[0])
        variants = []
        first = None
        for effect in read_effects(d, info):  # the sweep's metric order: the first ranks
            z, ylab, xlab = _sweep_grid(effect, component, (info.get("features") or {}).get("sae"))
            lim = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1.0
            ref = blobs.add(f"sweep_{n}_{effect.metric}", z, "float32")
            variants.append(
                {
                    "label": f"{effect.metric}: mean effect (edited − unedited)",
                    "z": ref,
                    "zmin": -lim or -1.0,
                    "zmax": lim or 1.0,
                }
            )
            first = first or (z, ylab, xlab, ref)
        if first is None:
            continue
        z, ylab, xlab, ref = first
        title = f"sweep {d.name}: {spec.get('edit', '')} {spec.get('over', component)}" + (
            f", source {info['source'].get('run_id')}" if isinstance(info.get("source"), dict) else ""
        )
        fig = F.heatmap(
            f"sweep-{n}",
            title,
            ref,
            blobs.add_texts(f"sweep_{n}_x", xlab),
            blobs.add_texts(f"sweep_{n}_y", ylab),
            zmin=variants[0]["zmin"],
            zmax=variants[0]["zmax"],
            colorscale=F.DIVERGING,
            n_rows=len(ylab),
            n_cols=len(xlab),
            cell_px=18,
            xtitle="",
            ytitle="",
            hover="%{y} %{x}<br>effect %{z:.4g}",
            variants=variants,
            zlabel="effect",
        )
        sec.figures.append(fig)
    return sec


def dla_section(data: RunData, sel, blobs: Blobs) -> Section | None:
    """Per-head direct logit attribution (`head_dla`, docs/archive.md "Direct logit attribution"):
    a layer × head heatmap per shown sequence, mean over its committed steps and at the step of the
    attention grid (`sel.attention_step`), toward the logit difference and toward the chosen logit."""
    if "head_dla" not in data.arrays:
        return None
    sec = Section("dla", "Direct logit attribution per head")
    sec.html = (
        "<p class='legend'>What each query head writes to the residual stream, projected on "
        "W<sub>U</sub>[chosen] − W<sub>U</sub>[runner-up] (or W<sub>U</sub>[chosen]) through the final norm "
        "frozen at its actual scale, in logits: blue pushes toward the chosen token, red away "
        "(docs/archive.md, “Direct logit attribution”).</p>"
    )
    layers = data.layers
    ylabels = blobs.add_texts("dla_layers", [f"L{layer}" for layer in layers])
    xlabels = blobs.add_texts("dla_heads", [f"H{h}" for h in range(data.n_heads)])
    for seq in sel.sequences:
        n = data.committed.get(seq, 0)
        if n <= 0:
            continue
        a = sel.attention_step[seq]
        variants = []
        for name, what in (("head_dla", "logit(chosen) − logit(runner-up)"), ("head_dla_logit", "logit(chosen)")):
            if name not in data.arrays:
                continue
            values = np.asarray(data.run.array(name)[seq, :n], dtype=np.float32)  # [step, layer, q_head]
            with np.errstate(invalid="ignore"):
                mean = np.nanmean(values, axis=0) if np.isfinite(values).any() else values[0]
            for grid, when in ((mean, f"mean over {n} steps"), (values[a], f"step {a}")):
                lim = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0
                key = f"{name}_{seq}_{'mean' if grid is mean else f'step{a}'}"
                variants.append(
                    {
                        "label": f"{what}, {when}",
                        "z": blobs.add(key, grid, "float32"),
                        "zmin": -(lim or 1.0),
                        "zmax": lim or 1.0,
                    }
                )
        first = variants[0]
        fig = F.heatmap(
            f"dla-{seq}",
            f"sequence {seq}: head DLA toward the chosen token",
            first["z"],
            xlabels,
            ylabels,
            zmin=first["zmin"],
            zmax=first["zmax"],
            colorscale=F.DIVERGING,
            n_rows=len(layers),
            xtitle="query head",
            ytitle="layer",
            hover="%{y}.%{x}<br>%{z:.4g} logits",
            variants=variants,
            zlabel="logits",
        )
        sec.figures.append(fig)
    return sec
