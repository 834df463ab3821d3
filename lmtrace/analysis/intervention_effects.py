"""What an intervention changed, step by step: effects.parquet, one row per sequence and child step.

Each row: the parent's token, the child's top-1, logprob of the parent's token before (archived)
and after (child), margin shift, KL(parent || child) on the tokens both archives store at the step
plus one tail bucket (`analysis.compare.stored_kl`, the KL `compare` reports), and whether the
winner changed; the four token ids also as text (`parent_token_text`, ..., from the child's
vocab.parquet). The comparisons are only meaningful on the parent's own context: they are null once
the child's tokens differ from the parent's.

`EffectsRecorder` collects the rows while `lmtrace intervene` runs the child; `summarize` is the
per-sequence summary the command prints and returns.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..archive import parquet_io
from ..archive.files import atomic_write_parquet
from ..archive.layout import EFFECTS
from ..archive.reader import Vocabulary
from ..runner.parent import ParentView
from .compare import stored_kl, stored_logprobs
from .compare.values import finite

# A finished batch's effects rows, until the child completes (a resumed child skips finished batches)
EFFECTS_PARTS = "effects.parts"
TEXT_COLUMNS = ("parent_token", "child_token", "child_top1", "parent_top1")  # ids that get a `_text` column
EFFECTS_SCHEMA = pa.schema(
    [(c, pa.int64()) for c in ("sequence", "step")]
    + [("context_identical", pa.bool_())]
    + [(c, pa.int64()) for c in ("parent_token", "child_token", "child_top1", "parent_top1")]
    + [
        (c, pa.float64())
        for c in (
            "parent_logprob",
            "child_logprob_of_parent_token",
            "logprob_shift",
            "parent_margin",
            "child_margin",
            "margin_shift",
            "kl_parent_child_topk",
        )
    ]
    + [("winner_changed", pa.bool_())]
)


class EffectsRecorder:
    """A StepSink collecting one effects row per active sequence and step; each finished batch's rows
    go to effects.parts/ (`batch_done`), and `write` joins them into effects.parquet."""

    def __init__(self, parent: ParentView):
        self.p = parent
        self.rows: dict[str, list] = {f.name: [] for f in EFFECTS_SCHEMA}  # the current batch's
        self.diverged: dict[int, bool] = {}
        self.final: pa.Table | None = None

    def on_step(self, r) -> None:
        c = r.choice
        seq_ids = r.seq_ids
        for b in np.flatnonzero(r.active):
            seq, step = seq_ids[b], r.step
            have_parent = step < len(self.p.generated[seq])
            identical = not self.diverged.get(seq, False) and have_parent
            parent_tok = self.p.generated[seq][step] if have_parent else None
            child_tok = int(c.token[b])
            ref = c.ref_logprobs[b].numpy() if c.ref_logprobs is not None else None
            after = float(ref[0]) if have_parent and ref is not None else None
            before = self.p.logprob[seq][step] if have_parent else None
            # KL(parent ‖ child) from what the two archives store at this step, as `compare` computes it
            kl = (
                finite(
                    stored_kl(
                        stored_logprobs(
                            self.p.alts[seq][step],
                            self.p.alt_logprobs[seq][step],
                            parent_tok,
                            self.p.logprob[seq][step],
                        ),
                        stored_logprobs(
                            c.alt_ids[b].tolist(), c.alt_logprobs[b].tolist(), child_tok, float(c.logprob[b])
                        ),
                    )
                )
                if have_parent and identical
                else None
            )
            values = {
                "sequence": seq,
                "step": step,
                "context_identical": identical,
                "parent_token": parent_tok,
                "child_token": child_tok,
                "child_top1": int(c.greedy_token[b]),
                "parent_top1": self.p.greedy[seq][step] if have_parent else None,
                "parent_logprob": before,
                "child_logprob_of_parent_token": after if identical else None,
                # the comparisons below are only meaningful on the parent's own context: null once it differs
                "logprob_shift": after - before if identical and after is not None and before is not None else None,
                "parent_margin": self.p.margin[seq][step] if have_parent else None,
                "child_margin": float(c.margin[b]),
                "margin_shift": float(c.margin[b]) - self.p.margin[seq][step] if identical else None,
                "kl_parent_child_topk": kl,
                "winner_changed": int(c.greedy_token[b]) != self.p.greedy[seq][step] if identical else None,
            }
            for k, v in values.items():
                self.rows[k].append(v)
            if parent_tok is None or child_tok != parent_tok:
                self.diverged[seq] = True

    def batch_done(self, run_dir: Path, batch: int) -> None:
        """Keep a finished batch's rows in effects.parts/ (written whole or not at all), before the
        batch is committed: a resumed child skips it, and replays an unfinished one from step 0."""
        parts = run_dir / EFFECTS_PARTS
        parts.mkdir(exist_ok=True)
        atomic_write_parquet(pa.table(self.rows, schema=EFFECTS_SCHEMA), parts / f"batch-{batch:06d}.parquet")
        self.rows = {f.name: [] for f in EFFECTS_SCHEMA}

    def batch_abandoned(self, seq_ids: list[int]) -> None:
        """A batch that ran out of memory is run again as halves, each from step 0 (replayed): drop its rows."""
        self.rows = {f.name: [] for f in EFFECTS_SCHEMA}
        for seq in seq_ids:
            self.diverged.pop(seq, None)

    def write(self, run_dir: Path) -> None:
        """effects.parquet from the batches' rows, with the text of each id column (`<column>_text`,
        null where the id is) from the child's own vocabulary (generate wrote it first)."""
        parts = run_dir / EFFECTS_PARTS
        files = sorted(parts.glob("batch-*.parquet")) if parts.is_dir() else []
        if not files and (run_dir / EFFECTS).is_file():  # a finalisation killed after it wrote it
            self.final = parquet_io.read_table(run_dir / EFFECTS)
            return
        table = pa.concat_tables([parquet_io.read_table(f) for f in files]) if files else EFFECTS_SCHEMA.empty_table()
        vocabulary = Vocabulary.read(run_dir)
        for col in TEXT_COLUMNS:
            ids = table.column(col).to_pylist()
            texts = vocabulary.text([-1 if i is None else i for i in ids])
            table = table.append_column(
                f"{col}_text", pa.array([None if i is None else x for i, x in zip(ids, texts)], pa.string())
            )
        atomic_write_parquet(table, run_dir / EFFECTS)
        shutil.rmtree(parts, ignore_errors=True)
        self.final = table

    def table(self) -> pa.Table:
        """effects.parquet's table, once `write` has written it."""
        return self.final


def summarize(effects) -> dict:
    """Per sequence: first step whose chosen token differs from the parent's, and the largest effects."""
    out = []
    for seq, e in effects.groupby("sequence"):
        changed = e[e.child_token != e.parent_token]
        same = e[e.context_identical]
        first = changed.sort_values("step").iloc[0] if len(changed) else None
        out.append(
            {
                "sequence": int(seq),
                "first_divergence_step": int(first.step) if first is not None else None,
                "first_divergence": (
                    None
                    if first is None or "parent_token_text" not in e
                    else {"parent": first.parent_token_text, "child": first.child_token_text}
                ),
                "winner_changes": int(same.winner_changed.fillna(False).sum()),
                "mean_logprob_shift": float(same.logprob_shift.mean()) if len(same) else None,
                "max_kl_topk": float(same.kl_parent_child_topk.max()) if len(same) else None,
            }
        )
    return {"sequences": out}
