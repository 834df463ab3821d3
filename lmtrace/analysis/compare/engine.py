"""`compare_runs`: two run archives -> a `Comparison`. Reads the archives only (no model) unless
`exact`; walks the sequence pairs, finds each pair's first divergence, fills the per-step,
per-layer and per-head tables, ranks layers and heads and states the verdict.

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

import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa

from ...archive.reader import IncompleteRunWarning, Run, open_run
from ...exits.errors import ArchiveError, SpecError
from .layer_figures import HEAD_FIELDS, LAYER_FIELDS, concat_columns, pair_layer_figures, typed_table
from .pair_summary import summarise_pair
from .pairing import PAIRING_MODES, compatibility, pair_sequences, spec_differences
from .ranking import rank_heads, rank_layers
from .result import Comparison
from .sides import Side, load_side
from .step_rows import STEP_FIELDS, pair_step_rows
from .verdict import verdict_line


def run_info(side: Side) -> dict:
    """What the summary says about one run: id, path, status, model, parent and generation settings."""
    m = side.run.manifest
    gen = (m.get("spec_resolved") or {}).get("generation") or {}
    return {
        "run_id": side.run.id,
        "path": str(side.run.path),
        "status": side.run.status,
        "model": (m.get("model") or {}).get("reference"),
        "parent": m.get("parent"),
        "sequences": side.n_seq,
        "generation": {k: gen.get(k) for k in ("max_new_tokens", "temperature", "top_k", "top_p", "seed")},
    }


def _side_run(label: str, run, runs_dir, allow_incomplete: bool) -> Run:
    """A `Run` reader as given, or opened from a run id, id prefix or directory (through `archive.reader.open_run`);
    an unfinished run is refused unless `allow_incomplete`."""
    if not isinstance(run, Run):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IncompleteRunWarning)
            run = open_run(str(run), runs_dir)
    if run.status != "complete" and not allow_incomplete:
        raise ArchiveError(
            f"run {label} ({run.id}) is {run.status}, not complete; pass --allow-incomplete to "
            f"compare the steps it committed"
        )
    return run


def _first_divergence(A: Side, B: Side, sa: int, sb: int) -> tuple[bool, int | None, str | None, int, str | None]:
    """(same prompt ids, first divergence step, its kind 'token' | 'length', number of paired steps, note) of a pair."""
    ga, gb = A.gen.get(sa), B.gen.get(sb)
    na, nb = A.n_steps(sa), B.n_steps(sb)
    pid_a, pid_b = A.prompt_ids.get(sa), B.prompt_ids.get(sb)
    same_prompt = pid_a is not None and pid_a == pid_b
    n_min = min(na, nb)
    if not same_prompt:
        return (
            False,
            None,
            None,
            0,
            (
                "prompt token ids differ (different prompt or chat rendering): the contexts are never identical"
                if pid_a is not None and pid_b is not None
                else "no archived prompt tokens on one side"
            ),
        )
    diff = np.flatnonzero(ga["token_id"][:n_min] != gb["token_id"][:n_min]) if n_min else np.array([], int)
    if diff.size:
        return True, int(diff[0]), "token", int(diff[0]) + 1, None
    if na != nb:
        shorter_finished = A.finished(sa) if na < nb else B.finished(sb)
        if shorter_finished:
            return True, n_min, "length", n_min, None
        return (
            True,
            None,
            None,
            n_min,
            (f"no divergence in the {n_min} steps both archives hold (one archive is incomplete)"),
        )
    return True, None, None, na, None


def _walk_pairs(A: Side, B: Side, pairing: dict, layers) -> tuple[list, list, list, list]:
    """(pair summaries, per-step rows, per-layer column parts, per-head column parts) of every sequence pair:
    each pair's first divergence, its step rows and, over its paired steps, its layer and head figures."""
    pair_summaries, step_rows, layer_parts, head_parts = [], [], [], []
    for k, (sa, sb) in enumerate(pairing["pairs"]):
        ga, gb = A.gen.get(sa), B.gen.get(sb)
        na, nb = A.n_steps(sa), B.n_steps(sb)
        same_prompt, first, kind, n_paired, pair_note = _first_divergence(A, B, sa, sb)
        rows = pair_step_rows(k, sa, sb, ga, gb, na, nb, same_prompt, first, kind)
        step_rows.extend(rows)
        if n_paired and layers:
            same_top2 = np.asarray(
                [bool(np.array_equal(ga["alt_ids"][s][:2], gb["alt_ids"][s][:2])) for s in range(n_paired)]
            )
            cols, heads = pair_layer_figures(k, A, B, sa, sb, n_paired, layers, same_top2)
            layer_parts.append(cols)
            head_parts.append(heads)
        pair_summaries.append(
            summarise_pair(k, A, B, sa, sb, pairing["method"], rows, first, kind, n_paired, same_prompt, pair_note)
        )
    return pair_summaries, step_rows, layer_parts, head_parts


def compare_runs(
    run_a: Run | str | Path,
    run_b: Run | str | Path,
    *,
    runs_dir: str | Path | None = None,
    allow_incomplete: bool = False,
    pair: str = "auto",
    exact: bool = False,
    exact_steps: str | None = None,
    device: str | None = None,
    note=lambda text: None,
) -> Comparison:
    """Compare two runs: `Run` readers, or run ids, id prefixes or directories (ids are looked up in `runs_dir`).
    Reads only the archives and loads no model, unless `exact`: then each side's model (loaded once when both
    runs share it) rescores the paired contexts. `note(text)` receives progress messages (--exact's loading)."""
    if pair not in PAIRING_MODES:
        raise SpecError(f"--pair must be one of {', '.join(PAIRING_MODES)} (got {pair!r})")
    A = load_side("A", _side_run("A", run_a, runs_dir, allow_incomplete))
    B = load_side("B", _side_run("B", run_b, runs_dir, allow_incomplete))
    compat = compatibility(A, B)
    notes = list(compat["notes"])
    for side in (A, B):
        if side.run.status != "complete":
            notes.append(f"run {side.label} is {side.run.status}: only its committed steps are compared")
    pairing = pair_sequences(A.prompt_text, B.prompt_text, pair)
    pair_summaries, step_rows, layer_parts, head_parts = _walk_pairs(A, B, pairing, compat["common_layers"])

    if exact:
        from .exact import exact_figures

        notes.append(exact_figures(A, B, pairing["pairs"], step_rows, exact_steps, device, note)["note"])
    elif step_rows:
        notes.append(
            "KL/JS are over the stored top-k + one tail bucket: lower bounds of the full-vocabulary values "
            "(--exact rescores the paired contexts with the models for exact figures)"
        )
    per_step = (
        pa.Table.from_pylist(step_rows, schema=pa.schema(STEP_FIELDS))
        if step_rows
        else pa.schema(STEP_FIELDS).empty_table()
    )
    per_layer = typed_table(LAYER_FIELDS, concat_columns(layer_parts))
    per_head = typed_table(HEAD_FIELDS, concat_columns(head_parts))
    ranked_layers = rank_layers(per_layer)
    ranked_heads = rank_heads(per_head)
    changed = [r["layer"] for r in ranked_layers if r["changed"]]
    first_changed = min(changed) if changed else None

    identical, verdict = verdict_line(pairing, pair_summaries, step_rows, first_changed)
    return Comparison(
        run_info(A),
        run_info(B),
        compat,
        spec_differences(A.run.manifest, B.run.manifest),
        pairing,
        pair_summaries,
        per_step,
        per_layer,
        per_head,
        ranked_layers,
        ranked_heads,
        first_changed,
        identical,
        verdict,
        notes,
    )
