"""Figure specifications: Plotly figure JSON whose data arrays are blob references.

A figure is a plain dict `{"id", "title", "data", "layout", "variants"}` that the page hands to
Plotly.newPlot once its blobs are decoded, and that `static.py` draws with matplotlib. `variants`
(optional) lists alternative views of the same figure (another layer, head or aggregation): a
selector under the figure swaps the first trace's fields for the chosen variant's.
"""

from __future__ import annotations

# Sequential scale for probabilities and attention weights: white (0) to dark blue (1), readable
# under cell text; diverging scale for signed scores (attributions, shifts).
SEQUENTIAL = [[0.0, "#f7fbff"], [0.25, "#c6dbef"], [0.5, "#6baed6"], [0.75, "#2171b5"], [1.0, "#08306b"]]
DIVERGING = [[0.0, "#b2182b"], [0.25, "#ef8a62"], [0.5, "#f7f7f7"], [0.75, "#67a9cf"], [1.0, "#2166ac"]]
CATEGORICAL = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]

ROW_PX = 14  # pixels per heatmap row, so that labels stay readable
WIDE_PX = 1100  # narrower figures fill the page's width


def height_for(n_rows: int, row_px: int = ROW_PX) -> int:
    """Pixels for a heatmap of n_rows rows (title and key labels included)."""
    return max(260, min(4000, 150 + n_rows * row_px))


def heatmap(
    fig_id: str,
    title: str,
    z: dict,
    x: dict,
    y: dict,
    *,
    zmin=0.0,
    zmax=1.0,
    colorscale=None,
    xtitle: str = "key position · token",
    ytitle: str = "",
    hover: str = "%{y}<br>%{x}<br>%{z:.4f}",
    text: dict | None = None,
    customdata: dict | None = None,
    n_rows: int = 10,
    n_cols: int = 10,
    cell_px: int | None = None,
    row_px: int = ROW_PX,
    variants: list[dict] | None = None,
    zlabel: str = "",
) -> dict:
    """A heatmap of z [rows, cols]; x / y are blob references to unique axis labels."""
    trace = {
        "type": "heatmap",
        "z": z,
        "x": x,
        "y": y,
        "zmin": zmin,
        "zmax": zmax,
        "colorscale": colorscale or SEQUENTIAL,
        "hovertemplate": hover + "<extra></extra>",
        "hoverongaps": False,
        "colorbar": {"title": {"text": zlabel}, "thickness": 12},
    }
    if text is not None:
        trace.update(text=text, texttemplate="%{text}", textfont={"size": 10})
    if customdata is not None:
        trace["customdata"] = customdata
    height = height_for(n_rows, row_px)
    layout = {
        "title": {"text": title, "font": {"size": 14}},
        "height": height,
        "margin": {"l": 110, "r": 30, "t": 40, "b": 110},
        "xaxis": {"title": {"text": xtitle}, "type": "category", "tickfont": {"size": 9}, "automargin": True},
        "yaxis": {
            "title": {"text": ytitle},
            "type": "category",
            "autorange": "reversed",
            "tickfont": {"size": 9},
            "automargin": True,
        },
    }
    if cell_px and 160 + n_cols * cell_px > WIDE_PX:  # wider than a page: a fixed width, scrolled sideways
        layout["width"] = 160 + n_cols * cell_px
    return {"id": fig_id, "title": title, "data": [trace], "layout": layout, "variants": variants or []}


def lines(
    fig_id: str,
    title: str,
    series: list[dict],
    *,
    xtitle: str,
    ytitle: str,
    ylog: bool = False,
    markers: bool = True,
    shapes: list[dict] | None = None,
    height: int = 340,
) -> dict:
    """Line plot; each series is {"name", "x": ref, "y": ref}, optionally "text": ref for hover."""
    data = []
    for i, s in enumerate(series):
        trace = {
            "type": "scatter",
            "mode": "lines+markers" if markers else "lines",
            "name": s["name"],
            "x": s["x"],
            "y": s["y"],
            "line": {"color": s.get("color", CATEGORICAL[i % len(CATEGORICAL)])},
            "marker": {"size": 5},
        }
        if "text" in s:
            trace["text"] = s["text"]
            trace["hovertemplate"] = "%{text}<extra>" + s["name"] + "</extra>"
        data.append(trace)
    layout = {
        "title": {"text": title, "font": {"size": 14}},
        "height": height,
        "margin": {"l": 70, "r": 30, "t": 40, "b": 100},
        "xaxis": {"title": {"text": xtitle}},
        "yaxis": {"title": {"text": ytitle}, "type": "log" if ylog else "linear"},
        # below the x axis title, not over it (anchored by its top edge, in the enlarged bottom margin)
        "legend": {"orientation": "h", "x": 0, "y": -0.3, "yanchor": "top"},
    }
    if shapes:
        layout["shapes"] = shapes
    return {"id": fig_id, "title": title, "data": data, "layout": layout, "variants": []}


def vline(x: float, label: str = "") -> dict:
    return {
        "type": "line",
        "x0": x,
        "x1": x,
        "yref": "paper",
        "y0": 0,
        "y1": 1,
        "line": {"color": "#d62728", "dash": "dot", "width": 1.5},
        "name": label,
    }
