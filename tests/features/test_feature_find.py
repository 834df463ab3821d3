"""Finding features fast (docs/features.md, "Finding features"): the feature arrays read shard file by
shard file equal zarr's own reads; `--feature F --prompt` finds over the prompt positions (against the
test's own top values of the archived prompt arrays, read with zarr); the logit effects come from the
cache once the model has been loaded, with the model gone, the same numbers, equal to the test's own
W_dec · gain · W_U."""

from __future__ import annotations

import hashlib
import json
import shutil
import time

import numpy as np
import pytest
import torch

from tests.helpers.cli import assert_one_line_error, lmtrace
from tests.helpers.runs import PROMPTS, run_spec
from tests.helpers.saes import random_sae
from tests.helpers.server import LiveServer

D_SAE, TOP_K, NAME = 96, 6, "resid-sae"


@pytest.fixture(scope="module")
def prompt_run(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("feature-find")
    model = shutil.copytree(tiny_llama_dir, root / "model")  # a copy this module may take away
    cfg, w = random_sae(root / NAME, "blocks.1.hook_resid_post", 64, D_SAE, seed=2, scale=3.0)
    run = run_spec(
        root / "runs",
        {
            "model": str(model),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 6, "batch_size": 2},
            "capture": {"features": [{"sae": str(root / NAME), "top_k": TOP_K, "prompt": True}]},
        },
    )
    return {"run": run, "w": w, "model": model, "root": root}


def _zarr_arrays(run_dir, prefix: str = ""):
    import zarr

    group = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    return np.asarray(group[f"{prefix}feat_{NAME}_idx"][:]), np.asarray(group[f"{prefix}feat_{NAME}_val"][:])


def test_feature_arrays_read_shard_by_shard_equal_zarrs_own_reads(prompt_run):
    import zarr

    from lmtrace.archive.feature_arrays import read_whole

    group = zarr.open_group(str(prompt_run["run"].path / "tensors.zarr"), mode="r")
    for prefix in ("", "prompt_"):
        for kind in ("idx", "val"):
            array = group[f"{prefix}feat_{NAME}_{kind}"]
            want = np.asarray(array[:])
            np.testing.assert_array_equal(read_whole(array), want)
            some = np.zeros(want.shape[0], dtype=bool)
            some[1] = True
            part = read_whole(array, some)
            np.testing.assert_array_equal(part[1], want[1])
            rest = part[~some]
            assert (np.isnan(rest) if kind == "val" else rest == -1).all()


def test_feature_examples_and_density_over_prompt_positions(prompt_run, tmp_path):
    run = prompt_run["run"]
    idx, val = _zarr_arrays(run.path, "prompt_")
    feature = int(np.bincount(idx[idx >= 0]).argmax())
    args = ("features", str(run.path), "--sae", NAME, "--feature", str(feature), "--top", "3", "--prompt")
    proc = lmtrace(tmp_path, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    seq, pos, k = np.nonzero(idx == feature)
    order = np.lexsort((pos, seq, -val[seq, pos, k]))[:3]
    assert [(e["sequence"], e["position"]) for e in out["examples"]] == [(int(seq[i]), int(pos[i])) for i in order]
    assert all(e["step"] is None for e in out["examples"])
    np.testing.assert_allclose([e["activation"] for e in out["examples"]], val[seq, pos, k][order], rtol=1e-6)
    tokens = run.tokens().to_pandas()
    first = out["examples"][0]
    text = tokens[(tokens.sequence == first["sequence"]) & (tokens.position == first["position"])].token_text.item()
    assert first["token"] == text and f"[[{text}]]" in first["context"]
    prompt_tokens = int(run.prompt_len().sum())
    assert (out["positions"], out["tokens"]) == ("prompt", prompt_tokens)
    assert out["active_tokens"] == len(set(zip(seq.tolist(), pos.tolist())))
    printed = lmtrace(tmp_path, *args).stdout
    assert f"of {prompt_tokens:,} prompt tokens" in printed and f"pos {int(pos[order[0]]):>5}" in printed


def test_logit_effects_come_from_the_cache_once_read_with_the_model_gone(prompt_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run = prompt_run["run"]
    env = {"LMTRACE_CACHE_DIR": str(tmp_path / "cache")}
    args = ("features", str(run.path), "--sae", NAME, "--feature", "3", "--tokens", "5", "--json")
    first = lmtrace(tmp_path, *args, env=env)
    assert first.returncode == 0, first.stderr
    assert list((tmp_path / "cache" / "unembedding").glob("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(prompt_run["model"], dtype=torch.float32)
    gone = prompt_run["model"].rename(prompt_run["root"] / "model-gone")
    try:
        second = lmtrace(tmp_path, *args, env=env)
        assert second.returncode == 0, second.stderr
        assert json.loads(second.stdout) == json.loads(first.stdout)
        # a fresh cache needs the model, which is gone: one line, exit 1 (the model could not be loaded)
        fresh = lmtrace(tmp_path, *args, env={"LMTRACE_CACHE_DIR": str(tmp_path / "empty")})
        assert_one_line_error(fresh, 1, "not available here", "logit effects")
        # a changed byte in the cache's data is a cache miss, never an effect shown: the model is needed again
        (cached,) = (tmp_path / "cache" / "unembedding").glob("*.safetensors")
        data = bytearray(cached.read_bytes())
        data[-3] ^= 0x40
        cached.write_bytes(bytes(data))
        damaged = lmtrace(tmp_path, *args, env=env)
        assert_one_line_error(damaged, 1, "not available here", "logit effects")
    finally:
        gone.rename(prompt_run["model"])
    effects = model.lm_head.weight.detach().double().numpy() @ (
        prompt_run["w"]["W_dec"][3].astype(np.float64) * model.model.norm.weight.detach().double().numpy()
    )
    out = json.loads(second.stdout)["logit_effects"]
    assert [t["id"] for t in out["promoted"]] == np.argsort(-effects)[:5].tolist()
    assert [t["id"] for t in out["suppressed"]] == np.argsort(effects)[:5].tolist()
    np.testing.assert_allclose([t["effect"] for t in out["promoted"]], np.sort(effects)[::-1][:5], rtol=1e-4)


def test_prompt_positions_without_prompt_arrays_are_refused_in_one_line(prompt_run, tmp_path):
    from lmtrace.archive.runs import read_manifest

    copy = shutil.copytree(prompt_run["run"].path, tmp_path / "runs" / prompt_run["run"].path.name)
    manifest = read_manifest(copy)
    manifest["features"][0]["prompt"] = False
    (copy / "manifest.json").write_text(json.dumps(manifest))
    proc = lmtrace(tmp_path, "features", str(copy), "--sae", NAME, "--feature", "1", "--prompt")
    assert_one_line_error(proc, 2, "no prompt-position features", "--prompt")


def test_a_feature_s_terminal_view_fits_80_columns_without_splitting_an_item(monkeypatch, capsys):
    """On an 80-column terminal: the header and the logit effects wrap between items (a token and its
    effect stay together), each example's context is cut around its activating token; piped, one line each."""
    from lmtrace.commands import feature_find

    tokens = [{"text": f" token{i} with space", "effect": 1.0 / (i + 1)} for i in range(10)]
    out = {
        "run_id": "20260101-000000-000aaaaaa",
        "sae": "sae-l10",
        "hook_name": "blocks.10.hook_resid_post",
        "feature": 5,
        "positions": "generated",
        "active_tokens": 1234,
        "tokens": 56789,
        "density": 0.0217,
        "examples": [
            {"activation": 53.9, "sequence": 1, "step": 22, "position": 40, "context": "x" * 60 + "[[ of]]" + "y" * 60}
        ],
        "logit_effects": {"promoted": tokens, "suppressed": tokens},
    }
    monkeypatch.setattr(feature_find, "terminal_width", lambda: 80)
    feature_find._print_feature(out)
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert "[[ of]]" in lines[2] and "…" in lines[2]
    text = "\n".join(lines)
    for t in tokens:  # each item whole on one line
        assert any(f"{t['text']!r} {t['effect']:+.3f}" in line for line in lines), text
    monkeypatch.setattr(feature_find, "terminal_width", lambda: None)
    feature_find._print_feature(out)
    piped = capsys.readouterr().out.splitlines()
    assert len(piped) == 4 and "x" * 60 + "[[ of]]" + "y" * 60 in piped[1]


def test_the_by_table_on_a_terminal_leaves_out_groups_that_do_not_fit_and_names_them(monkeypatch, capsys):
    from lmtrace.commands import feature_find

    groups = ["alpha", "beta", "gamma", "delta"]
    cell = {"mean": 12.3456, "low": 10.1234, "high": 14.5678}
    out = {
        "run_id": "20260101-000000-000aaaaaa",
        "sae": "sae-l10",
        "group_column": "topic",
        "groups": groups,
        "features": [{"feature": f, "spread": 1.5, "groups": [cell] * 4} for f in (7, 123)],
    }
    monkeypatch.setattr(feature_find, "terminal_width", lambda: 80)
    monkeypatch.setenv("COLUMNS", "80")
    feature_find._print_by(out)
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert any(line.lstrip().startswith("123 ") and "12.3456 [10.1234,14.5678]" in line for line in lines), lines
    assert "left out to fit 80 columns: " in " ".join(lines) and "delta" in lines[-1] + lines[-2], lines


STORE_SCRIPT = """
import sys, time
from pathlib import Path
from lmtrace.analysis.features.find import store_logit_effects
run, go, sha, first, count = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
while not go.exists():
    time.sleep(0.001)
for f in range(first, first + count):
    store_logit_effects(run, {"name": "resid-sae", "sha256": sha}, f, {"promoted": [[f, f / 2]], "by": first})
"""


def _effects_of(f: int, first: int) -> dict:
    return {"promoted": [[f, f / 2]], "by": first}


def test_concurrent_feature_effects_stores_all_end_up_in_the_file_and_recorded(prompt_run, tmp_path):
    import subprocess
    import sys

    from lmtrace.analysis.features.find import logit_effects_file
    from lmtrace.archive.runs import read_manifest

    run = shutil.copytree(prompt_run["run"].path, tmp_path / "runs" / prompt_run["run"].path.name)
    sae = next(f for f in read_manifest(run)["features"] if f["name"] == NAME)
    rel = logit_effects_file(NAME)
    before = set(json.loads((run / rel).read_text())["features"]) if (run / rel).is_file() else set()
    per, rounds = 12, 3
    for r in range(rounds):
        go = tmp_path / f"go{r}"
        starts = (10000 + 1000 * r, 10500 + 1000 * r)
        procs = [
            subprocess.Popen([sys.executable, "-c", STORE_SCRIPT, str(run), str(go), sae["sha256"], str(s), str(per)])
            for s in starts
        ]
        time.sleep(1.5)  # both imported and waiting
        go.touch()
        assert all(p.wait(timeout=120) == 0 for p in procs)
    kept = json.loads((run / rel).read_text())
    want = {
        str(f): _effects_of(f, s)
        for r in range(rounds)
        for s in (10000 + 1000 * r, 10500 + 1000 * r)
        for f in range(s, s + per)
    }
    assert {f: e for f, e in kept["features"].items() if f not in before} == want
    recorded = json.loads((run / "checksums.json").read_text())["files"]
    assert recorded[rel][1] == hashlib.sha256((run / rel).read_bytes()).hexdigest()
    assert lmtrace(tmp_path, "verify", str(run)).returncode == 0


def test_a_changed_byte_in_the_kept_logit_effects_is_damage_readers_report_and_verify_names(prompt_run, tmp_path):
    from lmtrace.analysis.features.find import logit_effects_file, store_logit_effects, stored_logit_effects
    from lmtrace.archive.reader import Run
    from lmtrace.archive.runs import read_manifest
    from lmtrace.exits.errors import ArchiveDamaged
    from lmtrace.viewdata.features import feature_page

    run = shutil.copytree(prompt_run["run"].path, tmp_path / "runs" / prompt_run["run"].path.name)
    sae = next(f for f in read_manifest(run)["features"] if f["name"] == NAME)
    store_logit_effects(run, sae, 5, _effects_of(5, 0))
    assert stored_logit_effects(run, sae, 5) == _effects_of(5, 0)
    rel = logit_effects_file(NAME)
    data = bytearray((run / rel).read_bytes())
    at = data.index(b"2.5")
    data[at] = ord("7")  # 2.5 -> 7.5: still valid JSON, a wrong effect
    (run / rel).write_bytes(bytes(data))
    with pytest.raises(ArchiveDamaged, match=f"{rel} is changed"):
        stored_logit_effects(run, sae, 5)
    with pytest.raises(ArchiveDamaged, match=f"{rel} is changed"):
        feature_page(Run(run), NAME, 5)
    store_logit_effects(run, sae, 6, _effects_of(6, 0))  # a writer leaves the damage as it is
    assert (run / rel).read_bytes() == bytes(data)
    proc = lmtrace(tmp_path, "verify", str(run))
    assert_one_line_error(proc, 2, f"{rel} is changed")
    server = LiveServer(tmp_path / "runs")
    try:
        status, _, body = server.request(f"/api/runs/{run.name}/features/{NAME}/5")
    finally:
        server.stop()
    assert status == 409 and f"{rel} is changed" in body.decode()
