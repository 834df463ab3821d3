"""What is wrong with a run's files, in one line: a Problem (a file relative to the run, and what is
wrong with it) and the message every reader shows for a damaged run. `integrity` finds problems
against the recorded checksums, `parquet_io` and the array reads find them as they read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Problem:
    path: str  # relative to the run directory
    kind: str  # missing | truncated | changed | unreadable | extra

    def __str__(self) -> str:
        return f"{self.path} is {self.kind}"


def damaged_message(run_id: str, problem: Problem | str) -> str:
    return f"run {run_id} is damaged: {problem}; `lmtrace verify {run_id}`"
