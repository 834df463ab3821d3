"""One side of a comparison: what a run archive holds, read per sequence (prompt ids, the committed
generated steps with their stored distributions, the per-layer table).

An unfinished run contributes only the steps it committed, so figures never read a half-written block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...archive.reader import Run
from ...exits.errors import ArchiveDamaged, ArchiveError


@dataclass
class Side:
    """A run as side A or B of a comparison, its tokens split per sequence."""

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


def column_array(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False)


def list_matrix(table: pa.Table, name: str) -> np.ndarray:
    """A list column whose lists all have the same length k, as an [rows, k] array."""
    col = table.column(name).combine_chunks()
    flat = col.flatten().to_numpy(zero_copy_only=False)
    n = len(col)
    return flat.reshape(n, len(flat) // n if n else 0)


def _read_optional(read):
    """`read()`, or None when the archive lacks that file (a damaged archive still raises)."""
    try:
        return read()
    except ArchiveDamaged:
        raise
    except ArchiveError:
        return None


def _prompt_texts(m: dict, seq_rows: dict[int, dict], n_seq: int) -> list[str | None]:
    """Each sequence's prompt text: from sequences.parquet, else the spec's inline texts, else None."""
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
    return prompt_text


def _committed_limits(run: Run) -> dict[int, int]:
    """sequence -> number of steps an unfinished run committed (the reader's one count, `Run.ready_steps`);
    empty (everything) for a complete run."""
    return {} if run.status == "complete" else run.ready_steps()


def _generated_columns(run: Run, tokens: pa.Table, limit: dict[int, int]) -> dict[int, dict]:
    """sequence -> its generated steps' columns, cut to the committed steps in `limit`."""
    is_prompt = tokens.column("is_prompt")
    g = tokens.filter(pc.invert(is_prompt)).sort_by([("sequence", "ascending"), ("step", "ascending")])
    cols = {
        c: column_array(g, c)
        for c in (
            "sequence",
            "step",
            "token_id",
            "logprob",
            "sampling_logprob",
            "entropy",
            "margin",
            "greedy_id",
            "is_eos",
        )
    }
    cols["token_text"] = np.asarray(g.column("token_text").to_pylist(), dtype=object)
    cols["alt_ids"] = list_matrix(g, "alt_ids")
    cols["alt_logprobs"] = list_matrix(g, "alt_logprobs")
    seqs = cols.pop("sequence")
    gen: dict[int, dict] = {}
    for s in np.unique(seqs):
        sel = seqs == s
        if int(s) in limit:
            sel &= cols["step"] < limit[int(s)]
        d = {k: v[sel] for k, v in cols.items()}
        n = len(d["step"])
        if n and not np.array_equal(d["step"], np.arange(n)):
            raise ArchiveError(
                f"run {run.id}: sequence {int(s)} has non-contiguous steps in tokens.parquet; the archive is damaged"
            )
        gen[int(s)] = d
    return gen


def load_side(label: str, run: Run) -> Side:
    """Read what the comparison needs of `run` (a reader): every committed step of every sequence."""
    m = run.manifest
    n_seq = int(m.get("n_prompts") or m["shape"]["n_sequences"])
    seq_rows = _read_optional(run.sequences)
    seq_rows = {} if seq_rows is None else {int(r["sequence"]): r for r in seq_rows.to_pylist()}
    prompt_text = _prompt_texts(m, seq_rows, n_seq)
    limit = _committed_limits(run)  # steps an unfinished run committed; all of a complete run
    tokens = _read_optional(run.tokens)
    prompt_ids: dict[int, tuple[int, ...]] = {}
    gen: dict[int, dict] = {}
    token_text: dict[int, str] = {}
    if tokens is not None and tokens.num_rows:
        token_text = dict(zip(column_array(tokens, "token_id").tolist(), tokens.column("token_text").to_pylist()))
        prompt = tokens.filter(tokens.column("is_prompt")).sort_by(
            [("sequence", "ascending"), ("position", "ascending")]
        )
        pseq, pid = column_array(prompt, "sequence"), column_array(prompt, "token_id")
        for s in np.unique(pseq):
            prompt_ids[int(s)] = tuple(int(x) for x in pid[pseq == s])
        gen = _generated_columns(run, tokens, limit)
    steps = _read_optional(run.steps)  # capture: none, or no committed block yet
    return Side(label, run, n_seq, prompt_text, prompt_ids, gen, seq_rows, steps, token_text)
