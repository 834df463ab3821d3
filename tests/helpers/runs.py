"""Runs made in-process for tests: a spec run with tmp_path's runs directory, the deferred lens
computed on it, and checksums recorded again after a test edits a run on purpose."""

from __future__ import annotations

from pathlib import Path

from lmtrace.archive.reader import Run
from lmtrace.runner.generation import run_generate
from lmtrace.spec.run_spec import build_spec

PROMPTS = ["The quick brown fox", "Paris is the capital of", "One, two, three, four, five, six, seven,"]


def run_spec(tmp_path: Path, data: dict) -> Run:
    data = dict(data)
    data.setdefault("output", {})
    data["output"] = {"runs_dir": str(tmp_path / "runs"), **data["output"]}
    spec = build_spec(data, "test-spec")
    import yaml

    result = run_generate(spec, yaml.safe_dump(data))
    return Run(result.run_dir)


def rerecord_checksums(path: Path) -> None:
    """After a test has edited a complete run's files on purpose (a hand-made archive, not a damaged
    one): record their checksums again, as the writer does at completion."""
    import json

    from lmtrace.archive.integrity import record

    manifest = json.loads((Path(path) / "manifest.json").read_text())
    manifest["checksums"] = record(Path(path))
    (Path(path) / "manifest.json").write_text(json.dumps(manifest))


def with_lens(run: Run) -> Run:
    """The run after `lmtrace lens` (the deferred logit lens, the default), reopened.

    Checks it really was deferred and pending, so a test that reads lens arrays through this
    helper exercises lmtrace/deferred_lens.py, not the inline lens."""
    from lmtrace.archive.reader import lens_state
    from lmtrace.commands.lens import compute_lens

    assert run.manifest["lens"]["when"] == "deferred" and lens_state(run.manifest) == "pending", run.manifest["lens"]
    assert compute_lens(run)["computed"] is True
    run = Run(run.path)
    assert lens_state(run.manifest) == "ready" and run.manifest["lens"]["computed"]["by"] == "lmtrace lens"
    return run
