"""The standing fault suite: same-id races, refused requests that must leave nothing behind, failures
recorded in the archive, damaged archives, signals outside the loop (issue 20).

Subprocess tests use the tiny random Llama (`tiny_llama_dir`) with one torch thread each."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lmtrace.archive.reader import Run
from tests.helpers.cli import cli_env as _env
from tests.helpers.cli import run_cli as _run


def _spec(tmp_path: Path, model, name="spec.yaml", **gen) -> Path:
    generation = {"max_new_tokens": 12, "batch_size": 2, "temperature": 0.9, "seed": 11, "eos_token_id": 0, **gen}
    path = tmp_path / name
    path.write_text(
        json.dumps(
            {
                "model": str(model),
                "prompts": ["Count slowly:", "A long story about a cat and a dog", "Fruits:"],
                "generation": generation,
                "output": {"chunk_steps": 4},
            }
        )
    )
    return path


def _start(args, runs: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lmtrace.cli", *args, "-q"],
        env=_env(runs, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until `path` exists (a heartbeat: the process is in its generation loop); fails if it ends first."""
    deadline = time.time() + timeout
    while not path.is_file():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)


def _race(args_a, args_b, runs: Path, pause: float = 4.0) -> list[subprocess.Popen]:
    """Two processes started together, each pausing `pause` s once it has created (or reopened) the run."""
    procs = [_start(args, runs, LMTRACE_TEST_PAUSE_AFTER_CREATE=str(pause)) for args in (args_a, args_b)]
    for p in procs:
        p.out, p.err = p.communicate(timeout=300)
    return procs


def _one_wrote_one_refused(procs) -> subprocess.Popen:
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [(p.returncode, p.err[-2000:]) for p in procs]
    loser = next(p for p in procs if p.returncode == 2)
    winner = next(p for p in procs if p.returncode == 0)
    line = loser.err.strip()
    assert line.startswith("error:") and "\n" not in line and "Traceback" not in line, loser.err
    assert f"being written by pid {winner.pid}" in line, line
    return winner


def test_two_writers_of_one_run_id_exactly_one_writes_and_the_archive_is_one_run(tmp_path, tiny_llama_dir):
    from tests.helpers.archives import assert_same_archive

    runs = tmp_path / "runs"
    spec = _spec(tmp_path, tiny_llama_dir)
    _one_wrote_one_refused(
        _race(["generate", str(spec), "--run-id", "race"], ["generate", str(spec), "--run-id", "race"], runs)
    )
    # two resumers of an interrupted run: the same
    killed = _start(["generate", str(spec), "--run-id", "resumed", "--set", "generation.max_new_tokens=400"], runs)
    _wait_for(runs / "resumed" / "heartbeats" / "shard-0-of-1.json", killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    _one_wrote_one_refused(_race(["generate", "--resume", "resumed"], ["generate", "--resume", "resumed"], runs))
    resumed = Run(runs / "resumed")
    assert resumed.status == "complete"
    # the raced run equals a run of the same spec by one process
    single = _run(["generate", str(spec), "--run-id", "single"], runs)
    assert single.returncode == 0, single.stderr
    assert_same_archive(Run(runs / "single"), Run(runs / "race"))


def _nothing_created(runs: Path) -> bool:
    return not runs.exists() or not any(runs.iterdir())


def test_eos_outside_the_vocabulary_is_refused_before_anything_is_created(tmp_path, tiny_llama_dir):
    runs = tmp_path / "runs"
    spec = _spec(tmp_path, tiny_llama_dir, eos_token_id=999999999)
    for cmd in (["validate", str(spec)], ["generate", str(spec), "--run-id", "eos"]):
        out = _run(cmd, runs, quiet=False)
        assert out.returncode == 2, out.stderr
        assert "eos_token_id" in out.stderr and "outside the vocabulary" in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert _nothing_created(runs), list(runs.rglob("*"))


def test_context_longer_than_the_model_is_refused_in_validate_and_generate(tmp_path, tiny_llama_dir):
    runs = tmp_path / "runs"
    # the tiny model has 4096 positions: 5000 new tokens never fit (refused before the model load), 4094 fit
    # only without a real prompt (refused once the prompts are tokenised, still before the run is created)
    for max_new in (5000, 4094):
        spec = _spec(tmp_path, tiny_llama_dir, max_new_tokens=max_new)
        gen = _run(["generate", str(spec)], runs)
        assert gen.returncode == 2, gen.stderr
        assert "exceed the 4096 positions" in gen.stderr and "max_new_tokens <=" in gen.stderr, gen.stderr
        assert _nothing_created(runs), list(runs.rglob("*"))
    val = _run(["validate", str(_spec(tmp_path, tiny_llama_dir, max_new_tokens=5000))], runs, quiet=False)
    assert val.returncode == 2 and "exceed the 4096 positions" in val.stderr, val.stderr


def test_shard_without_run_id_is_refused_before_the_model_load(tmp_path, tiny_llama_dir):
    # a checkpoint whose config reads fine but whose weights are missing: loading it would fail (exit 1)
    broken = tmp_path / "no-weights"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    runs = tmp_path / "runs"
    out = _run(["generate", str(_spec(tmp_path, broken)), "--shard", "0/2"], runs)
    assert out.returncode == 2 and "needs a shared run id" in out.stderr, out.stderr
    assert _nothing_created(runs)


def test_a_failure_after_the_run_exists_is_recorded_as_failed(tmp_path, tiny_llama_dir, monkeypatch):
    import lmtrace.runner.generation as gen
    from lmtrace.exits.errors import LmtraceError
    from tests.helpers.runs import run_spec

    def broken_tracer(*args, **kwargs):
        raise RuntimeError("tracer could not start")

    monkeypatch.setattr(gen, "Tracer", broken_tracer)
    with pytest.raises(RuntimeError):
        run_spec(
            tmp_path,
            {
                "model": str(tiny_llama_dir),
                "prompts": ["Hello"],
                "output": {"run_id": "broken"},
                "generation": {"max_new_tokens": 3},
            },
        )
    manifest = json.loads((tmp_path / "runs" / "broken" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "tracer could not start" in manifest["error"], manifest.get("status")
    shard = json.loads((tmp_path / "runs" / "broken" / "shards" / "shard-0-of-1.json").read_text())
    assert shard["status"] == "failed" and "tracer could not start" in shard["error"]
    assert not issubclass(RuntimeError, LmtraceError)  # an internal error: exit 1 from the CLI


def test_sigterm_while_loading_exits_3_and_writes_nothing(tmp_path, tiny_llama_dir):
    runs = tmp_path / "runs"
    proc = _start(["generate", str(_spec(tmp_path, tiny_llama_dir)), "--run-id", "early"], runs)
    time.sleep(1.5)  # importing torch and loading: far from the generation loop
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert err.strip().startswith("error: interrupted by signal 15") and "Traceback" not in err, err
    assert not (runs / "early" / "manifest.json").exists()


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has installed a SIGTERM handler (its SigCgt mask in /proc): lmtrace does so
    as a command starts, so from then on the command is running."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def _sigterm_while_running(args, runs: Path, delay: float) -> tuple[int, str]:
    """Start `lmtrace ARGS`, send SIGTERM `delay` s after the command started; (exit code, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmtrace.cli", *args],
        env=_env(runs),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while not _catches_sigterm(proc.pid):
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads SigCgt from /proc (Linux)")
@pytest.mark.parametrize(
    "args, delay",
    [
        (["lens", "a", "-q"], 2.0),  # loading the model or computing
        (["explain", "a", "--steps", "0", "-q"], 2.0),
        (["heads", "a"], 0.05),  # heads takes well under a second on this run: the signal lands while it reads
        (["report", "a", "-q"], 0.2),
        (
            ["intervene", "a", "--ablate-head", "0.0", "--run-id", "kid", "-q"],
            2.0,
        ),  # loading: the child not yet created
        (["sweep", "a", "--over", "heads", "-q"], 2.0),  # before its block loop
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_sigterm_stops_every_command_with_exit_3_and_one_line(complete_runs, tmp_path, args, delay):
    # the delay is when the signal usually lands in the command's work; on a fast, idle machine the
    # command may be done by then (exit 0, nothing to test): it runs again on a fresh copy with the
    # signal sooner, until one run is interrupted
    for attempt, wait in enumerate((delay, delay / 4, 0.0)):
        runs = tmp_path / f"runs{attempt}"
        a = _copy(complete_runs[0], runs)
        before = (a / "manifest.json").read_text()
        code, err = _sigterm_while_running(args, runs, wait)
        if code != 0:
            break
    assert code == 3, (args, code, err[-2000:])
    line = err.strip()
    assert "\n" not in line and line.startswith("error: interrupted by signal 15 (SIGTERM)"), line
    assert (a / "manifest.json").read_text() == before  # lens still pending, no explain or sweep recorded
    assert not (a / "report.html").exists() and not (a / "analysis" / "heads.parquet").exists()
    assert not [p for p in runs.rglob("*.tmp")], [str(p) for p in runs.rglob("*.tmp")]
    if (runs / "kid" / "manifest.json").is_file():  # (a child is recorded interrupted, never running)
        assert json.loads((runs / "kid" / "manifest.json").read_text())["status"] == "interrupted"
    assert _run(["verify", "a"], runs, quiet=False).returncode == 0


def _sigterm_at(point: str, args, runs: Path, pause: float = 30.0) -> tuple[int, str]:
    """Start `lmtrace ARGS` with the test-only LMTRACE_TEST_PAUSE_AT=POINT:PAUSE, send SIGTERM once it
    says `paused at POINT` (exits/faults.py, pause_point); (exit code, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmtrace.cli", *args],
        env=_env(runs, LMTRACE_TEST_PAUSE_AT=f"{point}:{pause}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in proc.stderr:  # (stdout stays small: the pipe cannot fill meanwhile)
        seen.append(line)
        if line.strip() == f"paused at {point}":
            break
    else:
        proc.wait(60)
        raise AssertionError(f"never paused at {point}: exit {proc.returncode}, {''.join(seen)[-2000:]}")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + err


RECORDED = {  # each command, and how to see that its work is recorded in run `a` (or its child `kid`)
    "lens": (["lens", "a"], lambda runs: Run(runs / "a").manifest["lens"]["computed"]["by"] == "lmtrace lens"),
    "explain": (["explain", "a", "--steps", "0"], lambda runs: len(Run(runs / "a").manifest["explain"]) == 1),
    "heads": (["heads", "a"], lambda runs: (runs / "a" / "analysis" / "heads.parquet").is_file()),
    "report": (["report", "a"], lambda runs: (runs / "a" / "report.html").is_file()),
    "sweep": (["sweep", "a", "--over", "heads"], lambda runs: len(Run(runs / "a").manifest["sweeps"]) == 1),
    "intervene": (
        ["intervene", "a", "--ablate-head", "0.0", "--run-id", "kid"],
        lambda runs: Run(runs / "kid").manifest["status"] == "complete",
    ),
}


@pytest.mark.parametrize("name", RECORDED)
def test_sigterm_after_a_command_recorded_its_work_exits_0_with_the_work_kept(complete_runs, tmp_path, name):
    args, recorded = RECORDED[name]
    runs = tmp_path / "runs"
    _copy(complete_runs[0], runs)
    code, err = _sigterm_at("recorded", [*args, "-q"], runs)
    assert code == 0 and "error" not in err, (code, err[-2000:])
    assert recorded(runs)
    assert not [p for p in runs.rglob("*.tmp")], [str(p) for p in runs.rglob("*.tmp")]
    assert _run(["verify", "a"], runs, quiet=False).returncode == 0


def test_sigterm_after_generate_completed_its_run_exits_0(tmp_path, tiny_llama_dir):
    runs = tmp_path / "runs"
    code, err = _sigterm_at("recorded", ["generate", str(_spec(tmp_path, tiny_llama_dir)), "--run-id", "g", "-q"], runs)
    assert code == 0 and "error" not in err, (code, err[-2000:])
    assert Run(runs / "g").manifest["status"] == "complete"


def test_sigterm_after_the_run_of_generate_lens_completed_stops_it_before_the_lens_with_3(tmp_path, tiny_llama_dir):
    runs = tmp_path / "runs"
    code, err = _sigterm_at(
        "recorded", ["generate", str(_spec(tmp_path, tiny_llama_dir)), "--run-id", "g", "--lens", "-q"], runs
    )
    assert code == 3 and err.strip().splitlines()[-1].startswith("error: interrupted by signal 15 (SIGTERM)"), err
    run = Run(runs / "g")
    assert run.manifest["status"] == "complete" and run.manifest["lens"]["computed"] is None  # kept, lens pending


@pytest.mark.parametrize("args", [["lens", "a", "-q"], ["show", "a", "-q"], ["verify", "a", "-q"]], ids=lambda v: v[0])
def test_sigterm_while_the_process_exits_after_its_command_leaves_exit_0_never_143(complete_runs, tmp_path, args):
    runs = tmp_path / "runs"
    _copy(complete_runs[0], runs)
    code, err = _sigterm_at("exit", args, runs)
    assert code == 0 and "error" not in err, (code, err[-2000:])


def test_sigterm_just_before_the_lens_is_recorded_exits_3_and_leaves_it_pending(complete_runs, tmp_path):
    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    before = (a / "manifest.json").read_text()
    code, err = _sigterm_at("lens-written", ["lens", "a", "-q"], runs)
    assert code == 3, (code, err[-2000:])
    assert err.strip().splitlines()[-1].startswith("error: interrupted by signal 15 (SIGTERM)"), err
    assert (a / "manifest.json").read_text() == before  # the lens still pending
    assert _run(["verify", "a"], runs, quiet=False).returncode == 0


def test_sigterm_while_an_intervene_child_is_written_records_it_interrupted(tmp_path, tiny_llama_dir):
    runs = tmp_path / "runs"
    spec = _spec(tmp_path, tiny_llama_dir, max_new_tokens=400, batch_size=1, temperature=0.0)
    assert _run(["generate", str(spec), "--run-id", "parent"], runs).returncode == 0
    proc = _start(["intervene", "parent", "--ablate-head", "1.1", "--run-id", "kid"], runs)
    _wait_for(runs / "kid" / "heartbeats" / "shard-0-of-1.json", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    line = err.strip()
    assert "\n" not in line and line.startswith("error: interrupted by signal 15 (SIGTERM)"), line
    assert "lmtrace generate --resume kid" in line, line
    assert json.loads((runs / "kid" / "manifest.json").read_text())["status"] == "interrupted"


# ---- damaged archives ---------------------------------------------------------------------------
def _cli(args, runs: Path):
    from typer.testing import CliRunner

    from lmtrace.cli.main import app

    result = CliRunner().invoke(app, [*args], env={"LMTRACE_RUNS_DIR": str(runs)})
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def complete_runs(tmp_path_factory, tiny_llama_dir):
    """Two complete runs of the tiny model (the second differs in seed) to damage copies of."""
    from tests.helpers.runs import run_spec

    base = tmp_path_factory.mktemp("damage")
    spec = {
        "model": str(tiny_llama_dir),
        "prompts": ["Hello there", "One two"],
        "generation": {"max_new_tokens": 6, "batch_size": 2, "temperature": 0.9},
        "capture": {"residual": {"vectors_at": [1]}},
        "output": {"chunk_steps": 4},
    }
    a = run_spec(base, {**spec, "output": {**spec["output"], "run_id": "a"}})
    b = run_spec(
        base, {**spec, "generation": {**spec["generation"], "seed": 5}, "output": {**spec["output"], "run_id": "b"}}
    )
    return a.path, b.path


def _copy(src: Path, runs: Path) -> Path:
    import shutil

    runs.mkdir(exist_ok=True)
    return Path(shutil.copytree(src, runs / src.name))


def _a_chunk(run_dir: Path, array: str = "attn") -> Path:
    return sorted(p for p in (run_dir / "tensors.zarr" / array / "c").rglob("*") if p.is_file())[0]


def test_verify_passes_an_intact_run_and_names_each_kind_of_damage(complete_runs, tmp_path):
    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    code, out, err = _cli(["verify", "a"], runs)
    assert code == 0 and "files match their checksums" in out, (out, err)
    chunk = _a_chunk(a)
    data = chunk.read_bytes()
    chunk.write_bytes(data[: len(data) // 2])  # truncated
    resid = _a_chunk(a, "resid")
    raw = bytearray(resid.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # changed, same size
    resid.write_bytes(bytes(raw))
    (a / "tokens.parquet").unlink()  # missing
    code, out, err = _cli(["verify", "a", "--json"], runs)
    report = json.loads(out)
    assert code == 2 and report["ok"] is False
    kinds = {p["path"]: p["kind"] for p in report["problems"]}
    rel = lambda p: str(p.relative_to(a))  # noqa: E731
    assert kinds == {"tokens.parquet": "missing", rel(chunk): "truncated", rel(resid): "changed"}, kinds


@pytest.mark.parametrize("damage", ["missing-table", "truncated-chunk"])
def test_every_reading_command_refuses_a_damaged_complete_run_in_one_line(complete_runs, tmp_path, damage):
    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    _copy(complete_runs[1], runs)  # a second, intact run beside the damaged one
    if damage == "missing-table":
        (a / "tokens.parquet").unlink()
        named = "tokens.parquet is missing"
    else:
        chunk = _a_chunk(a)
        chunk.write_bytes(chunk.read_bytes()[:10])
        named = f"{chunk.relative_to(a)} is truncated"
    expected = f"error: run a is damaged: {named}; `lmtrace verify a`"
    for args in (
        ["show", "a"],
        ["show", "a", "--json"],
        ["compare", "a", "b"],
        ["compare", "b", "a"],
        ["lens", "a"],
        ["explain", "a", "--steps", "0"],
        ["intervene", "a", "--ablate-head", "0.0"],
        ["verify", "a"],
    ):
        code, out, err = _cli(args, runs)
        assert code == 2, (args, code, out, err)
        if args[0] != "verify":
            assert err.strip() == expected, (args, err)
    code, out, _ = _cli(["ls", "--json"], runs)
    status = {r["run_id"]: r["status"] for r in json.loads(out)}
    assert status == {"a": "damaged", "b": "complete"}


def test_a_chunk_that_does_not_decode_is_named(complete_runs, tmp_path):
    from lmtrace.exits.errors import ArchiveError

    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    chunk = _a_chunk(a)
    chunk.write_bytes(b"\0" * chunk.stat().st_size)  # same size, not LZ4 any more: passes the stat check
    run = Run(a)
    with pytest.raises(ArchiveError, match=f"run a is damaged: {chunk.relative_to(a)} is changed; `lmtrace verify a`"):
        run.array("attn")[0, 0]


def _flip_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # changed, same size: only hashing finds it
    path.write_bytes(bytes(raw))


def test_lens_refuses_a_changed_file_it_reads_and_never_launders_damage_elsewhere(complete_runs, tmp_path):
    from lmtrace.archive.reader import lens_state

    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    resid = _a_chunk(a, "resid")  # what the lens reads
    _flip_a_byte(resid)
    code, out, err = _cli(["lens", "a"], runs)
    assert code == 2, (code, out, err)
    assert err.strip() == f"error: run a is damaged: {resid.relative_to(a)} is changed; `lmtrace verify a`", err
    assert lens_state(Run(a).manifest) == "pending"
    code, out, _ = _cli(["verify", "a", "--json"], runs)
    assert code == 2 and [p["path"] for p in json.loads(out)["problems"]] == [str(resid.relative_to(a))], out

    b = _copy(complete_runs[0], tmp_path / "other")
    attn = _a_chunk(b, "attn")  # a file the lens does not read: computed, and the damage stays on record
    _flip_a_byte(attn)
    code, out, err = _cli(["lens", "a"], tmp_path / "other")
    assert code == 0, err
    assert lens_state(Run(b).manifest) == "ready"
    code, out, _ = _cli(["verify", "a", "--json"], tmp_path / "other")
    report = json.loads(out)
    assert code == 2 and [(p["path"], p["kind"]) for p in report["problems"]] == [(str(attn.relative_to(b)), "changed")]
    assert report["files_checked"] > len(json.loads((a / "checksums.json").read_text())["files"])  # lens arrays too

    c = _copy(complete_runs[0], tmp_path / "third")
    _flip_a_byte(c / "steps.parquet")  # read and rewritten by the lens: checked while the lens is pending too
    for args in (["lens", "a"], ["verify", "a"]):
        code, out, err = _cli(args, tmp_path / "third")
        assert code == 2 and "steps.parquet is changed" in err, (args, out, err)


# ---- damaged bytes that still decode: the checksums every read checks (issue 41) ---------------
def _flip_inside_a_chunk(run_dir: Path, array: str = "attn") -> tuple[Path, int]:
    """Flip one byte inside a compressed inner chunk of the array's first shard file, at a place
    where the chunk still decompresses (numcodecs' zstd, which keeps no checksum of its own) to as
    many bytes with other values: damage no codec notices. Returns the shard file and the sequence
    whose inner chunk it is."""
    import math

    import numcodecs

    shard = _a_chunk(run_dir, array)
    meta = json.loads((run_dir / "tensors.zarr" / array / "zarr.json").read_text())
    (sharding,) = meta["codecs"]
    names = [c["name"] for c in sharding["configuration"]["codecs"]]
    assert "zstd" in names, names
    tail = 4 if names[-1] == "crc32c" else 0  # the chunk's own checksum, where it has one
    per_shard = tuple(
        o // i
        for o, i in zip(meta["chunk_grid"]["configuration"]["chunk_shape"], sharding["configuration"]["chunk_shape"])
    )
    data = bytearray(shard.read_bytes())
    n = math.prod(per_shard)
    index = np.frombuffer(bytes(data[-16 * n - 4 : -4]), "<u8").reshape(n, 2)
    zstd = numcodecs.Zstd()
    for i, (offset, nbytes) in enumerate(index.tolist()):
        if offset == 2**64 - 1:
            continue
        payload = bytes(data[offset : offset + nbytes - tail])
        clean = zstd.decode(payload)
        for pos in range(len(payload) // 2, len(payload)):  # past the frame header
            trial = bytearray(payload)
            trial[pos] ^= 0x10
            try:
                out = zstd.decode(bytes(trial))
            except Exception:  # noqa: BLE001 - a flip zstd itself refuses: try the next byte
                continue
            if len(out) == len(clean) and out != clean:
                data[offset + pos] ^= 0x10
                shard.write_bytes(bytes(data))
                return shard, int(np.unravel_index(i, per_shard)[0])
    raise AssertionError(f"no byte of {shard} flips without zstd noticing")


def _flip_inside_a_page(path: Path, column: str) -> None:
    """Flip one byte inside the data page of `column` in the first row group of a Parquet file, at a
    place where pyarrow, not checking page checksums, reads the file without error but other values."""
    import pyarrow.parquet as pq

    before = pq.read_table(path)
    md = pq.ParquetFile(path).metadata
    chunk = md.row_group(0).column(md.schema.names.index(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    original = path.read_bytes()
    for pos in range(start + chunk.total_compressed_size - 1, start + chunk.total_compressed_size // 2, -1):
        raw = bytearray(original)
        raw[pos] ^= 0x10
        path.write_bytes(bytes(raw))
        try:
            after = pq.read_table(path)
        except Exception:  # noqa: BLE001 - a flip the decoder itself refuses: try the next byte
            continue
        if not after.equals(before):
            return
    path.write_bytes(original)
    raise AssertionError(f"no byte of {path}'s {column} page flips without pyarrow noticing")


def test_a_flipped_byte_inside_an_attention_chunk_is_refused_by_zarr_and_named_by_every_reader(complete_runs, tmp_path):
    import zarr

    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    _copy(complete_runs[1], runs)
    clean = zarr.open_array(str(a / "tensors.zarr" / "attn"), mode="r")[...]
    shard, seq = _flip_inside_a_chunk(a)
    rel = shard.relative_to(a)
    attn = zarr.open_array(str(a / "tensors.zarr" / "attn"), mode="r")
    with pytest.raises(ValueError, match="checksum"):  # zarr alone, no lmtrace: the chunk's crc32c
        attn[seq, 0]
    other = 1 - seq  # the shard's other sequence still reads, as it was written
    np.testing.assert_array_equal(attn[other], clean[other])
    expected = f"error: run a is damaged: {rel} is changed; `lmtrace verify a`"
    for args in (["report", "a", "--sequence", str(seq), "--out", str(tmp_path / "r.html")], ["heads", "a"]):
        code, out, err = _cli(args, runs)
        assert (code, err.strip()) == (2, expected), (args, code, out, err)
    code, out, err = _cli(["report", "b", "--out", str(tmp_path / "b.html")], runs)
    assert code == 0, err


def test_serve_answers_409_naming_the_damaged_file_and_lists_the_run_damaged(complete_runs, tmp_path):
    from tests.helpers.server import LiveServer

    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    _copy(complete_runs[1], runs)
    shard, seq = _flip_inside_a_chunk(a)
    rel = str(shard.relative_to(a))
    server = LiveServer(runs)
    try:
        listed = {r["run_id"]: r["status"] for r in server.json("/api/runs")["runs"]}
        assert listed == {"a": "complete", "b": "complete"}  # the same size: a stat cannot tell
        status, headers, body = server.request(f"/api/runs/a/sequences/{seq}/steps/0")
        assert status == 409 and headers["content-type"] == "application/json", (status, body)
        answer = json.loads(body)
        assert answer == {"error": f"run a is damaged: {rel} is changed; `lmtrace verify a`", "file": rel}
        assert str(tmp_path) not in body.decode()
        listed = {r["run_id"]: (r["status"], r.get("error")) for r in server.json("/api/runs")["runs"]}
        assert listed == {"a": ("damaged", answer["error"]), "b": ("complete", None)}
        assert server.json("/api/runs/a")["damaged"] == answer["error"]
        assert server.json(f"/api/runs/b/sequences/{seq}/steps/0")["sequence"] == seq
        shutil.copy(complete_runs[0] / rel, shard)  # restored from a copy: the run is whole again
        assert {r["run_id"]: r["status"] for r in server.json("/api/runs")["runs"]}["a"] == "complete"
        assert server.json(f"/api/runs/a/sequences/{seq}/steps/0")["sequence"] == seq
    finally:
        server.stop()


def test_a_flipped_byte_inside_a_parquet_data_page_is_refused_naming_the_file(complete_runs, tmp_path):
    import pyarrow.parquet as pq

    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    _copy(complete_runs[1], runs)
    _flip_inside_a_page(a / "tokens.parquet", "logprob")
    with pytest.raises(OSError, match="CRC checksum verification failed"):  # pyarrow alone: the page's checksum
        pq.read_table(a / "tokens.parquet", page_checksum_verification=True)
    expected = "error: run a is damaged: tokens.parquet is changed; `lmtrace verify a`"
    for args in (["show", "a"], ["show", "a", "--step", "1"], ["stats", "a"], ["compare", "a", "b"], ["report", "a"]):
        code, out, err = _cli(args, runs)
        assert (code, err.strip()) == (2, expected), (args, code, out, err)


# ---- intervene: refused requests ----------------------------------------------------------------
@pytest.mark.parametrize(
    "args, says",
    [
        (["--run-id", "b", "--ablate-head", "0.0"], "a run b exists"),
        (["--mask-positions", "100"], "positions [100] are past every sequence: its sequences have positions 0.."),
        (["--mask-positions", "5-3"], "range 5-3 is empty"),
        (
            ["--ablate-head", "0.0", "--from-step", "-1"],
            "--from-step -1 is out of range: the parent run's steps are 0..5",
        ),
        (
            ["--ablate-head", "0.0", "--from-step", "99"],
            "--from-step 99 is out of range: the parent run's steps are 0..5",
        ),
        (
            ["--ablate-head", "0.0", "--temperatures", "0.5", "--mode", "rescore"],
            "cannot be combined with --mode rescore",
        ),
        ([], "no interventions given"),
    ],
)
def test_intervene_refuses_no_op_and_contradictory_requests(complete_runs, tmp_path, args, says):
    runs = tmp_path / "runs"
    _copy(complete_runs[0], runs), _copy(complete_runs[1], runs)
    before = {p: p.stat().st_mtime_ns for p in runs.rglob("*")}
    code, out, err = _cli(["intervene", "a", *args], runs)
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1, err
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("*")} == before  # nothing written, nothing touched


@pytest.mark.parametrize("status, shown", [("interrupted", "interrupted"), ("running", "killed")])
def test_intervene_and_sweep_on_an_unfinished_run_say_how_to_finish_it(complete_runs, tmp_path, status, shown):
    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    manifest = json.loads((a / "manifest.json").read_text())
    (a / "manifest.json").write_text(json.dumps({**manifest, "status": status}))  # (nobody writes it)
    expected = (
        f"error: run a is {shown}, not complete: finish it first with `lmtrace generate --resume a`, "
        f"then run this again"
    )
    for args in (["intervene", "a", "--ablate-head", "0.0"], ["sweep", "a", "--over", "heads"]):
        code, out, err = _cli(args, runs)
        assert code == 2 and err.strip() == expected, (args, code, err)


def test_intervene_on_a_run_still_being_written_says_to_wait(complete_runs, tmp_path):
    from lmtrace.archive.liveness import OwnerLock

    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    manifest = json.loads((a / "manifest.json").read_text())
    (a / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    owner = OwnerLock(a, "shard-0-of-1", "a").acquire()  # a live writer
    try:
        code, out, err = _cli(["intervene", "a", "--ablate-head", "0.0"], runs)
    finally:
        owner.release()
    assert code == 2 and err.strip() == (
        "error: run a is running, not complete: wait until it completes (`lmtrace ls` shows its status)"
    ), err


def test_regenerate_effects_compare_only_identical_contexts(complete_runs, tmp_path):
    runs = tmp_path / "runs"
    _copy(complete_runs[0], runs)
    code, out, err = _cli(
        [
            "intervene",
            "a",
            "--mode",
            "regenerate",
            "--ablate-layer",
            "0",
            "--ablate-layer",
            "1",
            "--run-id",
            "child",
            "--json",
        ],
        runs,
    )
    assert code == 0, err
    import pandas as pd

    effects = pd.read_parquet(runs / "child" / "effects.parquet")
    differ = effects[~effects.context_identical]
    assert len(differ), "the edit never changed a token: the test proves nothing"
    for col in (
        "child_logprob_of_parent_token",
        "logprob_shift",
        "margin_shift",
        "winner_changed",
        "kl_parent_child_topk",
    ):
        assert differ[col].isna().all(), col
    same = effects[effects.context_identical]
    assert same.logprob_shift.notna().all() and same.winner_changed.notna().all()


# ---- disk full ----------------------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MB tmpfs (root only); skipped with the reason otherwise."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_fails_cleanly_and_resume_says_so_in_one_line(tmp_path, tiny_llama_dir, small_tmpfs):
    runs = small_tmpfs / "runs"
    spec = _spec(tmp_path, tiny_llama_dir, max_new_tokens=1500, eos_token_id=[])
    out = _run(["generate", str(spec), "--run-id", "full", "--set", "capture.residual.vectors_at=all"], runs)
    assert out.returncode == 1, out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and "No space left on device" in line and "bytes free" in line, line
    manifest = json.loads((runs / "full" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "No space left on device" in manifest["error"]
    assert json.loads((runs / "full" / "shards" / "shard-0-of-1.json").read_text())["status"] == "failed"
    assert not [p for p in runs.rglob("*.tmp")], [str(p) for p in runs.rglob("*.tmp")]
    again = _run(["generate", "--resume", "full"], runs)
    assert again.returncode == 1, again.stderr
    line = again.stderr.strip()
    assert "\n" not in line and "internal error" not in line and "No space left on device" in line, line
    assert not [p for p in runs.rglob("*.tmp")]


def _fill(mount: Path, name: str, leave: int = 0) -> None:
    """Fill the file system at `mount` with the file `name`, then free `leave` bytes of it again."""
    fd = os.open(mount / name, os.O_WRONLY | os.O_CREAT)
    try:
        size = 1 << 20
        while size:
            try:
                if os.write(fd, b"\0" * size) == 0:
                    size //= 2
            except OSError:
                size //= 2
        os.ftruncate(fd, max(os.fstat(fd).st_size - leave, 0))
    finally:
        os.close(fd)


def test_a_full_disk_in_lens_explain_and_sweep_is_one_line_naming_the_run_and_its_free_space(
    complete_runs, small_tmpfs
):
    from lmtrace.archive.reader import lens_state

    runs = small_tmpfs / "runs"
    a = _copy(complete_runs[0], runs)
    _fill(small_tmpfs, "filler", leave=4096)  # room for the lens's lock file: it fails writing its arrays
    for args in (["lens", "a"], ["explain", "a", "--steps", "0"], ["sweep", "a", "--over", "layers"]):
        out = _run(args, runs, quiet=False)
        line = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
        assert out.returncode == 1, (args, out.returncode, out.stderr[-2000:])
        assert line.startswith(f"error: No space left on device writing {a}") and "bytes free there" in line, (
            args,
            line,
        )
        assert "internal error" not in out.stderr and "Traceback" not in out.stderr, out.stderr
        manifest = json.loads((a / "manifest.json").read_text())
        assert manifest["status"] == "complete" and lens_state(manifest) == "pending", args
        assert not manifest.get("explain") and not manifest.get("sweeps"), args
        _fill(small_tmpfs, f"filler-after-{args[0]}")  # whatever the failed command freed again
    assert not [p for p in runs.rglob("*.tmp")], [str(p) for p in runs.rglob("*.tmp")]
    (small_tmpfs / "filler").unlink()
    assert _run(["verify", "a"], runs, quiet=False).returncode == 0


def test_an_exceeded_quota_in_lens_is_one_line_naming_the_run(complete_runs, tmp_path, monkeypatch):
    """The same mapping without a small file system (no root needed): the lens's first array write fails."""
    import errno

    import lmtrace.archive.writer as writer
    from lmtrace.archive.reader import lens_state

    def over_quota(*args, **kwargs):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(writer, "create_array", over_quota)
    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    code, out, err = _cli(["lens", "a", "-q"], runs)
    assert code == 1, (code, out, err)
    assert err.startswith(f"error: Disk quota exceeded writing {a}; ") and "bytes free there" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert lens_state(Run(a).manifest) == "pending" and Run(a).status == "complete"


# ---- smaller promises -----------------------------------------------------------------------------
def test_a_run_with_nothing_committed_reads_as_empty_tables_with_the_schema(tmp_path, tiny_llama_dir, monkeypatch):
    import warnings

    import lmtrace.runner.generation as gen
    from lmtrace.archive import layout
    from tests.helpers.runs import run_spec

    def no_steps(self, *args, **kwargs):
        raise RuntimeError("killed before the first block")

    monkeypatch.setattr(gen.Tracer, "run_batch", no_steps)
    with pytest.raises(RuntimeError):
        run_spec(
            tmp_path,
            {
                "model": str(tiny_llama_dir),
                "prompts": ["Hello"],
                "output": {"run_id": "empty"},
                "generation": {"max_new_tokens": 3},
            },
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = Run(tmp_path / "runs" / "empty")
    assert run.tokens().num_rows == 0 and run.tokens().schema.equals(layout.token_schema())
    assert run.sequences().num_rows == 0 and run.sequences().schema.equals(layout.sequence_schema())


def test_sharded_run_sequences_table_is_in_sequence_order(tmp_path, tiny_llama_dir):
    import yaml

    from lmtrace.runner.generation import Shard, run_generate
    from lmtrace.spec.run_spec import build_spec

    data = {
        "model": str(tiny_llama_dir),
        "prompts": ["a b", "c d", "e f", "g h", "i j"],
        "generation": {"max_new_tokens": 2, "batch_size": 2},
        "output": {"runs_dir": str(tmp_path / "runs"), "run_id": "sharded"},
        "capture": "none",
    }
    for i in range(2):
        run_generate(build_spec(data, "test"), yaml.safe_dump(data), shard=Shard(i, 2))
    run = Run(tmp_path / "runs" / "sharded")
    assert run.status == "complete"
    assert run.sequences().column("sequence").to_pylist() == [0, 1, 2, 3, 4]


def test_a_load_error_is_reported_whole(tmp_path, tiny_llama_dir):
    broken = tmp_path / "no-tokenizer"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    out = _run(["generate", str(_spec(tmp_path, broken))], tmp_path / "runs")
    assert out.returncode == 1
    line = out.stderr.strip()
    assert "\n" not in line and not line.rstrip().endswith(("one of:", ":")), line


# ---- memory follows the work, not max_new_tokens ------------------------------------------------
@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory, tiny_llama_dir):
    """The tiny Llama with 200,000 positions (its weights do not depend on them: rotary positions)."""
    import shutil

    path = Path(shutil.copytree(tiny_llama_dir, tmp_path_factory.mktemp("long") / "model"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 200_000}))
    return path


# VmHWM: the peak RSS of this process image (ru_maxrss would include the forking pytest process's)
_PEAK = (
    "import runpy, sys\n"
    "sys.argv = ['lmtrace', *sys.argv[2:]]\n"
    "try:\n    runpy.run_module('lmtrace.cli', run_name='__main__')\n"
    "finally:\n"
    "    hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
    "    open(OUT, 'w').write(hwm.split()[1])\n"
)


def _peak_rss_kb(args, runs: Path, out: Path) -> int:
    """Peak RSS (KB) of one `lmtrace` process."""
    proc = subprocess.run(
        [sys.executable, "-c", f"OUT = {str(out)!r}\n" + _PEAK, "-", *args, "-q"],
        env=_env(runs),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(out.read_text())


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc (Linux)")
def test_peak_memory_follows_the_tokens_generated_not_max_new_tokens(tmp_path, long_llama_dir):
    from tests.helpers.runs import run_spec

    spec = {
        "model": str(long_llama_dir),
        "prompts": ["Count slowly:"],
        "output": {"chunk_steps": 16},
        "generation": {"max_new_tokens": 64, "temperature": 1.0, "seed": 3},
    }
    # an eos id that ends the run after ~30 tokens: the first new token from step 25 on
    probe = run_spec(tmp_path / "probe", {**spec, "output": {**spec["output"], "run_id": "probe"}})
    ids = probe.tokens().to_pandas().query("not is_prompt").token_id.tolist()
    step = next(i for i in range(25, len(ids)) if ids[i] not in ids[:i])
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**spec, "generation": {**spec["generation"], "eos_token_id": ids[step]}}))
    runs = tmp_path / "runs"
    peak = {}
    for n in (64, 100_000):
        peak[n] = _peak_rss_kb(
            ["generate", str(path), "--run-id", f"n{n}", "--set", f"generation.max_new_tokens={n}"],
            runs,
            tmp_path / f"peak{n}",
        )
        assert len(Run(runs / f"n{n}").tokens().to_pandas().query("not is_prompt")) == step + 1
    assert peak[100_000] <= 1.05 * peak[64], peak


def test_sigterm_is_honoured_within_a_step_at_a_huge_max_new_tokens(tmp_path, long_llama_dir):
    runs = tmp_path / "runs"
    spec = _spec(tmp_path, long_llama_dir, max_new_tokens=190_000, batch_size=1, eos_token_id=[])
    proc = _start(["generate", str(spec), "--run-id", "huge"], runs)
    _wait_for(runs / "huge" / "heartbeats" / "shard-0-of-1.json", proc)
    time.sleep(1)  # into the loop
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    took = time.time() - sent
    assert proc.returncode == 3, err
    assert took < 10, took
    assert json.loads((runs / "huge" / "manifest.json").read_text())["status"] == "interrupted"


def test_validate_states_the_estimate_for_the_tokens_generated_and_warns_past_the_free_space(
    tmp_path, long_llama_dir, monkeypatch
):
    import lmtrace.commands.validate as validate

    spec = _spec(tmp_path, long_llama_dir, max_new_tokens=190_000)
    monkeypatch.setattr(validate, "_free_bytes", lambda root: 50 * 2**30)
    report = validate.validate_spec(spec, [])
    assert (
        "archive at most ~" in report["summary"] and "if every prompt stops after 1000 new tokens" in report["summary"]
    )
    assert report["estimate"]["bytes_first_1000_steps"] < report["estimate"]["tensor_bytes_max"] / 100
    assert len(report["warnings"]) == 1 and "exceeds the 50.0 GB free" in report["warnings"][0], report["warnings"]
    assert all(
        lever in report["warnings"][0]
        for lever in ("capture.preset", "capture.attention.top_k", "capture.layers", "generation.max_new_tokens")
    ), report["warnings"]
    small = validate.validate_spec(_spec(tmp_path, long_llama_dir, max_new_tokens=64), [])
    assert small["warnings"] == [] and "stops after" not in small["summary"]


# ---- one writer for `lmtrace lens` / `lmtrace explain`; kill points in finalisation and the lens ---
def test_lens_and_explain_have_one_writer_at_a_time(complete_runs, tmp_path):
    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    winner = _one_wrote_one_refused(_race(["lens", a.name], ["lens", a.name], runs, pause=3.0))
    assert Run(a).manifest["lens"]["computed"]["by"] == "lmtrace lens", winner.err
    explain = ["explain", a.name, "--steps", "1"]
    _one_wrote_one_refused(_race(explain, explain, runs, pause=3.0))
    assert len(Run(a).manifest["explain"]) == 1  # one invocation's entry, the refused one wrote nothing
    assert _run(["verify", a.name], runs, quiet=False).returncode == 0


def _killed_at(point: str, args, runs: Path) -> None:
    out = _run(args, runs, LMTRACE_TEST_KILL_AT=point)
    assert out.returncode == -signal.SIGKILL, (point, out.returncode, out.stderr[-2000:])


@pytest.mark.slow
def test_sigkill_during_finalisation_never_leaves_a_false_complete_and_a_resume_completes(complete_runs, tmp_path):
    from tests.helpers.archives import assert_same_archive

    runs = tmp_path / "runs"
    reference = Run(complete_runs[0])
    import yaml

    data = yaml.safe_load(reference.path.joinpath("spec.yaml").read_text())
    data["output"] = {k: v for k, v in data["output"].items() if k not in ("run_id", "runs_dir")}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    # killed after the tables are compacted, then (on the resume) after the checksums are recorded:
    # in both the manifest has not said `complete`; the next resume finishes it
    _killed_at("finalize-compacted", ["generate", str(spec), "--run-id", "k"], runs)
    assert json.loads((runs / "k" / "manifest.json").read_text())["status"] == "running"
    _killed_at("finalize-checksums", ["generate", "--resume", "k"], runs)
    assert json.loads((runs / "k" / "manifest.json").read_text())["status"] == "running"
    out = _run(["generate", "--resume", "k"], runs)
    assert out.returncode == 0, out.stderr
    assert _run(["verify", "k"], runs, quiet=False).returncode == 0
    assert_same_archive(reference, Run(runs / "k"))


@pytest.mark.slow
def test_sigkill_during_lens_never_leaves_a_false_lens_and_a_rerun_completes(complete_runs, tmp_path):
    from lmtrace.archive.reader import lens_state
    from tests.helpers.archives import assert_same_archive
    from tests.helpers.runs import with_lens

    runs = tmp_path / "runs"
    a = _copy(complete_runs[0], runs)
    for point in ("lens-batch", "recording-replaced", "lens-checksums"):  # ("lens-written": as lens-batch)
        _killed_at(point, ["lens", a.name], runs)
        run = Run(a)  # not damaged: each file the lens rewrites matches the old record or the new one
        assert run.status == "complete" and lens_state(run.manifest) == "pending", point
        assert _run(["verify", a.name], runs, quiet=False).returncode == 0, point
    out = _run(["lens", a.name], runs)
    assert out.returncode == 0, out.stderr
    assert _run(["verify", a.name], runs, quiet=False).returncode == 0
    assert_same_archive(with_lens(Run(_copy(complete_runs[0], tmp_path / "clean"))), Run(a))


def test_a_killed_intervene_child_is_never_complete_and_keeps_its_flushed_steps(tmp_path, tiny_llama_dir):
    """SIGKILL while an intervention child is being written: the child says it is not complete, is
    readable up to its last committed block, and its id stays taken (a second child with it is refused)."""
    import warnings

    from lmtrace.archive.reader import IncompleteRunWarning

    runs = tmp_path / "runs"
    spec = _spec(tmp_path, tiny_llama_dir, max_new_tokens=400, batch_size=1, temperature=0.0)
    assert _run(["generate", str(spec), "--run-id", "parent"], runs).returncode == 0
    proc = _start(["intervene", "parent", "--ablate-head", "1.1", "--run-id", "kid"], runs)
    deadline, committed = time.time() + 120, 0
    while time.time() < deadline and committed < 8:
        try:
            batches = json.loads((runs / "kid" / "progress" / "shard-0-of-1.json").read_text())["batches"]
            committed = min(b["committed_steps"] for b in batches.values())
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert committed >= 8, "the child never committed a block"
    manifest = json.loads((runs / "kid" / "manifest.json").read_text())
    assert manifest["status"] != "complete" and manifest["kind"] == "intervene"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        kid = Run(runs / "kid")
        gen = kid.tokens().to_pandas()
    steps = sorted(gen[(gen.sequence == 0) & ~gen.is_prompt].step.tolist())
    assert steps[:8] == list(range(8))
    again = _run(["intervene", "parent", "--ablate-head", "1.1", "--run-id", "kid"], runs)
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr


# ---- query: read-only over the archives, damaged runs left out ----------------------------------
def _tree(root: Path) -> dict[str, str]:
    """Every file under `root` (relative path -> sha256 of its bytes): what `query` must never change."""
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _query_here(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`lmtrace query ARGS` in `cwd` with no --runs-dir and no $LMTRACE_RUNS_DIR: the runs are ./runs."""
    from tests.helpers.cli import lmtrace

    return lmtrace(cwd, "query", *args, env={"LMTRACE_RUNS_DIR": ""})


@pytest.mark.parametrize(
    "sql",
    [
        "COPY (SELECT 1 AS a) TO 'runs/a/tokens.parquet' (FORMAT parquet)",
        "COPY (SELECT 1 AS a) TO '{abs}/runs/a/tokens.parquet' (FORMAT parquet, USE_TMP_FILE false)",
        "COPY (SELECT * FROM tokens) TO 'runs/a/copy.csv'",
        "SELECT 1; COPY (SELECT 1 AS a) TO 'runs/new.parquet' (FORMAT parquet)",
        "EXPLAIN ANALYZE COPY (SELECT 1 AS a) TO '{abs}/runs/a/tokens.parquet' (FORMAT parquet, USE_TMP_FILE false)",
        "COPY (PIVOT (SELECT sequence, is_prompt FROM tokens) ON is_prompt USING count(*)) "
        "TO '{abs}/runs/a/tokens.parquet' (FORMAT parquet, USE_TMP_FILE false)",
        "ATTACH 'runs/x.duckdb'",
        "EXPORT DATABASE 'runs/exp'",
        "INSTALL httpfs",
        "LOAD parquet",
        "SET enable_external_access = true",
        "SET lock_configuration = false",
        "PRAGMA enable_profiling = 'json'",
        "SELECT * FROM query('COPY (SELECT 1 AS a) TO ''runs/q.csv''')",
    ],
)
def test_query_refuses_every_write_and_the_runs_stay_byte_identical(complete_runs, tmp_path, sql):
    runs = tmp_path / "runs"
    _copy(complete_runs[0], runs)
    before = _tree(runs)
    proc = _query_here(tmp_path, sql.replace("{abs}", str(tmp_path)))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert _tree(runs) == before
    code, out, err = _cli(["verify", "a"], runs)
    assert code == 0, (out, err)


def test_query_locks_duckdb_itself_to_reading_the_views_files(complete_runs, tmp_path, monkeypatch):
    """Past the statement check, DuckDB's own configuration refuses a write beside the files the
    views read, and refuses to be unlocked."""
    import duckdb

    from lmtrace.archive.sql_views import connect
    from lmtrace.archive.table_catalog import read_catalog
    from lmtrace.query.guard import lock

    runs = tmp_path / "runs"
    _copy(complete_runs[0], runs)
    monkeypatch.chdir(tmp_path)
    catalog = read_catalog(Path("runs"))
    con = connect(catalog, ["tokens"])
    # the SQL names a run's file as a string: still not one DuckDB may open (the views read the runs)
    named = "SELECT * FROM tokens, read_text('runs/a/manifest.json')"
    lock(con, [str(p) for p in catalog.listed], named, Path("runs"), str(tmp_path / "tmp"))
    assert con.execute("SELECT count(*) FROM tokens").fetchall()[0][0] == len(Run(runs / "a").tokens())
    for sql in (
        "COPY (SELECT 1 AS a) TO 'runs/a/new.parquet' (FORMAT parquet)",
        "ATTACH 'runs/x.duckdb'",
        "EXPORT DATABASE 'runs/exp'",
        "SET enable_external_access = true",
        "RESET lock_configuration",
        "SELECT * FROM read_text('runs/a/manifest.json')",
        "COPY (SELECT 1 AS a) TO 'runs/a/new.parquet' (FORMAT parquet, USE_TMP_FILE false)",
    ):
        with pytest.raises(duckdb.Error):
            con.execute(sql)
    assert sorted(p.name for p in (runs / "a").iterdir()) == sorted(p.name for p in complete_runs[0].iterdir())


def test_query_out_inside_the_runs_directory_is_refused(complete_runs, tmp_path):
    runs = tmp_path / "runs"
    _copy(complete_runs[0], runs)
    (tmp_path / "link").symlink_to(runs / "a")
    (tmp_path / "elsewhere").mkdir()
    before = _tree(runs)
    for out in (
        "runs/a/sequences.parquet",
        str(runs / "new.csv"),
        "link/sequences.parquet",
        "elsewhere/../runs/a/x.json",
        "runs",
    ):
        proc = _query_here(tmp_path, "SELECT * FROM sequences", "--out", out, "-f", "csv")
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and "inside the runs directory" in lines[0], (out, proc.stderr)
    assert _tree(runs) == before
    proc = _query_here(tmp_path, "SELECT count(*) AS n FROM sequences", "--out", "elsewhere/n.csv")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "elsewhere" / "n.csv").read_text() == f"n\n{len(Run(runs / 'a').sequences())}\n"


def test_query_reads_the_user_s_own_files_and_writes_none(complete_runs, tmp_path):
    runs = tmp_path / "runs"
    _copy(complete_runs[0], runs)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "one.csv").write_text("sequence,note\n0,first\n")
    (tmp_path / "data" / "two.csv").write_text("sequence,note\n1,second\n")
    proc = _query_here(
        tmp_path,
        "SELECT s.sequence, n.note FROM sequences s JOIN read_csv('data/one.csv') n USING (sequence)",
        "-f",
        "csv",
    )
    assert proc.returncode == 0 and proc.stdout == "sequence,note\n0,first\n", proc.stderr
    proc = _query_here(tmp_path, "SELECT note FROM 'data/*.csv' ORDER BY note", "-f", "csv")
    assert proc.returncode == 0 and proc.stdout == "note\nfirst\nsecond\n", proc.stderr
    proc = _query_here(tmp_path, f"SELECT content FROM read_text('{tmp_path / 'data' / 'one.csv'}')", "-f", "json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["content"] == "sequence,note\n0,first\n", proc.stderr
    proc = _query_here(tmp_path, "COPY (SELECT 1 AS a) TO 'data/out.csv'")  # a result is written with --out
    assert proc.returncode == 2 and "read-only" in proc.stderr and "--out" in proc.stderr, proc.stderr
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["one.csv", "two.csv"]


def test_query_skips_one_damaged_run_and_the_healthy_one_answers(complete_runs, tmp_path):
    runs = tmp_path / "runs"
    _copy(complete_runs[0], runs)
    b = _copy(complete_runs[1], runs)
    manifest = json.loads((b / "manifest.json").read_text())
    manifest["run_id"] = "b\x1b[2J\x07"  # control bytes in what the warning quotes
    (b / "manifest.json").write_text(json.dumps(manifest))
    raw = bytearray((b / "tokens.parquet").read_bytes())
    raw[-200] ^= 0x01  # near the end, same size
    (b / "tokens.parquet").write_bytes(bytes(raw))
    proc = _query_here(tmp_path, "SELECT run_id, count(*) AS n FROM tokens GROUP BY ALL", "-f", "json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert rows == [{"run_id": "a", "n": len(Run(runs / "a").tokens())}]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("warning: run b\\x1b[2J\\x07 is damaged (tokens.parquet is changed)"), lines
    assert all(c.isprintable() for c in lines[0])
