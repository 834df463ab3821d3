"""What each page shows, as JSON-ready dicts, read lazily from one run: `lmtrace serve` answers its
routes with them and the report inlines the same answers.

Every function reads only what its answer needs: one sequence's rows of a table (a filtered
Parquet read), or one (sequence, step) slice of an array, which zarr serves from the chunks
holding it. No function loads a whole array. Sort keys over all sequences read four columns of
the tokens table once per run version and are cached.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..analysis.attention_heads import most_attended, most_attended_kept
from ..archive import layout, parquet_io
from ..archive.columns import current_names, stored_name
from ..archive.liveness import live
from ..archive.reader import Run, lens_state, read_table_files
from ..archive.summary import status_label
from ..exits.errors import ArchiveError
from ..output.jsonout import strict
from . import blocks, kept
from .errors import BadParameter, NotFound

PAGE_SIZE = 50
SORTS = ("index", "lowest_prob", "highest_entropy", "length")
TEXT_LIMIT = 400  # characters of a prompt / generated text in a sequences-list row


# ---- tables, one sequence at a time -----------------------------------------------------------
def table_rows(run: Run, name: str, columns: list[str] | None = None, where=None) -> pa.Table:
    """Rows of a table matching the pyarrow expression `where`: from the compacted file of a
    complete run or the committed part files of a running one; only matching row groups are read.
    `columns` and the table's are today's names (an older archive's are mapped, archive/columns.py)."""

    def read(files: list) -> pa.Table:
        if not files:
            return pa.table({}) if columns is None else pa.table({c: pa.array([]) for c in columns})
        dataset = kept.dataset(files)
        stored = dataset.schema.names
        wanted = (
            None if columns is None else [s for s in (stored_name(stored, c, name) for c in columns) if s in stored]
        )
        # one thread: these reads are small (one sequence's or step's rows), and starting Arrow's
        # thread pool cost more than they do (cold: 70-300 ms against ~40 on a busy 2-core machine)
        return current_names(parquet_io.read_dataset(dataset, columns=wanted, filter=where, use_threads=False), name)

    try:
        return read_table_files(run.path, name, read)
    except (OSError, pa.ArrowException) as err:
        raise run.damaged(layout.table_file(name), err) from None


def run_info(run: Run) -> dict:
    """The run page's header: what was captured and how far it got. `run_id` is the run's address (its
    directory's name); `status` is what the runs list shows (`killed` for a running run no process writes)."""
    m = run.manifest
    name = run.path.name
    problem = kept.integrity_problem(run)
    status = status_label(run.path, m, problem)
    names = kept.array_names(run) if (run.path / layout.TENSORS).exists() else set()
    return {
        "run_id": name,
        **({"manifest_run_id": run.id} if run.id != name else {}),
        "status": status,
        "live": live(run.path, status),
        "kind": m.get("kind"),
        "model": (m.get("model") or {}).get("reference"),
        "created": m.get("created"),
        "parent_id": (m.get("parent") or {}).get("run_id"),
        "damaged": None if problem is None else f"run {name} is damaged: {problem}; `lmtrace verify {name}`",
        "sequences": run.shape.get("n_sequences"),
        "max_new_tokens": run.shape.get("n_steps"),
        "layers": run.layers,
        "heads": run.shape.get("n_heads"),
        "attention": "dense" if "attn" in names else "top-k" if "attn_topk_prob" in names else None,
        "lens": lens_state(m),
        "head_dla": "head_dla" in names,
    }


def _sequence_stats(run: Run) -> pa.Table:
    """Per sequence: the lowest probability and highest entropy of its generated tokens."""
    t = table_rows(run, "tokens", ["sequence", "is_prompt", "prob", "entropy"], where=~pc.field("is_prompt"))
    if t.num_rows == 0:
        return pa.table(
            {
                "sequence": pa.array([], pa.int32()),
                "min_prob": pa.array([], pa.float32()),
                "max_entropy": pa.array([], pa.float32()),
            }
        )
    g = t.group_by("sequence", use_threads=False).aggregate([("prob", "min"), ("entropy", "max")])
    return g.rename_columns({"prob_min": "min_prob", "entropy_max": "max_entropy"})


_stats_cache: dict[tuple, pa.Table] = {}
_stats_lock = threading.Lock()


def sequence_stats(run: Run) -> pa.Table:
    """`_sequence_stats`, cached for a complete run (a running run's grow with every block)."""
    if run.status != "complete":
        return _sequence_stats(run)
    key = (str(run.path), run.manifest.get("completed"), run.manifest.get("created"))
    with _stats_lock:
        if key in _stats_cache:
            return _stats_cache[key]
    stats = _sequence_stats(run)
    with _stats_lock:
        if len(_stats_cache) > 32:
            _stats_cache.clear()
        _stats_cache[key] = stats
    return stats


def sequence_page(run: Run, *, page: int = 0, query: str = "", sort: str = "index") -> dict:
    """One page (PAGE_SIZE rows) of the run's sequences, searched and sorted.

    `query` matches the prompt, the generated text and any text metadata column (case-insensitive);
    `sort`: index | lowest_prob (lowest-probability token first) | highest_entropy | length (longest first)."""
    if sort not in SORTS:
        raise BadParameter(f"sort {sort!r}: expected one of {', '.join(SORTS)}")
    seqs = table_rows(run, "sequences")
    if run.status != "complete":
        seqs = _with_unfinished(run, seqs)
    if seqs.num_rows == 0:
        return {"total": 0, "page": 0, "pages": 0, "page_size": PAGE_SIZE, "rows": []}
    stats = sequence_stats(run)
    seqs = seqs.join(stats, "sequence", join_type="left outer", use_threads=False)
    if query:
        q = query.lower()
        mask = None
        for field in seqs.schema:
            if pa.types.is_string(field.type) or pa.types.is_large_string(field.type):
                hit = pc.fill_null(pc.match_substring(pc.utf8_lower(seqs.column(field.name)), q), False)
                mask = hit if mask is None else pc.or_(mask, hit)
        seqs = seqs.filter(mask) if mask is not None else seqs.slice(0, 0)
    order = {
        "index": [("sequence", "ascending")],
        "lowest_prob": [("min_prob", "ascending"), ("sequence", "ascending")],
        "highest_entropy": [("max_entropy", "descending"), ("sequence", "ascending")],
        "length": [("generated_len", "descending"), ("sequence", "ascending")],
    }[sort]
    seqs = seqs.sort_by(order)  # nulls (no committed token yet) sort last
    total = seqs.num_rows
    pages = max(1, -(-total // PAGE_SIZE))
    page = max(0, min(page, pages - 1))
    metadata = [
        c for c in seqs.column_names if c not in layout.sequence_schema().names and c not in ("min_prob", "max_entropy")
    ]
    rows = []
    for r in seqs.slice(page * PAGE_SIZE, PAGE_SIZE).to_pylist():
        rows.append(
            {
                "sequence": r["sequence"],
                "prompt": (r.get("prompt") or "")[:TEXT_LIMIT],
                "generated_text": (r.get("generated_text") or "")[:TEXT_LIMIT],
                "prompt_len": r.get("prompt_len"),
                "generated_len": r.get("generated_len"),
                "stop_reason": r.get("stop_reason"),
                "min_prob": strict(r.get("min_prob")),
                "max_entropy": strict(r.get("max_entropy")),
                "metadata": {c: strict(r.get(c)) if not isinstance(r.get(c), str) else r.get(c) for c in metadata},
            }
        )
    return {"total": total, "page": page, "pages": pages, "page_size": PAGE_SIZE, "rows": rows}


def check_sequence(run: Run, seq: int) -> None:
    n = run.shape.get("n_sequences", 0)
    if not 0 <= seq < n:
        raise NotFound(f"run {run.id} has sequences 0-{n - 1}, not {seq}")


def sequence_tokens(run: Run, seq: int) -> dict:
    """One sequence's token strip: its prompt tokens, then its generated ones with their statistics
    (a running run: the committed ones)."""
    check_sequence(run, seq)
    t = table_rows(
        run,
        "tokens",
        ["position", "step", "is_prompt", "token_id", "token_text", "prob", "entropy", "token_rank"],
        where=pc.field("sequence") == seq,
    ).sort_by("position")
    ready = steps_ready(run, seq)  # a running run's table parts can be ahead of its progress record
    tokens = [
        {
            "position": r["position"],
            "step": r["step"],
            "text": r["token_text"],
            "prob": strict(r["prob"]),
            "entropy": strict(r["entropy"]),
            "token_rank": r["token_rank"],
        }
        for r in t.to_pylist()
        if r["step"] is None or r["step"] < ready
    ]
    prompt, source = sequence_prompt(run, seq, [x["text"] for x in tokens if x["step"] is None])
    return {
        "sequence": seq,
        "prompt": prompt,
        "prompt_source": source,
        "tokens": tokens,
        "steps": sum(1 for x in tokens if x["step"] is not None),
    }


def spec_prompts(run: Run) -> list[str] | None:
    """The run's inline prompts (`prompts.texts` of its resolved spec), one per sequence; None for
    prompts read from a file."""
    texts = ((run.manifest.get("spec_resolved") or {}).get("prompts") or {}).get("texts")
    if (
        isinstance(texts, list)
        and len(texts) == run.shape.get("n_sequences")
        and all(isinstance(t, str) for t in texts)
    ):
        return texts
    return None


def _with_unfinished(run: Run, seqs: pa.Table) -> pa.Table:
    """A run being written (or killed): its sequences table with a row for each sequence whose batch has
    not finished (no row of sequences.parquet yet): its prompt (the spec's, else its committed prompt
    tokens joined) and the steps committed so far as `generated_len`."""
    have = set(seqs.column("sequence").to_pylist()) if "sequence" in seqs.column_names else set()
    missing = [i for i in range(run.shape.get("n_sequences") or 0) if i not in have]
    if not missing:
        return seqs
    committed = run.committed_steps()
    texts = spec_prompts(run)
    if texts is not None:
        prompts = [texts[i] for i in missing]
    else:
        t = table_rows(
            run,
            "tokens",
            ["sequence", "position", "token_text"],
            where=pc.field("is_prompt") & pc.field("sequence").isin(missing),
        )
        t = t.sort_by([("sequence", "ascending"), ("position", "ascending")])
        joined: dict[int, str] = {}
        for q, x in zip(t.column("sequence").to_pylist(), t.column("token_text").to_pylist()):
            joined[q] = joined.get(q, "") + (x or "")
        prompts = [joined.get(i) for i in missing]
    rows = pa.table(
        {
            "sequence": pa.array(missing, pa.int32()),
            "prompt": pa.array(prompts, pa.string()),
            "generated_len": pa.array([committed.get(i, 0) for i in missing], pa.int32()),
        }
    )
    if not seqs.column_names:
        return rows
    return pa.concat_tables([seqs, rows], promote_options="default")


def sequence_prompt(run: Run, seq: int, prompt_tokens: list[str]) -> tuple[str | None, str | None]:
    """A sequence's prompt and where it was read: `sequences` (its row of sequences.parquet, written
    when its batch finishes), else `spec` (the run's inline prompts, `prompts.texts`, one per
    sequence), else `tokens` (its committed prompt tokens joined: the text the model read, chat
    template included). (None, None) before any of them holds it."""
    rows = table_rows(run, "sequences", ["prompt"], where=pc.field("sequence") == seq)
    found = rows.column("prompt").to_pylist() if "prompt" in rows.column_names else []
    if found and found[0] is not None:
        return found[0], "sequences"
    texts = spec_prompts(run)
    if texts is not None:
        return texts[seq], "spec"
    if prompt_tokens:
        return "".join(t or "" for t in prompt_tokens), "tokens"
    return None, None


def steps_ready(run: Run, seq: int) -> int:
    """Steps of `seq` whose arrays are committed (`Run.steps_ready`), with the lengths kept per run."""
    return run.steps_ready(seq, kept.lengths(run, "generated_len"))


def check_step(run: Run, seq: int, step: int) -> None:
    check_sequence(run, seq)
    ready = steps_ready(run, seq)
    if not 0 <= step < ready:
        raise NotFound(
            f"sequence {seq} of run {run.id} has steps 0-{ready - 1} committed, not {step}"
            if ready
            else f"sequence {seq} of run {run.id} has no committed step yet"
        )


def key_texts(run: Run, seq: int, n_keys: int) -> list[str]:
    t = table_rows(
        run, "tokens", ["position", "token_text"], where=(pc.field("sequence") == seq) & (pc.field("position") < n_keys)
    ).sort_by("position")
    texts = [""] * n_keys
    for pos, text in zip(t.column("position").to_pylist(), t.column("token_text").to_pylist()):
        texts[pos] = text
    return texts


def n_keys_of(run: Run, seq: int, step: int) -> int:
    """Keys the query of `step` attends over: the prompt, then one per earlier step."""
    return int(kept.lengths(run, "prompt_len")[seq]) + step


def attention_grid(run: Run, seq: int, step: int) -> dict | None:
    """For each (layer, head): the key the query of `step` attended to most (`analysis.attention_heads`), its
    weight and text.

    Reads the array's [seq, step] slice only: `attn` [layer, q_head, key] trimmed to the context,
    or for a top-k run `attn_topk_*` [layer, q_head, k_attn]."""
    names = kept.array_names(run)
    n_keys = n_keys_of(run, seq, step)
    if "attn" in names:
        rows = np.asarray(blocks.step_rows(run, seq, step, n_keys), dtype=np.float32)  # [layer, q_head, key]
        key, weight = most_attended(rows)  # [layer, q_head]
    elif "attn_topk_prob" in names:
        probs = np.asarray(kept.array(run, "attn_topk_prob")[seq, step], dtype=np.float32)  # [layer, q_head, k_attn]
        key, weight = most_attended_kept(np.asarray(kept.array(run, "attn_topk_idx")[seq, step]), probs)
    else:
        return None
    texts = key_texts(run, seq, n_keys)
    cells = [
        [
            {
                "key": int(key[li, h]),
                "weight": strict(float(weight[li, h])),
                "text": texts[int(key[li, h])] if 0 <= key[li, h] < n_keys else "",
            }
            for h in range(key.shape[1])
        ]
        for li in range(key.shape[0])
    ]
    return {
        "layers": run.layers,
        "heads": int(key.shape[1]),
        "n_keys": n_keys,
        "query_position": n_keys - 1,
        "cells": cells,
    }


def head_row(run: Run, seq: int, step: int, layer: int, head: int) -> dict:
    """The attention of the query of `step` over every key, for one (layer, head), with the keys' texts
    (a top-k run: its k keys)."""
    check_step(run, seq, step)
    if layer not in run.layers:
        raise NotFound(f"layer {layer} was not captured in run {run.id} (captured: {run.layers})")
    li = run.layers.index(layer)
    n_heads = run.shape.get("n_heads", 0)
    if not 0 <= head < n_heads:
        raise NotFound(f"run {run.id} has heads 0-{n_heads - 1}, not {head}")
    names = kept.array_names(run)
    n_keys = n_keys_of(run, seq, step)
    texts = key_texts(run, seq, n_keys)
    if "attn" in names:
        row = np.asarray(blocks.step_rows(run, seq, step, n_keys)[li, head], dtype=np.float32)
        keys = [{"key": k, "text": texts[k], "weight": strict(float(row[k]))} for k in range(n_keys)]
    elif "attn_topk_prob" in names:
        probs = np.asarray(kept.array(run, "attn_topk_prob")[seq, step, li, head], dtype=np.float32)
        idx = np.asarray(kept.array(run, "attn_topk_idx")[seq, step, li, head])
        keys = sorted(
            (
                {"key": int(k), "text": texts[int(k)], "weight": strict(float(p))}
                for k, p in zip(idx, probs)
                if 0 <= k < n_keys
            ),
            key=lambda x: x["key"],
        )
    else:
        raise NotFound(f"run {run.id} captured no attention")
    return {"sequence": seq, "step": step, "layer": layer, "head": head, "keys": keys, "dense": "attn" in names}


ALTERNATIVE_COLUMNS = [
    "token_text",
    "token_id",
    "position",
    "prob",
    "token_rank",
    "entropy",
    "margin",
    "greedy_id",
    "alt_ids",
    "alt_logprobs",
]


def alternatives(run: Run, seq: int, step: int) -> dict | None:
    """The chosen token of `step` and the alternatives the run kept, with their probabilities."""
    t = table_rows(
        run,
        "tokens",
        ALTERNATIVE_COLUMNS,
        where=(pc.field("sequence") == seq) & (pc.field("step") == step) & ~pc.field("is_prompt"),
    )
    if t.num_rows == 0:
        return None
    r = t.to_pylist()[0]
    alt_ids = r.get("alt_ids") or []
    alt_lp = r.get("alt_logprobs") or []
    alt_texts = run.text(alt_ids) if alt_ids else []
    return {
        "token": r["token_text"],
        "token_id": r["token_id"],
        "position": r["position"],
        "prob": strict(r.get("prob")),
        "token_rank": r.get("token_rank"),
        "entropy": strict(r.get("entropy")),
        "margin": strict(r.get("margin")),
        "greedy": run.text([r["greedy_id"]])[0] if r.get("greedy_id") is not None else None,
        "alternatives": [
            {"id": i, "text": text, "prob": None if lp is None else math.exp(lp)}
            for i, text, lp in zip(alt_ids, alt_texts, alt_lp)
        ],
    }


def lens_column(run: Run, seq: int, step: int) -> dict:
    """The logit lens at `step`, per captured layer: its top-1 token and probability, and the chosen
    token's rank and probability under the lens (steps.parquet's lens_target_rank / _prob)."""
    state = lens_state(run.manifest)
    if state == "none":
        return {"state": state, "rows": []}
    if state == "pending":
        return {
            "state": state,
            "note": f"the logit lens is deferred: run `lmtrace lens {run.id}` to compute it",
            "rows": [],
        }
    ids = np.asarray(kept.array(run, "lens_ids")[seq, step])  # [layer, k_lens]
    probs = np.asarray(kept.array(run, "lens_probs")[seq, step], dtype=np.float32)
    texts = run.text(ids[:, 0])
    target = table_rows(
        run,
        "steps",
        ["layer", "lens_target_rank", "lens_target_prob"],
        where=(pc.field("sequence") == seq) & (pc.field("step") == step),
    )
    by_layer = {r["layer"]: r for r in target.to_pylist()}
    rows = []
    for li, layer in enumerate(run.layers):
        t = by_layer.get(layer, {})
        rows.append(
            {
                "layer": layer,
                "top1": texts[li],
                "top1_id": int(ids[li, 0]),
                "top1_prob": strict(float(probs[li, 0])),
                "target_rank": t.get("lens_target_rank"),
                "target_prob": strict(t.get("lens_target_prob")),
            }
        )
    return {"state": state, "rows": rows}


def head_dla(run: Run, seq: int, step: int) -> dict | None:
    """Per-head direct logit attribution at `step` [layer][q_head], when captured."""
    if "head_dla" not in kept.array_names(run):
        return None
    values = np.asarray(kept.array(run, "head_dla")[seq, step], dtype=np.float32)  # [layer, q_head]
    return {
        "layers": run.layers,
        "values": [[strict(float(v)) for v in row] for row in values],
        "target": "logit(chosen) - logit(runner-up)",
    }


def step_detail(run: Run, seq: int, step: int) -> dict:
    """Everything the page shows for one selected token."""
    check_step(run, seq, step)
    if not (run.path / layout.TENSORS).exists():
        raise ArchiveError(f"run {run.id} wrote no tensors (capture: none): there is nothing to show per step")
    return {
        "sequence": seq,
        "step": step,
        "token": alternatives(run, seq, step),
        "attention": attention_grid(run, seq, step),
        "lens": lens_column(run, seq, step),
        "head_dla": head_dla(run, seq, step),
    }
