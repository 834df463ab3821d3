"""lmtrace's CLI run as a user runs it: a subprocess with its own runs directory and no network,
and the checks of what a user sees (one `error: ...` line, no complete run left, help as POSIX usage)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def lmtrace(tmp_path: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m lmtrace.cli ARGS` in tmp_path, runs under tmp_path/runs, never touching the network."""
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "LMTRACE_RUNS_DIR": str(tmp_path / "runs"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "lmtrace.cli", *args],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one stderr line, got:\n{proc.stderr}"
    line = lines[0]
    assert line.startswith("error: "), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    assert proc.returncode == code, (proc.returncode, line)
    return line


def assert_no_complete_run(runs: Path) -> None:
    for manifest in runs.glob("*/manifest.json"):
        assert json.loads(manifest.read_text()).get("status") != "complete", manifest


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def assert_help_shows_no_python_types(tmp_path: Path, commands) -> None:
    """`COMMAND -h` of each command: POSIX usage, no Python types, a help text on every option row."""
    env = {"COLUMNS": "200"}
    for command in commands:
        proc = lmtrace(tmp_path, command, "-h", env=env)
        assert proc.returncode == 0, (command, proc.stderr)
        text = proc.stdout
        # typer's default prints `<bool>`, `<list[str]>`, `<str>` after every option and `{RUN}` in usage
        assert not re.search(r"<(bool|str|int|float|path|list\[[a-z]+\])>", text), (command, text)
        usage = next(line for line in text.splitlines() if "Usage:" in line)
        assert "{" not in usage, usage
        for line in text.splitlines():  # every option row has a help text after its metavar
            m = re.match(r"^\W*(--[a-z-]+)(?:\s+-\w)?\s+(\S.*?)\s*\W*$", line)
            if m:
                assert len(m.group(2).split()) >= 2 or m.group(2).isupper(), (command, line)


def cli_env(runs: Path, **extra) -> dict:
    """The environment of a CLI subprocess: one torch thread, `runs` as its runs directory."""
    return {**os.environ, **ONE_THREAD, "LMTRACE_RUNS_DIR": str(runs), **extra}


def run_cli(args, runs: Path, timeout=300, quiet=True, **env) -> subprocess.CompletedProcess:
    """`lmtrace ARGS -q` to its end, one torch thread, under `runs`."""
    return subprocess.run(
        [sys.executable, "-m", "lmtrace.cli", *args, *(["-q"] if quiet else [])],
        env=cli_env(runs, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(args, runs, env=None, **kw):
    """`lmtrace ARGS` started (not waited for), one torch thread, under `runs`, its output piped."""
    env = cli_env(runs, **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "lmtrace.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def wait_committed(runs: Path, at_least: int, timeout: float = 120) -> Path:
    """The run directory under `runs` once one of its batches has committed `at_least` steps."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for progress in runs.glob("*/progress/*.json"):
            try:
                batches = json.loads(progress.read_text())["batches"]
            except (json.JSONDecodeError, OSError):
                continue
            if any(b["committed_steps"] >= at_least for b in batches.values()):
                return progress.parent.parent
        time.sleep(0.05)
    raise AssertionError("the run never committed a block")


def sampled_spec(tmp_path: Path, model: str, **gen) -> Path:
    """tmp_path/spec.yaml: three prompts sampled at temperature 0.9 (seeded per sequence and step, so
    neither batching by row nor sharding changes a token), batch 2, 8-step chunks, the residual of
    layer 1 archived; `gen` overrides generation keys."""
    generation = {"max_new_tokens": 150, "batch_size": 2, "temperature": 0.9, "seed": 11, "eos_token_id": 0, **gen}
    spec = {
        "model": model,
        "prompts": ["Count slowly:", "A long story about a cat and a dog", "Fruits:"],
        "generation": generation,
        "capture": {"residual": {"vectors_at": [1]}},
        "output": {"chunk_steps": 8},
    }
    return write(tmp_path / "spec.yaml", json.dumps(spec))
