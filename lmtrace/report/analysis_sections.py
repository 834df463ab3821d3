"""Report sections for analyses stored in a run: `lmtrace heads` (analysis/heads.parquet) and
`lmtrace sweep` (sweeps/<id>/sweep_mean.parquet). Read from those files only, through their
documented columns (docs/heads.md, docs/sweep.md)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq

from . import figures as F
from .blobs import Blobs
from .run_data import RunData
from .sections import Section, esc

HEAD_LABELS = ("sink", "previous-token", "induction", "local", "focused", "diffuse")
HEADS_FILE = ("analysis", "heads.parquet")
SWEEPS_DIR = "sweeps"


def _discrete_scale(colours: list[str]) -> list[list]:
    """A Plotly colour scale with one flat band per category 0..n-1 (zmin 0, zmax n-1)."""
    n = len(colours)
    scale = []
    for i, c in enumerate(colours):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


def heads_section(data: RunData, blobs: Blobs) -> Section:
    sec = Section("heads", "What each head does (lmtrace heads)")
    path = data.run.path.joinpath(*HEADS_FILE)
    if not path.is_file():
        sec.notes.append(f"no head classification yet: `lmtrace heads {data.run.id}` computes it from the archive")
        return sec
    t = pq.read_table(path).to_pylist()
    layers = sorted({r["layer"] for r in t})
    n_heads = max(r["head"] for r in t) + 1
    row = {layer: i for i, layer in enumerate(layers)}
    label = np.full((len(layers), n_heads), np.nan, dtype=np.float32)
    text = np.full(label.shape, "", dtype=object)
    custom = np.full(label.shape, "", dtype=object)
    scores = ("sink_score", "prev_token_score", "local_score", "induction_score", "duplicate_score", "entropy",
              "concentration", "importance")
    for r in t:
        i, h = row[r["layer"]], r["head"]
        label[i, h] = HEAD_LABELS.index(r["label"]) if r["label"] in HEAD_LABELS else np.nan
        text[i, h] = (r["label"] or "")[:4]
        custom[i, h] = f"<b>{esc(r['label'])}</b><br>" + "<br>".join(
            f"{k}: {r[k]:.3f}" for k in scores if isinstance(r.get(k), (int, float)) and r.get(k) == r.get(k))
    ylabels = blobs.add_texts("heads_layers", [f"L{layer}" for layer in layers])
    xlabels = blobs.add_texts("heads_heads", [f"H{h}" for h in range(n_heads)])
    z = blobs.add("heads_label", label, "float32")
    sec.html = ("<p class='legend'>colour = label: " + ", ".join(
        f"<span class='tok' style='background:{c}'>&nbsp;{esc(n)}&nbsp;</span>"
        for n, c in zip(HEAD_LABELS, F.CATEGORICAL)) + "; hover a cell for its scores (docs/heads.md).</p>")
    variants = [{"label": "label", "z": z, "text": blobs.add("heads_text", text), "colorscale":
                 _discrete_scale(F.CATEGORICAL[:len(HEAD_LABELS)]), "zmin": 0, "zmax": len(HEAD_LABELS) - 1}]
    for key in scores:
        values = [r.get(key) for r in t]
        if not any(isinstance(v, (int, float)) and v == v for v in values):
            continue
        grid = np.full(label.shape, np.nan, dtype=np.float32)
        for r in t:
            if isinstance(r.get(key), (int, float)):
                grid[row[r["layer"]], r["head"]] = r[key]
        top = float(np.nanmax(grid)) if np.isfinite(grid).any() else 1.0
        variants.append({"label": key, "z": blobs.add(f"heads_{key}", grid, "float32"),
                         "text": blobs.add(f"heads_{key}_text", np.vectorize(
                             lambda v: "" if v != v else f"{v:.2f}", otypes=[object])(grid)),
                         "colorscale": F.SEQUENTIAL, "zmin": 0, "zmax": max(top, 1e-9)})
    fig = F.heatmap("heads", "heads by label (and each score as a view)", z, xlabels, ylabels,
                    customdata=blobs.add("heads_custom", custom), text=variants[0]["text"], n_rows=len(layers),
                    xtitle="head", ytitle="layer", hover="%{y}.%{x}<br>%{customdata}", variants=variants)
    fig["data"][0].update(colorscale=variants[0]["colorscale"], zmin=0, zmax=len(HEAD_LABELS) - 1, showscale=False)
    sec.figures.append(fig)
    return sec


def _sweep_grid(rows: list[dict], metric: str):
    """Mean effect over sequences per cell: (kind, grid [rows, cols], row labels, col labels) or None."""
    rows = [r for r in rows if r["metric"] == metric]
    if not rows:
        return None
    cells: dict[tuple, list[float]] = {}
    for r in rows:
        key = (r["component"], r["layer"], r["head"], r["neuron"], r["position"])
        if r["effect"] is not None:
            cells.setdefault(key, []).append(r["effect"])
    mean = {k: float(np.mean(v)) for k, v in cells.items()}
    component = rows[0]["component"]
    second = {"head": 2, "neuron": 3, "position": 4, "resid": 4}.get(component)
    layers = sorted({k[1] for k in mean if k[1] is not None})
    if second is not None and layers:
        cols = sorted({k[second] for k in mean if k[second] is not None})
        grid = np.full((len(layers), len(cols)), np.nan, dtype=np.float32)
        for k, v in mean.items():
            if k[1] is not None and k[second] is not None:
                grid[layers.index(k[1]), cols.index(k[second])] = v
        prefix = {2: "H", 3: "N", 4: "pos "}[second]
        return component, grid, [f"L{layer}" for layer in layers], [f"{prefix}{c}" for c in cols]
    if layers:  # one value per layer (attn, mlp, layer)
        grid = np.asarray([[mean.get(k, np.nan) for k in sorted(mean, key=lambda k: k[1])]], dtype=np.float32)
        return component, grid, [component], [f"L{layer}" for layer in layers]
    cols = sorted({k[4] for k in mean if k[4] is not None})  # positions alone
    grid = np.asarray([[np.mean([v for k, v in mean.items() if k[4] == c]) for c in cols]], dtype=np.float32)
    return component, grid, [component], [f"pos {c}" for c in cols]


def sweeps_section(data: RunData, blobs: Blobs) -> Section | None:
    folder = data.run.path / SWEEPS_DIR
    done = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")) if folder.is_dir() else []
    if not done:
        return None
    sec = Section("sweeps", "Sweeps (lmtrace sweep)")
    for n, d in enumerate(done):
        mean_file = d / "sweep_mean.parquet"
        if not mean_file.is_file():
            continue
        info = json.loads((d / "sweep.json").read_text()) if (d / "sweep.json").is_file() else {}
        rows = pq.read_table(mean_file).to_pylist()
        stored = list(dict.fromkeys(r["metric"] for r in rows))
        metrics = [m for m in info.get("metrics") or [] if m in stored] or stored  # the sweep's order: first ranks
        variants = []
        first = None
        for metric in metrics:
            grid = _sweep_grid(rows, metric)
            if grid is None:
                continue
            component, z, ylab, xlab = grid
            lim = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1.0
            ref = blobs.add(f"sweep_{n}_{metric}", z, "float32")
            variants.append({"label": f"{metric}: mean effect (edited − unedited)", "z": ref,
                             "zmin": -lim or -1.0, "zmax": lim or 1.0})
            first = first or (component, z, ylab, xlab, ref)
        if first is None:
            continue
        component, z, ylab, xlab, ref = first
        spec = info.get("spec") or {}
        title = (f"sweep {d.name}: {spec.get('edit', '')} {spec.get('over', component)}"
                 + (f", source {info['source'].get('run_id')}" if isinstance(info.get("source"), dict) else ""))
        fig = F.heatmap(f"sweep-{n}", title, ref, blobs.add_texts(f"sweep_{n}_x", xlab),
                        blobs.add_texts(f"sweep_{n}_y", ylab), zmin=variants[0]["zmin"], zmax=variants[0]["zmax"],
                        colorscale=F.DIVERGING, n_rows=len(ylab), n_cols=len(xlab), cell_px=18,
                        xtitle="", ytitle="", hover="%{y} %{x}<br>effect %{z:.4g}", variants=variants, zlabel="effect")
        sec.figures.append(fig)
    return sec


def dla_section(data: RunData, sel, blobs: Blobs) -> Section | None:
    """Per-head direct logit attribution (`head_dla`, docs/archive.md "Direct logit attribution"):
    a layer × head heatmap per shown sequence, mean over its committed steps and at the step of the
    attention grid (`sel.attention_step`), toward the logit difference and toward the chosen logit."""
    if "head_dla" not in data.arrays:
        return None
    sec = Section("dla", "Direct logit attribution per head")
    sec.html = ("<p class='legend'>What each query head writes to the residual stream, projected on "
                "W<sub>U</sub>[chosen] − W<sub>U</sub>[runner-up] (or W<sub>U</sub>[chosen]) through the final norm "
                "frozen at its actual scale, in logits: blue pushes toward the chosen token, red away "
                "(docs/archive.md, “Direct logit attribution”).</p>")
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
                variants.append({"label": f"{what}, {when}", "z": blobs.add(key, grid, "float32"),
                                 "zmin": -(lim or 1.0), "zmax": lim or 1.0})
        first = variants[0]
        fig = F.heatmap(f"dla-{seq}", f"sequence {seq}: head DLA toward the chosen token", first["z"], xlabels, ylabels,
                        zmin=first["zmin"], zmax=first["zmax"], colorscale=F.DIVERGING, n_rows=len(layers),
                        xtitle="query head", ytitle="layer", hover="%{y}.%{x}<br>%{z:.4g} logits", variants=variants,
                        zlabel="logits")
        sec.figures.append(fig)
    return sec
