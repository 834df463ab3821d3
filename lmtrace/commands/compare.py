"""`lmtrace compare A B`: what differs between two run archives, read from disk (no model is loaded).

This module only computes; `views.compare_view` renders the result (terminal, JSON, markdown).
Definitions (documented in docs/compare.md):

- **Pairing**: by sequence index when both runs have the same prompt texts in the same order,
  else by prompt text (the k-th occurrence of a prompt in A with the k-th in B). Unpaired
  sequences are listed, never silently dropped.
- **Context of step s**: the prompt token ids plus generated ids 0..s-1. Step s is *paired* when
  both contexts are identical: every step up to and including the first divergence step (where
  the contexts are still the same but the chosen tokens differ). Only paired steps get figures
  that compare the two sides; later steps get per-side figures only, marked as not paired.
- **KL / JS over the stored top-k**: each side stores the logprobs of its top-k alternatives and of
  its chosen token. Both are computed on the finest partition of the vocabulary on which both
  distributions are known: one bucket per token whose probability is stored on both sides, plus
  one tail bucket holding everything else (each side's unstored mass and the tokens stored on one
  side only). The values are exact for that partition and lower bounds of the full-vocabulary
  values (coarsening never increases an f-divergence); `tail_a`, `tail_b` and `n_common` say how
  much the partition hides. With no token stored on both sides the bound is vacuous and the values
  are null. Natural logs (nats); JS ≤ ln 2.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..archive.reader import IncompleteRunWarning, Run
from ..errors import ArchiveError, SpecError
from ..archive.runs import find_run, runs_root
from .compare_divergence import TAIL_FLOOR, attention_js_dense, attention_js_sparse, topk_divergence
from .compare_pairing import PAIRING_MODES, compatibility, pair_sequences, spec_differences

STEP_CHUNK = 16  # attention rows are compared this many steps at a time (bounded memory)
JSON_MAX_STEP_ROWS = 20000  # larger per-step tables go to --out only
FLOAT_NOISE_KL = 1e-6  # nats: paired distributions closer than this (both KL directions) are "the same up to float noise"


# ---- one side: what a run archive holds, per sequence --------------------------------------------
@dataclass
class _Side:
    label: str
    run: Run
    n_seq: int
    prompt_text: list[str | None]
    prompt_ids: dict[int, tuple[int, ...]]
    gen: dict[int, dict]  # sequence -> columns over its archived steps 0..n-1
    seq_rows: dict[int, dict]  # sequences.parquet rows (finished batches only)
    steps: pa.Table | None
    token_text: dict[int, str]

    def n_steps(self, seq: int) -> int:
        g = self.gen.get(seq)
        return 0 if g is None else len(g["token_id"])

    def finished(self, seq: int) -> bool:
        """The sequence's batch finished: nothing after its last archived step will ever exist."""
        return seq in self.seq_rows

    def stop_reason(self, seq: int) -> str | None:
        row = self.seq_rows.get(seq)
        return None if row is None else row["stop_reason"]


def _np(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False)


def _list_matrix(table: pa.Table, name: str) -> np.ndarray:
    """A list column whose lists all have the same length k, as an [rows, k] array."""
    col = table.column(name).combine_chunks()
    flat = col.flatten().to_numpy(zero_copy_only=False)
    n = len(col)
    return flat.reshape(n, len(flat) // n if n else 0)


def _load_side(label: str, run: Run) -> _Side:
    m = run.manifest
    n_seq = int(m.get("n_prompts") or m["shape"]["n_sequences"])
    try:
        seq_rows = {int(r["sequence"]): r for r in run.sequences().to_pylist()}
    except ArchiveError:
        seq_rows = {}
    spec_prompts = (m.get("spec_resolved") or {}).get("prompts") or {}
    inline = spec_prompts.get("texts") if isinstance(spec_prompts.get("texts"), list) else None
    prompt_text = []
    for s in range(n_seq):
        if s in seq_rows:
            prompt_text.append(seq_rows[s]["prompt"])
        elif inline is not None and len(inline) == n_seq:
            prompt_text.append(inline[s])
        else:
            prompt_text.append(None)

    # steps an unfinished run committed; everything of a complete run
    limit = {}
    if run.status != "complete" and hasattr(run, "committed_steps"):
        limit = {int(s): int(n) for s, n in run.committed_steps().items()}
    elif run.status != "complete":  # single-writer archives: progress.json, batches numbered 0, 1, ...
        batch_size = int(m["spec_resolved"]["generation"]["batch_size"])
        batches = run.progress.get("batches", {})
        for s in range(n_seq):
            batch = seq_rows[s]["batch"] if s in seq_rows else s // batch_size
            limit[s] = int(batches.get(str(batch), {}).get("committed_steps", 0))

    try:
        tokens = run.tokens()
    except ArchiveError:
        tokens = None
    prompt_ids: dict[int, tuple[int, ...]] = {}
    gen: dict[int, dict] = {}
    token_text: dict[int, str] = {}
    if tokens is not None and tokens.num_rows:
        token_text = dict(zip(_np(tokens, "token_id").tolist(), tokens.column("token_text").to_pylist()))
        is_prompt = tokens.column("is_prompt")
        prompt = tokens.filter(is_prompt).sort_by([("sequence", "ascending"), ("position", "ascending")])
        pseq, pid = _np(prompt, "sequence"), _np(prompt, "token_id")
        for s in np.unique(pseq):
            prompt_ids[int(s)] = tuple(int(x) for x in pid[pseq == s])
        g = tokens.filter(pc.invert(is_prompt)).sort_by([("sequence", "ascending"), ("step", "ascending")])
        cols = {c: _np(g, c) for c in ("sequence", "step", "token_id", "logprob", "sampling_logprob", "entropy",
                                       "margin", "greedy_id", "is_eos")}
        cols["token_text"] = np.asarray(g.column("token_text").to_pylist(), dtype=object)
        cols["alt_ids"] = _list_matrix(g, "alt_ids")
        cols["alt_logprobs"] = _list_matrix(g, "alt_logprobs")
        seqs = cols.pop("sequence")
        for s in np.unique(seqs):
            sel = seqs == s
            if int(s) in limit:
                sel &= cols["step"] < limit[int(s)]
            d = {k: v[sel] for k, v in cols.items()}
            n = len(d["step"])
            if n and not np.array_equal(d["step"], np.arange(n)):
                raise ArchiveError(f"run {run.id}: sequence {int(s)} has non-contiguous steps in tokens.parquet; "
                                   f"the archive is damaged")
            gen[int(s)] = d
    try:
        steps = run.steps()
    except ArchiveError:  # capture: none, or no committed block yet
        steps = None
    return _Side(label, run, n_seq, prompt_text, prompt_ids, gen, seq_rows, steps, token_text)




# ---- per pair ---------------------------------------------------------------------------------
STEP_FIELDS = [
    ("pair", pa.int32()), ("seq_a", pa.int32()), ("seq_b", pa.int32()), ("step", pa.int32()),
    ("phase", pa.string()), ("context_identical", pa.bool_()),
    ("token_a", pa.int32()), ("token_b", pa.int32()), ("text_a", pa.string()), ("text_b", pa.string()),
    ("logprob_a", pa.float64()), ("logprob_b", pa.float64()),
    ("logprob_a_under_b", pa.float64()), ("logprob_b_under_a", pa.float64()),
    ("sampling_logprob_a", pa.float64()), ("sampling_logprob_b", pa.float64()),
    ("entropy_a", pa.float64()), ("entropy_b", pa.float64()), ("entropy_delta", pa.float64()),
    ("margin_a", pa.float64()), ("margin_b", pa.float64()), ("margin_delta", pa.float64()),
    ("top1_a", pa.int32()), ("top1_b", pa.int32()), ("top1_agree", pa.bool_()), ("same_stored", pa.bool_()),
    ("kl_ab", pa.float64()), ("kl_ba", pa.float64()), ("js", pa.float64()),
    ("tail_a", pa.float64()), ("tail_b", pa.float64()), ("n_common", pa.int32()),
    ("kl_stored_max", pa.float64()),
    # --exact only (null otherwise): full-vocabulary figures from the two models rescoring the shared context
    ("exact_kl_ab", pa.float64()), ("exact_kl_ba", pa.float64()), ("exact_js", pa.float64()),
    ("exact_max_abs_logit_diff", pa.float64()), ("exact_chosen_logit_diff", pa.float64()),
]
EXACT_FIELDS = ("exact_kl_ab", "exact_kl_ba", "exact_js", "exact_max_abs_logit_diff", "exact_chosen_logit_diff")
PAIRED_STEP_FIGURES = ("logprob_a_under_b", "logprob_b_under_a", "entropy_delta", "margin_delta", "top1_agree",
                       "same_stored", "kl_ab", "kl_ba", "js", "tail_a", "tail_b", "n_common", "kl_stored_max")

LAYER_FIELDS = [
    ("pair", pa.int32()), ("seq_a", pa.int32()), ("seq_b", pa.int32()), ("step", pa.int32()), ("layer", pa.int32()),
    ("resid_norm_a", pa.float64()), ("resid_norm_b", pa.float64()), ("resid_norm_delta", pa.float64()),
    ("resid_norm_rel_delta", pa.float64()),
    ("delta_norm_a", pa.float64()), ("delta_norm_b", pa.float64()), ("delta_norm_delta", pa.float64()),
    ("attn_norm_delta", pa.float64()), ("mlp_norm_delta", pa.float64()),
    ("lens_top1_a", pa.int32()), ("lens_top1_b", pa.int32()), ("lens_changed", pa.bool_()),
    ("lens_top1_prob_delta", pa.float64()),
    ("margin_contrib_a", pa.float64()), ("margin_contrib_b", pa.float64()), ("margin_contrib_delta", pa.float64()),
    ("same_final_top2", pa.bool_()),
    ("attn_js_mean", pa.float64()), ("attn_js_max", pa.float64()),
    ("resid_dist", pa.float64()), ("resid_cos", pa.float64()),
]
HEAD_FIELDS = [("pair", pa.int32()), ("seq_a", pa.int32()), ("seq_b", pa.int32()), ("step", pa.int32()),
               ("layer", pa.int32()), ("head", pa.int32()), ("attn_js", pa.float64())]


def _f(x) -> float | None:
    """A finite float or None (for JSON and nullable columns)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _stored(g: dict, s: int) -> dict[int, float]:
    """Token id -> logprob of the top-k alternatives stored at step s, without the chosen token's own entry."""
    return {int(i): float(v) for i, v in zip(g["alt_ids"][s], g["alt_logprobs"][s]) if int(i) >= 0}


def _known(g: dict, s: int) -> dict[int, float]:
    """Token id -> logprob stored at step s: the top-k alternatives and the chosen token."""
    known = {int(i): float(v) for i, v in zip(g["alt_ids"][s], g["alt_logprobs"][s])}
    known[int(g["token_id"][s])] = float(g["logprob"][s])
    return known


def _is_paired(row: dict) -> bool:
    """Both sides took this step from the same context: the paired figures exist."""
    return bool(row["context_identical"]) and row["token_a"] is not None and row["token_b"] is not None


def _step_rows(k: int, sa: int, sb: int, ga: dict | None, gb: dict | None, na: int, nb: int,
               same_prompt: bool, first: int | None, kind: str | None) -> list[dict]:
    rows = []
    for s in range(max(na, nb)):
        ha, hb = s < na, s < nb
        ctx = same_prompt and (first is None or s <= first) and ((ha and hb) or s == first)
        if not same_prompt:
            phase = "different_prompt"
        elif first is None and not (ha and hb):
            phase = "one_side_only"  # the other archive is incomplete: this step is not (yet) on its side
        elif first is None or s < first:
            phase = "shared"
        elif s == first:
            phase = "divergence"
        else:
            phase = "after_divergence"
        row = {"pair": k, "seq_a": sa, "seq_b": sb, "step": s, "phase": phase, "context_identical": ctx}
        for tag, g, h in (("a", ga, ha), ("b", gb, hb)):
            row[f"token_{tag}"] = int(g["token_id"][s]) if h else None
            row[f"text_{tag}"] = g["token_text"][s] if h else None
            row[f"logprob_{tag}"] = _f(g["logprob"][s]) if h else None
            row[f"sampling_logprob_{tag}"] = _f(g["sampling_logprob"][s]) if h else None
            row[f"entropy_{tag}"] = _f(g["entropy"][s]) if h else None
            row[f"margin_{tag}"] = _f(g["margin"][s]) if h else None
            row[f"top1_{tag}"] = int(g["greedy_id"][s]) if h else None
        if ctx and ha and hb:
            ka, kb = _known(ga, s), _known(gb, s)
            row["logprob_a_under_b"] = kb.get(row["token_a"])
            row["logprob_b_under_a"] = ka.get(row["token_b"])
            row["entropy_delta"] = row["entropy_b"] - row["entropy_a"]
            row["margin_delta"] = row["margin_b"] - row["margin_a"]
            row["top1_agree"] = row["top1_a"] == row["top1_b"]
            # judged without the chosen tokens' own entries: a sampled token outside the top-k is not a model difference
            sa_, sb_ = _stored(ga, s), _stored(gb, s)
            row["same_stored"] = (sa_ == sb_ and row["entropy_a"] == row["entropy_b"]
                                  and row["margin_a"] == row["margin_b"])
            row.update({key: (_f(v) if isinstance(v, float) else v) for key, v in topk_divergence(ka, kb).items()})
            stored = topk_divergence(sa_, sb_)
            row["kl_stored_max"] = (None if stored["kl_ab"] is None
                                    else _f(max(stored["kl_ab"], stored["kl_ba"])))
        else:
            row.update({key: None for key in PAIRED_STEP_FIGURES})
        row.update({key: None for key in EXACT_FIELDS})
        rows.append(row)
    return rows


def _steps_block(side: _Side, seq: int, n: int, layers: list[int]) -> dict[str, np.ndarray]:
    """steps.parquet columns of one sequence as [step, layer] arrays over steps 0..n-1 (NaN where absent)."""
    t = side.steps
    t = t.filter(pc.and_(pc.equal(t.column("sequence"), seq), pc.less(t.column("step"), n)))
    step, layer = _np(t, "step").astype(int), _np(t, "layer").astype(int)
    col_of = {x: i for i, x in enumerate(layers)}
    keep = np.asarray([x in col_of for x in layer], dtype=bool)
    step, cols = step[keep], np.asarray([col_of[x] for x in layer[keep]], dtype=int)
    out = {}
    for name in t.column_names:
        if name in ("sequence", "step", "layer"):
            continue
        arr = np.full((n, len(layers)), np.nan)
        arr[step, cols] = _np(t, name)[keep].astype(np.float64)
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


def _attention_js(A: _Side, B: _Side, sa: int, sb: int, n: int, layers: list[int], prompt_len: int) -> np.ndarray | None:
    """[step, layer, head] JS between the two sides' attention rows (None when either has no attention)."""
    if not ({"attn", "attn_topk_idx"} & set(A.run.array_names())
            and {"attn", "attn_topk_idx"} & set(B.run.array_names())):
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


def _resid_figures(A: _Side, B: _Side, sa: int, sb: int, n: int, layers: list[int]):
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


def _layer_figures(k: int, A: _Side, B: _Side, sa: int, sb: int, n: int, layers: list[int],
                   same_top2: np.ndarray) -> tuple[dict, dict]:
    L = len(layers)
    xa, xb = _steps_block(A, sa, n, layers), _steps_block(B, sb, n, layers)
    nan = np.full((n, L), np.nan)

    def pair_of(name):
        return xa.get(name, nan), xb.get(name, nan)

    cols: dict[str, np.ndarray] = {
        "pair": np.full((n, L), k), "seq_a": np.full((n, L), sa), "seq_b": np.full((n, L), sb),
        "step": np.repeat(np.arange(n)[:, None], L, 1), "layer": np.repeat(np.asarray(layers)[None, :], n, 0),
    }
    ra, rb = pair_of("resid_norm")
    cols.update(resid_norm_a=ra, resid_norm_b=rb, resid_norm_delta=rb - ra,
                resid_norm_rel_delta=np.divide(rb - ra, ra, out=np.full((n, L), np.nan), where=ra > 0))
    da, db = pair_of("delta_norm")
    cols.update(delta_norm_a=da, delta_norm_b=db, delta_norm_delta=db - da)
    for name in ("attn_norm", "mlp_norm"):
        x, y = pair_of(name)
        cols[f"{name}_delta"] = y - x
    la, lb = pair_of("lens_top1")
    cols.update(lens_top1_a=la, lens_top1_b=lb,
                lens_changed=np.where(np.isnan(la) | np.isnan(lb), np.nan, (la != lb).astype(float)))
    x, y = pair_of("lens_top1_prob")
    cols["lens_top1_prob_delta"] = y - x
    ma, mb = pair_of("margin_contrib")
    cols.update(margin_contrib_a=ma, margin_contrib_b=mb, margin_contrib_delta=mb - ma,
                same_final_top2=np.repeat(same_top2[:, None].astype(float), L, 1))
    js = _attention_js(A, B, sa, sb, n, layers, len(A.prompt_ids[sa]))
    heads: dict[str, np.ndarray] = {}
    if js is not None:
        H = js.shape[-1]
        cols["attn_js_mean"] = js.mean(-1)
        cols["attn_js_max"] = js.max(-1)
        heads = {"pair": np.full(js.shape, k), "seq_a": np.full(js.shape, sa), "seq_b": np.full(js.shape, sb),
                 "step": np.broadcast_to(np.arange(n)[:, None, None], js.shape),
                 "layer": np.broadcast_to(np.asarray(layers)[None, :, None], js.shape),
                 "head": np.broadcast_to(np.arange(H)[None, None, :], js.shape), "attn_js": js}
        heads = {name: np.asarray(v).reshape(-1) for name, v in heads.items()}
    else:
        cols["attn_js_mean"] = cols["attn_js_max"] = nan
    dist, cos = _resid_figures(A, B, sa, sb, n, layers)
    cols["resid_dist"] = nan if dist is None else dist
    cols["resid_cos"] = nan if cos is None else cos
    return {name: np.asarray(v).reshape(-1) for name, v in cols.items()}, heads


def _table(fields: list[tuple[str, pa.DataType]], columns: dict[str, np.ndarray] | None) -> pa.Table:
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


def _concat(parts: list[dict]) -> dict[str, np.ndarray] | None:
    parts = [p for p in parts if p]
    if not parts:
        return None
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _mean(x) -> float | None:
    x = np.asarray([v for v in x if v is not None], np.float64)
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else None


def _pair_summary(k: int, A: _Side, B: _Side, sa: int, sb: int, matched_by: str, rows: list[dict],
                  first: int | None, kind: str | None, n_paired: int, same_prompt: bool, note: str | None) -> dict:
    ga, gb = A.gen.get(sa), B.gen.get(sb)
    na, nb = A.n_steps(sa), B.n_steps(sb)
    paired = [r for r in rows if _is_paired(r)]
    div = None
    if first is not None:
        r = rows[first]
        div = {"step": first, "kind": kind,
               "token_a": None if r["token_a"] is None else {
                   "id": r["token_a"], "text": r["text_a"], "logprob_under_a": r["logprob_a"],
                   "logprob_under_b": r["logprob_a_under_b"]},
               "token_b": None if r["token_b"] is None else {
                   "id": r["token_b"], "text": r["text_b"], "logprob_under_b": r["logprob_b"],
                   "logprob_under_a": r["logprob_b_under_a"]},
               "kl_ab": r["kl_ab"], "js": r["js"], "top1_a": r["top1_a"], "top1_b": r["top1_b"]}
        if kind == "length":
            ended = "A" if na < nb else "B"
            div["explanation"] = (f"identical for the {first} steps both generated; {ended} stopped "
                                  f"({(A if ended == 'A' else B).stop_reason(sa if ended == 'A' else sb)}), "
                                  f"the other continued")
        elif r["same_stored"]:
            div["explanation"] = ("same stored distribution on both sides at this step: the choice differs by "
                                  "sampling (seed, temperature, top-k/top-p), not by the model")
        elif r["top1_a"] != r["top1_b"]:
            div["explanation"] = "the two models' top-1 tokens differ at this step"
        else:
            div["explanation"] = "the distributions differ but agree on the top-1: sampling picked differently"
    text_a = list(ga["token_text"]) if ga is not None else []
    text_b = list(gb["token_text"]) if gb is not None else []
    cut = 0 if not same_prompt else (first if first is not None else min(len(text_a), len(text_b)))
    after = None
    if first is not None or not same_prompt:
        start = 0 if not same_prompt else first + 1
        ra = [r for r in rows[start:] if r["token_a"] is not None]
        rb = [r for r in rows[start:] if r["token_b"] is not None]
        after = {"paired": False, "from_step": start, "steps_a": len(ra), "steps_b": len(rb),
                 "mean_logprob_a": _mean(r["logprob_a"] for r in ra), "mean_logprob_b": _mean(r["logprob_b"] for r in rb),
                 "mean_entropy_a": _mean(r["entropy_a"] for r in ra), "mean_entropy_b": _mean(r["entropy_b"] for r in rb),
                 "mean_margin_a": _mean(r["margin_a"] for r in ra), "mean_margin_b": _mean(r["margin_b"] for r in rb)}
    figures = None
    if paired:
        js = [-1.0 if r["js"] is None else r["js"] for r in paired]
        imax = int(np.argmax(js))
        # B − A for each side's own token: how much more (or less) likely B finds it than A does
        shift_a = [r["logprob_a_under_b"] - r["logprob_a"] for r in paired if r["logprob_a_under_b"] is not None]
        shift_b = [r["logprob_b"] - r["logprob_b_under_a"] for r in paired if r["logprob_b_under_a"] is not None]
        figures = {
            "steps": len(paired), "mean_kl_ab": _mean(r["kl_ab"] for r in paired),
            "mean_kl_ba": _mean(r["kl_ba"] for r in paired), "mean_js": _mean(r["js"] for r in paired),
            "max_js": paired[imax]["js"], "max_js_step": paired[imax]["step"] if paired[imax]["js"] is not None else None,
            "steps_without_common_tokens": sum(r["n_common"] == 0 for r in paired),
            "top1_agreement": sum(bool(r["top1_agree"]) for r in paired) / len(paired),
            "mean_entropy_delta": _mean(r["entropy_delta"] for r in paired),
            "mean_margin_delta": _mean(r["margin_delta"] for r in paired),
            "mean_logprob_shift_a": _mean(shift_a), "mean_logprob_shift_b": _mean(shift_b),
            "logprob_a_under_b_missing": sum(r["logprob_a_under_b"] is None for r in paired),
            "logprob_b_under_a_missing": sum(r["logprob_b_under_a"] is None for r in paired),
            "mean_tail_a": _mean(r["tail_a"] for r in paired), "mean_tail_b": _mean(r["tail_b"] for r in paired),
        }
        if any(r.get("exact_kl_ab") is not None for r in paired):  # --exact: full-vocabulary figures
            ex_rows = [r for r in paired if r.get("exact_js") is not None]
            jmax = max(ex_rows, key=lambda r: r["exact_js"])
            figures.update({"exact_steps": len(ex_rows), "mean_exact_kl_ab": _mean(r["exact_kl_ab"] for r in ex_rows),
                            "mean_exact_kl_ba": _mean(r["exact_kl_ba"] for r in ex_rows),
                            "mean_exact_js": _mean(r["exact_js"] for r in ex_rows), "max_exact_js": jmax["exact_js"],
                            "max_exact_js_step": jmax["step"]})
    first_step = None
    if not same_prompt and na and nb:  # different contexts: step 0 side by side, labelled as not paired
        d = topk_divergence(_known(ga, 0), _known(gb, 0))
        first_step = {"paired": False, "token_a": int(ga["token_id"][0]), "text_a": ga["token_text"][0],
                      "token_b": int(gb["token_id"][0]), "text_b": gb["token_text"][0],
                      "top1_a": int(ga["greedy_id"][0]), "top1_b": int(gb["greedy_id"][0]),
                      "logprob_a": _f(ga["logprob"][0]), "logprob_b": _f(gb["logprob"][0]),
                      "entropy_a": _f(ga["entropy"][0]), "entropy_b": _f(gb["entropy"][0]),
                      "kl_ab": _f(d["kl_ab"]), "kl_ba": _f(d["kl_ba"]), "js": _f(d["js"]), "n_common": d["n_common"]}
    return {
        "pair": k, "seq_a": sa, "seq_b": sb, "matched_by": matched_by, "prompt": A.prompt_text[sa],
        "prompt_b": B.prompt_text[sb], "same_prompt_ids": same_prompt, "first_step": first_step,
        "step0_logit_diff": step0_logit_diff(ga, gb) if na and nb else None,
        "same_text": text_a == text_b, "generated_len_a": na, "generated_len_b": nb,
        "stop_reason_a": A.stop_reason(sa), "stop_reason_b": B.stop_reason(sb),
        "paired_steps": n_paired, "first_divergence": div, "note": note,
        "text": {"common": "".join(text_a[:cut]), "a": "".join(text_a[cut:]), "b": "".join(text_b[cut:])},
        "paired_figures": figures, "after_divergence": after,
    }


def step0_logit_diff(ga: dict, gb: dict) -> dict | None:
    """logit(A's step-0 token) − logit(B's step-0 token) in each run's own step-0 distribution.

    The quantity activation patching normalises by (clean vs corrupted prompt: the clean answer's
    logit minus the corrupted answer's). Within one distribution a logit difference equals the
    logprob difference, so it is read from the stored top-k; null on a side whose stored top-k
    lacks one of the two tokens. None when both runs chose the same token (the difference is 0)."""
    x, y = int(ga["token_id"][0]), int(gb["token_id"][0])
    if x == y:
        return None
    known_a, known_b = _known(ga, 0), _known(gb, 0)

    def diff(known: dict[int, float]) -> float | None:
        return _f(known[x] - known[y]) if x in known and y in known else None

    return {"token_a": x, "text_a": ga["token_text"][0], "token_b": y, "text_b": gb["token_text"][0],
            "under_a": diff(known_a), "under_b": diff(known_b)}


# ---- rankings ----------------------------------------------------------------------------------
def _absmean(x: np.ndarray) -> float | None:
    x = np.abs(np.asarray(x, np.float64))
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else None


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
            "layer": int(layer), "steps": int(m.sum()),
            "delta_norm_rel_change": _rel(c["delta_norm_delta"][m], c["delta_norm_a"][m]),
            "resid_norm_rel_change": _rel(c["resid_norm_delta"][m], c["resid_norm_a"][m]),
            "resid_norm_abs_delta": _absmean(c["resid_norm_delta"][m]),
            "delta_norm_abs_delta": _absmean(c["delta_norm_delta"][m]),
            "attn_norm_abs_delta": _absmean(c["attn_norm_delta"][m]), "mlp_norm_abs_delta": _absmean(c["mlp_norm_delta"][m]),
            "attn_js_mean": _absmean(c["attn_js_mean"][m]), "attn_js_max": _f(np.nanmax(c["attn_js_max"][m]))
            if np.isfinite(c["attn_js_max"][m]).any() else None,
            "lens_changes": int(np.nansum(lens[m])) if np.isfinite(lens[m]).any() else None,
            "margin_contrib_abs_delta": _absmean(c["margin_contrib_delta"][m & same2]),
            "resid_dist_mean": _absmean(c["resid_dist"][m]),
        }
        figures = [row[k] for k in ("resid_norm_abs_delta", "delta_norm_abs_delta", "attn_norm_abs_delta",
                                    "mlp_norm_abs_delta", "attn_js_mean", "lens_changes", "resid_dist_mean")]
        figures.append(_absmean(c["margin_contrib_delta"][m & same2]))  # only where both margins mean the same
        row["changed"] = any(v not in (None, 0, 0.0) for v in figures)
        out.append(row)
    out.sort(key=lambda r: (-(r["delta_norm_rel_change"] or 0.0), -(r["resid_norm_rel_change"] or 0.0),
                            -(r["attn_js_mean"] or 0.0), r["layer"]))
    return out


def _rel(delta: np.ndarray, base: np.ndarray) -> float | None:
    """mean |delta| / mean |base|: a change relative to the size of what changed."""
    d, b = _absmean(delta), _absmean(base)
    if d is None:
        return None
    return d / b if b else (0.0 if d == 0 else None)


def rank_heads(per_head: pa.Table) -> list[dict]:
    """Per (layer, head): mean and max attention-row JS over paired steps, most changed first."""
    if per_head.num_rows == 0:
        return []
    layer = per_head.column("layer").to_numpy()
    head = per_head.column("head").to_numpy()
    js = per_head.column("attn_js").to_numpy(zero_copy_only=False)
    key = layer.astype(np.int64) * 100000 + head
    out = []
    for u in np.unique(key):
        m = key == u
        x = js[m][np.isfinite(js[m])]
        if not x.size:
            continue
        out.append({"layer": int(u // 100000), "head": int(u % 100000), "steps": int(m.sum()),
                    "attn_js_mean": float(x.mean()), "attn_js_max": float(x.max())})
    out.sort(key=lambda r: (-r["attn_js_mean"], -r["attn_js_max"], r["layer"], r["head"]))
    return out


# ---- the comparison ----------------------------------------------------------------------------
DEFINITIONS = {
    "pairing": "by index when both runs have the same prompt texts in the same order, else by prompt text "
               "(k-th occurrence with k-th occurrence)",
    "context_identical": "same prompt token ids and same generated ids before the step; holds up to and including "
                         "the first divergence step",
    "first_divergence": "first step whose chosen tokens differ (kind 'token'), or where one side stopped and the "
                        "other continued (kind 'length'); prompts with different token ids never share a context",
    "logprob_x_under_y": "logprob of side x's token in side y's distribution (T=1), known only if it is in y's "
                         "stored top-k or is y's own token; null otherwise",
    "kl_js": "nats, on the partition {each token whose logprob is stored on both sides} + {one tail bucket with "
             "everything else}; exact for that partition, a lower bound of the full-vocabulary value; tail masses "
             f"floored at {TAIL_FLOOR:g}",
    "deltas": "B minus A",
    "attn_js": "Jensen-Shannon divergence (nats) between the two sides' attention rows of a head over the shared "
               "context keys (rows renormalised; top-k rows use the stored-on-both + tail partition)",
    "after_divergence": "per-side figures only (each side saw its own text): not paired, not differences",
    "exact": "--exact only: KL/JS over the full vocabulary and logit differences (B − A), from each side's model "
             "(float32, eager, an intervention child's edits replayed) rescoring the shared context",
}


@dataclass
class Comparison:
    a: dict
    b: dict
    compatibility: dict
    spec_differences: list[dict]
    pairing: dict
    pairs: list[dict]
    per_step: pa.Table
    per_layer: pa.Table
    per_head: pa.Table
    layers: list[dict]
    heads: list[dict]
    first_changed_layer: int | None
    identical: bool
    verdict: str
    notes: list[str] = field(default_factory=list)

    def summary(self, *, include_steps: bool = True) -> dict:
        """Everything as JSON-ready values: per-pair summaries, rankings, and the per-step table."""
        out = {
            "a": self.a, "b": self.b, "identical": self.identical, "verdict": self.verdict,
            "compatibility": self.compatibility, "spec_differences": self.spec_differences,
            "pairing": {**self.pairing, "pairs": [{"pair": i, "seq_a": x, "seq_b": y}
                                                  for i, (x, y) in enumerate(self.pairing["pairs"])]},
            "definitions": DEFINITIONS, "notes": self.notes, "pairs": self.pairs,
            "first_changed_layer": self.first_changed_layer, "layers": self.layers, "heads": self.heads,
        }
        if include_steps and self.per_step.num_rows <= JSON_MAX_STEP_ROWS:
            out["per_step"] = self.per_step.to_pylist()
        elif include_steps:
            out["per_step"] = None
            out["notes"] = self.notes + [f"per_step has {self.per_step.num_rows} rows: left out of the JSON, "
                                         f"written by --out DIR as per_step.parquet"]
        return _clean(out)

    def write_tables(self, out_dir: str | Path) -> list[Path]:
        """per_step / per_layer / per_head / pairs Parquet tables (and summary.json) under out_dir."""
        import json

        out = Path(out_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SpecError(f"cannot create output directory {out} ({err.strerror})") from None
        written = []
        for name, table in (("per_step", self.per_step), ("per_layer", self.per_layer), ("per_head", self.per_head),
                            ("pairs", _pairs_table(self.pairs))):
            path = out / f"{name}.parquet"
            pq.write_table(table, path)
            written.append(path)
        path = out / "summary.json"
        path.write_text(json.dumps(self.summary(include_steps=False), indent=2))
        written.append(path)
        return written


def _clean(x):
    """NaN/inf -> None, numpy scalars -> Python, tuples -> lists (strict JSON)."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return _f(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def _pairs_table(pairs: list[dict]) -> pa.Table:
    rows = []
    for p in pairs:
        d = p.get("first_divergence") or {}
        f = p.get("paired_figures") or {}
        rows.append({
            "pair": p["pair"], "seq_a": p["seq_a"], "seq_b": p["seq_b"], "matched_by": p["matched_by"],
            "prompt": p["prompt"], "same_prompt_ids": p["same_prompt_ids"],
            "generated_len_a": p["generated_len_a"], "generated_len_b": p["generated_len_b"],
            "paired_steps": p["paired_steps"], "first_divergence_step": d.get("step"), "divergence_kind": d.get("kind"),
            "token_a": (d.get("token_a") or {}).get("id"), "token_b": (d.get("token_b") or {}).get("id"),
            "mean_kl_ab": f.get("mean_kl_ab"), "mean_js": f.get("mean_js"), "max_js": f.get("max_js"),
            "top1_agreement": f.get("top1_agreement"),
            "text_common": p["text"]["common"], "text_a": p["text"]["a"], "text_b": p["text"]["b"],
            "step0_logit_diff_under_a": (p.get("step0_logit_diff") or {}).get("under_a"),
            "step0_logit_diff_under_b": (p.get("step0_logit_diff") or {}).get("under_b"),
        })
    schema = pa.schema([("pair", pa.int32()), ("seq_a", pa.int32()), ("seq_b", pa.int32()), ("matched_by", pa.string()),
                        ("prompt", pa.string()), ("same_prompt_ids", pa.bool_()), ("generated_len_a", pa.int32()),
                        ("generated_len_b", pa.int32()), ("paired_steps", pa.int32()),
                        ("first_divergence_step", pa.int32()), ("divergence_kind", pa.string()),
                        ("token_a", pa.int32()), ("token_b", pa.int32()), ("mean_kl_ab", pa.float64()),
                        ("mean_js", pa.float64()), ("max_js", pa.float64()), ("top1_agreement", pa.float64()),
                        ("text_common", pa.string()), ("text_a", pa.string()), ("text_b", pa.string()),
                        ("step0_logit_diff_under_a", pa.float64()), ("step0_logit_diff_under_b", pa.float64())])
    return pa.Table.from_pylist(_clean(rows), schema=schema)


def _run_info(side: _Side) -> dict:
    m = side.run.manifest
    gen = (m.get("spec_resolved") or {}).get("generation") or {}
    return {"run_id": side.run.id, "path": str(side.run.path), "status": side.run.status,
            "model": (m.get("model") or {}).get("reference"), "parent": m.get("parent"),
            "sequences": side.n_seq, "generation": {k: gen.get(k) for k in
                                                   ("max_new_tokens", "temperature", "top_k", "top_p", "seed")}}


def _open(label: str, ref, root: Path, allow_incomplete: bool) -> Run:
    path = find_run(str(ref), root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        run = Run(path)
    if run.status != "complete" and not allow_incomplete:
        raise ArchiveError(f"run {label} ({run.id}) is {run.status}, not complete; pass --allow-incomplete to "
                           f"compare the steps it committed")
    return run


def compare_runs(ref_a, ref_b, *, runs_dir: str | Path | None = None, allow_incomplete: bool = False,
                 pair: str = "auto", exact: bool = False, exact_steps: str | None = None,
                 device: str | None = None, note=lambda text: None) -> Comparison:
    """Compare two run archives (ids, id prefixes or paths). Reads only the archives and loads no model, unless
    `exact`: then each side's model (loaded once when both runs share it) rescores the paired contexts."""
    progress = note  # `note` is reused below for each pair's note
    if pair not in PAIRING_MODES:
        raise SpecError(f"--pair must be one of {', '.join(PAIRING_MODES)} (got {pair!r})")
    root = Path(runs_dir) if runs_dir is not None else runs_root()
    A = _load_side("A", _open("A", ref_a, root, allow_incomplete))
    B = _load_side("B", _open("B", ref_b, root, allow_incomplete))
    compat = compatibility(A, B)
    notes = list(compat["notes"])
    for side in (A, B):
        if side.run.status != "complete":
            notes.append(f"run {side.label} is {side.run.status}: only its committed steps are compared")
    pairing = pair_sequences(A.prompt_text, B.prompt_text, pair)
    layers = compat["common_layers"]
    pair_summaries, step_rows, layer_parts, head_parts = [], [], [], []
    for k, (sa, sb) in enumerate(pairing["pairs"]):
        ga, gb = A.gen.get(sa), B.gen.get(sb)
        na, nb = A.n_steps(sa), B.n_steps(sb)
        pid_a, pid_b = A.prompt_ids.get(sa), B.prompt_ids.get(sb)
        same_prompt = pid_a is not None and pid_a == pid_b
        n_min = min(na, nb)
        first, kind, note = None, None, None
        if not same_prompt:
            n_paired = 0
            note = ("prompt token ids differ (different prompt or chat rendering): the contexts are never identical"
                    if pid_a is not None and pid_b is not None else "no archived prompt tokens on one side")
        else:
            diff = np.flatnonzero(ga["token_id"][:n_min] != gb["token_id"][:n_min]) if n_min else np.array([], int)
            if diff.size:
                first, kind = int(diff[0]), "token"
                n_paired = first + 1
            elif na != nb:
                shorter_finished = A.finished(sa) if na < nb else B.finished(sb)
                n_paired = n_min
                if shorter_finished:
                    first, kind = n_min, "length"
                else:
                    note = f"no divergence in the {n_min} steps both archives hold (one archive is incomplete)"
            else:
                n_paired = na
        rows = _step_rows(k, sa, sb, ga, gb, na, nb, same_prompt, first, kind)
        step_rows.extend(rows)
        if n_paired and layers:
            same_top2 = np.asarray([bool(np.array_equal(ga["alt_ids"][s][:2], gb["alt_ids"][s][:2]))
                                    for s in range(n_paired)])
            cols, heads = _layer_figures(k, A, B, sa, sb, n_paired, layers, same_top2)
            layer_parts.append(cols)
            head_parts.append(heads)
        pair_summaries.append(_pair_summary(k, A, B, sa, sb, pairing["method"], rows, first, kind, n_paired,
                                            same_prompt, note))

    exact_info = None
    if exact:
        from ..analysis.compare_exact import exact_figures

        exact_info = exact_figures(A, B, pairing["pairs"], step_rows, exact_steps, device, progress)
        notes.append(exact_info["note"])
    elif step_rows:
        notes.append("KL/JS are over the stored top-k + one tail bucket: lower bounds of the full-vocabulary values "
                     "(--exact rescores the paired contexts with the models for exact figures)")
    per_step = pa.Table.from_pylist(step_rows, schema=pa.schema(STEP_FIELDS)) if step_rows \
        else pa.schema(STEP_FIELDS).empty_table()
    per_layer = _table(LAYER_FIELDS, _concat(layer_parts))
    per_head = _table(HEAD_FIELDS, _concat(head_parts))
    ranked_layers = rank_layers(per_layer)
    ranked_heads = rank_heads(per_head)
    changed = [r["layer"] for r in ranked_layers if r["changed"]]
    first_changed = min(changed) if changed else None

    identical, verdict = _verdict(pairing, pair_summaries, step_rows, first_changed)
    return Comparison(_run_info(A), _run_info(B), compat, spec_differences(A.run.manifest, B.run.manifest), pairing,
                      pair_summaries, per_step, per_layer, per_head, ranked_layers, ranked_heads, first_changed,
                      identical, verdict, notes)


def _verdict(pairing, pairs, step_rows, first_changed) -> tuple[bool, str]:
    """One line: what differs, for every kind of pair (same prompt or not), and whether the paired next-token
    distributions differ beyond float noise (judged on the stored top-k without the chosen tokens' own entries)."""
    n = len(pairs)
    same_ctx = [p for p in pairs if p["same_prompt_ids"]]
    other_ctx = [p for p in pairs if not p["same_prompt_ids"]]
    diverged = [p for p in same_ctx if p["first_divergence"] is not None]
    paired = [r for r in step_rows if _is_paired(r)]
    figures_zero = all(r["same_stored"] for r in paired)  # same stored top-k logprobs, entropy and margin
    kl = [r["kl_stored_max"] for r in paired]
    known = [x for x in kl if x is not None]
    max_kl = max(known, default=0.0)
    noise_only = (not figures_zero and len(known) == len(kl) and max_kl < FLOAT_NOISE_KL
                  and all(r["top1_agree"] for r in paired))
    same_lengths = all(p["generated_len_a"] == p["generated_len_b"] for p in pairs)
    unpaired = len(pairing["unpaired_a"]) + len(pairing["unpaired_b"])
    identical = (n > 0 and not other_ctx and not diverged and figures_zero and first_changed is None and same_lengths
                 and not unpaired)
    if identical:
        return True, (f"no difference: all {n} paired sequence(s) generated the same tokens and every compared "
                      f"figure is equal")
    parts = []
    if n == 0:
        parts.append("no sequences could be paired")
    if same_ctx:
        what = "pair(s)" if not other_ctx else "pair(s) with the same prompt"
        if diverged:
            first = min(diverged, key=lambda p: p["first_divergence"]["step"])
            parts.append(f"{len(diverged)} of {len(same_ctx)} {what} diverge (earliest: pair {first['pair']} at step "
                         f"{first['first_divergence']['step']})")
        else:
            parts.append(f"all {len(same_ctx)} {what} generated the same tokens")
    if other_ctx:
        differ = [p for p in other_ctx if not p["same_text"]]
        line = f"{len(other_ctx)} pair(s) have different prompt tokens"
        if differ:
            p = differ[0]
            line += (f", {len(differ)} of them generated different text (pair {p['pair']}: "
                     f"{_clip(p['text']['a'])!r} vs {_clip(p['text']['b'])!r})")
        else:
            line += ", all of them generated the same text"
        parts.append(line)
    if paired:
        if first_changed is not None:
            parts.append(f"internal figures change from layer {first_changed} on"
                         + (f" (output distributions equal up to float noise: KL < {FLOAT_NOISE_KL:g})"
                            if noise_only or figures_zero else ""))
        elif noise_only:
            parts.append(f"same next-token distributions up to float noise (max KL over the stored top-k "
                         f"{max_kl:.1e} < {FLOAT_NOISE_KL:g} nats)")
        elif figures_zero and diverged:
            parts.append("the stored next-token distributions are identical at every paired step: the tokens differ "
                         "by sampling, not by the model")
        elif not figures_zero:
            parts.append(f"next-token distributions differ (max KL over the stored top-k {max_kl:.3g} nats, "
                         f"a lower bound)")
    if unpaired:
        parts.append(f"{unpaired} sequence(s) unpaired")
    return False, "; ".join(parts)


def _clip(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
