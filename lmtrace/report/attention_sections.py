"""The report's attention section: every layer and head over the context at the selected step, the
mean and max over heads, the selected layers' attention over steps, and the prompt's own matrix when
the run captured it. A top-k run's rows are read dense (`archive.attention.topk_dense`)."""

from __future__ import annotations

import warnings

import numpy as np

from ..analysis.attention_heads import mean_max_over_heads
from ..archive.attention import topk_dense
from . import figures as F
from .blobs import Blobs
from .run_data import RunData, display
from .sections import Section, key_labels, shown_sequences, step_labels
from .selection import Selection


def _dense_rows(data: RunData, seq: int, steps: list[int], n_keys: int):
    """Yield (step, rows [layer, head, key<n_keys]) as float arrays; top-k captures as `archive.attention.topk_dense`."""
    if "attn" in data.arrays:
        for s, rows in data.read_steps("attn", seq, steps, (slice(None), slice(None), slice(0, n_keys))):
            yield s, rows
        return
    idx_iter = data.read_steps("attn_topk_idx", seq, steps)
    prob_iter = data.read_steps("attn_topk_prob", seq, steps)
    for (s, idx), (_, prob) in zip(idx_iter, prob_iter):
        yield s, topk_dense(idx, prob, n_keys)


def _blob_dtype(arr: np.ndarray) -> str:
    return "float16" if arr.dtype == np.float16 else "float32"


def _context_grid_figure(
    data: RunData, seq: int, a: int, n_keys: int, rows: np.ndarray, tok, blobs: Blobs, head_labels: list[str]
) -> dict:
    """Every layer and head over the context at step `a` (rows [layer, head, key<n_keys]), with the
    mean and the max over heads as views."""
    layers = data.layers
    keys = blobs.add_texts(f"attn_keys_{seq}_{a}", key_labels(tok.context_texts(n_keys)))
    grid = rows.reshape(len(layers) * data.n_heads, n_keys)
    dt = _blob_dtype(rows)
    z = blobs.add(f"attn_grid_{seq}", grid, dt)
    mean_rows, max_rows = mean_max_over_heads(rows)
    mean = blobs.add(f"attn_grid_mean_{seq}", mean_rows, "float32")
    mx = blobs.add(f"attn_grid_max_{seq}", max_rows, dt)
    ylabels, layer_labels = {"$blob": "attn_head_labels"}, {"$blob": "attn_layer_labels"}
    chosen = display(tok.gen["token_text"][a]) if a < tok.n_steps else ""
    return F.heatmap(
        f"attn-grid-{seq}",
        f"sequence {seq}, step {a} (chose {chosen!r}): every layer and head over the context",
        z,
        keys,
        ylabels,
        n_rows=len(head_labels),
        row_px=6,
        ytitle="layer.head",
        variants=[
            {"label": "every head", "z": z, "y": ylabels, "height": F.height_for(len(head_labels), 6)},
            {"label": "mean over heads", "z": mean, "y": layer_labels, "height": F.height_for(len(layers))},
            {"label": "max over heads", "z": mx, "y": layer_labels, "height": F.height_for(len(layers))},
        ],
        zlabel="weight",
    )


def _rows_over_steps(
    data: RunData, sel: Selection, seq: int, P: int, steps: list[int], k_max: int
) -> dict[int, np.ndarray]:
    """Per selected layer its attention over `steps`: [step, head, key<k_max] float32, NaN past each
    step's context (P prompt tokens + the step)."""
    per_layer = {layer: np.full((len(steps), data.n_heads, k_max), np.nan, dtype=np.float32) for layer in sel.layers}
    for i, (s, r) in enumerate(_dense_rows(data, seq, steps, k_max)):
        for layer in sel.layers:
            per_layer[layer][i, :, : P + s] = r[data.run.layer_index(layer), :, : P + s]
    return per_layer


def _steps_variants(seq: int, per_layer: dict[int, np.ndarray], n_heads: int, dt: str, blobs: Blobs) -> list[dict]:
    """The views of the steps × keys figure: per layer the mean and the max over heads, then each head."""
    variants = []
    for layer, m in per_layer.items():
        with warnings.catch_warnings():  # keys past a step's context are NaN in every head
            warnings.simplefilter("ignore", RuntimeWarning)
            variants.append(
                {
                    "label": f"layer {layer}: mean over heads",
                    "z": blobs.add(f"attn_steps_{seq}_L{layer}_mean", np.nanmean(m, axis=1) if m.size else m[:, 0], dt),
                }
            )
            variants.append(
                {
                    "label": f"layer {layer}: max over heads",
                    "z": blobs.add(f"attn_steps_{seq}_L{layer}_max", np.nanmax(m, axis=1) if m.size else m[:, 0], dt),
                }
            )
        for h in range(n_heads):
            variants.append(
                {"label": f"layer {layer}, head {h}", "z": blobs.add(f"attn_steps_{seq}_L{layer}_H{h}", m[:, h], dt)}
            )
    return variants


def _steps_figure(data: RunData, sel: Selection, seq: int, P: int, tok, dt: str, blobs: Blobs) -> dict | None:
    """Steps × keys for the selected layers (one blob per layer and head, mean or max); None without
    a selected layer."""
    steps = sel.heatmap_steps[seq]
    k_max = P + steps[-1]
    key_refs = blobs.add_texts(f"attn_keys_{seq}", key_labels(tok.context_texts(k_max)))
    step_refs = blobs.add_texts(f"attn_steps_{seq}", step_labels(steps, tok.gen["token_text"]))
    variants = _steps_variants(seq, _rows_over_steps(data, sel, seq, P, steps, k_max), data.n_heads, dt, blobs)
    if not variants:
        return None
    return F.heatmap(
        f"attn-steps-{seq}",
        f"sequence {seq}: attention over steps (rows: the step that chose the token)",
        variants[0]["z"],
        key_refs,
        step_refs,
        n_rows=len(steps),
        ytitle="step:chosen token",
        variants=variants,
        zlabel="weight",
    )


def _prefill_figure(data: RunData, sel: Selection, seq: int, P: int, tok, blobs: Blobs) -> dict:
    """The prompt's (P tokens) query × key attention matrix of each selected layer: the mean over
    heads, then each head."""
    mat = np.asarray(data.run.array("prefill_attn")[seq, :, :, :P, :P])  # [layer, head, query, key]
    plabels = blobs.add_texts(f"prefill_keys_{seq}", key_labels(tok.prompt_texts[:P]))
    variants = []
    for layer in sel.layers:
        mm = mat[data.run.layer_index(layer)]
        variants.append(
            {
                "label": f"layer {layer}: mean over heads",
                "z": blobs.add(f"prefill_{seq}_L{layer}_mean", mm.astype(np.float32).mean(axis=0), "float32"),
            }
        )
        for h in range(data.n_heads):
            variants.append(
                {
                    "label": f"layer {layer}, head {h}",
                    "z": blobs.add(f"prefill_{seq}_L{layer}_H{h}", mm[h], _blob_dtype(mm)),
                }
            )
    return F.heatmap(
        f"prefill-{seq}",
        f"sequence {seq}: the prompt's attention matrix (query × key)",
        variants[0]["z"],
        plabels,
        plabels,
        n_rows=P,
        ytitle="query position",
        variants=variants,
        zlabel="weight",
    )


def attention_section(data: RunData, sel: Selection, blobs: Blobs) -> Section:
    """Per shown sequence: every layer and head over the context at the attention step, the selected
    layers over steps, and the prompt's matrix when captured; notes for what the run did not capture."""
    sec = Section("attention", "Attention")
    if not ({"attn", "attn_topk_idx"} & data.arrays):
        sec.notes.append("attention rows were not captured: set `capture.attention: true` in the spec")
        return sec
    if "attn" not in data.arrays:
        sec.notes.append("the run stored each head's top-k attention weights (`attention.top_k`): other keys show as 0")
    head_labels = [f"L{layer}.H{h}" for layer in data.layers for h in range(data.n_heads)]
    blobs.add_texts("attn_head_labels", head_labels)
    blobs.add_texts("attn_layer_labels", [f"L{layer}" for layer in data.layers])
    for seq, _, tok in shown_sequences(data, sel):
        P = data.prompt_len(seq)
        a = sel.attention_step[seq]
        ((_, rows),) = list(_dense_rows(data, seq, [a], P + a))
        sec.figures.append(_context_grid_figure(data, seq, a, P + a, rows, tok, blobs, head_labels))
        steps_figure = _steps_figure(data, sel, seq, P, tok, _blob_dtype(rows), blobs)
        if steps_figure is not None:
            sec.figures.append(steps_figure)
        if "prefill_attn" in data.arrays and sel.layers:
            sec.figures.append(_prefill_figure(data, sel, seq, P, tok, blobs))
    if "prefill_attn" not in data.arrays:
        sec.notes.append(
            "the prompt's full attention matrices were not captured: set `capture.prefill_attention: true` to see them"
        )
    return sec
