"""The token view's pictures, as compact answers a page draws on a canvas: one head's whole attention
pattern (query x key: the prompt's rows when `prefill_attn` was captured, then every generated
step's row), every head of a layer (small multiples), the attention averaged and maximised over
heads, the logit lens over the steps (layers x steps, top-1 token and its probability) and one
head's direct logit attribution over the steps.

Arrays travel as the archive's own bytes, base64 of little-endian float16 or float32 (`packed`): a
number the page shows is the archived number, and 4,000 keys x 16 steps are 128 kB instead of a
table of 64,000 cells. A matrix of more than MAX_CELLS cells is max-pooled (`stride` > 1: each cell
is the maximum of stride x stride archived cells). Each answer reads one slice of its arrays.
"""

from __future__ import annotations

import base64

import numpy as np

from ..analysis.attention_heads import mean_max_over_heads
from ..analysis.attention_images import full_pattern, pool_max
from ..archive.attention import topk_dense
from ..archive.reader import Run, lens_state
from ..output.jsonout import strict
from . import blocks, kept
from .errors import NotFound
from .queries import check_sequence, check_step, key_texts, n_keys_of, steps_ready

MAX_CELLS = 1 << 21  # cells of one head's pattern sent at most (2M: 4 MB of float16) before pooling
LAYER_CELLS = 1 << 18  # cells per head of a layer's small multiples (9 heads x 256k float16: 4.5 MB)
MAX_STEPS = 4096  # steps of a pattern (rows) read at most


def packed(a: np.ndarray) -> dict:
    """An array as {"dtype", "shape", "data": base64 of its little-endian bytes}: float16 stays float16
    (the archive's numbers, exactly), any other float is float32."""
    a = np.ascontiguousarray(a, dtype="<f2" if a.dtype == np.float16 else "<f4")
    return {
        "dtype": "float16" if a.dtype == np.float16 else "float32",
        "shape": list(a.shape),
        "data": base64.b64encode(a.tobytes()).decode("ascii"),
    }


def _check_head(run: Run, layer: int, head: int | None) -> int:
    if layer not in run.layers:
        raise NotFound(f"layer {layer} was not captured in run {run.id} (captured: {run.layers})")
    n_heads = run.shape.get("n_heads", 0)
    if head is not None and not 0 <= head < n_heads:
        raise NotFound(f"run {run.id} has heads 0-{n_heads - 1}, not {head}")
    return run.layers.index(layer)


def _step_rows(run: Run, seq: int, li: int, heads, n: int, k_max: int) -> np.ndarray:
    """attn [step, .., key] of (layer li, heads) for the first n steps, keys < k_max, NaN past each step's
    context (a top-k run: dense, 0 for a key it did not keep)."""
    names = kept.array_names(run)
    if "attn" in names:
        rows = blocks.steps_rows(run, seq, n, k_max, (li, heads))
        rows = rows if rows is not None else np.asarray(kept.array(run, "attn")[seq, :n, li, heads, :k_max])
    elif "attn_topk_prob" in names:
        rows = topk_dense(
            np.asarray(kept.array(run, "attn_topk_idx")[seq, :n, li, heads]),
            np.asarray(kept.array(run, "attn_topk_prob")[seq, :n, li, heads]),
            k_max,
        )
    else:
        raise NotFound(f"run {run.id} captured no attention")
    p = k_max - n + 1  # the prompt's length: step s attends to p + s keys
    past = np.arange(k_max)[None, :] >= (p + np.arange(n))[:, None]  # [step, key]
    past = past.reshape((n,) + (1,) * (rows.ndim - 2) + (k_max,))
    return np.where(past, np.nan, rows).astype(rows.dtype)


def _prompt_rows(run: Run, seq: int, li: int, heads, p: int) -> np.ndarray | None:
    if "prefill_attn" not in kept.array_names(run) or p < 2:
        return None
    return np.asarray(kept.array(run, "prefill_attn")[seq, li, heads, :p, :p])


def _context(run: Run, seq: int) -> tuple[int, int, int]:
    """(steps committed (at most MAX_STEPS), prompt length, keys of the last step's context)."""
    check_sequence(run, seq)
    n = min(steps_ready(run, seq), MAX_STEPS)
    if n == 0:
        raise NotFound(f"sequence {seq} of run {run.id} has no committed step yet")
    return n, n_keys_of(run, seq, 0), n_keys_of(run, seq, n - 1)


def head_image(run: Run, seq: int, layer: int, head: int) -> dict:
    """One head's whole pattern: `weights` [query, key] packed (NaN past a query's context), its first
    query's position `query_start` (0 with the prompt's rows, else the prompt's last position), the
    keys' texts, each step's chosen token, `stride` (1 unless pooled)."""
    li = _check_head(run, layer, head)
    n, p, k_max = _context(run, seq)
    steps = _step_rows(run, seq, li, head, n, k_max)  # [step, key]
    matrix, start = full_pattern(_prompt_rows(run, seq, li, head, p), steps)
    pooled, stride = pool_max(matrix, MAX_CELLS)
    texts = key_texts(run, seq, k_max + 1)
    return {
        "sequence": seq,
        "layer": layer,
        "head": head,
        "prompt_len": p,
        "steps": n,
        "query_start": start,
        "prompt_rows": start == 0,
        "stride": stride,
        "keys": texts[:k_max],
        "chosen": texts[p : p + n],
        "dense": "attn" in kept.array_names(run),
        "weights": packed(pooled),
    }


def layer_images(run: Run, seq: int, layer: int) -> dict:
    """Every head of a layer (small multiples): `weights` [head, query, key] packed, as `head_image`."""
    li = _check_head(run, layer, None)
    n, p, k_max = _context(run, seq)
    heads = slice(None)
    rows = _step_rows(run, seq, li, heads, n, k_max)  # [step, head, key]
    rows = np.moveaxis(rows, 1, 0)  # [head, step, key]
    prompt = _prompt_rows(run, seq, li, heads, p)  # [head, P, P] or None
    mats = [full_pattern(None if prompt is None else prompt[h], rows[h]) for h in range(rows.shape[0])]
    start = mats[0][1]
    pooled, stride = pool_max(np.stack([m for m, _ in mats]), LAYER_CELLS)
    return {
        "sequence": seq,
        "layer": layer,
        "heads": int(rows.shape[0]),
        "prompt_len": p,
        "steps": n,
        "query_start": start,
        "prompt_rows": start == 0,
        "stride": stride,
        "dense": "attn" in kept.array_names(run),
        "weights": packed(pooled),
    }


def over_heads_image(run: Run, seq: int, step: int) -> dict | None:
    """The attention of `step` averaged and maximised over heads (`mean`, `max` [layer, key], packed: the
    mean float32 as `analysis.attention_heads` takes it, the max in the archive's dtype) and the keys' texts."""
    check_step(run, seq, step)
    names = kept.array_names(run)
    n_keys = n_keys_of(run, seq, step)
    if "attn" in names:
        rows = blocks.step_rows(run, seq, step, n_keys)
    elif "attn_topk_prob" in names:
        rows = topk_dense(
            np.asarray(kept.array(run, "attn_topk_idx")[seq, step]),
            np.asarray(kept.array(run, "attn_topk_prob")[seq, step]),
            n_keys,
        )
    else:
        return None
    mean, mx = mean_max_over_heads(rows)
    return {"layers": run.layers, "keys": key_texts(run, seq, n_keys), "mean": packed(mean), "max": packed(mx)}


def lens_grid(run: Run, seq: int) -> dict:
    """The logit lens over the sequence's steps: per captured layer and step the lens's top-1 token and
    its probability (`lens_ids` / `lens_probs` [.., 0]); `state` pending (with the `lmtrace lens`
    command) or none when there is nothing to draw."""
    check_sequence(run, seq)
    state = lens_state(run.manifest)
    if state == "none":
        return {"state": state}
    if state == "pending":
        return {"state": state, "note": f"the logit lens is deferred: run `lmtrace lens {run.path.name}` to compute it"}
    n = steps_ready(run, seq)
    ids = np.asarray(kept.array(run, "lens_ids")[seq, :n, :, 0])  # [step, layer]
    probs = np.asarray(kept.array(run, "lens_probs")[seq, :n, :, 0], dtype=np.float32)
    vocab = sorted(set(int(i) for i in ids.ravel()))
    texts = dict(zip(vocab, run.text(vocab))) if vocab else {}
    chosen = key_texts(run, seq, n_keys_of(run, seq, 0) + n)[n_keys_of(run, seq, 0) :]
    return {
        "state": state,
        "layers": run.layers,
        "steps": n,
        "chosen": chosen,
        "top1": [[texts[int(i)] for i in row] for row in ids.T],  # [layer][step]
        "top1_id": ids.T.tolist(),
        "prob": [[strict(float(x)) for x in row] for row in probs.T],
    }


def head_dla_over_steps(run: Run, seq: int, layer: int, head: int) -> dict:
    """One head's direct logit attribution (logit(chosen) - logit(runner-up)) at every committed step."""
    li = _check_head(run, layer, head)
    check_sequence(run, seq)
    if "head_dla" not in kept.array_names(run):
        raise NotFound(f"run {run.id} did not capture head DLA (capture.head_dla)")
    n = steps_ready(run, seq)
    values = np.asarray(kept.array(run, "head_dla")[seq, :n, li, head], dtype=np.float32)
    p = n_keys_of(run, seq, 0)
    return {
        "sequence": seq,
        "layer": layer,
        "head": head,
        "values": [strict(float(v)) for v in values],
        "chosen": key_texts(run, seq, p + n)[p:],
        "target": "logit(chosen) - logit(runner-up)",
    }
