"""More of a selected token in `lmtrace serve`: the attention summarised over heads
(`analysis.attention_heads`), one head's pattern over every step of a sequence, and the
attributions `lmtrace explain` computed for that step (`archive.explanations.read_explanations`,
read filtered to the sequence and step), with the per-component relevance of a method that archived
some (lrp: per layer and per head, `manifest.explain[].components`)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from ..analysis.attention_heads import mean_max_over_heads
from ..archive.attention import topk_dense
from ..archive.columns import current_names
from ..archive.explanations import EXPLAIN_DIR, SCORES_PARTS, read_component, read_explanations
from ..archive.heads import ANALYSIS_DIR, HEADS_FILE
from ..archive.reader import Run
from ..output.jsonout import strict
from . import blocks, kept
from .features import token_features
from .queries import NotFound, check_sequence, check_step, key_texts, n_keys_of, step_detail, steps_ready

PATTERN_STEPS = 512  # steps of one head's pattern sent at most (rows of the steps x keys view)


def over_heads(run: Run, seq: int, step: int) -> dict | None:
    """Per captured layer, each key's attention weight averaged and maximised over the query heads."""
    names = kept.array_names(run)
    n_keys = n_keys_of(run, seq, step)
    if "attn" in names:
        rows = blocks.step_rows(run, seq, step, n_keys)  # [layer, q_head, key]
    elif "attn_topk_prob" in names:
        rows = topk_dense(
            np.asarray(kept.array(run, "attn_topk_idx")[seq, step]),
            np.asarray(kept.array(run, "attn_topk_prob")[seq, step], dtype=np.float32),
            n_keys,
        )
    else:
        return None
    mean, mx = mean_max_over_heads(rows)
    return {"layers": run.layers, "keys": key_texts(run, seq, n_keys), "mean": _lists(mean), "max": _lists(mx)}


def _lists(a: np.ndarray) -> list:
    """a.tolist() with NaN and ±inf as None, with no Python call per value when all are finite
    (tens of thousands of values for a late step)."""
    return a.tolist() if np.isfinite(a).all() else strict(a.tolist())


def head_pattern(run: Run, seq: int, layer: int, head: int) -> dict:
    """One (layer, head)'s attention from each step's query over the keys: a row per committed step
    (keys past a step's context are null). One slice of the array: [seq, steps, layer, head, keys]."""
    check_sequence(run, seq)
    if layer not in run.layers:
        raise NotFound(f"layer {layer} was not captured in run {run.id} (captured: {run.layers})")
    n_heads = run.shape.get("n_heads", 0)
    if not 0 <= head < n_heads:
        raise NotFound(f"run {run.id} has heads 0-{n_heads - 1}, not {head}")
    li = run.layers.index(layer)
    n = min(steps_ready(run, seq), PATTERN_STEPS)
    if n == 0:
        raise NotFound(f"sequence {seq} of run {run.id} has no committed step yet")
    k_max = n_keys_of(run, seq, n - 1)
    names = kept.array_names(run)
    if "attn" in names:
        m = np.asarray(kept.array(run, "attn")[seq, :n, li, head, :k_max], dtype=np.float32)  # [step, key]
    elif "attn_topk_prob" in names:
        m = topk_dense(
            np.asarray(kept.array(run, "attn_topk_idx")[seq, :n, li, head]),
            np.asarray(kept.array(run, "attn_topk_prob")[seq, :n, li, head], dtype=np.float32),
            k_max,
        )
    else:
        raise NotFound(f"run {run.id} captured no attention")
    prompt_len = n_keys_of(run, seq, 0)
    texts = key_texts(run, seq, k_max + 1)
    rows = [[strict(float(w)) for w in m[s, : prompt_len + s]] + [None] * (k_max - prompt_len - s) for s in range(n)]
    return {
        "sequence": seq,
        "layer": layer,
        "head": head,
        "keys": texts[:k_max],
        "steps": list(range(n)),
        "chosen": texts[prompt_len : prompt_len + n],
        "rows": rows,
        "dense": "attn" in names,
    }


def attributions(run: Run, seq: int, step: int) -> list[dict] | None:
    """Every explain method's scores for (seq, step): one entry per (invocation, method, target), its
    scores per context position. None when the run has no explanations."""
    if not any((run.path / EXPLAIN_DIR / SCORES_PARTS).glob("*.parquet")):
        return None
    t = read_explanations(run, sequence=seq, step=step).sort_by(
        [("explain_id", "ascending"), ("method", "ascending"), ("position", "ascending")]
    )
    groups: dict[tuple, dict] = {}
    for r in t.to_pylist():
        key = (r["explain_id"], r["method"], r["target"], r["quantity"])
        g = groups.setdefault(
            key,
            {
                "explain_id": r["explain_id"],
                "method": r["method"],
                "target": r["target"],
                "quantity": r["quantity"],
                "target_token_id": r["target_token_id"],
                "runner_up_token_id": r["runner_up_token_id"],
                "scores": [],
            },
        )
        g["scores"].append(
            {
                "position": r["position"],
                "text": r["token_text"],
                "is_prompt": r["is_prompt"],
                "score": strict(r["score"]),
            }
        )
    entries = {(e["id"], e["method"]): e for e in run.manifest.get("explain") or [] if e.get("sequence") == seq}
    for g in groups.values():
        entry = entries.get((g["explain_id"], g["method"]))
        if entry and entry.get("components") and step in entry["steps"]:
            g["components"] = components(run, entry, step)
    return list(groups.values())


CONSERVATION_KEYS = ("f_x", "sum_scores", "bias_relevance", "conservation_error", "conservation_error_relative")


def components(run: Run, entry: dict, step: int) -> dict:
    """One explained step's per-component relevance (a manifest entry's `components`: [step, layer] arrays
    and heads [step, layer, head]) and the conservation numbers of its `results`: layers x heads floats."""
    out: dict = {"per_layer": {}}
    for name in entry["components"]:
        values = read_component(run, entry, name, step)
        if values.ndim == 2:
            out[name] = _lists(values)
        else:
            out["per_layer"][name] = _lists(values)
        out["layers"] = list(range(values.shape[0]))
    result = next((r for r in entry.get("results") or [] if r.get("step") == step), {})
    out["conservation"] = {key: result[key] for key in CONSERVATION_KEYS if key in result}
    return out


def head_labels(run: Run) -> dict | None:
    """What `lmtrace heads` called each head (analysis/heads.parquet's `label`, analysis/heads.py's
    classes): {"labels": [layer index][q_head] label or None, "file": its path in the run}, or None
    when `lmtrace heads` has not been run on it."""
    path = run.path / ANALYSIS_DIR / HEADS_FILE
    if not path.is_file():
        return None
    t = current_names(pq.read_table(path), "heads")
    n_heads = int(run.shape.get("n_heads") or 0)
    labels: list[list[str | None]] = [[None] * n_heads for _ in run.layers]
    index = {layer: i for i, layer in enumerate(run.layers)}
    for layer, head, label in zip(
        t.column("layer").to_pylist(), t.column("q_head").to_pylist(), t.column("label").to_pylist()
    ):
        if layer in index and head is not None and 0 <= head < n_heads:
            labels[index[layer]][head] = label
    return {"labels": labels, "file": f"{ANALYSIS_DIR}/{HEADS_FILE}"}


def selected_token(run: Run, seq: int, step: int) -> dict:
    """The token view's answer for one selected token (serve's steps/STEP route; the report inlines it):
    queries.step_detail with the attributions of that step, each SAE's top latents at it (`features`:
    features.token_features, None without feature arrays), and in its `attention` the heads' labels
    of `lmtrace heads` (`head_labels`) when the run has them. The attention over heads is its own answer
    (`over_heads`, the steps/STEP/over_heads route): 2 x layers x keys weights, ~400 kB late in a long
    sequence, fetched only when the view shows it."""
    detail = step_detail(run, seq, step)
    if detail["attention"] is not None:
        detail["attention"]["head_labels"] = head_labels(run)
    return {**detail, "attributions": attributions(run, seq, step), "features": token_features(run, seq, step)}


def step_over_heads(run: Run, seq: int, step: int) -> dict | None:
    """The answer of serve's steps/STEP/over_heads route (the report inlines it too): `over_heads` of
    a committed step; NotFound for any other step."""
    check_step(run, seq, step)
    return over_heads(run, seq, step)
