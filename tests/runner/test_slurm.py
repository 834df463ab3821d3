"""A real one-node SLURM: an array job with --shard auto, one task preempted with SIGTERM and resumed; a sweep
as an array job.

Needs root and Debian's slurmctld/slurmd/slurm-client/munge (`.ci/run` installs them with
`scripts/slurm-cluster.sh install`); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmtrace.archive.reader import Run
from tests.helpers.archives import assert_same_archive

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "munged", "mungekey")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root (munged, slurmctld and slurmd are started here)")
    missing = [t for t in TOOLS if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
    if missing:
        pytest.skip(
            f"SLURM packages not installed ({', '.join(missing)} missing): run scripts/slurm-cluster.sh install"
        )
    state = tmp_path_factory.mktemp("slurm-state")
    up = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm-cluster.sh"), "up", str(state)], capture_output=True, text=True
    )
    assert up.returncode == 0, f"slurm did not start: {up.stderr}\n{(state / 'log').glob('*')}"
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    try:
        yield env
    finally:
        subprocess.run(["bash", str(ROOT / "scripts/slurm-cluster.sh"), "down", str(state)], capture_output=True)


def _sbatch(env, *args) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


def _wait_gone(env, job: str, timeout=900) -> None:
    """Poll squeue (sbatch --wait polls slowly and sacct needs slurmdbd)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True)
        if out.returncode == 0 and not out.stdout.strip():
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not finish")


def test_array_job_with_a_preempted_task_resumes_to_the_single_process_result(slurm, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        json.dumps(
            {
                "prompts": [
                    "Count from one to fifty in words:",
                    "The alphabet, letter by letter:",
                    "Days of the week:",
                ],
                "generation": {"max_new_tokens": 40, "batch_size": 1, "temperature": 0.7, "seed": 2},
                "output": {"chunk_steps": 4},
            }
        )
    )
    runs = tmp_path / "runs"
    lmtrace = f"{sys.executable} -m lmtrace.cli"
    script = tmp_path / "task.sh"
    script.write_text(
        f"#!/bin/bash\ncd {ROOT}\nexport OMP_NUM_THREADS=1\n"
        f"exec {lmtrace} generate {spec} --shard auto --runs-dir {runs}\n"
    )
    job = _sbatch(slurm, "--array=0-2", "-o", str(tmp_path / "task-%a.out"), "--cpus-per-task=1", str(script))
    run_dir = runs / f"slurm-{job}"
    beat = run_dir / "heartbeats" / "shard-1-of-3.json"
    deadline = time.time() + 600
    while not beat.is_file():  # task 1 is generating
        assert time.time() < deadline, (
            (tmp_path / "task-1.out").read_text() if (tmp_path / "task-1.out").exists() else "no output"
        )
        time.sleep(0.1)
    subprocess.run(["scancel", "--batch", "--signal=TERM", f"{job}_1"], env=slurm, check=True)
    _wait_gone(slurm, job)
    log1 = (tmp_path / "task-1.out").read_text()
    assert "error: interrupted" in log1, log1
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] != "complete"
    shards = {p.stem: json.loads(p.read_text())["status"] for p in (run_dir / "shards").glob("*.json")}
    assert shards == {"shard-0-of-3": "complete", "shard-1-of-3": "interrupted", "shard-2-of-3": "complete"}, shards

    again = _sbatch(
        slurm,
        "-o",
        str(tmp_path / "resume.out"),
        "--wrap",
        f"cd {ROOT} && OMP_NUM_THREADS=1 exec {lmtrace} generate --resume slurm-{job} --shard 1/3 --runs-dir {runs}",
    )
    _wait_gone(slurm, again)
    assert Run(run_dir).status == "complete", (tmp_path / "resume.out").read_text()

    single = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmtrace.cli",
            "generate",
            str(spec),
            "--run-id",
            "single",
            "--runs-dir",
            str(runs),
            "-q",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert single.returncode == 0, single.stderr
    assert_same_archive(Run(runs / "single"), Run(run_dir))


def test_sweep_as_an_array_job_equals_the_unsharded_sweep(slurm, tmp_path, sharp_llama_dir):  # noqa: F811
    """`lmtrace sweep --shard auto` in a 3-task array: one sweep `slurm-<job id>`, assembled once by the last task,
    equal to the unsharded sweep bit for bit (same --batch, so the same blocks; one thread in both, as float sums
    depend on the thread count)."""
    import pandas as pd
    import pyarrow.parquet as pq

    from tests.helpers.runs import run_spec

    parent = run_spec(
        tmp_path,
        {
            "model": str(sharp_llama_dir),
            "prompts": ["The quick brown fox", "Paris is the"],
            "capture": "none",
            "output": {"run_id": "parent"},
            "generation": {"max_new_tokens": 4, "batch_size": 2, "temperature": 0.9, "seed": 5},
        },
    )
    metrics = ["logprob", "kl", "logit_diff:42,7"]
    args = [
        "--over",
        "heads",
        "--edit",
        "zero",
        "--batch",
        "3",
        "--from-step",
        "1",
        "--json",
        *[a for m in metrics for a in ("--metric", m)],
    ]
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = tmp_path / "task.sh"
    script.write_text(
        f"#!/bin/bash\ncd {ROOT}\nexport {' '.join(f'{k}={v}' for k, v in env.items())}\n"
        f"exec {sys.executable} -m lmtrace.cli sweep {parent.path} {' '.join(map(shlex.quote, args))} "
        f"--shard auto\n"
    )
    job = _sbatch(slurm, "--array=0-2", "-o", str(tmp_path / "task-%a.out"), "--cpus-per-task=1", str(script))
    _wait_gone(slurm, job)
    logs = [(tmp_path / f"task-{i}.out").read_text() for i in range(3)]
    statuses = []
    for log in logs:
        assert "Traceback" not in log and "error" not in log.lower(), log
        statuses.append(json.loads(log.strip().splitlines()[-1])["status"])
    assert sorted(statuses) == ["complete", "shard-complete", "shard-complete"], logs  # exactly one assembled
    sweep_id = f"slurm-{job}"
    root = parent.path / "sweeps"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".lock")) == [sweep_id]  # no partial left
    assert [e["id"] for e in Run(parent.path).manifest["sweeps"]] == [sweep_id]
    info = json.loads((root / sweep_id / "sweep.json").read_text())
    assert info["timings"]["shards"] == 3 and info["n_cells"] == 16

    single = subprocess.run(
        [sys.executable, "-m", "lmtrace.cli", "sweep", str(parent.path), *args, "--run-id", "single"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    assert single.returncode == 0, single.stderr
    key = ["component", "layer", "q_head", "neuron", "position", "sequence", "step", "metric"]

    def table(path):
        return pq.read_table(path / "sweep.parquet").to_pandas().sort_values(key).reset_index(drop=True)

    sharded, unsharded = table(root / sweep_id), table(root / "single")
    assert len(sharded) == 16 * 2 * 3 * len(metrics)  # heads x sequences x steps 1..3 x metrics
    pd.testing.assert_frame_equal(sharded, unsharded, check_exact=True)
    assert unsharded[unsharded.metric == "kl"].effect.max() > 1e-2  # the cells differ: a wrong cell cannot pass
