"""Still images of a report's figures (PNG or SVG) for papers, drawn with matplotlib offline.

Each figure is drawn as its page shows it first (its first variant); the file is named after the
figure's id. Heatmap cells with text (the logit lens) keep their text when the grid is small enough
to read it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..exits.errors import SpecError
from .blobs import Blobs, resolve

MAX_TICKS = 60
MAX_TEXT_CELLS = 2500


def _cmap(scale):
    from matplotlib.colors import LinearSegmentedColormap

    if isinstance(scale, str):
        return scale.lower()
    return LinearSegmentedColormap.from_list("lmtrace", [(float(p), c) for p, c in scale])


def _ticks(ax, labels, axis: str):
    labels = [str(v) for v in labels]
    step = max(1, -(-len(labels) // MAX_TICKS))
    pos = np.arange(0, len(labels), step)
    if axis == "x":
        ax.set_xticks(pos, [labels[i] for i in pos], rotation=90, fontsize=6)
    else:
        ax.set_yticks(pos, [labels[i] for i in pos], fontsize=6)


def _heatmap(fig_spec: dict, plt):
    t = fig_spec["data"][0]
    z = np.asarray(t["z"], dtype=np.float64)
    rows, cols = z.shape if z.ndim == 2 else (1, z.size)
    width = min(40.0, max(6.0, 2.5 + cols * 0.12))
    height = min(40.0, max(3.0, 1.5 + rows * 0.12))
    fig, ax = plt.subplots(figsize=(width, height))
    im = ax.imshow(
        np.ma.masked_invalid(z.reshape(rows, cols)),
        aspect="auto",
        cmap=_cmap(t.get("colorscale")),
        vmin=t.get("zmin"),
        vmax=t.get("zmax"),
        interpolation="nearest",
    )
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
    _ticks(ax, list(t["x"]), "x")
    _ticks(ax, list(t["y"]), "y")
    if "text" in t and rows * cols <= MAX_TEXT_CELLS:
        text = np.asarray(t["text"], dtype=object).reshape(rows, cols)
        for i in range(rows):
            for j in range(cols):
                ax.text(j, i, str(text[i, j]), ha="center", va="center", fontsize=5)
    layout = fig_spec["layout"]
    ax.set_xlabel(layout["xaxis"]["title"]["text"], fontsize=8)
    ax.set_ylabel(layout["yaxis"]["title"]["text"], fontsize=8)
    return fig, ax


def _lines(fig_spec: dict, plt):
    fig, ax = plt.subplots(figsize=(8, 4))
    for t in fig_spec["data"]:
        x, y = np.asarray(t["x"]), np.asarray(t["y"], dtype=np.float64)
        style = "x" if t.get("mode") == "markers" else "-o"
        ax.plot(x, y, style, markersize=3, label=t["name"], color=(t.get("line") or {}).get("color"))
    layout = fig_spec["layout"]
    for shape in layout.get("shapes", []):
        ax.axvline(shape["x0"], color="#d62728", linestyle=":")
    if layout["yaxis"].get("type") == "log":
        ax.set_yscale("log")
    ax.set_xlabel(layout["xaxis"]["title"]["text"])
    ax.set_ylabel(layout["yaxis"]["title"]["text"])
    ax.legend(fontsize=7)
    return fig, ax


def export_figures(figures: list[dict], blobs: Blobs, out_dir: Path, fmt: str = "png") -> list[Path]:
    """Write each figure as out_dir/<figure id>.<fmt>; returns the paths."""
    if fmt not in ("png", "svg"):
        raise SpecError(f"image format must be png or svg (got {fmt!r})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpecError(f"cannot create {out_dir}: {err.strerror}; choose another directory") from None
    written = []
    for spec in figures:
        spec = dict(spec)
        if spec.get("variants"):
            first = {k: v for k, v in spec["variants"][0].items() if k != "label"}
            spec["data"] = [{**spec["data"][0], **first}] + spec["data"][1:]
        spec = resolve(spec, blobs.items)
        kind = spec["data"][0]["type"]
        fig, ax = (_heatmap if kind == "heatmap" else _lines)(spec, plt)
        ax.set_title(spec["title"], fontsize=9)
        fig.tight_layout()
        path = out_dir / f"{spec['id']}.{fmt}"
        fig.savefig(path, dpi=150)
        plt.close(fig)
        written.append(path)
    return written
