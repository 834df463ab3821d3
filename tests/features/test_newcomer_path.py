"""The README's feature path ("Features, from a fresh clone"), run as written: its command lines are read
out of README.md, so the README cannot drift from what works, and run one by one in a fresh directory
holding copies of configs/ and scripts/, with the quick sizes the README gives for a first look
(`--limit 8`, `--latents 256 --k 8 --epochs 1`) in place of the full ones. Each exits 0 and prints or
writes what the README promises; the feature's top example is checked against the archived prompt
arrays read with zarr by the test itself. The last line (`lmtrace serve` and the feature page's
address) is only checked to name the page of the SAE and feature the lines before used."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.cli import REPO

pytestmark = pytest.mark.slow

HEADING = "### Features, from a fresh clone"


def readme_path() -> tuple[list[tuple[str, str]], str]:
    """((command, the line as written) for each line of the section's first sh block, the section's text
    after the block)."""
    text = (REPO / "README.md").read_text()
    assert HEADING in text, f"README.md has no {HEADING!r} section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "the section has no sh block"
    lines = [(re.sub(r"\s+#\s.*$", "", line).strip(), line) for line in block.group(1).splitlines()]
    return [(command, line) for command, line in lines if command], section[block.end() :]


def quick_options(after: str) -> dict[str, str]:
    """The options of the README's "first look" sizes: `--limit 8` and `--latents 256 --k 8 --epochs 1`."""
    m = re.search(r"first\s+look[^:]*:\s*`([^`]+)`\s+and\s+`([^`]+)`", after)
    assert m, "the README gives no quick sizes for a first look"
    words = (m.group(1) + " " + m.group(2)).split()
    return dict(zip(words[::2], words[1::2]))


def with_quick(args: list[str], quick: dict[str, str]) -> list[str]:
    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a in quick:
            out[i + 1] = quick[a]
    return out


def run_line(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    program = {"python": [sys.executable], "lmtrace": [sys.executable, "-m", "lmtrace.cli"]}[args[0]]
    proc = subprocess.run(program + args[1:], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stderr}"
    return proc


def test_readme_feature_path_runs_as_written(tmp_path):
    lines, after = readme_path()
    quick = quick_options(after)
    assert set(quick) >= {"--limit", "--latents", "--epochs"}
    for folder in ("configs", "scripts"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "LMTRACE_RUNS_DIR": str(tmp_path / "runs"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    values: dict[str, str] = {}
    used = set()
    for command, line in lines:
        assign = re.fullmatch(r"(\w+)=\$\((.*)\)", command)
        args = shlex.split(assign.group(2) if assign else command)
        used |= {a for a in args if a in quick}
        args = with_quick([values.get(a.lstrip("$"), a) if a.startswith("$") else a for a in args], quick)
        args = [a.replace("'$RUN'", f"'{values.get('RUN', '')}'") for a in args]
        if args[:2] == ["lmtrace", "serve"]:
            page = re.search(r"http://127\.0\.0\.1:\d+/#/run/\$RUN/feature/(\S+)/(\w+)\?positions=(\w+)", line)
            assert page and page.groups() == ("sae-l10", "F", "prompt"), line
            check_feature_page(tmp_path / "runs", values["RUN"], int(values["F"]), page.group(3))
            continue
        if args[-2:] == ["--feature", "F"]:
            args[-1] = values["F"]
        proc = run_line(args, tmp_path, env)
        if assign:
            values[assign.group(1)] = proc.stdout.strip()
        elif args[:2] == ["lmtrace", "query"]:
            rows = [r.split() for r in proc.stdout.splitlines() if re.match(r"\s*[│|]?\s*\d", r)]
            assert rows, proc.stdout
            values["F"] = rows[0][0].strip("│|")
        check_line(args, proc, tmp_path, values)
    assert used == set(quick), f"quick options the README's lines do not have: {set(quick) - used}"
    assert {"RUN", "F", "feature"} <= set(values), values


def check_line(args: list[str], proc, cwd: Path, values: dict) -> None:
    """What each line promises."""
    if args[0] == "python":
        prompts = (cwd / args[2]).read_text().splitlines()
        assert len(prompts) == int(args[args.index("--limit") + 1])
        assert all(json.loads(p)["prompt"] for p in prompts)
    elif args[1] == "generate":
        run = cwd / "runs" / proc.stdout.strip()
        assert json.loads((run / "manifest.json").read_text())["status"] == "complete"
    elif args[1:3] == ["sae", "train"]:
        out = cwd / args[args.index("--out") + 1]
        card = json.loads((out / "training_card.json").read_text())
        assert card["heldout"]["explained_variance"] > 0
        assert json.loads((out / "cfg.json").read_text())["d_sae"] == int(args[args.index("--latents") + 1])
    elif args[1] == "features" and "--feature" not in args:
        manifest = json.loads((cwd / "runs" / values["RUN"] / "manifest.json").read_text())
        assert [(f["name"], f["prompt"]) for f in manifest["features"]] == [("sae-l10", True)]
    elif args[1] == "features":
        check_top_example(proc.stdout, cwd / "runs" / values["RUN"], int(values["F"]))
        values["feature"] = proc.stdout


def check_feature_page(runs: Path, run_id: str, feature: int, positions: str) -> None:
    """The page's data, from `lmtrace serve`'s app: the top example is the largest activation over the
    archived prompt positions, marked in its context."""
    import zarr

    from tests.helpers.server import LiveServer

    server = LiveServer(runs)
    try:
        status, _, body = server.request(f"/api/runs/{run_id}/features/sae-l10/{feature}?positions={positions}")
    finally:
        server.stop()
    assert status == 200, body
    page = json.loads(body)
    group = zarr.open_group(str(runs / run_id / "tensors.zarr"), mode="r")
    idx = np.asarray(group["prompt_feat_sae-l10_idx"][:])
    val = np.asarray(group["prompt_feat_sae-l10_val"][:])
    top = page["examples"][0]
    assert top["step"] is None and top["activation"] == pytest.approx(float(val[idx == feature].max()), abs=1e-4)
    hit = next(c for c in top["context"] if c["position"] == top["position"])
    assert hit["activation"] == pytest.approx(top["activation"])
    assert page["active_tokens"] == int((idx == feature).any(-1).sum())


def check_top_example(stdout: str, run_dir: Path, feature: int) -> None:
    """The printed top activation is the feature's largest over the archived prompt positions, read
    here with zarr; the activating token is marked and the logit effects are printed."""
    import zarr

    group = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    idx = np.asarray(group["prompt_feat_sae-l10_idx"][:])
    val = np.asarray(group["prompt_feat_sae-l10_val"][:])
    assert f"feature {feature}: active on {int((idx == feature).any(-1).sum()):,} of" in stdout, stdout
    first = next(line for line in stdout.splitlines() if "[[" in line)
    assert float(first.split()[0]) == pytest.approx(float(val[idx == feature].max()), abs=1e-4)
    assert "promotes:" in stdout and "suppresses:" in stdout
