"""`lmtrace explain`: every method checked against a computation the test does itself.

References are the tiny model loaded straight from transformers (eager, float32) and contexts
read straight from tokens.parquet with pandas, never lmtrace's own context or forward code.
"""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pandas as pd
import pytest
import torch

from lmtrace.analysis import attribution as attr
from lmtrace.archive.explanations import record_entries
from lmtrace.commands.explain import explain_run
from lmtrace.commands.explain_render import summary
from lmtrace.exits.errors import ArchiveError, ModelLoadError, SpecError
from tests.helpers.runs import run_spec

TOL = 1e-4


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def forward_only_run(tmp_path_factory, tiny_llama_dir):
    spec = {
        "model": str(tiny_llama_dir),
        "prompts": ["The quick brown fox", "Paris is the capital of"],
        "capture": "none",
        "generation": {"max_new_tokens": 6, "batch_size": 2},
    }
    return run_spec(tmp_path_factory.mktemp("fwd"), spec)


@pytest.fixture(scope="module")
def attention_run(tmp_path_factory, tiny_llama_dir):
    spec = {
        "model": str(tiny_llama_dir),
        "prompts": ["One, two, three, four"],
        "capture": {
            "prefill_attention": True,
            "qkv": False,
            "ffn": {"enabled": False},
            "lens": {"enabled": False},
            "component_norms": False,
            "margin_contributions": False,
        },
        "generation": {"max_new_tokens": 5},
        "output": {"float_dtype": "float32"},
    }
    return run_spec(tmp_path_factory.mktemp("attn"), spec)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32, attn_implementation="eager")
    return m.eval().requires_grad_(False)


def context(run, seq: int, step: int):
    """(context ids, chosen id, runner-up id) of a step, straight from tokens.parquet."""
    t = pd.read_parquet(run.path / "tokens.parquet")
    t = t[t.sequence == seq]
    prompt = t[t.is_prompt].sort_values("position").token_id.tolist()
    gen = t[~t.is_prompt].sort_values("step")
    chosen = int(gen.token_id.iloc[step])
    runner = next(int(a) for a in gen.alt_ids.iloc[step] if int(a) != chosen)
    return prompt + gen.token_id.tolist()[:step], chosen, runner


def f_of(model, embeds, chosen, runner, target="chosen", quantity="logit", mask=None):
    n = embeds.shape[1]
    mask = torch.ones((embeds.shape[0], n), dtype=torch.long) if mask is None else mask
    logits = model(inputs_embeds=embeds, attention_mask=mask, position_ids=torch.arange(n)[None]).logits[:, -1]
    v = logits.log_softmax(-1) if quantity == "logprob" else logits
    return {"chosen": v[:, chosen], "runner-up": v[:, runner], "contrast": v[:, chosen] - v[:, runner]}[target]


def scores_of(result, method, step):
    (e,) = [e for e in result.explanations if e.method == method and e.step == step]
    return e


# ---- attention rollout --------------------------------------------------------------------------
def test_rollout_matches_hand_computation():
    # two layers, two heads, three positions (rows = queries, sum to 1)
    attn = np.array(
        [
            [[[1, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]], [[1, 0, 0], [1.0, 0.0, 0], [0.6, 0.2, 0.2]]],
            [[[1, 0, 0], [0.0, 1.0, 0], [0.5, 0.5, 0.0]], [[1, 0, 0], [0.0, 1.0, 0], [0.5, 0.5, 0.0]]],
        ]
    )
    # by hand: layer 0 head mean [[1,0,0],[.75,.25,0],[.4,.25,.35]]; + I and row-normalise:
    #   Â0 = [[1,0,0],[.375,.625,0],[.2,.125,.675]];  Â1 = [[1,0,0],[0,1,0],[.25,.25,.5]]
    #   R = Â1 Â0: last row = .25*[1,0,0] + .25*[.375,.625,0] + .5*[.2,.125,.675]
    expected = np.array([[1, 0, 0], [0.375, 0.625, 0], [0.44375, 0.21875, 0.3375]])
    np.testing.assert_allclose(attr.rollout(attn), expected, atol=1e-12)


def test_rollout_from_archive_equals_rollout_of_the_models_attention(attention_run, model):
    result = explain_run(attention_run.path, "0,4", methods=["attention_rollout"])
    for step in (0, 4):
        ids, _, _ = context(attention_run, 0, step)
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True)
        full = np.stack([a[0].numpy() for a in out.attentions])  # [layer, head, n, n]
        got = scores_of(result, "attention_rollout", step).scores
        np.testing.assert_allclose(got, attr.rollout(full)[-1], atol=TOL)
        assert abs(got.sum() - 1) < 1e-4


def test_rollout_without_the_sink_matches_hand_computation():
    attn = np.array(
        [
            [[[1, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]], [[1, 0, 0], [1.0, 0.0, 0], [0.6, 0.2, 0.2]]],
            [[[1, 0, 0], [0.0, 1.0, 0], [0.5, 0.5, 0.0]], [[1, 0, 0], [0.0, 1.0, 0], [0.5, 0.5, 0.0]]],
        ]
    )
    # by hand, column 0 zeroed in each head mean before + I and row-normalising:
    #   Â0 last row [0, .25, 1.35] / 1.6;  Â1 = [[1,0,0],[0,1,0],[0,1/3,2/3]]
    #   last row of R = 1/3*[0,1,0] + 2/3*[0,.15625,.84375] = [0, .4375, .5625]
    R = attr.rollout(attn, exclude=(0,))
    np.testing.assert_allclose(R[-1], [0, 0.4375, 0.5625], atol=1e-12)
    assert R[0, 0] == 1.0


def test_rollout_leaving_out_the_sink_from_the_archive(attention_run, model):
    settings = attr.Settings(rollout_exclude="sink")
    result = explain_run(attention_run.path, "3", methods=["attention_rollout"], settings=settings)
    ids, _, _ = context(attention_run, 0, 3)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    n = len(ids)
    R = np.eye(n)  # the test's own rollout, position 0's column left out of every layer's head mean
    for a in out.attentions:
        m = a[0].double().numpy().mean(0)
        m[:, 0] = 0
        m = m + np.eye(n)
        R = (m / m.sum(-1, keepdims=True)) @ R
    got = scores_of(result, "attention_rollout", 3).scores
    np.testing.assert_allclose(got, R[-1], atol=TOL)
    assert got[0] == 0 and abs(got.sum() - 1) < 1e-4
    with pytest.raises(SpecError, match="--rollout-exclude"):
        attr.Settings(rollout_exclude="first").check()


def test_rollout_needs_no_weights_and_gradients_do(attention_run, tmp_path):
    moved = tmp_path / attention_run.path.name
    shutil.copytree(attention_run.path, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["spec_resolved"]["model"]["ref"] = str(tmp_path / "gone-model")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    result = explain_run(moved, "2", methods=["rollout"])
    assert result.explanations[0].scores.shape == (len(context(attention_run, 0, 2)[0]),)
    with pytest.raises(ModelLoadError, match=r"gone-model.*not available.*grad_x_input.*attention_rollout does not"):
        explain_run(moved, "2", methods=["grad_x_input"])


def test_rollout_on_a_forward_only_run_names_what_is_missing(forward_only_run):
    with pytest.raises(ArchiveError) as err:
        explain_run(forward_only_run.path, "1", methods=["attention_rollout"])
    msg = str(err.value)
    assert "capture.attention.enabled: true" in msg and "capture.prefill_attention: true" in msg


# ---- gradient methods -----------------------------------------------------------------------------
@pytest.mark.parametrize("seq,steps,target,quantity", [(1, [0, 5], "chosen", "logit"), (0, [3], "contrast", "logprob")])
def test_grad_x_input_matches_autograd(forward_only_run, model, seq, steps, target, quantity):
    result = explain_run(
        forward_only_run.path,
        steps,
        sequence=seq,
        methods=["grad_x_input"],
        settings=attr.Settings(target=target, quantity=quantity),
    )
    for step in steps:
        ids, chosen, runner = context(forward_only_run, seq, step)
        e = model.get_input_embeddings()(torch.tensor([ids])).detach().requires_grad_(True)
        f = f_of(model, e, chosen, runner, target, quantity)
        (grad,) = torch.autograd.grad(f.sum(), e)
        expected = (grad * e).sum(-1)[0].detach().numpy()
        got = scores_of(result, "grad_x_input", step)
        np.testing.assert_allclose(got.scores, expected, atol=TOL, rtol=1e-3)
        assert got.info["f_x"] == pytest.approx(f.item(), abs=TOL)
        assert got.info["recomputed_logprob"] == pytest.approx(got.info["archived_logprob"], abs=TOL)


@pytest.mark.parametrize("baseline", ["zero", "pad"])
def test_integrated_gradients_sum_to_the_output_difference_within_the_reported_error(forward_only_run, model, baseline):
    settings = attr.Settings(target="contrast", quantity="logprob", baseline=baseline, ig_steps=16, ig_max_points=128)
    result = explain_run(forward_only_run.path, "2", methods=["ig"], settings=settings)
    ids, chosen, runner = context(forward_only_run, 0, 2)
    emb = model.get_input_embeddings()
    with torch.no_grad():
        x = emb(torch.tensor([ids]))
        pad = emb(torch.tensor([[2]]))  # the tokenizer's pad token (= eos for this tokenizer)
        b = torch.zeros_like(x) if baseline == "zero" else pad.expand_as(x).clone()
        b[:, 0] = x[:, 0]  # the default --ig-keep sink: position 0 keeps its own embedding
        fx, fb = (f_of(model, v, chosen, runner, "contrast", "logprob").item() for v in (x, b))
    e = scores_of(result, "integrated_gradients", 2)
    reported = e.info["completeness_error"]
    assert abs(float(e.scores.sum()) - (fx - fb)) <= reported + 1e-4
    assert reported == pytest.approx(abs(float(e.scores.sum()) - (fx - fb)), abs=1e-4)
    assert e.info["f_x"] == pytest.approx(fx, abs=TOL) and e.info["f_baseline"] == pytest.approx(fb, abs=TOL)


@pytest.fixture(scope="module")
def smooth_run(tmp_path_factory, tiny_llama_dir):
    """The tiny model with a non-zero pad embedding: the path from it to the input avoids the all-zero
    input, where RMSNorm is nearly singular, so the IG integrand is smooth."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("smooth-model")
    m = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        m.get_input_embeddings().weight[2] = torch.randn(m.config.hidden_size) * 0.02
    m.save_pretrained(path)
    AutoTokenizer.from_pretrained(str(tiny_llama_dir)).save_pretrained(path)
    spec = {
        "model": str(path),
        "prompts": ["The quick brown fox"],
        "capture": "none",
        "generation": {"max_new_tokens": 4},
    }
    return run_spec(tmp_path_factory.mktemp("smooth"), spec)


def test_integrated_gradients_error_shrinks_with_steps(smooth_run):
    errors = {}
    for m in (4, 32):
        r = explain_run(
            smooth_run.path,
            "3",
            methods=["integrated_gradients"],
            settings=attr.Settings(baseline="pad", ig_steps=m, ig_rule="midpoint", batch_size=33),
        )
        info = r.explanations[0].info
        errors[m] = info["completeness_error"]
        assert abs(float(r.explanations[0].scores.sum()) - (info["f_x"] - info["f_baseline"])) <= errors[m] + 1e-5
    assert errors[32] < errors[4]
    assert errors[32] / abs(info["f_x"] - info["f_baseline"]) < 5e-3
    # on a smooth path the adaptive rule needs no refinement beyond its initial intervals
    r = explain_run(smooth_run.path, "3", methods=["ig"], settings=attr.Settings(baseline="pad", ig_steps=4))
    assert r.explanations[0].info["converged"] and r.explanations[0].info["completeness_error_relative"] < 0.01


# ---- occlusion ---------------------------------------------------------------------------------------
def test_occlusion_equals_the_change_of_a_masked_forward(forward_only_run, model):
    result = explain_run(
        forward_only_run.path,
        "4",
        sequence=1,
        methods=["occlusion"],
        settings=attr.Settings(target="chosen", quantity="logprob", batch_size=3),
    )
    ids, chosen, runner = context(forward_only_run, 1, 4)
    x = model.get_input_embeddings()(torch.tensor([ids]))
    got = scores_of(result, "occlusion", 4).scores
    with torch.no_grad():
        fx = f_of(model, x, chosen, runner, "chosen", "logprob").item()
        for p in range(len(ids)):
            mask = torch.ones((1, len(ids)), dtype=torch.long)
            mask[0, p] = 0  # position p removed from the attention mask, positions unchanged
            masked = f_of(model, x, chosen, runner, "chosen", "logprob", mask=mask).item()
            assert got[p] == pytest.approx(fx - masked, abs=TOL)


# ---- archive, manifest, CLI -----------------------------------------------------------------------------
def test_results_are_written_into_the_run(forward_only_run):
    before = json.loads((forward_only_run.path / "manifest.json").read_text())
    mode = (forward_only_run.path / "manifest.json").stat().st_mode
    r = explain_run(forward_only_run.path, "1,2", methods=["grad_x_input,occlusion"])
    assert (forward_only_run.path / "manifest.json").stat().st_mode == mode  # rewritten, same permissions
    manifest = json.loads((forward_only_run.path / "manifest.json").read_text())
    assert manifest["status"] == before["status"] == "complete"
    mine = [e for e in manifest["explain"] if e["id"] == r.explain_id]
    assert [e["method"] for e in mine] == ["grad_x_input", "occlusion"]
    assert mine[0]["steps"] == [1, 2] and mine[0]["sequence"] == 0 and mine[0]["target"] == "chosen"
    assert mine[0]["model"]["dtype"] == "float32" and mine[1]["settings"]["mask"] == "attention_mask[position] = 0"
    table = pd.read_parquet(forward_only_run.path / "explain" / "scores.parts")  # every invocation, one dataset
    mine_t = table[table.explain_id == r.explain_id]
    assert set(mine_t.method) == {"grad_x_input", "occlusion"}
    import zarr

    arr = zarr.open_group(str(r.path / "scores.zarr"), mode="r")["occlusion"][:]
    for e in r.explanations:
        if e.method == "occlusion":
            rows = mine_t[(mine_t.method == "occlusion") & (mine_t.step == e.step)].sort_values("position")
            np.testing.assert_array_equal(rows.score.to_numpy(), e.scores)
            np.testing.assert_array_equal(arr[[1, 2].index(e.step), : len(e.scores)], e.scores)
            assert rows.token_id.tolist() == context(forward_only_run, 0, e.step)[0]
    assert json.loads((r.path / "explain.json").read_text())["entries"] == mine


def test_a_failed_scores_part_write_leaves_no_tmp_and_no_unnamed_explanation(forward_only_run, monkeypatch):
    """A full disk while the scores part is written: no `.tmp` left, no explain/<id>/ that the manifest
    never names, the manifest as before."""
    import errno

    import lmtrace.archive.explanations as explanations

    before = json.loads((forward_only_run.path / "manifest.json").read_text())
    folders = (
        {p.name for p in (forward_only_run.path / "explain").iterdir()}
        if (forward_only_run.path / "explain").is_dir()
        else set()
    )

    def full(table, where, *args, **kwargs):
        open(where, "wb").write(b"half")  # as a real write that ran out of room would leave it
        raise OSError(errno.ENOSPC, "No space left on device", str(where))

    monkeypatch.setattr(explanations.parquet_io.pq, "write_table", full)  # under parquet_io's page checksums
    with pytest.raises(OSError):
        explain_run(forward_only_run.path, "1", methods=["grad_x_input"])
    root = forward_only_run.path / "explain"
    assert not list(root.rglob("*.tmp")), list(root.rglob("*.tmp"))
    assert {p.name for p in root.iterdir()} <= folders | {"scores.parts"}
    assert json.loads((forward_only_run.path / "manifest.json").read_text()).get("explain") == before.get("explain")


def test_concurrent_manifest_writers_lose_nothing(forward_only_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(forward_only_run.path, run_dir)

    def writer(i):
        for j in range(5):
            record_entries(run_dir, [{"id": f"w{i}-{j}"}])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    ids = {e["id"] for e in manifest["explain"]}
    assert {f"w{i}-{j}" for i in range(6) for j in range(5)} <= ids
    assert manifest["status"] == "complete"


def test_bad_requests_fail_clearly(forward_only_run):
    with pytest.raises(SpecError, match=r"\[6, 9\] out of range.*6 generated token\(s\) \(steps 0\.\.5\)"):
        explain_run(forward_only_run.path, "0,6,9")
    with pytest.raises(SpecError, match="--sequence 2 out of range"):
        explain_run(forward_only_run.path, "0", sequence=2)
    with pytest.raises(SpecError, match="unknown; available: grad_x_input"):
        explain_run(forward_only_run.path, "0", methods=["shap"])
    with pytest.raises(SpecError, match="--target"):
        explain_run(forward_only_run.path, "0", settings=attr.Settings(target="best"))


def test_cli_shows_context_and_top_contributors(forward_only_run):
    from typer.testing import CliRunner

    from lmtrace.cli.main import app

    runner = CliRunner()
    out = runner.invoke(
        app, ["explain", str(forward_only_run.path), "--steps", "1", "-m", "grad_x_input", "--top", "3"]
    )
    assert out.exit_code == 0, out.output
    assert "top 3 positions" in out.output and "' quick'" in out.output
    js = runner.invoke(app, ["explain", str(forward_only_run.path), "--steps", "0", "--json", "--target", "contrast"])
    assert js.exit_code == 0, js.output
    summary = json.loads(js.stdout.strip().splitlines()[-1])
    assert summary["entries"][0]["target"] == "contrast" and len(summary["top"][0]["positions"]) == 4
    bad = runner.invoke(app, ["explain", str(forward_only_run.path), "--steps", "7"])
    assert bad.exit_code == 2 and "error: --steps: step(s) [7] out of range" in bad.output
    missing = runner.invoke(app, ["explain", str(forward_only_run.path), "--steps", "0", "-m", "rollout"])
    assert missing.exit_code == 2 and "capture.prefill_attention: true" in missing.output


# ---- integrated gradients: completeness met or reported as not met (issue 22) ------------------------
def _ig_reference(model, ids, chosen, runner, target, quantity, baseline):
    """f(x) − f(b) from the test's own forwards, b built here: zero, or the mean row of the embedding matrix, at
    every position but the first, which keeps its own embedding (the default --ig-keep sink)."""
    emb = model.get_input_embeddings()
    with torch.no_grad():
        x = emb(torch.tensor([ids]))
        b = torch.zeros_like(x) if baseline == "zero" else emb.weight.double().mean(0).float().expand_as(x).clone()
        b[:, 0] = x[:, 0]
        return (
            f_of(model, x, chosen, runner, target, quantity) - f_of(model, b, chosen, runner, target, quantity)
        ).item()


@pytest.mark.parametrize(
    "baseline,target,quantity",
    [("mean", "chosen", "logit"), ("mean", "contrast", "logprob"), ("zero", "runner-up", "logprob")],
)
def test_integrated_gradients_converge_to_completeness_or_say_they_did_not(
    forward_only_run, model, baseline, target, quantity
):
    settings = attr.Settings(target=target, quantity=quantity, baseline=baseline, batch_size=16)
    result = explain_run(forward_only_run.path, "1,4", sequence=1, methods=["ig"], settings=settings)
    for e in result.explanations:
        ids, chosen, runner = context(forward_only_run, 1, e.step)
        change = _ig_reference(model, ids, chosen, runner, target, quantity, baseline)
        scale = max(abs(change), attr.IG_SCALE_FLOOR)
        error = abs(float(e.scores.astype(np.float64).sum()) - change) / scale
        assert e.info["converged"] is True, e.info  # the adaptive rule reaches 1 % on this model
        assert error <= 0.01 + 1e-4, (e.step, error)
        assert e.info["completeness_error_relative"] == pytest.approx(error, abs=1e-4)
    # the fixed grid with as many gradient points does not meet the tolerance everywhere, and says so
    fixed = explain_run(
        forward_only_run.path,
        "1,4",
        sequence=1,
        methods=["ig"],
        settings=attr.Settings(
            target=target, quantity=quantity, baseline=baseline, ig_rule="midpoint", ig_steps=16, batch_size=16
        ),
    )
    for e in fixed.explanations:
        ids, chosen, runner = context(forward_only_run, 1, e.step)
        change = _ig_reference(model, ids, chosen, runner, target, quantity, baseline)
        error = abs(float(e.scores.astype(np.float64).sum()) - change) / max(abs(change), attr.IG_SCALE_FLOOR)
        assert e.info["converged"] is (error <= 0.01 + 1e-6) or abs(error - 0.01) < 1e-4


def test_integrated_gradients_never_take_a_gradient_at_the_baseline_and_report_nan(forward_only_run, monkeypatch):
    seen = []
    original = attr.IGPath.density

    def density(self, alphas):
        seen.extend(np.asarray(alphas).tolist())
        return original(self, alphas)

    monkeypatch.setattr(attr.IGPath, "density", density)
    r = explain_run(forward_only_run.path, "2", methods=["ig"], settings=attr.Settings(baseline="zero", batch_size=16))
    assert seen and min(seen) > 0 and max(seen) < 1
    # a model whose output is NaN near the baseline: the result is flagged, never a silent NaN
    logits = attr.Scorer.logits

    def poisoned(self, embeds, mask=None):
        out = logits(self, embeds, mask)
        small = embeds.detach().abs().mean(dim=(1, 2)) < 0.3 * self.embed.weight.abs().mean()
        return torch.where(small[:, None], torch.full_like(out, float("nan")), out)

    monkeypatch.setattr(attr.Scorer, "logits", poisoned)
    monkeypatch.setattr(attr.IGPath, "density", original)
    r = explain_run(
        forward_only_run.path,
        "2",
        methods=["ig"],
        settings=attr.Settings(baseline="zero", ig_rule="midpoint", ig_steps=8),
    )
    e = r.explanations[0]
    assert e.info["converged"] is False and e.info["nonfinite"] is True
    entry = [x for x in json.loads((r.path / "explain.json").read_text())["entries"]][0]
    assert entry["converged"] is False and entry["results"][0]["completeness_error"] is None
    assert any("did not converge" in n for n in r.notes)
    text = json.dumps(summary(r), allow_nan=False)  # strict JSON: null, never NaN
    assert "NaN" not in text and json.loads(text)["converged"] is False


def test_cli_strict_exits_1_when_not_converged_and_json_is_strict(forward_only_run):
    from typer.testing import CliRunner

    from lmtrace.cli.main import app

    runner = CliRunner()
    args = [
        "explain",
        str(forward_only_run.path),
        "--steps",
        "2",
        "-m",
        "ig",
        "--baseline",
        "zero",
        "--ig-rule",
        "midpoint",
        "--ig-steps",
        "2",
        "--ig-tolerance",
        "1e-6",
        "--json",
    ]
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    summary = json.loads(out.stdout.strip().splitlines()[-1], parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert summary["converged"] is False and summary["top"][0]["converged"] is False
    assert summary["checks_passed"] is False and summary["top"][0]["check_passed"] is False  # the method's own check
    assert summary["top"][0]["check_failed"].startswith("integrated_gradients did not converge: completeness error")
    strict = runner.invoke(app, args + ["--strict"])
    assert strict.exit_code == 1 and "did not converge" in strict.output and "Traceback" not in strict.output
    for bad in (["--ig-rule", "trapezoid"], ["--ig-tolerance", "0"], ["--baseline", "random"]):
        r = runner.invoke(app, ["explain", str(forward_only_run.path), "--steps", "0", "-m", "ig", *bad])
        errors = [line for line in r.output.splitlines() if line.startswith("error:")]  # progress lines may precede
        assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output


# ---- intervention children: the child's edits replayed ---------------------------------------------------
@pytest.fixture(scope="module")
def ablated_child(tmp_path_factory, tiny_llama_dir):
    from lmtrace.archive.reader import Run
    from lmtrace.commands.intervene import run_intervene

    root = tmp_path_factory.mktemp("child")
    parent = run_spec(
        root,
        {
            "model": str(tiny_llama_dir),
            "prompts": ["The quick brown fox", "Paris is the capital of"],
            "capture": "none",
            "generation": {"max_new_tokens": 5, "batch_size": 2},
        },
    )
    entries = [
        {"kind": "ablate_mlp", "layer": 1},
        {"kind": "ablate_head", "layer": 2, "head": 1, "mode": "mean", "steps": {"from": 2}},
    ]
    result, _ = run_intervene(str(parent.path), entries, runs_dir=str(root / "runs"))
    return parent, Run(result.run_dir)


def test_explain_on_an_ablation_child_replays_its_edits(ablated_child, model):
    parent, child = ablated_child
    result = explain_run(child.path, "0,3", sequence=1, methods=["grad_x_input"])
    # the test's own edits: layer 1's MLP output zeroed everywhere; head 2.1's o_proj input set to its mean over
    # the parent's final sequences (computed here), at positions computed at steps >= 2 (P-1+2 onwards)
    hd = model.config.hidden_size // model.config.num_attention_heads
    acc = []
    h = model.model.layers[2].self_attn.o_proj.register_forward_pre_hook(lambda m, a: acc.append(a[0][0].double()))
    t = pd.read_parquet(parent.path / "tokens.parquet")
    with torch.no_grad():
        for seq in (0, 1):
            ids = t[t.sequence == seq].sort_values("position").token_id.tolist()
            model(torch.tensor([ids]))
    h.remove()
    mean = torch.cat(acc).mean(0)[1 * hd : 2 * hd].float()
    for step in (0, 3):
        ids, chosen, runner = context(child, 1, step)
        P = len(ids) - step
        handles = [model.model.layers[1].mlp.register_forward_hook(lambda m, a, o: torch.zeros_like(o))]

        def head(m, a, P=P):
            x = a[0].clone()
            x[:, P + 1 :, hd : 2 * hd] = mean  # position P-1+t computed at step t >= 2
            return (x,)

        handles.append(model.model.layers[2].self_attn.o_proj.register_forward_pre_hook(head))
        try:
            e = model.get_input_embeddings()(torch.tensor([ids])).detach().requires_grad_(True)
            f = f_of(model, e, chosen, runner)
            (grad,) = torch.autograd.grad(f.sum(), e)
            with torch.no_grad():
                lp = model(inputs_embeds=e).logits[0, -1].log_softmax(-1)[chosen].item()
        finally:
            for x in handles:
                x.remove()
        got = scores_of(result, "grad_x_input", step)
        np.testing.assert_allclose(got.scores, (grad * e).sum(-1)[0].detach().numpy(), atol=TOL, rtol=1e-3)
        assert got.info["recomputed_logprob"] == pytest.approx(got.info["archived_logprob"], abs=1e-4)
        assert got.info["recomputed_logprob"] == pytest.approx(lp, abs=1e-4)
    assert result.entries[0]["model"]["interventions_replayed"][0]["kind"] == "ablate_mlp"


def test_explain_refuses_a_child_whose_edits_cannot_be_replayed(ablated_child, tmp_path):
    from typer.testing import CliRunner

    from lmtrace.cli.main import app

    _, child = ablated_child
    moved = tmp_path / child.path.name
    shutil.copytree(child.path, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["interventions"] = [
        {
            "kind": "patch_residual",
            "layer": 1,
            "source_run": "elsewhere",
            "steps": "all",
            "sequences": "all",
            "positions": "all",
        }
    ]
    (moved / "manifest.json").write_text(json.dumps(manifest))
    out = CliRunner().invoke(app, ["explain", str(moved), "--steps", "1"])
    assert out.exit_code == 2 and "patch_residual" in out.output and "cannot replay" in out.output
    assert "Traceback" not in out.output


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory):
    """SmolLM2-135M, greedy: "The capital of France is" -> " Paris.\n\nThe" (steps 0..3)."""
    return run_spec(
        tmp_path_factory.mktemp("embedded"),
        {"prompts": ["The capital of France is"], "capture": "none", "generation": {"max_new_tokens": 4}},
    )


@pytest.fixture(scope="module")
def embedded_model64():
    from transformers import AutoModelForCausalLM

    from lmtrace.runner.models import load_model
    from lmtrace.spec.run_spec import ModelSpec

    source = load_model(ModelSpec(dtype="float32", attn_implementation="eager")).model
    # a plain transformers copy in float64: the reference f values carry no float32 rounding
    m = AutoModelForCausalLM.from_config(source.config, attn_implementation="eager", dtype=torch.float64)
    m.load_state_dict({k: v.double() for k, v in source.state_dict().items()})
    return m.eval().requires_grad_(False)


def _kept_first_mean_baseline(model, ids):
    """The default baseline, built here: the embedding matrix's mean row at every position but the first, which
    keeps its own embedding (the attention sink)."""
    emb = model.get_input_embeddings()
    with torch.no_grad():
        x = emb(torch.tensor([ids]))
        b = emb.weight.mean(0).expand_as(x).clone()
        b[:, 0] = x[:, 0]
    return x, b


@pytest.mark.slow
@pytest.mark.parametrize("target,quantity", [("chosen", "logit"), ("contrast", "logprob"), ("runner-up", "logprob")])
def test_integrated_gradients_converge_on_the_embedded_model(embedded_run, embedded_model64, target, quantity):
    """Default settings on SmolLM2-135M: every step converges, and the scores add up to f(x) − f(b) from the
    test's own float64 forwards within 1 %."""
    settings = attr.Settings(target=target, quantity=quantity, batch_size=16)
    result = explain_run(embedded_run.path, "0,3", methods=["ig"], settings=settings)
    for e in result.explanations:
        ids, chosen, runner = context(embedded_run, 0, e.step)
        x, b = _kept_first_mean_baseline(embedded_model64, ids)
        with torch.no_grad():
            change = (
                f_of(embedded_model64, x, chosen, runner, target, quantity)
                - f_of(embedded_model64, b, chosen, runner, target, quantity)
            ).item()
        error = abs(float(e.scores.astype(np.float64).sum()) - change) / max(abs(change), attr.IG_SCALE_FLOOR)
        assert e.info["converged"] is True, (e.step, e.info)
        assert error <= 0.01, (e.step, error, e.info)
        assert e.info["completeness_error_relative"] == pytest.approx(error, abs=1e-3)
        assert e.scores[0] == 0.0  # the kept first position has no path, so no attribution


def test_integrated_gradients_keep_positions_and_float64(forward_only_run, model):
    """--ig-keep: kept positions take their own embedding in the baseline (score 0); --ig-dtype float64: f values
    equal the test's own float64 forwards, and the model is float32 again for the next method."""
    ids, chosen, runner = context(forward_only_run, 0, 2)
    m64 = type(model)(model.config).double().eval().requires_grad_(False)
    m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    emb = m64.get_input_embeddings()
    for keep, kept, dtype, tol in (("none", [], "float64", 1e-9), ("0,2", [0, 2], "float32", 1e-4)):
        r = explain_run(
            forward_only_run.path,
            "2",
            methods=["ig", "gxi"],
            settings=attr.Settings(target="contrast", quantity="logprob", ig_keep=keep, ig_dtype=dtype, batch_size=16),
        )
        with torch.no_grad():
            x = emb(torch.tensor([ids]))
            b = emb.weight.mean(0).expand_as(x).clone()
            b[:, kept] = x[:, kept]
            fx, fb = (f_of(m64, v, chosen, runner, "contrast", "logprob").item() for v in (x, b))
        e = scores_of(r, "integrated_gradients", 2)
        assert e.info["f_x"] == pytest.approx(fx, abs=tol) and e.info["f_baseline"] == pytest.approx(fb, abs=tol)
        assert all(e.scores[k] == 0.0 for k in kept) and all(
            e.scores[k] != 0.0 for k in range(len(ids)) if k not in kept
        )
        assert abs(float(e.scores.astype(np.float64).sum()) - (fx - fb)) <= e.info["completeness_error"] + 10 * tol
        assert r.entries[0]["settings"]["ig_keep"] == kept and r.entries[0]["settings"]["ig_dtype"] == dtype
        # grad × input in the same invocation, after IG, still matches the float32 model
        x32 = model.get_input_embeddings()(torch.tensor([ids])).detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(f_of(model, x32, chosen, runner, "contrast", "logprob").sum(), x32)
        np.testing.assert_allclose(
            scores_of(r, "grad_x_input", 2).scores, (grad * x32).sum(-1)[0].detach().numpy(), atol=TOL, rtol=1e-3
        )


def test_integrated_gradients_keep_special_tokens_of_a_chat_context(tmp_path, tiny_llama_dir, model):
    """--ig-keep special: position 0 and every position whose token the tokenizer calls special (found here from
    the tokenizer itself) keep their embedding; f(baseline) equals the test's own forward on that baseline."""
    from transformers import AutoTokenizer

    run = run_spec(
        tmp_path,
        {
            "model": str(tiny_llama_dir),
            "prompts": {"texts": ["Name a colour."], "chat": True},
            "capture": "none",
            "generation": {"max_new_tokens": 3},
        },
    )
    ids, chosen, runner = context(run, 0, 2)
    special = set(AutoTokenizer.from_pretrained(str(tiny_llama_dir)).all_special_ids)
    kept = sorted({0} | {i for i, t in enumerate(ids) if t in special})
    assert len(kept) >= 4  # the chat template's <|im_start|> / <|im_end|> tokens
    r = explain_run(
        run.path, "2", methods=["ig"], settings=attr.Settings(ig_keep="special", ig_rule="midpoint", ig_steps=4)
    )
    e = scores_of(r, "integrated_gradients", 2)
    assert e.info["kept_positions"] == kept and r.entries[0]["settings"]["ig_keep_special"] is True
    assert all(e.scores[k] == 0.0 for k in kept) and all(e.scores[k] != 0.0 for k in range(len(ids)) if k not in kept)
    with torch.no_grad():
        x = model.get_input_embeddings()(torch.tensor([ids]))
        b = model.get_input_embeddings().weight.double().mean(0).float().expand_as(x).clone()
        b[:, kept] = x[:, kept]
        assert e.info["f_baseline"] == pytest.approx(f_of(model, b, chosen, runner).item(), abs=1e-4)
    with pytest.raises(SpecError, match="`special`"):
        attr.Settings(ig_keep="specials").check()


def test_not_converged_says_which_condition_was_missed():
    """A result can meet completeness by cancellation while its intervals' own checks fail: the message must name
    the bound then, never claim the completeness error exceeded the tolerance (it did not)."""
    base = {"nonfinite": False, "gradient_points": 1024}
    on_bound = attr.ig_shortfall({**base, "completeness_error_relative": 0.0003, "error_bound_relative": 0.049}, 0.01)
    assert "0.03% ≤ 1%" in on_bound and "error bound 4.90% > 1%" in on_bound and "1024 gradient points" in on_bound
    on_total = attr.ig_shortfall({**base, "completeness_error_relative": 0.2, "error_bound_relative": 0.3}, 0.01)
    assert "completeness error 20.00% > 1%" in on_total and "bound" not in on_total
    nonfinite = attr.ig_shortfall(
        {**base, "nonfinite": True, "completeness_error_relative": None, "error_bound_relative": None}, 0.01
    )
    assert nonfinite.startswith("non-finite values")


# ---- integrated gradients on a model that scales its embeddings (Gemma) -----------------------------------
@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, tiny_llama_dir):
    """A tiny random Gemma 3: its embedding module multiplies the table rows by √d_model = 8. A direction common to
    every row (as trained embeddings have) makes the mean row clearly non-zero, so its scale matters."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    m = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        w = m.get_input_embeddings().weight
        w += torch.randn(w.shape[1]) * float(w.std())
    path = tmp_path_factory.mktemp("tiny-gemma3")
    m.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_integrated_gradients_mean_baseline_is_on_the_inputs_scale_on_gemma(tmp_path, gemma_dir, monkeypatch):
    """The default `mean` baseline is the mean of what the embedding module outputs (the inputs' scale, √d_model
    included), computed here over every token id; the path's end points, f(baseline) and completeness are checked
    against the test's own embeddings and forwards."""
    from transformers import AutoModelForCausalLM

    paths = []  # (e, b) of every integrated-gradients path, as the method built them
    init = attr.IGPath.__init__

    def recording_init(self, ctx, e, b):
        paths.append((e, b))
        init(self, ctx, e, b)

    monkeypatch.setattr(attr.IGPath, "__init__", recording_init)

    run = run_spec(
        tmp_path,
        {
            "model": str(gemma_dir),
            "prompts": ["The quick brown fox"],
            "capture": "none",
            "generation": {"max_new_tokens": 4},
            "output": {"float_dtype": "float32"},
        },
    )
    model = AutoModelForCausalLM.from_pretrained(str(gemma_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval().requires_grad_(False)
    emb = model.get_input_embeddings()
    with torch.no_grad():
        mean = emb(torch.arange(emb.weight.shape[0])[None])[0].double().mean(0).float()  # the module's own outputs
    raw = emb.weight.double().mean(0).norm().item()
    assert mean.norm().item() == pytest.approx(8 * raw, rel=1e-4)  # the module scales: a raw table row is 8× smaller
    result = explain_run(
        run.path, "1,3", methods=["ig"], settings=attr.Settings(target="contrast", quantity="logprob", batch_size=16)
    )
    assert len(paths) == 2
    for e, (e_path, b_path) in zip(result.explanations, paths):
        ids, chosen, runner = context(run, 0, e.step)
        with torch.no_grad():
            x = emb(torch.tensor([ids]))
            b = mean.expand_as(x).clone()
            b[:, 0] = x[:, 0]  # the default --ig-keep sink
            assert b[0, 1:].norm(dim=-1).mean() > 0.3 * x[0, 1:].norm(dim=-1).mean()  # on the inputs' scale
            torch.testing.assert_close(e_path, x[0], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(b_path, b[0], rtol=1e-5, atol=1e-6)
            fx, fb = (f_of(model, v, chosen, runner, "contrast", "logprob").item() for v in (x, b))
        assert e.info["f_x"] == pytest.approx(fx, abs=TOL)
        assert e.info["f_baseline"] == pytest.approx(fb, abs=TOL)
        assert e.info["converged"] is True, e.info
        assert abs(float(e.scores.astype(np.float64).sum()) - (fx - fb)) <= 0.01 * max(abs(fx - fb), 0.01) + TOL


# ---- refusals before any work (one line, exit 2) -----------------------------------------------------------
def _cli_explain(*args):
    from typer.testing import CliRunner

    from lmtrace.cli.main import app

    out = CliRunner().invoke(app, ["explain", *map(str, args)])
    return out, [line for line in out.output.splitlines() if line.startswith("error:")]


def test_a_bad_device_is_refused_in_one_line_naming_the_choices(forward_only_run):
    out, errors = _cli_explain(forward_only_run.path, "--steps", "0", "--device", "bogus")
    assert out.exit_code == 2 and len(errors) == 1, out.output
    assert "'bogus'" in errors[0] and "cpu, cuda, cuda:N" in errors[0] and "loading model" not in out.output


def test_kept_positions_outside_the_context_are_refused_before_any_work(forward_only_run, attention_run):
    n = len(context(forward_only_run, 0, 2)[0])  # step 2's context: positions 0..n-1
    out, errors = _cli_explain(forward_only_run.path, "--steps", "0,2", "-m", "ig", "--ig-keep", f"0,{n},999")
    assert out.exit_code == 2 and len(errors) == 1 and "loading model" not in out.output, out.output
    assert f"positions {n}, 999 are outside" in errors[0] and f"0..{n - 1}" in errors[0]
    out, errors = _cli_explain(attention_run.path, "--steps", "1", "-m", "rollout", "--rollout-exclude", "999")
    assert out.exit_code == 2 and len(errors) == 1 and "--rollout-exclude '999'" in errors[0], out.output
    kept = explain_run(
        forward_only_run.path,
        "0,2",
        methods=["ig"],
        settings=attr.Settings(ig_keep=f"0,{n - 1}", ig_rule="midpoint", ig_steps=2),
    )  # inside step 2's context: kept there, not at step 0
    assert [e.info["kept_positions"] for e in kept.explanations] == [[0], [0, n - 1]]


@pytest.mark.parametrize("status", ["interrupted", "failed", "running"])
def test_a_run_that_is_not_complete_is_refused(forward_only_run, tmp_path, status):
    moved = tmp_path / forward_only_run.path.name
    shutil.copytree(forward_only_run.path, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["status"] = status
    (moved / "manifest.json").write_text(json.dumps(manifest))
    before = (moved / "manifest.json").read_text(), sorted(moved.rglob("*"))
    out, errors = _cli_explain(moved, "--steps", "0")
    assert out.exit_code == 2 and len(errors) == 1, out.output
    assert f"is {status}, not complete" in errors[0] and f"lmtrace generate --resume {moved.name}" in errors[0]
    assert ((moved / "manifest.json").read_text(), sorted(moved.rglob("*"))) == before  # nothing written


# ---- what the terminal prints ---------------------------------------------------------------------------
def test_the_legend_matches_what_is_printed_with_and_without_colour(forward_only_run):
    import io

    from rich.console import Console

    from lmtrace.commands.explain_render import render

    out, _ = _cli_explain(forward_only_run.path, "--steps", "1", "-m", "gxi")  # not a terminal: no colours
    assert out.exit_code == 0, out.output
    assert "green" not in out.output and "red =" not in out.output
    assert "+ supports the target, − opposes it" in out.output
    result = explain_run(forward_only_run.path, "1", methods=["gxi"])
    for colour, expected in ((None, "score sign: + supports"), ("truecolor", "green = supports the target")):
        buf = io.StringIO()
        render(result, Console(file=buf, force_terminal=colour is not None, color_system=colour, width=200))
        text = buf.getvalue()
        assert expected in text
        assert ("\x1b[" in text) is (colour is not None)  # colours printed exactly when the legend speaks of them
