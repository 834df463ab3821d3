"""What each attention head does, from a run's archived attention rows alone (`lmtrace heads`).

No model is loaded. Every archived attention row of a head (the query position of every generated
step, `attn[sequence, step, layer, head, key]`, query position q = prompt_len + step − 1, keys
0..q; and, when the run captured `prefill_attention`, the prompt's rows q = 1 .. prompt_len − 2,
the last prompt row being step 0's) gives these scores; a head's score is their mean over all rows
of all sequences (`--per-sequence`: over one sequence's rows). Rows whose query is position 0 (it
can only attend to itself) are left out.

  sink_score        attention to position 0 (the first token: BOS where the tokenizer adds one)
  prev_token_score  attention to position q − 1
  local_score       attention to the query and the LOCAL_WINDOW positions before it, position 0 excluded
  induction_score   attention to the positions j + 1 right after earlier occurrences j of the query's
                    own token (j + 1 < q); mean over the rows whose token occurred before (`n_induction_rows`)
  duplicate_score   attention to earlier occurrences j < q of the query's own token; mean over the same
                    kind of rows (their count equals `n_induction_rows` unless the only earlier occurrence is q − 1)
  entropy           −Σ a·log a over the keys, nats
  concentration     the row's largest weight

Label (THRESHOLDS): among sink / previous-token / induction, the one whose score reaches its
threshold with the highest score (equal scores: that order); else `local` if local_score reaches
its threshold; else `focused` if concentration does; else `diffuse`.

Importance: with per-head direct logit attribution in the run (`capture.head_dla`), `importance` is
the mean |head_dla| over the rows (`dla_rank` ranks by it); with a head sweep of the run (`lmtrace
sweep RUN --over heads`, the latest one), `sweep_effect` is the head's mean measured effect on the
sweep's first metric over all its (sequence, step) rows (`sweep_rank` ranks by |sweep_effect|).
`head_rank` follows the measured effect when there is a sweep, else the DLA, else the label in
RANK_ORDER and, within a label, the label's score (largest first).

No printing, no paths: `lmtrace heads` (commands/heads.py) writes the tables through
`archive/heads.py` and prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ..archive.attention import topk_dense
from ..archive.groups import GROUP_COLUMN, GROUP_VALUE, SequenceGroups, group_order
from ..archive.reader import Run
from ..archive.sweeps import read_sweep
from ..exits.errors import ArchiveError
from .sweep.effects import cell_effects

LOCAL_WINDOW = 4  # local_score: keys q − 4 .. q
THRESHOLDS = {"sink": 0.5, "previous-token": 0.4, "induction": 0.3, "local": 0.5, "focused": 0.5}
LABELS = ("sink", "previous-token", "induction", "local", "focused", "diffuse")
# Without a sweep or DLA, heads rank by label in this order: the heads that implement a specific
# mechanism first (induction copies what followed an earlier occurrence; previous-token heads feed
# it), then positional patterns, and last what many heads of a trained model do and what tells
# least about a head (sinks: twenty or more of SmolLM2-135M's 270 heads; diffuse).
RANK_ORDER = ("induction", "previous-token", "local", "focused", "sink", "diffuse")
SCORES = (
    "sink_score",
    "prev_token_score",
    "local_score",
    "induction_score",
    "duplicate_score",
    "entropy",
    "concentration",
)


def row_scores(rows: np.ndarray, q: np.ndarray, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row scores of attention rows.

    rows [R, L, H, K] float (NaN or anything past key q is ignored), q [R] query positions (≥ 1),
    tokens [K'] the sequence's token ids by position (K' > max q). Returns name -> [R, L, H]
    (induction / duplicate: NaN on rows whose token did not occur before).
    """
    R, _, _, K = rows.shape
    k = np.arange(K)[None, :]
    qq = q[:, None]
    valid = k <= qq  # [R, K]
    a = np.where(valid[:, None, None], np.nan_to_num(rows.astype(np.float32), nan=0.0), 0.0)
    tok = np.full(K + 1, -2, dtype=np.int64)
    n = min(len(tokens), K)
    tok[:n] = tokens[:n]
    tok_q = tok[q][:, None]  # [R, 1]
    prev_tok = np.concatenate([[-3], tok[: K - 1]])[None, :]  # token at k − 1
    masks = {
        "prev_token_score": k == qq - 1,
        "local_score": (k >= qq - LOCAL_WINDOW) & (k >= 1) & valid,
        "induction_score": (k >= 1) & (k < qq) & (prev_tok == tok_q),
        "duplicate_score": (k < qq) & (tok[None, :K] == tok_q),
    }
    out = {"sink_score": a[..., 0]}
    for name, m in masks.items():
        s = np.einsum("rlhk,rk->rlh", a, m.astype(np.float32))
        if name in ("induction_score", "duplicate_score"):
            s = np.where(m.any(-1)[:, None, None], s, np.nan)
        out[name] = s
    with np.errstate(divide="ignore", invalid="ignore"):
        out["entropy"] = -np.where(a > 0, a * np.log(np.where(a > 0, a, 1.0)), 0.0).sum(-1)
    out["concentration"] = a.max(-1)
    return out


def label_of(scores: dict[str, float]) -> str:
    """The class label of one head from its mean scores (see the module docstring)."""
    specific = [
        ("sink", scores["sink_score"]),
        ("previous-token", scores["prev_token_score"]),
        ("induction", scores["induction_score"]),
    ]
    passed = [
        (v, -i, name)
        for i, (name, v) in enumerate(specific)
        if v is not None and not np.isnan(v) and v >= THRESHOLDS[name]
    ]
    if passed:
        return max(passed)[2]
    if scores["local_score"] >= THRESHOLDS["local"]:
        return "local"
    if scores["concentration"] >= THRESHOLDS["focused"]:
        return "focused"
    return "diffuse"


@dataclass
class _Acc:
    """Sums and counts of per-row scores, per (layer, head)."""

    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]

    @classmethod
    def new(cls, L: int, H: int) -> "_Acc":
        return cls({s: np.zeros((L, H)) for s in SCORES}, {s: np.zeros((L, H)) for s in SCORES})

    def add(self, scores: dict[str, np.ndarray]) -> None:
        for name, v in scores.items():
            ok = ~np.isnan(v)
            self.sums[name] += np.where(ok, v, 0.0).sum(0)
            self.counts[name] += ok.sum(0)

    def merge(self, other: "_Acc") -> None:
        for name in SCORES:
            self.sums[name] += other.sums[name]
            self.counts[name] += other.counts[name]

    def means(self) -> dict[str, np.ndarray]:
        with np.errstate(invalid="ignore", divide="ignore"):
            return {
                name: np.where(self.counts[name] > 0, self.sums[name] / np.maximum(self.counts[name], 1), np.nan)
                for name in SCORES
            }


def _check_run(run: Run) -> None:
    names = set(run.array_names())
    if not names & {"attn", "attn_topk_idx"}:
        raise ArchiveError(
            f"run {run.id} captured no attention rows (`capture: none` or capture.attention.enabled: "
            f"false): `lmtrace heads` needs them; generate it again with capture.attention.enabled: true"
        )


def _dense_rows(run: Run, seq: int, s0: int, s1: int, K: int) -> np.ndarray:
    """[s1 - s0, L, H, K] float32 attention rows of steps s0..s1-1 of a sequence; with `attention.top_k`
    as `archive.attention.topk_dense` (a NaN weight counts as 0 in `row_scores`, as in `attn`)."""
    if "attn" in run.array_names():
        return np.asarray(run.array("attn")[seq, s0:s1, :, :, :K], dtype=np.float32)
    idx = np.asarray(run.array("attn_topk_idx")[seq, s0:s1])
    prob = np.asarray(run.array("attn_topk_prob")[seq, s0:s1], dtype=np.float32)
    return topk_dense(idx, prob, K)


def _sequence_scores(
    run: Run, seq: int, n: int, P: int, tokens: np.ndarray, prefill: bool, block: int
) -> tuple[_Acc, int]:
    """The summed scores of one sequence's rows (its prompt's with `prefill`, then its first n steps', `block`
    steps of every layer at a time: bounded memory) and how many rows there were."""
    acc = _Acc.new(len(run.layers), int(run.shape["n_heads"]))
    n_rows = 0
    if prefill:
        q = np.arange(1, P - 1)
        if len(q):
            rows = np.asarray(run.array("prefill_attn")[seq, :, :, 1 : P - 1, :P], dtype=np.float32)  # [L, H, q, k]
            acc.add(row_scores(rows.transpose(2, 0, 1, 3), q, tokens))
            n_rows += len(q)
    for s0 in range(0, n, block):
        s1 = min(n, s0 + block)
        q = P + np.arange(s0, s1) - 1
        K = int(q.max()) + 1
        rows = _dense_rows(run, seq, s0, s1, K)
        keep = q >= 1
        if keep.any():
            acc.add(row_scores(rows[keep], q[keep], tokens))
            n_rows += int(keep.sum())
    return acc, n_rows


def _tokens_by_position(run: Run) -> dict[int, np.ndarray]:
    t = run.table("tokens", columns=["sequence", "position", "token_id"]).to_pandas()
    out = {}
    for seq, g in t.groupby("sequence"):
        g = g.sort_values("position")
        ids = np.full(int(g.position.max()) + 1, -1, dtype=np.int64)
        ids[g.position.to_numpy()] = g.token_id.to_numpy()
        out[int(seq)] = ids
    return out


def compute_heads(run: Run, per_sequence: bool = False, block: int = 32, groups: SequenceGroups | None = None) -> dict:
    """Head scores of a run. Returns {"table": pa.Table, "per_sequence": pa.Table | None, "by_group": pa.Table |
    None, "notes": [...], "rows": n}.

    groups: the run's sequences grouped by a sequences.parquet column: then "by_group" holds every
    head's scores over each group's rows (the rows of its sequences pooled, as the whole run's are),
    one table (`group_schema`), groups in the column's order, null last."""
    _check_run(run)
    notes = []
    gen_len = run.generated_len()
    ready = run.ready_steps(gen_len)
    prompt_len = run.prompt_len()
    layers = list(run.layers)
    L, H = len(layers), int(run.shape["n_heads"])
    tokens = _tokens_by_position(run)
    prefill = "prefill_attn" in run.array_names()
    dla = run.array("head_dla") if "head_dla" in run.array_names() else None
    total = _Acc.new(L, H)
    # kept only where asked for: a sequence's sums are 2 x len(SCORES) arrays of (L, H) float64 (26 KB
    # on SmolLM2), 260 MB over 10,000 sequences
    per_parts: list[pa.Table] = []  # --per-sequence: each sequence's table
    pooled: dict[object, tuple[_Acc, int]] = {}  # --by: each group's sums and its sequences
    dla_sum, dla_n = np.zeros((L, H)), np.zeros((L, H))
    n_rows = 0
    for seq in range(len(gen_len)):
        n = ready.get(seq, 0)
        if n <= 0 or seq not in tokens:
            continue
        acc, seq_rows = _sequence_scores(run, seq, n, int(prompt_len[seq]), tokens[seq], prefill, block)
        seq_dla = None
        if dla is not None:
            d = np.asarray(dla[seq, :n], dtype=np.float64)  # [n, L, H]
            ok = ~np.isnan(d)
            dla_sum += np.where(ok, np.abs(d), 0).sum(0)
            dla_n += ok.sum(0)
            with np.errstate(invalid="ignore"):
                seq_dla = np.where(ok, np.abs(d), 0).sum(0) / np.maximum(ok.sum(0), 1)
        total.merge(acc)
        n_rows += seq_rows
        if per_sequence:
            per_parts.append(_table(layers, H, acc, seq_dla, ranked=False, sequence=seq))
        if groups is not None:
            key = groups.of.get(seq)
            group, n_seqs = pooled.get(key, (_Acc.new(L, H), 0))
            group.merge(acc)
            pooled[key] = (group, n_seqs + 1)
    if n_rows == 0:
        raise ArchiveError(f"run {run.id} has no committed attention rows yet: nothing to score")
    if run.status != "complete":
        notes.append(
            f"run {run.id} is {run.status}: computed on its committed steps "
            f"({sum(ready.values())} of up to {len(gen_len) * run.shape['n_steps']})"
        )
    if "attn" not in run.array_names():
        notes.append(
            f"run {run.id} kept the top {run.shape.get('k_attn')} weights per row "
            f"(capture.attention.top_k): scores count only those, entropy is of the kept weights"
        )
    importance = None
    if dla is not None:
        with np.errstate(invalid="ignore"):
            importance = np.where(dla_n > 0, dla_sum / np.maximum(dla_n, 1), np.nan)
    sweep = head_sweep_effects(run, notes)
    table = _table(layers, H, total, importance, ranked=True, sweep=sweep)
    per = pa.concat_tables(per_parts) if per_sequence else None
    by_group = None if groups is None else _group_tables(layers, H, pooled, groups)
    return {
        "table": table,
        "per_sequence": per,
        "by_group": by_group,
        "notes": notes,
        "rows": n_rows,
        "dla": dla is not None,
        "sweep": None if sweep is None else {k: v for k, v in sweep.items() if k != "effects"},
    }


def head_sweep_effects(run: Run, notes: list[str]) -> dict | None:
    """The run's latest head sweep (`lmtrace sweep RUN --over heads`): {"id", "edit", "metric", "effects":
    {(layer, head): mean effect over every (sequence, step) row}}, or None without one. A sweep that hid
    heads at single positions (`--positions`) measures something else and is not used."""
    entries = [e for e in (run.manifest.get("sweeps") or []) if e.get("over") == "heads"]
    if not entries:
        return None
    entry = entries[-1]
    metric = entry["metrics"][0]
    try:
        effects = cell_effects(read_sweep(run, entry["id"]), metric)
    except (OSError, KeyError, pa.ArrowInvalid) as err:
        raise ArchiveError(f"run {run.id}: cannot read sweep {entry['id']} ({entry.get('path')}): {err}") from None
    effects = effects[(effects.component == "head") & effects.position.isna()]
    if effects.empty:
        notes.append(f"sweep {entry['id']} hid heads at single positions; heads are not ranked by it")
        return None
    return {
        "id": entry["id"],
        "edit": entry.get("edit"),
        "metric": metric,
        "effects": {(int(r.layer), int(r.q_head)): float(r.effect) for r in effects.itertuples()},
    }


def _table(
    layers: list[int],
    H: int,
    acc: _Acc,
    importance,
    *,
    ranked: bool,
    sequence: int | None = None,
    sweep: dict | None = None,
) -> pa.Table:
    means = acc.means()
    rows = []
    for li, layer in enumerate(layers):
        for h in range(H):
            scores = {name: float(means[name][li, h]) for name in SCORES}
            label = label_of(scores)
            rows.append(
                {
                    **({"sequence": sequence} if sequence is not None else {}),
                    "layer": layer,
                    "q_head": h,
                    "label": label,
                    **scores,
                    "n_rows": int(acc.counts["sink_score"][li, h]),
                    "n_induction_rows": int(acc.counts["induction_score"][li, h]),
                    "importance": None
                    if importance is None or np.isnan(importance[li, h])
                    else float(importance[li, h]),
                }
            )
            if ranked:
                rows[-1]["sweep_effect"] = None if sweep is None else sweep["effects"].get((layer, h))
    if ranked:
        _rank_by(rows, "dla_rank", lambda r: r["importance"])
        _rank_by(rows, "sweep_rank", lambda r: None if r["sweep_effect"] is None else abs(r["sweep_effect"]))

        def key(r):  # measured effect first, then direct attribution, then what the attention looks like
            for n, name in enumerate(("sweep_rank", "dla_rank")):
                if r[name] is not None:
                    return (n, r[name], 0.0)
            return (2, RANK_ORDER.index(r["label"]), -label_score(r))

        rows.sort(key=key)
        for i, r in enumerate(rows):
            r["head_rank"] = i + 1
    return pa.Table.from_pylist(rows, schema=_schema(sequence is not None, ranked))


def _group_tables(
    layers: list[int], H: int, pooled: dict[object, tuple["_Acc", int]], groups: SequenceGroups
) -> pa.Table:
    """Per group (in the column's order, null last): every head's scores over the pooled rows of its
    sequences (`pooled`: group -> the sums over its sequences' rows, its number of sequences), with
    n_sequences; importance (direct logit attribution) is left null. Columns: `group_schema`."""
    parts = []
    for key in sorted(pooled, key=group_order):
        acc, n = pooled[key]
        t = _table(layers, H, acc, None, ranked=False)
        t = t.add_column(0, "n_sequences", pa.array([n] * t.num_rows, pa.int32()))
        t = t.add_column(0, GROUP_VALUE, pa.array([key] * t.num_rows, groups.type))
        parts.append(t.add_column(0, GROUP_COLUMN, pa.array([groups.column] * t.num_rows, pa.string())))
    return pa.concat_tables(parts).cast(group_schema(groups.type))


def grouped_rows(table: pa.Table, wanted: list[str] | None) -> list[dict]:
    """Every group's heads (those with the labels asked for): the rows of heads_by_<COLUMN>.parquet (`by_group` of compute_heads)
    without group_column (`by.column` names it), groups in the file's order, each group's heads in
    rank order (label, then the label's score), NaN as null."""
    rows = [r for r in table.drop_columns([GROUP_COLUMN]).to_pylist() if wanted is None or r["label"] in wanted]
    rows.sort(key=lambda r: (group_order(r[GROUP_VALUE]), RANK_ORDER.index(r["label"]), -label_score(r)))
    return [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()} for r in rows]


def group_schema(value_type: pa.DataType) -> pa.Schema:
    """heads_by_<COLUMN>.parquet: group_column (the sequences.parquet column's name), group_value (its
    value, of its type `value_type`; null for sequences without one), n_sequences, then the columns
    of heads_per_sequence.parquet without `sequence`."""
    return pa.schema(
        [(GROUP_COLUMN, pa.string()), (GROUP_VALUE, value_type), ("n_sequences", pa.int32()), *_schema(False, False)]
    )


def _rank_by(rows: list[dict], column: str, value) -> None:
    """rows[column] = 1 for the largest value(row), 2 for the next...; None where value is None."""
    scored = sorted((r for r in rows if value(r) is not None), key=lambda r: -value(r))
    for r in rows:
        r[column] = None
    for i, r in enumerate(scored):
        r[column] = i + 1


def label_score(r: dict) -> float:
    name = {
        "sink": "sink_score",
        "previous-token": "prev_token_score",
        "induction": "induction_score",
        "local": "local_score",
        "focused": "concentration",
        "diffuse": "entropy",
    }[r["label"]]
    v = r[name]
    return 0.0 if v is None or np.isnan(v) else v


def _schema(per_sequence: bool, ranked: bool) -> pa.Schema:
    i32, f32 = pa.int32(), pa.float32()
    fields = [("sequence", i32)] if per_sequence else []
    fields += [("layer", i32), ("q_head", i32), ("label", pa.string())]
    fields += [(s, f32) for s in SCORES]
    fields += [("n_rows", i32), ("n_induction_rows", i32), ("importance", f32)]
    if ranked:
        fields += [("dla_rank", i32), ("sweep_effect", f32), ("sweep_rank", i32), ("head_rank", i32)]
    return pa.schema(fields)
