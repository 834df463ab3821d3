"""The real CLI as a user runs it (a subprocess): bad input gets ONE `error: ...` line on stderr,
the documented exit code, no traceback, and never a run directory marked `complete`.

Exit codes (lmtrace/exits/errors.py): 2 bad usage / spec / unknown run, 1 the run failed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmtrace.archive.reader import Run
from tests.helpers.cli import REPO, assert_no_complete_run, assert_one_line_error, lmtrace, write

DEMO = REPO / "configs" / "demo.yaml"


# ---- bad specs: caught before torch is imported or a model loaded (about a second each) ------------
SPEC_CASES = {
    "malformed_yaml": (
        "prompts: [hi]\ngeneration:\n  seed: 1\n  top_k: a: b\n",
        [],
        ["spec.yaml: malformed YAML at line 4, column 11", "indentation"],
    ),
    "unknown_key": (
        "prompts: [hi]\ngeneration:\n  max_new_tokenz: 3\n",
        [],
        ["generation.max_new_tokenz: unknown key", "did you mean 'max_new_tokens'"],
    ),
    "wrong_type": ("prompts: [hi]\ngeneration:\n  top_k: abc\n", [], ["generation.top_k:", "integer", "'abc'"]),
    "out_of_range": (
        "prompts: [hi]\ngeneration:\n  top_p: 2\n",
        [],
        ["generation.top_p:", "less than or equal to 1", "(got 2)"],
    ),
    "missing_prompt_file": ("prompts:\n  file: missing.txt\n", [], ["prompts.file:", "missing.txt does not exist"]),
    "empty_prompt_list": ("prompts: []\n", [], ["prompts.texts is empty", "at least one prompt"]),
    "empty_prompt_file": ("prompts:\n  file: empty.txt\n", [], ["empty.txt contains no prompts", "add at least one"]),
    "set_without_equals": (
        "prompts: [hi]\n",
        ["--set", "generation.seed"],
        ["--set 'generation.seed': expected KEY=VALUE", "--set generation.seed=3"],
    ),
    "bad_set_value": ("prompts: [hi]\n", ["--set", "generation.top_k=-1"], ["generation.top_k:", "(got -1)"]),
}


@pytest.mark.parametrize("case", SPEC_CASES)
def test_bad_spec_is_one_line_exit_2(tmp_path, case):
    text, extra, fragments = SPEC_CASES[case]
    write(tmp_path / "spec.yaml", text)
    write(tmp_path / "empty.txt", "\n   \n\n")
    proc = lmtrace(tmp_path, "generate", "spec.yaml", *extra)
    assert_one_line_error(proc, 2, *fragments)
    assert not (tmp_path / "runs").exists()


def test_missing_spec_file(tmp_path):
    proc = lmtrace(tmp_path, "generate", "nope.yaml")
    assert_one_line_error(proc, 2, "nope.yaml", "spec file not found")
    proc = lmtrace(tmp_path, "validate", "nope.yaml")
    assert_one_line_error(proc, 2, "nope.yaml", "spec file not found")


def test_usage_errors_are_one_line_too(tmp_path):
    assert_one_line_error(lmtrace(tmp_path, "show"), 2, "Missing argument 'run'", "show --help")
    assert_one_line_error(lmtrace(tmp_path, "generate"), 2, "SPEC")
    assert_one_line_error(lmtrace(tmp_path, "generate", "x.yaml", "--bogus"), 2, "No such option: --bogus")


# ---- bad model references and runs directories: caught before loading any weights ---------------
def test_unknown_embedded_model(tmp_path):
    write(tmp_path / "spec.yaml", "model: embedded:nope\nprompts: [hi]\n")
    assert_one_line_error(
        lmtrace(tmp_path, "generate", "spec.yaml"), 2, "unknown embedded model 'nope'", "embedded:smollm2-135m"
    )


def test_nonexistent_local_model_path(tmp_path):
    write(tmp_path / "spec.yaml", "model: ./models/missing-checkpoint\nprompts: [hi]\n")
    assert_one_line_error(
        lmtrace(tmp_path, "generate", "spec.yaml"), 2, "./models/missing-checkpoint does not exist", "config.json"
    )


def test_hub_id_not_in_the_local_cache_is_never_downloaded(tmp_path):
    write(tmp_path / "spec.yaml", "model: lmtrace-tests/not-a-cached-model\nprompts: [hi]\n")
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "hf-home" / "hub")}
    line = assert_one_line_error(
        lmtrace(tmp_path, "generate", "spec.yaml", env=env),
        1,
        "'lmtrace-tests/not-a-cached-model'",
        "not in the local Hugging Face cache",
        "never downloads",
    )
    assert "download it first" in line
    assert not (tmp_path / "runs").exists()


def test_layer_out_of_range_names_the_valid_range(tmp_path):
    write(tmp_path / "spec.yaml", "prompts: [hi]\ngeneration: {max_new_tokens: 2}\ncapture:\n  layers: [0, 99]\n")
    proc = lmtrace(tmp_path, "generate", "spec.yaml")
    assert_one_line_error(proc, 2, "capture.layers: [99] out of range", "0..29")
    assert_no_complete_run(tmp_path / "runs")
    assert not (tmp_path / "runs").exists()  # checked before the model loads: no run directory at all


def test_runs_dir_that_cannot_be_created(tmp_path):
    # a path below a regular file cannot be created even by root (chmod would not stop root)
    write(tmp_path / "some_file", "not a directory\n")
    write(tmp_path / "spec.yaml", "prompts: [hi]\n")
    proc = lmtrace(tmp_path, "generate", "spec.yaml", "--runs-dir", "some_file/runs")
    assert_one_line_error(
        proc, 2, "runs directory some_file/runs cannot be created", "some_file is a file", "--runs-dir"
    )
    proc = lmtrace(tmp_path, "ls", "--runs-dir", "some_file")
    assert_one_line_error(proc, 2, "some_file is not a directory")


def test_model_that_fails_to_load_is_exit_1_and_leaves_no_complete_run(tmp_path):
    ckpt = tmp_path / "ckpt"  # a config but neither weights nor tokenizer
    write(
        ckpt / "config.json",
        json.dumps({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8}),
    )
    write(tmp_path / "spec.yaml", "model: ./ckpt\nprompts: [hi]\n")
    proc = lmtrace(tmp_path, "generate", "spec.yaml", "--quiet")
    assert_one_line_error(proc, 1, "cannot load model")
    assert_no_complete_run(tmp_path / "runs")


# ---- ls / show ----------------------------------------------------------------------------------
def test_show_unknown_run(tmp_path):
    (tmp_path / "runs").mkdir()
    proc = lmtrace(tmp_path, "show", "nonexistent-run")
    assert_one_line_error(proc, 2, "no run 'nonexistent-run'", "lmtrace ls")


def test_ls_of_an_empty_runs_directory_succeeds(tmp_path):
    (tmp_path / "runs").mkdir()
    proc = lmtrace(tmp_path, "ls")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "no runs in" in proc.stdout
    (tmp_path / "empty").mkdir()
    proc = lmtrace(tmp_path, "ls", "--json", "--runs-dir", "empty")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


@pytest.fixture(scope="module")
def one_run(tmp_path_factory, tiny_llama_dir) -> Path:
    """A runs directory holding one complete run `a` of the tiny model."""
    from tests.helpers.runs import run_spec

    base = tmp_path_factory.mktemp("one_run")
    run_spec(
        base,
        {
            "model": str(tiny_llama_dir),
            "prompts": ["Hello there"],
            "output": {"run_id": "a"},
            "generation": {"max_new_tokens": 3, "batch_size": 1},
        },
    )
    return base / "runs"


# every command that takes --runs-dir and reads runs from it (generate creates its runs directory)
READING_COMMANDS = {
    "ls": ["ls"],
    "show": ["show", "a"],
    "verify": ["verify", "a"],
    "query": ["query", "SELECT count(*) AS n FROM tokens"],
    "explain": ["explain", "a", "--steps", "0"],
    "lens": ["lens", "a"],
    "heads": ["heads", "a"],
    "stats": ["stats", "a"],
    "compare": ["compare", "a", "a"],
    "report": ["report", "a"],
    "serve": ["serve", "--port", "0"],
    "intervene": ["intervene", "a", "--ablate-head", "0.0"],
    "sweep": ["sweep", "a", "--over", "heads"],
    "generate --resume": ["generate", "--resume", "a"],
}


@pytest.mark.parametrize("args", READING_COMMANDS.values(), ids=READING_COMMANDS.keys())
def test_a_runs_dir_that_does_not_exist_is_refused_by_every_reading_command(tmp_path, one_run, args):
    # the flag is mistyped; $LMTRACE_RUNS_DIR holds the run, so the flag alone is what is wrong
    proc = lmtrace(tmp_path, *args, "--runs-dir", "rnus", env={"LMTRACE_RUNS_DIR": str(one_run)}, timeout=60)
    assert_one_line_error(proc, 2, "runs directory rnus does not exist", "--runs-dir")
    assert not (tmp_path / "rnus").exists()


@pytest.mark.parametrize(
    "args", [READING_COMMANDS["ls"], READING_COMMANDS["query"], READING_COMMANDS["show"]], ids=["ls", "query", "show"]
)
def test_a_runs_dir_from_the_environment_that_does_not_exist_is_refused(tmp_path, args):
    proc = lmtrace(tmp_path, *args, env={"LMTRACE_RUNS_DIR": str(tmp_path / "rnus")}, timeout=60)
    assert_one_line_error(proc, 2, f"runs directory {tmp_path / 'rnus'} does not exist ($LMTRACE_RUNS_DIR)")


def test_generate_creates_a_runs_dir_that_does_not_exist(tmp_path, tiny_llama_dir):
    write(
        tmp_path / "spec.yaml",
        json.dumps({"model": str(tiny_llama_dir), "prompts": ["hi"], "generation": {"max_new_tokens": 2}}),
    )
    proc = lmtrace(tmp_path, "generate", "spec.yaml", "--runs-dir", "new/runs", "--run-id", "first", "-q")
    assert proc.returncode == 0, proc.stderr
    assert Run(tmp_path / "new" / "runs" / "first").manifest["status"] == "complete"


# ---- success paths ----------------------------------------------------------------------------
def test_validate_demo_prints_resolved_spec_without_loading_weights(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    proc = lmtrace(tmp_path, "validate", str(DEMO), env={"LMTRACE_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    assert "ref: embedded:smollm2-135m" in out and "max_new_tokens: 24" in out and "chat: true" in out
    estimate = out.strip().splitlines()[-1]
    assert estimate.startswith("# 2 prompt(s), up to 24 new tokens each, 30 of 30 layers captured; archive at most ~")
    assert not (cache / "models").exists()  # no converted weights: nothing was loaded
    assert not (tmp_path / "runs").exists()


def test_validate_on_an_80_column_terminal_wraps_its_estimate_into_comment_lines(tmp_path):
    """stdout a terminal (a pseudo-terminal) 80 columns wide: the estimate is wrapped at word breaks,
    every line a YAML comment no wider than the terminal."""
    import pty

    main, side = pty.openpty()
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lmtrace.cli", "validate", str(DEMO)],
        stdout=side,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    os.close(side)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the terminal's other side is closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert proc.returncode == 0, proc.stderr
    lines = b"".join(chunks).decode().replace("\r\n", "\n").splitlines()
    comment = lines[lines.index(next(x for x in lines if x.startswith("# 2 prompt(s)"))) :]
    assert len(comment) >= 2 and all(x.startswith("# ") and len(x) <= 80 for x in comment), comment
    assert " ".join(x[2:] for x in comment).startswith(
        "# 2 prompt(s), up to 24 new tokens each, 30 of 30 layers captured; archive at most ~"[2:]
    )


def test_generate_then_ls_and_show(tmp_path):
    runs = tmp_path / "myruns"
    proc = lmtrace(
        tmp_path,
        "generate",
        str(DEMO),
        "--set",
        "generation.max_new_tokens=4",
        "--set",
        "generation.seed=3",
        "--set",
        "model.device=cpu",
        "--json",
        "--runs-dir",
        str(runs),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["status"] == "complete" and summary["sequences"] == 2
    run_id = summary["run_id"]

    manifest = json.loads((runs / run_id / "manifest.json").read_text())
    resolved = manifest["spec_resolved"]
    assert manifest["status"] == "complete"
    assert resolved["generation"]["seed"] == 3 and manifest["seed"] == 3
    assert resolved["generation"]["max_new_tokens"] == 4
    assert resolved["model"]["device"] == "cpu" and manifest["device"] == "cpu"
    assert resolved["capture"]["residual"]["vectors_at"] == [0, 15, 29]  # the rest of the demo spec

    proc = lmtrace(tmp_path, "ls", "--json", "--runs-dir", str(runs))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["run_id"], r["status"], r["tokens"]) for r in rows] == [
        (run_id, "complete", summary["generated_tokens"])
    ]

    proc = lmtrace(tmp_path, "show", run_id[:15], "--runs-dir", str(runs))  # a unique prefix is enough
    assert proc.returncode == 0, proc.stderr
    assert f"run {run_id}" in proc.stdout and "status: complete" in proc.stdout
    assert "seed=3" in proc.stdout
    texts = Run(runs / run_id).sequences().column("generated_text").to_pylist()
    assert len(texts) == 2 and all(t.strip() for t in texts)
    plain = re.sub(r"\[[0-9.e+-]+\]", "", proc.stdout)  # piped: each token is followed by [probability]
    for text in texts:
        assert text.strip() in plain


@pytest.mark.parametrize("args", [["lens", "any-run"], ["compare", "a", "b", "--exact"]], ids=["lens", "compare"])
def test_a_bad_device_is_refused_in_one_line_before_any_run_is_read(tmp_path, args):
    """As explain does: the choices named, exit 2, not a cut pydantic message after reading the runs."""
    assert_one_line_error(lmtrace(tmp_path, *args, "--device", "bogus"), 2, "--device 'bogus'", "cpu, cuda, cuda:N")
