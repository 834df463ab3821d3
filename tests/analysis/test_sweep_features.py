"""`lmtrace sweep --over features --sae DIR`: every feature cell equals the test's own forward with the
latent changed at the SAE's hook and the reconstruction error kept (x' = x + (f' − f) W_dec, computed by
the test in float64 from the SAE's weights); attribution estimates equal the test's own first-order
formula (autograd gradient at the hook · (Δf_F · W_dec[F])); the top features are the test's own maxima
at the measured positions; a killed sweep resumes to the same tables; bad input exits 2 in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmtrace.archive.sweeps import read_sweep
from lmtrace.commands.sweep import run_sweep
from lmtrace.spec.sweep_spec import SweepSpec
from tests.helpers.saes import encode, random_sae
from tests.helpers.sweep_runs import CLEAN, CORRUPT, eager_model, sequence_ids, sweep_run

METRICS = ["logprob", "prob", "kl", "logit_diff:42,7"]
LAYER = 2
D_SAE = 48


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sharp_llama_dir):
    tmp = tmp_path_factory.mktemp("feature-sweep")
    return sweep_run(tmp, sharp_llama_dir, CLEAN, "clean"), sweep_run(tmp, sharp_llama_dir, CORRUPT, "corrupt")


@pytest.fixture(scope="module")
def model(sharp_llama_dir):
    return eager_model(sharp_llama_dir)


@pytest.fixture(scope="module")
def sae(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("saes") / "sae-l2"
    cfg, w = random_sae(path, f"blocks.{LAYER}.hook_resid_post", model.config.hidden_size, D_SAE, seed=3)
    return path, cfg, w


def _forward(model, ids, edit=None, grad=False):
    """The test's own forward: (logits [T, V] float, the hook's activation [T, d] (with `grad`: [1, T, d], in the
    graph));
    edit(x [T, d] float64) -> x' replaces layer LAYER's output."""
    got = {}

    def hook(m, a, o):
        x = o[0] if isinstance(o, tuple) else o
        if edit is not None:
            x = edit(x[0].double())[None].to(x.dtype)
        got["x"] = x
        return (x, *o[1:]) if isinstance(o, tuple) else x

    h = model.model.layers[LAYER].register_forward_hook(hook)
    emb = model.model.embed_tokens.register_forward_hook(lambda m, a, o: o.detach().requires_grad_(True))
    try:
        with torch.enable_grad() if grad else torch.inference_mode():
            out = model(torch.tensor([ids])).logits[0].float()
    finally:
        h.remove()
        emb.remove()
    return out, got["x"][0] if not grad else got["x"]


def _metrics(logits, base, P, gen):
    rows, brow = logits[P - 1 : P - 1 + len(gen)], base[P - 1 : P - 1 + len(gen)]
    lp, blp = rows.log_softmax(-1), brow.log_softmax(-1)
    tok = torch.tensor(gen)[:, None]
    return {
        "logprob": lp.gather(-1, tok)[:, 0].numpy(),
        "prob": lp.gather(-1, tok)[:, 0].exp().numpy(),
        "kl": (blp.exp() * (blp - lp)).sum(-1).numpy(),
        "logit_diff:42,7": (rows[:, 42] - rows[:, 7]).numpy(),
    }


def _latents(cfg, w, x):
    return encode(cfg, w, x.detach().double().numpy())  # [T, d_sae] float64, the test's own encode


def _set_latent(cfg, w, feature, target, positions=None):
    """The test's own edit: x + (f'_F − f_F) · W_dec[F] at `positions` (None: all), f' = target [T]."""

    def edit(x):
        f = torch.from_numpy(_latents(cfg, w, x))
        change = torch.as_tensor(target, dtype=torch.float64) - f[:, feature]
        if positions is not None:
            keep = torch.zeros(len(change), dtype=torch.bool)
            keep[positions] = True
            change = torch.where(keep, change, 0.0)
        return x + change[:, None] * torch.from_numpy(w["W_dec"][feature].astype(np.float64))

    return edit


def _rows(df, metric, seq, feature, position=None):
    d = df[(df.metric == metric) & (df.sequence == seq) & (df.neuron == feature) & (df.component == "feature")]
    d = d[d.position.isna()] if position is None else d[d.position == position]
    return d.sort_values("step")


@pytest.mark.parametrize("edit,value,positions", [("zero", None, None), ("clamp", 2.5, [1, 3]), ("patch", None, None)])
def test_exact_feature_cells_equal_the_tests_own_edited_forward(runs, model, sae, edit, value, positions):
    clean, corrupt = runs
    path, cfg, w = sae
    features = [0, 5, 17, 40]
    spec = SweepSpec(
        over="features",
        sae=str(path),
        features=",".join(map(str, features)),
        edit=edit,
        value=value,
        metrics=METRICS,
        positions=None if positions is None else ",".join(map(str, positions)),
        source=str(corrupt.path) if edit == "patch" else None,
        batch=3,
    )
    df = read_sweep(clean, run_sweep(str(clean.path), spec).sweep_id).to_pandas()
    assert set(df.component) == {"feature"} and set(df.layer) == {LAYER} and sorted(set(df.neuron)) == features
    biggest = 0.0
    for s in range(2):
        P, gen = len(sequence_ids(clean, s)[0]), sequence_ids(clean, s)[1]
        ids = sum(sequence_ids(clean, s), [])
        base, x = _forward(model, ids)
        src = _latents(cfg, w, _forward(model, sum(sequence_ids(corrupt, s), []))[1]) if edit == "patch" else None
        for f in features:
            for p in positions or [None]:
                target = src[: len(ids), f] if edit == "patch" else np.full(len(ids), 0.0 if edit == "zero" else value)
                logits, _ = _forward(model, ids, _set_latent(cfg, w, f, target, None if p is None else [p]))
                want = _metrics(logits, base, P, gen)
                for m in METRICS:
                    got = _rows(df, m, s, f, p)
                    np.testing.assert_allclose(got.value.to_numpy(), want[m], rtol=1e-4, atol=1e-4, err_msg=f"{m} {f}")
                biggest = max(biggest, float(np.abs(_rows(df, "logprob", s, f, p).effect).max()))
    assert biggest > 1e-2  # the edits do change the metric


def test_attribution_estimates_equal_the_tests_own_gradient_times_decoder_change(runs, model, sae):
    clean, corrupt = runs
    path, cfg, w = sae
    features = [0, 5, 17, 40]
    biggest = 0.0
    for edit in ("zero", "patch"):
        spec = SweepSpec(
            over="features",
            sae=str(path),
            features="0,5,17,40",
            edit=edit,
            metrics=METRICS,
            method="attribution",
            source=str(corrupt.path) if edit == "patch" else None,
            graddrop=edit == "zero",
        )
        df = read_sweep(clean, run_sweep(str(clean.path), spec).sweep_id).to_pandas()
        assert set(df.method) == {"attribution"} and df[df.metric == "kl"].value.isna().all()
        assert df[df.metric == "logprob"].graddrop.notna().all() == (edit == "zero")
        for s in range(2):
            P, gen = len(sequence_ids(clean, s)[0]), sequence_ids(clean, s)[1]
            ids = sum(sequence_ids(clean, s), [])
            logits, x = _forward(model, ids, grad=True)
            f_now = _latents(cfg, w, x[0])
            f_new = (
                _latents(cfg, w, _forward(model, sum(sequence_ids(corrupt, s), []))[1])
                if edit == "patch"
                else np.zeros_like(f_now)
            )
            for st, tok in enumerate(gen):
                row = logits[P - 1 + st]
                scalars = {"logprob": row.log_softmax(-1)[tok], "logit_diff:42,7": row[42] - row[7]}
                scalars["prob"] = scalars["logprob"].exp()
                for m, scalar in scalars.items():
                    (g,) = torch.autograd.grad(scalar, x, retain_graph=True)
                    g = g[0].double().numpy()  # [T, d]
                    for f in features:
                        est = float(((f_new[:, f] - f_now[:, f])[:, None] * w["W_dec"][f] * g).sum())
                        got = _rows(df, m, s, f)
                        got = got[got.step == st].value.iloc[0]
                        assert got == pytest.approx(float(scalar.detach()) + est, rel=1e-4, abs=1e-4), (
                            edit,
                            m,
                            s,
                            st,
                            f,
                        )
                        biggest = max(biggest, abs(est))
    assert biggest > 1e-2  # the estimates are not all zero


def _maxima(cfg, w, model, run, keep: int | None = None):
    """The test's own largest activation per feature over every sequence's measured positions (P − 1 + s);
    with `keep` only each token's `keep` largest (what an archive of top-k latents holds)."""
    out = np.zeros(D_SAE)
    for s in range(2):
        P, gen = len(sequence_ids(run, s)[0]), sequence_ids(run, s)[1]
        f = _latents(cfg, w, _forward(model, sum(sequence_ids(run, s), []))[1])[P - 1 : P - 1 + len(gen)]
        if keep is not None:
            cut = -np.sort(-f, axis=1)[:, keep - 1 : keep]
            f = np.where(f >= cut, f, 0.0)
        out = np.maximum(out, f.max(0))
    return out


def test_the_top_features_are_the_largest_at_the_measured_positions(runs, model, sae):
    clean, _ = runs
    path, cfg, w = sae
    spec = SweepSpec(over="features", sae=str(path), top_features=5, metrics=["logprob"])
    done = run_sweep(str(clean.path), spec)
    df = read_sweep(clean, done.sweep_id).to_pandas()
    want = np.argsort(-_maxima(cfg, w, model, clean), kind="stable")[:5]
    assert sorted(set(df.neuron)) == sorted(int(f) for f in want)
    info = json.loads((done.path / "sweep.json").read_text())
    assert info["features"]["sae"] == "sae-l2" and info["features"]["layer"] == LAYER
    assert sorted(info["features"]["features"]) == sorted(int(f) for f in want)


def test_top_features_of_a_run_that_archived_them_come_from_its_arrays(tmp_path, sharp_llama_dir, model, sae):
    from lmtrace.commands.features import compute_features

    path, cfg, w = sae
    run = sweep_run(tmp_path, sharp_llama_dir, CLEAN, "archived")
    assert compute_features(str(run.path), str(path), top_k=3)["computed"]
    run = type(run)(run.path)
    spec = SweepSpec(over="features", sae="sae-l2", top_features=4, metrics=["logprob"])
    df = read_sweep(run, run_sweep(str(run.path), spec).sweep_id).to_pandas()
    want = np.argsort(-_maxima(cfg, w, model, run, keep=3), kind="stable")[:4]
    assert sorted(set(df.neuron)) == sorted(int(f) for f in want)


def test_a_killed_feature_sweep_resumes_to_the_same_tables(runs, sae, monkeypatch):
    import lmtrace.commands.sweep as sweep_mod

    clean, _ = runs
    path, _, _ = sae
    spec = SweepSpec(over="features", sae=str(path), top_features=6, metrics=["logprob", "kl"], batch=2)
    whole = read_sweep(clean, run_sweep(str(clean.path), spec).sweep_id).to_pandas()
    calls = {"n": 0}
    real = sweep_mod.write_block

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(sweep_mod, "write_block", dying)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(clean.path), spec, sweep_id="killed-features")
    monkeypatch.setattr(sweep_mod, "write_block", real)
    partial = clean.path / "sweeps" / ".partial-killed-features"
    assert len(list((partial / "blocks").glob("*.parquet"))) == 3
    assert json.loads((partial / "plan.json").read_text())["features"] == sorted(set(whole.neuron))
    done = run_sweep(str(clean.path), spec, sweep_id="killed-features", resume=True)
    assert done.status == "complete" and not partial.exists()
    key = ["neuron", "sequence", "step", "metric"]
    a = whole.sort_values(key).reset_index(drop=True)
    b = read_sweep(clean, "killed-features").to_pandas().sort_values(key).reset_index(drop=True)
    np.testing.assert_array_equal(a.value.to_numpy(), b.value.to_numpy())


@pytest.fixture(scope="module")
def far_sae(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("saes") / "far"
    random_sae(path, "blocks.9.hook_resid_post", model.config.hidden_size, D_SAE)
    return path


BAD = [
    (["--features", "3,48"], "[48] not in SAE sae-l2 (latents 0..47)"),
    (["--features", "1,2", "--top-features", "3"], "not both"),
    (["--edit", "clamp"], "needs --value"),
    (["--edit", "mean"], "--over features takes --edit zero"),
    (["FAR"], "blocks.9.hook_resid_post is not in this model"),
]


@pytest.mark.parametrize("args,fragment", BAD)
def test_bad_feature_sweeps_exit_2_with_one_line(runs, sae, far_sae, args, fragment):
    import re

    from typer.testing import CliRunner

    from lmtrace.cli.main import app

    clean, _ = runs
    sae_dir = str(far_sae) if args == ["FAR"] else str(sae[0])
    args = [] if args == ["FAR"] else args
    result = CliRunner().invoke(app, ["sweep", str(clean.path), "--over", "features", "--sae", sae_dir, *args])
    lines = [x for x in result.stderr.splitlines() if x.strip() and not re.match(r"\[\d\d:\d\d:\d\d\] ", x)]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], (
        result.stderr
    )


def test_a_yaml_sweep_spec_lists_the_features(runs, sae, tmp_path):
    from lmtrace.spec.sweep_spec import build_sweep_spec, load_sweep_spec

    clean, _ = runs
    path = tmp_path / "sweep.yaml"
    path.write_text(f"over: features\nsae: {sae[0]}\nfeatures: [40, 3]\nmetrics: [logprob]\nsequences: '0'\n")
    spec = build_sweep_spec(load_sweep_spec(path), str(path))
    df = read_sweep(clean, run_sweep(str(clean.path), spec).sweep_id).to_pandas()
    assert sorted(set(df.neuron)) == [3, 40] and set(df.sequence) == {0}


def test_an_sae_on_a_flattened_opt_site_is_refused_in_one_line_before_anything_is_written(tmp_path):
    """OPT computes fc2 over flattened tokens ([batch*pos, width]): a sweep of an SAE at its mlp_post (fc2's
    input) or mlp_out (its output) exits 2 in one line naming the hook, and writes nothing into sweeps/;
    the other feature commands take that SAE (intervene's edit, explain --sae)."""
    from lmtrace.runner.models import load_model
    from lmtrace.spec.run_spec import ModelSpec
    from tests.helpers.architectures import BY_ID, build_tiny
    from tests.helpers.cli import assert_one_line_error, lmtrace
    from tests.helpers.runs import PROMPTS, run_spec

    model = build_tiny(BY_ID["opt"], load_model(ModelSpec()).tokenizer, tmp_path / "opt")
    spec = {"model": str(model), "prompts": PROMPTS[:2], "generation": {"max_new_tokens": 3, "batch_size": 2}}
    run = run_spec(tmp_path, spec)
    for name, hook, width in (("post", "blocks.1.mlp.hook_post", 128), ("out", "blocks.1.hook_mlp_out", 64)):
        random_sae(tmp_path / name, hook, width, 16, seed=1)
        args = ("sweep", str(run.path), "--over", "features", "--sae", str(tmp_path / name), "--top-features", "2")
        assert_one_line_error(lmtrace(tmp_path, *args), 2, f"does not support {hook} on opt models", "flattened tokens")
    assert not (run.path / "sweeps").exists() or not list((run.path / "sweeps").iterdir())
    child = lmtrace(tmp_path, "intervene", str(run.path), "--feature-clamp", f"{tmp_path / 'post'}:3=2.0")
    assert child.returncode == 0 and "Traceback" not in child.stderr, child.stderr
    explained = lmtrace(
        tmp_path, "explain", str(run.path), "--sae", str(tmp_path / "post"), "--sequence", "0", "--steps", "1"
    )
    assert explained.returncode == 0 and "Traceback" not in explained.stderr, explained.stderr
