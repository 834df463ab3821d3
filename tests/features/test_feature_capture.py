"""Feature activations in the archive (docs/features.md, "Archiving features"): `capture.features`
during generate against the SAE applied by the test's own numpy formula to the model's own full
forward at the hook (the test's own hooks), on tiny random models of three families at three hook
points; the deferred `lmtrace features RUN --sae DIR` (archive and replay) against the inline arrays;
a killed and resumed run; the `features` query view, `--feature` (examples, density, logit effects
against the test's own W_dec · gain · W_U), `--by` against the test's own group means, `show --step`;
bad input refused in one line before any step."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.architectures import BY_ID, build_tiny
from tests.helpers.cli import assert_one_line_error, lmtrace
from tests.helpers.runs import PROMPTS, run_spec
from tests.helpers.saes import dense, encode, random_sae, top_of, write_saelens_dir

# family -> (hook name, the test's own module path from the CausalLM and which side of it, width)
HOOKS = {
    "llama": ("blocks.1.hook_resid_post", "model.layers.1", "out", 64),
    "gpt2": ("blocks.1.attn.hook_z", "transformer.h.1.attn.c_proj", "in", 64),
    "opt": ("blocks.2.mlp.hook_post", "model.decoder.layers.2.fc2", "in", 128),
}
D_SAE, TOP_K = 96, 6


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from lmtrace.runner.models import load_model
    from lmtrace.spec.run_spec import ModelSpec

    tok = load_model(ModelSpec()).tokenizer
    root = tmp_path_factory.mktemp("feature-models")
    return {family: build_tiny(BY_ID[family], tok, root / family) for family in HOOKS}


def _module(root, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root


@torch.inference_mode()
def own_site(model_dir: Path, path: str, side: str, ids: list[int]) -> np.ndarray:
    """[T, width]: the tensor at the hook for every position of `ids`, from the model's own eager full
    forward in float32 with the test's own hook."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    seen = []
    mod = _module(model, path)
    if side == "out":
        h = mod.register_forward_hook(lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o))
    else:
        h = mod.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    model(torch.tensor([ids]))
    h.remove()
    return seen[0].reshape(len(ids), -1).float().numpy()


def _sequences(run) -> dict[int, tuple[list[int], list[int]]]:
    t = run.tokens().to_pandas().sort_values(["sequence", "position"])
    return {
        int(s): (g[g.is_prompt].token_id.tolist(), g[~g.is_prompt].token_id.tolist()) for s, g in t.groupby("sequence")
    }


@pytest.mark.parametrize("family", list(HOOKS))
def test_archived_features_equal_the_sae_on_the_models_own_forward_at_the_hook(tmp_path, tiny_models, family):
    hook, path, side, width = HOOKS[family]
    cfg, w = random_sae(
        tmp_path / "my-sae", hook, width, D_SAE, arch="jumprelu" if family == "gpt2" else "standard", seed=1, scale=3.0
    )
    run = run_spec(
        tmp_path,
        {
            "model": str(tiny_models[family]),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 5, "batch_size": 2},
            "capture": {"features": [{"sae": str(tmp_path / "my-sae"), "top_k": TOP_K, "prompt": True}]},
        },
    )
    idx, val = run.array("feat_my-sae_idx")[:], run.array("feat_my-sae_val")[:]
    p_idx, p_val = run.array("prompt_feat_my-sae_idx")[:], run.array("prompt_feat_my-sae_val")[:]
    assert idx.dtype == np.int32 and val.dtype == np.float32 and idx.shape[-1] == TOP_K
    checked = 0
    for seq, (prompt, generated) in _sequences(run).items():
        x = own_site(tiny_models[family], path, side, prompt + generated)
        want = top_of(encode(cfg, w, x), TOP_K)  # [T, d_sae]
        steps = [len(prompt) - 1 + s for s in range(len(generated))]
        np.testing.assert_allclose(
            dense(idx[seq, : len(generated)], val[seq, : len(generated)], D_SAE), want[steps], atol=2e-4, rtol=1e-3
        )
        np.testing.assert_allclose(
            dense(p_idx[seq, : len(prompt)], p_val[seq, : len(prompt)], D_SAE),
            want[: len(prompt)],
            atol=2e-4,
            rtol=1e-3,
        )
        assert (idx[seq, len(generated) :] == -1).all() and np.isnan(val[seq, len(generated) :]).all()
        # largest first, -1 / NaN after the active ones
        v = np.where(idx[seq, : len(generated)] >= 0, val[seq, : len(generated)], -np.inf)
        assert (np.diff(v, axis=-1) <= 0).all()
        checked += int((idx[seq, : len(generated)] >= 0).sum())
    assert checked > 10  # the SAE is active on the tokens
    entry = run.manifest["features"][0]
    import hashlib

    assert entry["sha256"] == hashlib.sha256((tmp_path / "my-sae" / "sae_weights.safetensors").read_bytes()).hexdigest()
    assert (entry["name"], entry["hook_name"], entry["d_sae"], entry["top_k"]) == ("my-sae", hook, D_SAE, TOP_K)
    assert lmtrace(tmp_path, "verify", str(run.path)).returncode == 0


# --- one llama run with inline features, and the same run without them --------------------------
SPEC = {
    "prompts": PROMPTS,
    "generation": {"max_new_tokens": 6, "batch_size": 2},
    "capture": {"residual": {"vectors_at": [1], "dtype": "float32"}},
}


@pytest.fixture(scope="module")
def feature_runs(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("feature-runs")
    cfg, w = random_sae(root / "resid-sae", "blocks.1.hook_resid_post", 64, D_SAE, seed=2, scale=3.0)
    data = {**SPEC, "model": str(tiny_models["llama"])}
    inline = run_spec(
        root / "inline",
        {
            **data,
            "capture": {
                **SPEC["capture"],
                "features": [{"sae": str(root / "resid-sae"), "top_k": TOP_K, "prompt": True}],
            },
        },
    )
    plain = run_spec(root / "plain", data)
    return {"root": root, "inline": inline, "plain": plain, "cfg": cfg, "w": w, "sae": root / "resid-sae"}


def _arrays(run_dir: Path, name: str, prompt: bool = False) -> tuple[np.ndarray, np.ndarray]:
    from lmtrace.archive.reader import Run

    run = Run(run_dir)
    p = "prompt_" if prompt else ""
    return run.array(f"{p}feat_{name}_idx")[:], run.array(f"{p}feat_{name}_val")[:]


@pytest.mark.parametrize("source", ["archive", "replay"])
def test_deferred_features_equal_the_inline_ones(feature_runs, tmp_path, source):
    plain = tmp_path / "runs" / feature_runs["plain"].path.name
    shutil.copytree(feature_runs["plain"].path, plain)
    args = [
        "features",
        str(plain),
        "--sae",
        str(feature_runs["sae"]),
        "--top-k",
        str(TOP_K),
        "--source",
        source,
        "--json",
    ] + (["--prompt"] if source == "replay" else [])
    proc = lmtrace(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["computed"] and out["source"] == source and out["name"] == "resid-sae"
    idx, val = _arrays(feature_runs["inline"].path, "resid-sae")
    idx2, val2 = _arrays(plain, "resid-sae")
    np.testing.assert_array_equal(idx2, idx)
    np.testing.assert_allclose(val2, val, atol=1e-5, rtol=1e-4)
    if source == "replay":
        p, pv = _arrays(feature_runs["inline"].path, "resid-sae", prompt=True)
        p2, pv2 = _arrays(plain, "resid-sae", prompt=True)
        np.testing.assert_array_equal(p2, p)
        np.testing.assert_allclose(pv2, pv, atol=1e-5, rtol=1e-4)
    assert lmtrace(tmp_path, "verify", str(plain)).returncode == 0  # checksums recorded for the new arrays
    again = json.loads(lmtrace(tmp_path, *args).stdout)
    assert again["computed"] is False


def test_a_killed_and_resumed_run_archives_the_same_features(feature_runs, tmp_path):
    spec = tmp_path / "spec.json"
    data = {
        **SPEC,
        "model": str(feature_runs["inline"].manifest["spec_resolved"]["model"]["ref"]),
        "output": {"chunk_steps": 2},
        "capture": {**SPEC["capture"], "features": [{"sae": str(feature_runs["sae"]), "top_k": TOP_K}]},
    }
    spec.write_text(json.dumps(data))  # (JSON is YAML)
    killed = lmtrace(
        tmp_path, "generate", str(spec), "--run-id", "killed", "-q", env={"LMTRACE_TEST_KILL_AT": "block-committed@2"}
    )
    assert killed.returncode != 0
    resumed = lmtrace(tmp_path, "generate", "--resume", "killed", "-q")
    assert resumed.returncode == 0, resumed.stderr
    idx, val = _arrays(feature_runs["inline"].path, "resid-sae")
    idx2, val2 = _arrays(tmp_path / "runs" / "killed", "resid-sae")
    np.testing.assert_array_equal(idx2, idx)
    np.testing.assert_allclose(val2, val, atol=1e-5, rtol=1e-4)
    assert lmtrace(tmp_path, "verify", "killed").returncode == 0


def test_the_features_query_view_holds_every_archived_latent(feature_runs, tmp_path):
    run = feature_runs["inline"]
    proc = lmtrace(
        tmp_path,
        "query",
        "--runs-dir",
        str(run.path.parent),
        "--format",
        "csv",
        "SELECT run_id, sequence, position, step, sae, feature, activation FROM features "
        "ORDER BY sequence, position, step NULLS FIRST, feature",
    )
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(io.StringIO(proc.stdout)))
    idx, val = _arrays(run.path, "resid-sae")
    p_idx, p_val = _arrays(run.path, "resid-sae", prompt=True)
    prompt_len = run.prompt_len()
    want = []
    for s in range(idx.shape[0]):
        for t in range(p_idx.shape[1]):
            want += [(s, t, None, int(i), float(v)) for i, v in zip(p_idx[s, t], p_val[s, t]) if i >= 0]
        for t in range(idx.shape[1]):
            want += [(s, int(prompt_len[s]) + t, t, int(i), float(v)) for i, v in zip(idx[s, t], val[s, t]) if i >= 0]
    want.sort(key=lambda r: (r[0], r[1], -1 if r[2] is None else r[2], r[3]))
    got = [
        (
            int(r["sequence"]),
            int(r["position"]),
            None if r["step"] == "" else int(r["step"]),
            int(r["feature"]),
            float(r["activation"]),
        )
        for r in rows
    ]
    assert [g[:4] for g in got] == [w[:4] for w in want]
    np.testing.assert_allclose([g[4] for g in got], [w[4] for w in want], rtol=1e-6)
    assert {r["sae"] for r in rows} == {"resid-sae"} and {r["run_id"] for r in rows} == {run.id}


def test_feature_examples_density_and_logit_effects(feature_runs, tmp_path, tiny_models):
    from transformers import AutoModelForCausalLM

    run = feature_runs["inline"]
    idx, val = _arrays(run.path, "resid-sae")
    feature = int(np.bincount(idx[idx >= 0]).argmax())  # the most often active latent
    proc = lmtrace(
        tmp_path,
        "features",
        str(run.path),
        "--sae",
        "resid-sae",
        "--feature",
        str(feature),
        "--top",
        "3",
        "--tokens",
        "4",
        "--window",
        "2",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    seq, step, k = np.nonzero(idx == feature)
    order = np.argsort(-val[seq, step, k], kind="stable")[:3]
    assert [(e["sequence"], e["step"]) for e in out["examples"]] == [(int(seq[i]), int(step[i])) for i in order]
    np.testing.assert_allclose([e["activation"] for e in out["examples"]], val[seq, step, k][order], rtol=1e-6)
    assert "[[" in out["examples"][0]["context"]
    n_tokens = int(np.maximum(run.generated_len(), 0).sum())
    assert out["active_tokens"] == len(set(zip(seq.tolist(), step.tolist())))
    assert out["density"] == pytest.approx(out["active_tokens"] / n_tokens)
    # the test's own logit effects: W_dec[F] times the final RMSNorm's weight, through lm_head
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    effects = model.lm_head.weight.detach().double().numpy() @ (
        feature_runs["w"]["W_dec"][feature].astype(np.float64) * model.model.norm.weight.detach().double().numpy()
    )
    top = np.argsort(-effects)[:4]
    bottom = np.argsort(effects)[:4]
    assert [t["id"] for t in out["logit_effects"]["promoted"]] == top.tolist()
    assert [t["id"] for t in out["logit_effects"]["suppressed"]] == bottom.tolist()
    np.testing.assert_allclose([t["effect"] for t in out["logit_effects"]["promoted"]], effects[top], rtol=1e-4)


def test_features_by_a_prompt_column_give_the_group_means(tmp_path, feature_runs):
    prompts = tmp_path / "prompts.csv"
    prompts.write_text(
        "prompt,topic\n"
        + "\n".join(
            f'"{p}",{"a" if i % 2 else "b"}' for i, p in enumerate(PROMPTS + ["Once upon a time", "Red, green,"])
        )
        + "\n"
    )
    run = run_spec(
        tmp_path,
        {
            **SPEC,
            "model": feature_runs["inline"].manifest["spec_resolved"]["model"]["ref"],
            "prompts": {"file": str(prompts)},
            "capture": {"features": [{"sae": str(feature_runs["sae"]), "top_k": TOP_K}]},
        },
    )
    proc = lmtrace(
        tmp_path, "features", str(run.path), "--sae", str(feature_runs["sae"]), "--by", "topic", "--top", "3", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    idx, val = _arrays(run.path, "resid-sae")
    n = np.maximum(run.generated_len(), 0)
    topic = {s: ("a" if s % 2 else "b") for s in range(len(n))}
    acts = dense(idx, np.nan_to_num(val), D_SAE)  # [seq, step, d_sae]
    means = {
        g: acts[[s for s in topic if topic[s] == g]].sum((0, 1)) / n[[s for s in topic if topic[s] == g]].sum()
        for g in ("a", "b")
    }
    spread = np.abs(means["a"] - means["b"])
    assert out["groups"] == ["a", "b"]
    assert [r["feature"] for r in out["features"]] == np.argsort(-spread, kind="stable")[:3].tolist()
    for r in out["features"]:
        for g, stats in zip(("a", "b"), r["groups"]):
            assert stats["mean"] == pytest.approx(means[g][r["feature"]], rel=1e-5, abs=1e-9)
            assert stats["low"] <= stats["mean"] + 1e-9 and stats["mean"] <= stats["high"] + 1e-9


def _own_active(run_dir: Path, name: str, seq: int, step: int) -> list[tuple[int, float]]:
    """The token's archived latents read here with zarr: (latent, activation), largest first, ties by id."""
    import zarr

    store = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    ids, vals = np.asarray(store[f"feat_{name}_idx"][seq, step]), np.asarray(store[f"feat_{name}_val"][seq, step])
    return sorted(((int(i), float(v)) for i, v in zip(ids, vals) if i >= 0), key=lambda x: (-x[1], x[0]))


def test_show_step_lists_every_archived_latent_of_the_token_in_json_and_at_80_columns(feature_runs, tmp_path):
    """All of them (16 here, more than the token view's 10), in --json and in the terminal's cells."""
    run = tmp_path / "runs" / "wide-k"
    shutil.copytree(feature_runs["plain"].path, run)
    proc = lmtrace(tmp_path, "features", str(run), "--sae", str(feature_runs["sae"]), "--top-k", "16")
    assert proc.returncode == 0, proc.stderr
    for path, seq, step in ((feature_runs["inline"].path, 2, 1), (run, 0, 0), (run, 1, 3)):
        want = _own_active(path, "resid-sae", seq, step)
        assert path == feature_runs["inline"].path or len(want) == 16
        args = ("show", str(path), "--step", str(step), "--sequence", str(seq))
        proc = lmtrace(tmp_path, *args, "--json")
        assert proc.returncode == 0, proc.stderr
        (entry,) = json.loads(proc.stdout)["features"]
        assert (entry["sae"], entry["hook_name"]) == ("resid-sae", "blocks.1.hook_resid_post")
        assert [a["feature"] for a in entry["active"]] == [i for i, _ in want]
        np.testing.assert_allclose([a["activation"] for a in entry["active"]], [v for _, v in want], rtol=1e-6)
        # at 80 columns the 55-column head is a line of its own, the cells packed under it
        lines = lmtrace(tmp_path, *args, env={"COLUMNS": "80"}).stdout.splitlines()
        first = lines.index("features of SAE resid-sae (blocks.1.hook_resid_post):")
        block = []
        for line in lines[first + 1 :]:
            if not line.startswith("  "):
                break
            block.append(line)
        assert all(len(line) <= 80 for line in block) and len(block) < len(want)
        cells = [c.split() for line in block for c in line[2:].split("  ")]
        assert [int(f) for f, _ in cells] == [i for i, _ in want]
        np.testing.assert_allclose([float(v) for _, v in cells], [v for _, v in want], rtol=1e-2)


def _bad_saes(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good_cfg, good_w = random_sae(tmp_path / "good", "blocks.1.hook_resid_post", 64, 16)
    nan_w = {**good_w, "W_dec": np.full_like(good_w["W_dec"], np.nan)}
    return {
        "missing directory": (tmp_path / "nowhere", "no such directory"),
        "d_in mismatch": (
            random_sae(tmp_path / "narrow", "blocks.1.hook_resid_post", 32, 16) and tmp_path / "narrow",
            "d_in 32 does not match",
        ),
        "layer the model lacks": (
            random_sae(tmp_path / "deep", "blocks.9.hook_resid_post", 64, 16) and tmp_path / "deep",
            "layer 9 is out of range",
        ),
        "NaN weights": (write_saelens_dir(tmp_path / "nan", good_cfg, nan_w), "W_dec holds NaN"),
        "unknown architecture": (
            write_saelens_dir(tmp_path / "gated", {**good_cfg, "architecture": "gated"}, good_w),
            "unknown architecture 'gated'",
        ),
    }


def test_bad_saes_are_refused_in_one_line_before_any_step(tmp_path, tiny_models):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        json.dumps({"model": str(tiny_models["llama"]), "prompts": ["a b c"], "generation": {"max_new_tokens": 2}})
    )
    for what, (path, fragment) in _bad_saes(tmp_path).items():
        proc = lmtrace(tmp_path, "generate", str(spec), "--sae", str(path), "-q")
        assert_one_line_error(proc, 2, fragment)
        assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), what
    typo = tmp_path / "typo.yaml"
    typo.write_text(
        json.dumps(
            {"model": str(tiny_models["llama"]), "prompts": ["a"], "capture": {"features": [{"sae": "x", "topk": 3}]}}
        )
    )
    assert_one_line_error(lmtrace(tmp_path, "generate", str(typo), "-q"), 2, "topk")


def test_features_command_bad_input_gets_one_line_and_exit_2(feature_runs, tmp_path):
    run = str(feature_runs["inline"].path)
    plain = str(feature_runs["plain"].path)
    bad = _bad_saes(tmp_path)
    assert_one_line_error(
        lmtrace(tmp_path, "features", plain, "--sae", str(bad["missing directory"][0])), 2, "no such directory"
    )
    assert_one_line_error(
        lmtrace(tmp_path, "features", plain, "--sae", str(bad["d_in mismatch"][0])), 2, "d_in 32 does not match"
    )
    assert_one_line_error(
        lmtrace(tmp_path, "features", plain, "--sae", "resid-sae", "--feature", "1"), 2, "no feature activations"
    )
    assert_one_line_error(
        lmtrace(tmp_path, "features", run, "--sae", "other", "--feature", "1"), 2, "not an SAE of run"
    )
    assert_one_line_error(
        lmtrace(tmp_path, "features", run, "--sae", "resid-sae", "--feature", str(D_SAE)), 2, f"latents 0..{D_SAE - 1}"
    )
    assert_one_line_error(lmtrace(tmp_path, "features", run, "--sae", "resid-sae", "--by", "nope"), 2, "no such column")
