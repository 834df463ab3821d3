"""The manifest's tokenizer fingerprint: stable for the same files, and what changes when they change.

The weights' sha256 of a model directory covers only its weight files; a tokenizer edited in place
(another chat template, an added token) would otherwise go unnoticed by the commands that load the
run's model again (`lmtrace lens`, `lmtrace explain`) and by `lmtrace compare`.
"""

from __future__ import annotations

import json
import shutil

from lmtrace.analysis.compare import compare_runs
from tests.helpers.cli import assert_one_line_error, lmtrace
from tests.helpers.runs import PROMPTS, run_spec


def _spec(model_dir) -> dict:
    return {
        "model": str(model_dir),
        "prompts": PROMPTS[:1],
        "generation": {"max_new_tokens": 2},
        "capture": {"layers": [0, 1]},
    }


def test_a_changed_tokenizer_is_recorded_refused_and_compared(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    first = run_spec(tmp_path, _spec(model_dir))
    again = run_spec(tmp_path, _spec(model_dir))
    sha = first.manifest["tokenizer"]["sha256"]
    assert len(sha) == 64 and again.manifest["tokenizer"]["sha256"] == sha  # same files, same fingerprint
    assert not [
        d
        for d in compare_runs(first.id, again.id, runs_dir=tmp_path / "runs").spec_differences
        if d["key"].startswith("tokenizer")
    ]

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # weight files unchanged
    tok.save_pretrained(model_dir)
    changed = run_spec(tmp_path, _spec(model_dir))
    assert changed.manifest["model"]["weights_sha256"] == first.manifest["model"]["weights_sha256"]
    assert changed.manifest["tokenizer"]["sha256"] != sha

    diffs = compare_runs(first.id, changed.id, runs_dir=tmp_path / "runs").spec_differences
    assert {"key": "tokenizer.sha256", "a": sha[:16], "b": changed.manifest["tokenizer"]["sha256"][:16]} in diffs

    # what loads the first run's model again refuses: the tokenizer it was made with is gone
    changed_since = f"changed since run {first.id}"
    assert_one_line_error(lmtrace(tmp_path, "lens", "--quiet", first.id), 1, "the tokenizer of", changed_since)
    assert_one_line_error(
        lmtrace(tmp_path, "intervene", first.id, "--ablate-head", "0.1", "--quiet"),
        1,
        "the tokenizer of",
        changed_since,
    )
    assert len(list((tmp_path / "runs").iterdir())) == 3  # no child run was created
    manifest = json.loads((first.path / "manifest.json").read_text())  # as if it had been interrupted
    (first.path / "manifest.json").write_text(json.dumps({**manifest, "status": "interrupted"}))
    assert_one_line_error(
        lmtrace(tmp_path, "generate", "--resume", first.id, "--quiet"), 1, "the tokenizer of", changed_since
    )
    assert json.loads((first.path / "manifest.json").read_text())["status"] == "interrupted"  # left as it was
    proc = lmtrace(tmp_path, "lens", changed.id)  # the run made with the edited tokenizer still works
    assert proc.returncode == 0, proc.stderr
