"""A run that `generate`'s worker processes write (commands/workers.py), followed from disk by the
command that started them: its progress for the CLI's bar or lines while they run, then what the run
came to, reported as a run in one process is."""

from __future__ import annotations

import json
from pathlib import Path


class RunFollower:
    """A run its workers write, followed from disk for one process's progress callbacks (the CLI's bar
    or lines, as for a run in one process): `start` once the manifest exists, with the run's sequences
    and steps, the sequences a resume finds done, then each batch the log gains (`batch_done`: its
    sequences and tokens). `fresh`: the run did not exist before the workers started, so every batch
    in its log is theirs."""

    def __init__(self, run_dir: Path, progress, *, fresh: bool):
        self.run_dir, self.progress, self.fresh = run_dir, progress, fresh
        self.offset: int | None = None  # bytes of the log read; None until the run has a manifest
        self.partial = b""

    def poll(self) -> None:
        from ..archive import layout

        if self.offset is None and not self._start():
            return
        try:
            with (self.run_dir / layout.LOG).open("rb") as fh:
                fh.seek(self.offset)
                data = self.partial + fh.read()
        except OSError:
            return
        self.offset += len(data) - len(self.partial)
        *lines, self.partial = data.split(b"\n")  # a line being written waits for its end
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "batch_done":
                tokens = int(event.get("tokens") or 0)
                self.progress.advance(tokens)
                self.progress.sequences_done(len(event.get("sequences") or []), tokens)

    def _start(self) -> bool:
        from ..archive import layout
        from ..archive.batch_plan import sequences_done
        from ..archive.runs import read_manifest

        try:
            m = read_manifest(self.run_dir)
            done = 0 if self.fresh else sequences_done(self.run_dir, m)
            log = self.run_dir / layout.LOG
            self.offset = 0 if self.fresh or not log.exists() else log.stat().st_size
        except Exception:  # noqa: BLE001 - not written yet (or being replaced): the next poll looks again
            return False
        shape = m.get("shape") or {}
        self.progress.start(shape.get("n_sequences") or m.get("n_prompts") or 0, shape.get("n_steps") or 0)
        if done:
            self.progress.sequences_done(done, None)
        return True


def run_result(run_dir: Path, seconds: float):
    """What a run its workers wrote came to, as one process's `generate` reports it: status,
    sequences, tokens, the seconds since the workers started, and the generated texts."""
    import warnings

    from ..archive.reader import IncompleteRunWarning, open_run
    from ..runner.generation import GenerateResult

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        run = open_run(run_dir)
    m = run.manifest
    texts: list[str] = []
    if m.get("status") == "complete":
        rows = run.sequences().select(["sequence", "generated_text"]).to_pylist()
        texts = [r["generated_text"] for r in sorted(rows, key=lambda r: r["sequence"])]
    return GenerateResult(
        run_id=run.id,
        run_dir=run_dir,
        status=m.get("status", "unknown"),
        n_sequences=int(m.get("n_prompts") or 0),
        n_tokens=int(m.get("n_generated_tokens") or 0),
        seconds=seconds,
        texts=texts,
    )
