"""What the report reads from a run archive, read once and by chunks.

Arrays are read through the reader one block of steps at a time (the archive's own step chunks),
so a report of a long run never holds a whole multi-GB array in memory.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..archive.reader import IncompleteRunWarning, Run, lens_state


def display(text: str) -> str:
    """A token as a person can see it: whitespace made visible, nothing empty."""
    return (text or "").replace("\n", "⏎").replace("\t", "⇥").replace("\r", "␍") or "∅"


@dataclass
class SequenceTokens:
    """One sequence's rows of tokens.parquet, as columns (prompt and generated parts)."""

    prompt_ids: list[int]
    prompt_texts: list[str]
    gen: dict[str, list]  # column -> values over steps 0..n-1 (sorted by step)

    @property
    def n_steps(self) -> int:
        return len(self.gen.get("token_id", []))

    def context_texts(self, n_keys: int) -> list[str]:
        """Texts of key positions 0..n_keys-1: the prompt, then the generated tokens."""
        texts = self.prompt_texts + list(self.gen.get("token_text", []))
        return texts[:n_keys]


class RunData:
    def __init__(self, run: Run):
        self.run = run
        self._tokens: dict[int, SequenceTokens] = {}  # read per sequence shown, once

    @classmethod
    def open(cls, ref, runs_dir=None) -> "RunData":
        from ..archive.reader import open_run

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IncompleteRunWarning)  # the page says so in a banner
            return cls(open_run(ref, runs_dir))

    @property
    def manifest(self) -> dict:
        return self.run.manifest

    @cached_property
    def arrays(self) -> set[str]:
        try:
            return set(self.run.array_names())
        except Exception:  # noqa: BLE001 - `capture: none` runs may have no tensors store at all
            return set()

    @cached_property
    def lens_state(self) -> str:
        return lens_state(self.manifest)

    @cached_property
    def n_sequences(self) -> int:
        return int(self.manifest.get("n_prompts") or len(self.sequences))

    @cached_property
    def sequences(self) -> list[dict]:
        try:
            return sorted(self.run.sequences().to_pylist(), key=lambda r: r["sequence"])
        except Exception:  # noqa: BLE001 - an unfinished run may have no finished batch yet
            return []

    @cached_property
    def committed(self) -> dict[int, int]:
        """sequence -> readable steps (`Run.ready_steps`)."""
        return self.run.ready_steps()

    # The page shows a few sequences: their rows are read, not the whole table (on a 10,000-sequence
    # run the steps table alone is 4.8 million rows).
    def tokens(self, seq: int) -> SequenceTokens:
        if seq not in self._tokens:  # each section asks again
            self._tokens[seq] = self._read_tokens(seq)
        return self._tokens[seq]

    def _read_tokens(self, seq: int) -> SequenceTokens:
        t = self.run.table("tokens", sequences=[seq])
        rows = t.sort_by("position").to_pydict()
        prompt = [i for i, p in enumerate(rows["is_prompt"]) if p]
        gen = [i for i, p in enumerate(rows["is_prompt"]) if not p]
        gen.sort(key=lambda i: rows["step"][i])
        limit = self.committed.get(seq, len(gen))
        gen = gen[:limit]
        return SequenceTokens(
            [rows["token_id"][i] for i in prompt],
            [rows["token_text"][i] for i in prompt],
            {k: [v[i] for i in gen] for k, v in rows.items()},
        )

    @cached_property
    def has_steps(self) -> bool:
        """Whether the run has per-layer rows (not `capture: none`): a complete run's manifest counts
        them, an unfinished run's table is read by one column."""
        rows = (self.manifest.get("table_rows") or {}) if self.run.status == "complete" else {}
        if "steps" in rows:
            return rows["steps"] > 0
        try:
            return self.run.table("steps", columns=["sequence"]).num_rows > 0
        except Exception:  # noqa: BLE001 - capture: none has no steps table
            return False

    def step_columns(self, seq: int) -> dict[str, np.ndarray] | None:
        if not self.has_steps:
            return None
        t = self.run.table("steps", sequences=[seq])
        return {name: t.column(name).to_numpy(zero_copy_only=False) for name in t.column_names}

    @property
    def layers(self) -> list[int]:
        return list((self.manifest.get("shape") or {}).get("layers") or [])

    @property
    def n_heads(self) -> int:
        return int((self.manifest.get("shape") or {}).get("n_heads") or 0)

    def prompt_len(self, seq: int) -> int:
        return int(self.run.prompt_len()[seq])

    def read_steps(self, name: str, seq: int, steps: list[int], index=(), block: int | None = None):
        """Yield (step, values) for `steps` of a per-step array, reading one chunk of steps at a time.

        `index` selects inside a step (e.g. (slice(None), slice(None), slice(0, k)) for attn)."""
        arr = self.run.array(name)
        width = block or arr.chunks[1]
        wanted = sorted(steps)
        i = 0
        while i < len(wanted):
            b0 = (wanted[i] // width) * width
            b1 = b0 + width
            chunk = np.asarray(arr[(seq, slice(b0, min(b1, arr.shape[1])), *index)])
            while i < len(wanted) and wanted[i] < b1:
                yield wanted[i], chunk[wanted[i] - b0]
                i += 1


def stack_steps(data: "RunData", name: str, seq: int, steps: list[int]) -> np.ndarray:
    """A per-step array's values at `steps` of one sequence, stacked: [step, ...]."""
    return np.stack([v for _, v in data.read_steps(name, seq, steps)])


def token_prob(logprob) -> float:
    return math.exp(logprob) if logprob is not None and math.isfinite(logprob) else float("nan")
