"""The rankings of a comparison: the layers and the heads that changed most over the paired steps of
every pair, read from the per-layer and per-head tables."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .values import abs_mean, finite


def rank_layers(per_layer: pa.Table) -> list[dict]:
    """Per layer over every paired step of every pair, most changed first (by the relative change of the norm
    of the layer's own output, then of the residual norm after it)."""
    if per_layer.num_rows == 0:
        return []
    c = {name: per_layer.column(name).to_numpy(zero_copy_only=False) for name in per_layer.column_names}
    lens = np.asarray([np.nan if v is None else float(v) for v in per_layer.column("lens_changed").to_pylist()])
    same2 = np.asarray([bool(v) for v in per_layer.column("same_final_top2").to_pylist()])
    out = []
    for layer in sorted(set(c["layer"].tolist())):
        m = c["layer"] == layer
        row = {
            "layer": int(layer),
            "steps": int(m.sum()),
            "delta_norm_rel_change": _rel(c["delta_norm_delta"][m], c["delta_norm_a"][m]),
            "resid_norm_rel_change": _rel(c["resid_norm_delta"][m], c["resid_norm_a"][m]),
            "resid_norm_abs_delta": abs_mean(c["resid_norm_delta"][m]),
            "delta_norm_abs_delta": abs_mean(c["delta_norm_delta"][m]),
            "attn_norm_abs_delta": abs_mean(c["attn_norm_delta"][m]),
            "mlp_norm_abs_delta": abs_mean(c["mlp_norm_delta"][m]),
            "attn_js_mean": abs_mean(c["attn_js_mean"][m]),
            "attn_js_max": finite(np.nanmax(c["attn_js_max"][m])) if np.isfinite(c["attn_js_max"][m]).any() else None,
            "lens_changes": int(np.nansum(lens[m])) if np.isfinite(lens[m]).any() else None,
            "margin_contrib_abs_delta": abs_mean(c["margin_contrib_delta"][m & same2]),
            "resid_dist_mean": abs_mean(c["resid_dist"][m]),
        }
        figures = [
            row[k]
            for k in (
                "resid_norm_abs_delta",
                "delta_norm_abs_delta",
                "attn_norm_abs_delta",
                "mlp_norm_abs_delta",
                "attn_js_mean",
                "lens_changes",
                "resid_dist_mean",
            )
        ]
        # Not the margin contribution: it is the layer's output read through the final norm, whose scale any
        # later change moves, so it differs at layers whose own values are identical.
        row["changed"] = any(v not in (None, 0, 0.0) for v in figures)
        out.append(row)
    out.sort(
        key=lambda r: (
            -(r["delta_norm_rel_change"] or 0.0),
            -(r["resid_norm_rel_change"] or 0.0),
            -(r["attn_js_mean"] or 0.0),
            r["layer"],
        )
    )
    return out


def _rel(delta: np.ndarray, base: np.ndarray) -> float | None:
    """mean |delta| / mean |base|: a change relative to the size of what changed."""
    d, b = abs_mean(delta), abs_mean(base)
    if d is None:
        return None
    return d / b if b else (0.0 if d == 0 else None)


def rank_heads(per_head: pa.Table) -> list[dict]:
    """Per (layer, head): mean and max attention-row JS over paired steps, most changed first."""
    if per_head.num_rows == 0:
        return []
    layer = per_head.column("layer").to_numpy()
    head = per_head.column("q_head").to_numpy()
    js = per_head.column("attn_js").to_numpy(zero_copy_only=False)
    key = layer.astype(np.int64) * 100000 + head
    out = []
    for u in np.unique(key):
        m = key == u
        x = js[m][np.isfinite(js[m])]
        if not x.size:
            continue
        out.append(
            {
                "layer": int(u // 100000),
                "q_head": int(u % 100000),
                "steps": int(m.sum()),
                "attn_js_mean": float(x.mean()),
                "attn_js_max": float(x.max()),
            }
        )
    out.sort(key=lambda r: (-r["attn_js_mean"], -r["attn_js_max"], r["layer"], r["q_head"]))
    return out
