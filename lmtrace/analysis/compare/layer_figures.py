"""The per-layer and per-head figures of one sequence pair over its paired steps: each side's
per-layer statistics side by side (norms, lens winners, margin contributions), the JS between the
two sides' attention rows per head, and the residual distance; as typed tables (`LAYER_FIELDS`,
`HEAD_FIELDS`). Attention is read `STEP_CHUNK` steps at a time, so memory stays bounded."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...archive.reader import Run
from .divergence import attention_js_dense, attention_js_sparse
from .sides import Side, column_array

STEP_CHUNK = 16  # attention rows are compared this many steps at a time (bounded memory)

LAYER_FIELDS = [
    ("pair", pa.int32()),
    ("seq_a", pa.int32()),
    ("seq_b", pa.int32()),
    ("step", pa.int32()),
    ("layer", pa.int32()),
    ("resid_norm_a", pa.float64()),
    ("resid_norm_b", pa.float64()),
    ("resid_norm_delta", pa.float64()),
    ("resid_norm_rel_delta", pa.float64()),
    ("delta_norm_a", pa.float64()),
    ("delta_norm_b", pa.float64()),
    ("delta_norm_delta", pa.float64()),
    ("attn_norm_delta", pa.float64()),
    ("mlp_norm_delta", pa.float64()),
    ("lens_top1_a", pa.int32()),
    ("lens_top1_b", pa.int32()),
    ("lens_changed", pa.bool_()),
    ("lens_top1_prob_delta", pa.float64()),
    ("margin_contrib_a", pa.float64()),
    ("margin_contrib_b", pa.float64()),
    ("margin_contrib_delta", pa.float64()),
    ("same_final_top2", pa.bool_()),
    ("attn_js_mean", pa.float64()),
    ("attn_js_max", pa.float64()),
    ("resid_dist", pa.float64()),
    ("resid_cos", pa.float64()),
]
HEAD_FIELDS = [
    ("pair", pa.int32()),
    ("seq_a", pa.int32()),
    ("seq_b", pa.int32()),
    ("step", pa.int32()),
    ("layer", pa.int32()),
    ("q_head", pa.int32()),
    ("attn_js", pa.float64()),
    ("head_dla_a", pa.float64()),
    ("head_dla_b", pa.float64()),
    ("head_dla_delta", pa.float64()),
]


def _steps_block(side: Side, seq: int, n: int, layers: list[int]) -> dict[str, np.ndarray]:
    """steps.parquet columns of one sequence as [step, layer] arrays over steps 0..n-1 (NaN where absent)."""
    t = side.steps
    t = t.filter(pc.and_(pc.equal(t.column("sequence"), seq), pc.less(t.column("step"), n)))
    step, layer = column_array(t, "step").astype(int), column_array(t, "layer").astype(int)
    col_of = {x: i for i, x in enumerate(layers)}
    keep = np.asarray([x in col_of for x in layer], dtype=bool)
    step, cols = step[keep], np.asarray([col_of[x] for x in layer[keep]], dtype=int)
    out = {}
    for name in t.column_names:
        if name in ("sequence", "step", "layer"):
            continue
        arr = np.full((n, len(layers)), np.nan)
        arr[step, cols] = column_array(t, name)[keep].astype(np.float64)
        out[name] = arr
    return out


def _attention_source(run: Run, seq: int, s0: int, s1: int, li: int, n_keys_max: int):
    """Steps s0..s1-1 of one layer: ('dense', [step, head, key]) or ('sparse', (ids, probs)) or (None, None)."""
    names = run.array_names()
    if "attn" in names:
        return "dense", run.array("attn")[seq, s0:s1, li, :, :n_keys_max]
    if "attn_topk_idx" in names:
        return "sparse", (run.array("attn_topk_idx")[seq, s0:s1, li], run.array("attn_topk_prob")[seq, s0:s1, li])
    return None, None


def _attention_js(A: Side, B: Side, sa: int, sb: int, n: int, layers: list[int], prompt_len: int) -> np.ndarray | None:
    """[step, layer, head] JS between the two sides' attention rows (None when either has no attention)."""
    if not (
        {"attn", "attn_topk_idx"} & set(A.run.array_names()) and {"attn", "attn_topk_idx"} & set(B.run.array_names())
    ):
        return None
    n_keys = prompt_len + np.arange(n)
    out = None
    for j, layer in enumerate(layers):
        for s0 in range(0, n, STEP_CHUNK):
            s1 = min(n, s0 + STEP_CHUNK)
            kind_a, xa = _attention_source(A.run, sa, s0, s1, A.run.layer_index(layer), prompt_len + s1)
            kind_b, xb = _attention_source(B.run, sb, s0, s1, B.run.layer_index(layer), prompt_len + s1)
            nk = n_keys[s0:s1]
            if kind_a == "dense" and kind_b == "dense":
                js = attention_js_dense(xa, xb, nk)
            else:
                ia, pa_ = _as_sparse(kind_a, xa, nk)
                ib, pb_ = _as_sparse(kind_b, xb, nk)
                js = attention_js_sparse(ia, pa_, ib, pb_)
            if out is None:
                out = np.full((n, len(layers), js.shape[-1]), np.nan)
            out[s0:s1, j] = js
    return out


def _head_dla(side: Side, seq: int, n: int, layers: list[int]) -> np.ndarray | None:
    """[step, layer, head] the side's direct logit attribution per head (`capture.head_dla`: each head's
    share of logit(chosen) − logit(runner-up)) over steps 0..n-1, None without it."""
    if "head_dla" not in side.run.array_names():
        return None
    x = np.asarray(side.run.array("head_dla")[seq, :n], np.float64)  # [n, L_run, H]
    return x[:, [side.run.layer_index(layer) for layer in layers]]


def _as_sparse(kind: str, x, n_keys: np.ndarray):
    """Sparse (key id, prob) form of an attention source; a dense row keeps every key of its context."""
    if kind == "sparse":
        return np.asarray(x[0]), np.asarray(x[1], np.float64)
    x = np.nan_to_num(np.asarray(x, np.float64))
    K = x.shape[-1]
    ids = np.broadcast_to(np.arange(K), x.shape).copy()
    ids[np.arange(K)[None, None, :] >= n_keys[:, None, None]] = -1
    x = np.where(ids >= 0, x, 0.0)
    total = x.sum(-1, keepdims=True)
    return ids, np.divide(x, total, out=np.zeros_like(x), where=total > 0)


def _resid_figures(A: Side, B: Side, sa: int, sb: int, n: int, layers: list[int]):
    """[step, layer] L2 distance and cosine of the full residual vectors, where both sides stored them."""
    if "resid" not in A.run.array_names() or "resid" not in B.run.array_names():
        return None, None
    ra, rb = A.run.shape["resid_layers"], B.run.shape["resid_layers"]
    dist = np.full((n, len(layers)), np.nan)
    cos = np.full((n, len(layers)), np.nan)
    for j, layer in enumerate(layers):
        if layer in ra and layer in rb:
            va = np.asarray(A.run.array("resid")[sa, :n, ra.index(layer)], np.float64)
            vb = np.asarray(B.run.array("resid")[sb, :n, rb.index(layer)], np.float64)
            dist[:, j] = np.linalg.norm(vb - va, axis=-1)
            den = np.linalg.norm(va, axis=-1) * np.linalg.norm(vb, axis=-1)
            cos[:, j] = np.divide((va * vb).sum(-1), den, out=np.full(n, np.nan), where=den > 0)
    return dist, cos


def pair_layer_figures(
    k: int, A: Side, B: Side, sa: int, sb: int, n: int, layers: list[int], same_top2: np.ndarray
) -> tuple[dict, dict]:
    """Pair k's per-layer columns (`LAYER_FIELDS`, flattened [step, layer]) and per-head columns
    (`HEAD_FIELDS`, flattened [step, layer, head]; empty without attention) over its n paired steps.
    `same_top2` [n]: both sides' stored top-2 agree, so their margin contributions mean the same."""
    L = len(layers)
    xa, xb = _steps_block(A, sa, n, layers), _steps_block(B, sb, n, layers)
    nan = np.full((n, L), np.nan)

    def pair_of(name):
        return xa.get(name, nan), xb.get(name, nan)

    cols: dict[str, np.ndarray] = {
        "pair": np.full((n, L), k),
        "seq_a": np.full((n, L), sa),
        "seq_b": np.full((n, L), sb),
        "step": np.repeat(np.arange(n)[:, None], L, 1),
        "layer": np.repeat(np.asarray(layers)[None, :], n, 0),
    }
    ra, rb = pair_of("resid_norm")
    cols.update(
        resid_norm_a=ra,
        resid_norm_b=rb,
        resid_norm_delta=rb - ra,
        resid_norm_rel_delta=np.divide(rb - ra, ra, out=np.full((n, L), np.nan), where=ra > 0),
    )
    da, db = pair_of("delta_norm")
    cols.update(delta_norm_a=da, delta_norm_b=db, delta_norm_delta=db - da)
    for name in ("attn_norm", "mlp_norm"):
        x, y = pair_of(name)
        cols[f"{name}_delta"] = y - x
    la, lb = pair_of("lens_top1")
    cols.update(
        lens_top1_a=la,
        lens_top1_b=lb,
        lens_changed=np.where(np.isnan(la) | np.isnan(lb), np.nan, (la != lb).astype(float)),
    )
    x, y = pair_of("lens_top1_prob")
    cols["lens_top1_prob_delta"] = y - x
    ma, mb = pair_of("margin_contrib")
    cols.update(
        margin_contrib_a=ma,
        margin_contrib_b=mb,
        margin_contrib_delta=mb - ma,
        same_final_top2=np.repeat(same_top2[:, None].astype(float), L, 1),
    )
    js = _attention_js(A, B, sa, sb, n, layers, len(A.prompt_ids[sa]))
    dla_a, dla_b = _head_dla(A, sa, n, layers), _head_dla(B, sb, n, layers)
    if dla_a is None or dla_b is None:
        dla_a = dla_b = None
    heads: dict[str, np.ndarray] = {}
    if js is not None:
        cols["attn_js_mean"] = js.mean(-1)
        cols["attn_js_max"] = js.max(-1)
    else:
        cols["attn_js_mean"] = cols["attn_js_max"] = nan
    shape = js.shape if js is not None else None if dla_a is None else dla_a.shape
    if shape is not None:
        H = shape[-1]
        none = np.full(shape, np.nan)
        da, db = (none, none) if dla_a is None else (dla_a, dla_b)
        heads = {
            "pair": np.full(shape, k),
            "seq_a": np.full(shape, sa),
            "seq_b": np.full(shape, sb),
            "step": np.broadcast_to(np.arange(n)[:, None, None], shape),
            "layer": np.broadcast_to(np.asarray(layers)[None, :, None], shape),
            "q_head": np.broadcast_to(np.arange(H)[None, None, :], shape),
            "attn_js": none if js is None else js,
            "head_dla_a": da,
            "head_dla_b": db,
            "head_dla_delta": db - da,
        }
        heads = {name: np.asarray(v).reshape(-1) for name, v in heads.items()}
    dist, cos = _resid_figures(A, B, sa, sb, n, layers)
    cols["resid_dist"] = nan if dist is None else dist
    cols["resid_cos"] = nan if cos is None else cos
    return {name: np.asarray(v).reshape(-1) for name, v in cols.items()}, heads


def typed_table(fields: list[tuple[str, pa.DataType]], columns: dict[str, np.ndarray] | None) -> pa.Table:
    """Columns of numpy arrays -> a typed table; NaN in int/bool columns becomes null."""
    schema = pa.schema(fields)
    if not columns:
        return schema.empty_table()
    arrays = []
    for name, typ in fields:
        v = np.asarray(columns[name], np.float64) if columns[name].dtype != object else columns[name]
        mask = np.isnan(v) if v.dtype.kind == "f" else None
        if pa.types.is_integer(typ):
            arrays.append(pa.array(np.nan_to_num(v).astype(np.int64), type=typ, mask=mask))
        elif pa.types.is_boolean(typ):
            arrays.append(pa.array(np.nan_to_num(v) != 0, type=typ, mask=mask))
        else:
            arrays.append(pa.array(v, type=typ, mask=mask))
    return pa.Table.from_arrays(arrays, schema=schema)


def concat_columns(parts: list[dict]) -> dict[str, np.ndarray] | None:
    """The pairs' column dicts joined end to end (None when no pair has any)."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
