"""`lmtrace compare`: pairs of runs whose differences are known independently of lmtrace/compare.py.

- a run vs itself: nothing may differ;
- the same spec with another seed: same model and same contexts, so until the first divergence the
  archived distributions are identical and every paired figure must be exactly 0;
- a parent and a head-ablated child (the test zeroes the o_proj input columns of one head in a copy
  of the tiny model): attention rows are unchanged up to and including the ablated layer, residual
  norms up to the layer before it; the figures are recomputed here from the two archives' arrays;
- a model of another shape with the same tokenizer and reordered prompts: pairing by prompt text,
  per-layer figures skipped.
Expected values are computed from the archives with pandas/numpy, never with compare.py's helpers.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from lmtrace.analysis.compare import compare_runs
from lmtrace.cli.main import app
from tests.helpers.runs import PROMPTS, rerecord_checksums, run_spec, with_lens

ABLATED_LAYER, ABLATED_HEAD = 2, 1
N = 5  # generated tokens per sequence
SAMPLED = {"max_new_tokens": N, "batch_size": 3, "temperature": 1.0, "top_k": 5, "seed": 1}
GREEDY = {"max_new_tokens": N, "batch_size": 3}


def _model_copy(src, dst, edit):
    from transformers import LlamaForCausalLM

    shutil.copytree(src, dst)
    model = LlamaForCausalLM.from_pretrained(src)
    with torch.no_grad():
        edit(model)
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("compare")

    def ablate(model):
        hd = model.config.hidden_size // model.config.num_attention_heads
        model.model.layers[ABLATED_LAYER].self_attn.o_proj.weight[:, ABLATED_HEAD * hd : (ABLATED_HEAD + 1) * hd] = 0

    child_dir = _model_copy(tiny_llama_dir, root / "ablated", ablate)

    def two_layers(model):  # same tokenizer, another shape: drop the last two layers
        model.model.layers = model.model.layers[:2]
        model.config.num_hidden_layers = 2
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:2]

    small_dir = _model_copy(tiny_llama_dir, root / "small", two_layers)
    capture = {"residual": {"vectors_at": [1, 3]}}
    out = {
        "sampled": run_spec(root, {"model": str(tiny_llama_dir), "prompts": PROMPTS, "generation": SAMPLED}),
        "seed2": run_spec(
            root, {"model": str(tiny_llama_dir), "prompts": PROMPTS, "generation": {**SAMPLED, "seed": 2}}
        ),
        # the deferred logit lens computed (`lmtrace lens`): per-layer lens winner changes are compared
        "parent": with_lens(
            run_spec(root, {"model": str(tiny_llama_dir), "prompts": PROMPTS, "generation": GREEDY, "capture": capture})
        ),
        "child": with_lens(
            run_spec(root, {"model": str(child_dir), "prompts": PROMPTS, "generation": GREEDY, "capture": capture})
        ),
        "small": run_spec(
            root,
            {
                "model": str(small_dir),
                "prompts": [PROMPTS[2], PROMPTS[0], "Something else entirely"],
                "generation": {**GREEDY, "max_new_tokens": 3},
            },
        ),
    }
    out["root"] = root
    return out


# ---- independent expectations, from the archives ----------------------------------------------
def _gen(run, seq):
    t = run.tokens().to_pandas()
    return t[(t.sequence == seq) & ~t.is_prompt].sort_values("step").reset_index(drop=True)


def _first_divergence(a, b):
    ids_a, ids_b = a.token_id.tolist(), b.token_id.tolist()
    for s, (x, y) in enumerate(zip(ids_a, ids_b)):
        if x != y:
            return s
    return None if len(ids_a) == len(ids_b) else min(len(ids_a), len(ids_b))


def _known(row):
    known = dict(zip(row.alt_ids.tolist(), np.asarray(row.alt_logprobs, np.float64).tolist()))
    known[int(row.token_id)] = float(row.logprob)
    return known


def _expected_kl_js(row_a, row_b):
    """The documented definition: tokens stored on both sides + one tail bucket (floored at 1e-12)."""
    ka, kb = _known(row_a), _known(row_b)
    common = sorted(set(ka) & set(kb))
    if not common:  # a single bucket: the bound says nothing, reported as null
        return None, None
    p = [math.exp(ka[i]) for i in common]
    q = [math.exp(kb[i]) for i in common]
    p.append(max(1 - sum(p), 0.0, 1e-12))
    q.append(max(1 - sum(q), 0.0, 1e-12))
    kl = sum(x * math.log(x / y) for x, y in zip(p, q) if x > 0)
    ent = lambda v: -sum(x * math.log(x) for x in v if x > 0)  # noqa: E731
    js = ent([(x + y) / 2 for x, y in zip(p, q)]) - (ent(p) + ent(q)) / 2
    return kl, js


def _js_rows(p, q):
    """Jensen-Shannon via entropies, rows renormalised: H(m) - (H(p) + H(q)) / 2."""
    p = p / p.sum(-1, keepdims=True)
    q = q / q.sum(-1, keepdims=True)
    ent = lambda v: -(np.where(v > 0, v * np.log(np.where(v > 0, v, 1)), 0)).sum(-1)  # noqa: E731
    return ent((p + q) / 2) - (ent(p) + ent(q)) / 2


# ---- tests ------------------------------------------------------------------------------------
def test_a_run_compared_with_itself_reports_no_difference(runs):
    run = runs["parent"]
    cmp = compare_runs(run.path, run.id, runs_dir=run.path.parent)
    assert cmp.identical and cmp.verdict.startswith("no difference")
    assert cmp.pairing["method"] == "index" and cmp.pairing["pairs"] == [(0, 0), (1, 1), (2, 2)]
    assert all(p["first_divergence"] is None and p["paired_steps"] == N for p in cmp.pairs)
    steps = cmp.per_step.to_pandas()
    assert len(steps) == 3 * N and steps.context_identical.all() and (steps.phase == "shared").all()
    for col in ("kl_ab", "kl_ba", "js", "entropy_delta", "margin_delta"):
        assert (steps[col] == 0).all(), col
    assert (steps.logprob_a_under_b == steps.logprob_a).all() and steps.top1_agree.all() and steps.same_stored.all()
    layers = cmp.per_layer.to_pandas()
    assert len(layers) == 3 * N * 4
    for col in (
        "resid_norm_delta",
        "delta_norm_delta",
        "attn_norm_delta",
        "mlp_norm_delta",
        "margin_contrib_delta",
        "attn_js_max",
        "resid_dist",
    ):
        assert (layers[col].dropna() == 0).all(), col
    assert (layers.lens_changed == 0).all() and len(cmp.per_head) == 3 * N * 4 * 4  # computed, and unchanged
    assert not any("lmtrace lens" in n for n in cmp.notes)
    assert cmp.first_changed_layer is None and not cmp.spec_differences


def test_another_seed_diverges_by_sampling_only(runs):
    a, b = runs["sampled"], runs["seed2"]
    cmp = compare_runs(a.path, b.path)
    assert {"key": "generation.seed", "a": 1, "b": 2} in cmp.spec_differences
    steps = cmp.per_step.to_pandas()
    assert any(p["first_divergence"] is not None for p in cmp.pairs)
    for p in cmp.pairs:
        ga, gb = _gen(a, p["seq_a"]), _gen(b, p["seq_b"])
        first = _first_divergence(ga, gb)
        assert (p["first_divergence"] or {}).get("step") == first
        n = len(ga) if first is None else first + 1
        assert p["paired_steps"] == n
        mine = steps[steps.pair == p["pair"]].set_index("step")
        assert mine.context_identical.sum() == n and (mine.phase.iloc[n:] == "after_divergence").all()
        for s in range(n):
            # same model, same context: the archives hold the same distribution, so every figure is 0
            np.testing.assert_array_equal(ga.alt_logprobs[s], gb.alt_logprobs[s])
            assert mine.loc[s, "kl_ab"] == 0 and mine.loc[s, "js"] == 0 and mine.loc[s, "entropy_delta"] == 0
            assert mine.loc[s, "same_stored"]
        if first is not None:
            # top_k=5 sampling: B's token is among A's 10 stored alternatives, with B's own logprob
            row_a, row_b = ga.iloc[first], gb.iloc[first]
            expected = dict(zip(row_a.alt_ids.tolist(), row_a.alt_logprobs.tolist()))[int(row_b.token_id)]
            assert mine.loc[first, "logprob_b_under_a"] == pytest.approx(expected, abs=0)
            assert mine.loc[first, "logprob_b_under_a"] == pytest.approx(float(row_b.logprob), abs=1e-6)
            assert "sampling" in p["first_divergence"]["explanation"]
            # after the divergence: per-side values only, nothing paired
            after = mine.iloc[n:]
            assert after[["kl_ab", "js", "logprob_a_under_b", "margin_delta"]].isna().all().all()
            assert p["after_divergence"]["paired"] is False
    layers = cmp.per_layer.to_pandas()
    assert (layers.resid_norm_delta == 0).all() and (cmp.per_head.to_pandas().attn_js == 0).all()


def test_head_ablated_child_changes_from_the_ablated_layer_on(runs):
    a, b = runs["parent"], runs["child"]
    cmp = compare_runs(a.path, b.path)
    steps = cmp.per_step.to_pandas()
    layers = cmp.per_layer.to_pandas()
    heads = cmp.per_head.to_pandas()
    sa, sb = a.steps().to_pandas(), b.steps().to_pandas()
    attn_a, attn_b = a.array("attn")[:].astype(np.float64), b.array("attn")[:].astype(np.float64)
    resid_a, resid_b = a.array("resid")[:], b.array("resid")[:]
    # `resid` holds vectors_at [1, 3] and, the lens being deferred, every captured layer: index by layer
    resid_at = {layer: i for i, layer in enumerate(a.manifest["shape"]["resid_layers"])}
    assert b.manifest["shape"]["resid_layers"] == a.manifest["shape"]["resid_layers"]
    for p in cmp.pairs:
        seq = p["seq_a"]
        ga, gb = _gen(a, seq), _gen(b, seq)
        first = _first_divergence(ga, gb)
        assert (p["first_divergence"] or {}).get("step") == first
        n = len(ga) if first is None else first + 1
        P = int(a.prompt_len()[seq])
        mine = steps[steps.pair == p["pair"]].set_index("step")
        for s in range(n):
            kl, js = _expected_kl_js(ga.iloc[s], gb.iloc[s])
            if kl is None:
                assert pd.isna(mine.loc[s, "kl_ab"]) and pd.isna(mine.loc[s, "js"]) and mine.loc[s, "n_common"] == 0
            else:
                assert mine.loc[s, "kl_ab"] == pytest.approx(kl, rel=1e-6, abs=1e-12)
                assert mine.loc[s, "js"] == pytest.approx(js, rel=1e-4, abs=1e-12)
                assert mine.loc[s, "kl_ab"] >= 0 and mine.loc[s, "js"] >= 0
            expected_entropy = float(gb.entropy[s]) - float(ga.entropy[s])
            assert mine.loc[s, "entropy_delta"] == pytest.approx(expected_entropy, abs=1e-6)
        # the ablation changes the next-token distribution: at step 0 the stored top-k differ
        assert not np.array_equal(ga.alt_logprobs[0], gb.alt_logprobs[0]) and not mine.loc[0, "same_stored"]
        assert pd.isna(mine.loc[0, "js"]) or mine.loc[0, "js"] > 0
        lay = layers[layers.pair == p["pair"]].set_index(["step", "layer"])
        hd = heads[heads.pair == p["pair"]].set_index(["step", "layer", "q_head"])
        for s in range(n):
            for layer in range(4):
                ra = float(sa[(sa.sequence == seq) & (sa.step == s) & (sa.layer == layer)].resid_norm.iloc[0])
                rb = float(sb[(sb.sequence == seq) & (sb.step == s) & (sb.layer == layer)].resid_norm.iloc[0])
                got = lay.loc[(s, layer)]
                assert got.resid_norm_delta == pytest.approx(rb - ra, abs=1e-6)
                if layer < ABLATED_LAYER:
                    assert rb - ra == 0 and got.resid_norm_delta == 0
                else:
                    assert abs(rb - ra) > 0 and got.resid_norm_delta != 0
                # attention of the query row: unchanged up to and including the ablated layer
                row_a = attn_a[seq, s, layer, :, : P + s]
                row_b = attn_b[seq, s, layer, :, : P + s]
                expected = _js_rows(row_a, row_b)
                if layer <= ABLATED_LAYER:
                    np.testing.assert_array_equal(row_a, row_b)
                    assert got.attn_js_max == 0
                else:
                    assert (expected > 0).all()
                for h in range(4):
                    assert hd.loc[(s, layer, h)].attn_js == pytest.approx(expected[h], rel=1e-4, abs=1e-12)
            # full residual vectors at layers 1 and 3: equal before the ablated layer, different after
            r1, r3 = resid_at[1], resid_at[3]
            assert lay.loc[(s, 1)].resid_dist == 0 and np.array_equal(resid_a[seq, s, r1], resid_b[seq, s, r1])
            dist = np.linalg.norm(resid_b[seq, s, r3].astype(np.float64) - resid_a[seq, s, r3])
            assert lay.loc[(s, 3)].resid_dist == pytest.approx(dist, rel=1e-6) and dist > 0
            # logit-lens winners, from the two steps tables: unchanged before the ablated layer
            for layer in range(4):
                la = sa[(sa.sequence == seq) & (sa.step == s) & (sa.layer == layer)].lens_top1.iloc[0]
                lb = sb[(sb.sequence == seq) & (sb.step == s) & (sb.layer == layer)].lens_top1.iloc[0]
                assert lay.loc[(s, layer)].lens_changed == float(la != lb)
                if layer < ABLATED_LAYER:
                    assert la == lb
    assert cmp.first_changed_layer == ABLATED_LAYER
    assert cmp.layers[0]["layer"] in (2, 3) and all(r["layer"] == 3 for r in cmp.heads if r["attn_js_mean"] > 0)
    assert {r["layer"] for r in cmp.layers if not r["changed"]} == {0, 1}
    assert not cmp.identical and "layer 2" in cmp.verdict


def test_pairing_by_prompt_with_a_model_of_another_shape(runs):
    a, b = runs["parent"], runs["small"]
    cmp = compare_runs(a.path, b.path)
    assert cmp.pairing["method"] == "prompt"
    assert cmp.pairing["pairs"] == [(0, 1), (2, 0)]
    assert cmp.pairing["unpaired_a"] == [1] and cmp.pairing["unpaired_b"] == [2]
    assert not cmp.compatibility["same_architecture"] and cmp.per_layer.num_rows == 0
    assert any("shape" in n for n in cmp.notes)
    steps = cmp.per_step.to_pandas()
    assert steps.groupby("pair").context_identical.first().all()  # same prompt ids: step 0 is paired
    paired = steps[steps.context_identical]
    assert paired.entropy_delta.notna().all() and paired.top1_agree.notna().all()
    # KL/JS are null exactly where the two stored top-k lists share no token
    assert (paired.kl_ab.isna() == (paired.n_common == 0)).all()
    by_index = compare_runs(a.path, b.path, pair="index")
    assert by_index.pairing["pairs"] == [(0, 0), (1, 1), (2, 2)]
    assert all(not p["same_prompt_ids"] and p["paired_steps"] == 0 for p in by_index.pairs)
    assert by_index.per_step.to_pandas().kl_ab.isna().all()


def test_cli_json_out_and_refusals(runs, tmp_path):
    a, b = runs["parent"], runs["child"]
    cli = CliRunner()
    res = cli.invoke(app, ["compare", str(a.path), str(b.path), "--json"])
    assert res.exit_code == 0, res.output
    assert "NaN" not in res.stdout and "Infinity" not in res.stdout  # strict JSON
    summary = json.loads(res.stdout)
    assert summary["identical"] is False and summary["first_changed_layer"] == ABLATED_LAYER
    assert summary["pairing"]["unpaired_a"] == [] and len(summary["per_step"]) == 3 * N
    out = tmp_path / "out"
    res = cli.invoke(app, ["compare", a.id, b.id[:-2], "--runs-dir", str(a.path.parent), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "diverge" in res.stdout and "layers that changed most" in res.stdout
    per_head = pd.read_parquet(out / "per_head.parquet")
    paired = sum(p["paired_steps"] for p in summary["pairs"])
    assert len(per_head) == paired * 4 * 4 and len(pd.read_parquet(out / "per_step.parquet")) == 3 * N
    assert len(pd.read_parquet(out / "per_layer.parquet")) == paired * 4
    assert "# lmtrace compare" in (out / "report.md").read_text()

    # an incomplete archive: refused unless --allow-incomplete, then compared up to its committed steps
    cut = shutil.copytree(a.path, tmp_path / "cut")
    manifest = json.loads((cut / "manifest.json").read_text())
    (cut / "manifest.json").write_text(json.dumps({**manifest, "status": "interrupted"}))
    progress_files = list(cut.glob("progress.json")) + list(cut.glob("progress/*.json"))
    assert progress_files
    for f in progress_files:  # the crash-safety record: only 3 steps were committed
        progress = json.loads(f.read_text())
        for entry in progress["batches"].values():
            entry.update(committed_steps=3, done=False)
        f.write_text(json.dumps(progress))
    (cut / "sequences.parquet").unlink()  # written when a batch finishes, and this one did not
    res = cli.invoke(app, ["compare", str(a.path), str(cut)])
    assert res.exit_code == 2 and "--allow-incomplete" in res.stderr
    res = cli.invoke(app, ["compare", str(a.path), str(cut), "--allow-incomplete", "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert all(p["paired_steps"] == 3 and p["first_divergence"] is None for p in s["pairs"])

    # different tokenizers: by vocabulary size, or by a token id that decodes differently
    other = shutil.copytree(a.path, tmp_path / "other_tok")
    (other / "manifest.json").write_text(
        json.dumps({**manifest, "tokenizer": {**manifest["tokenizer"], "vocab_size": 32000}})
    )
    res = cli.invoke(app, ["compare", str(a.path), str(other)])
    assert res.exit_code == 2 and "different tokenizers" in res.stderr
    renamed = shutil.copytree(a.path, tmp_path / "renamed")
    tokens = pq.read_table(renamed / "tokens.parquet")
    texts = tokens.column("token_text").to_pylist()
    texts = ["@@" + texts[0]] + texts[1:]
    pq.write_table(
        tokens.set_column(tokens.schema.get_field_index("token_text"), "token_text", pa.array(texts, pa.string())),
        renamed / "tokens.parquet",
    )
    rerecord_checksums(renamed)  # a run whose tokenizer decodes differently, not a damaged one
    res = cli.invoke(app, ["compare", str(a.path), str(renamed)])
    assert res.exit_code == 2 and "decode differently" in res.stderr
    res = cli.invoke(app, ["compare", str(a.path), str(b.path), "--pair", "nearest"])
    assert res.exit_code == 2 and "--pair" in res.stderr


def test_compare_loads_no_model(runs):
    code = textwrap.dedent(f"""
        import sys
        from lmtrace.commands.compare import compare_view
        compare_view({str(runs["parent"].path)!r}, {str(runs["child"].path)!r}, json_out=True)
        assert "torch" not in sys.modules and "transformers" not in sys.modules, "a model library was imported"
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["a"]["run_id"] == runs["parent"].id


def test_topk_figures_are_lower_bounds_and_sparse_attention_matches_dense():
    """The stored-top-k partition never exceeds the full-vocabulary KL/JS; sparse rows agree with dense."""
    from lmtrace.analysis.compare.divergence import attention_js_dense, attention_js_sparse, topk_divergence

    rng = np.random.default_rng(0)
    for _ in range(20):
        logits_a = rng.normal(0, 3, 200)
        logits_b = logits_a + rng.normal(0, 1, 200)
        lp_a = logits_a - np.log(np.exp(logits_a).sum())
        lp_b = logits_b - np.log(np.exp(logits_b).sum())
        pa_, pb_ = np.exp(lp_a), np.exp(lp_b)
        full_kl = float((pa_ * (lp_a - lp_b)).sum())
        m = (pa_ + pb_) / 2
        full_js = float(0.5 * (pa_ * np.log(pa_ / m)).sum() + 0.5 * (pb_ * np.log(pb_ / m)).sum())
        top_a, top_b = np.argsort(-lp_a)[:10], np.argsort(-lp_b)[:10]
        d = topk_divergence({int(i): lp_a[i] for i in top_a}, {int(i): lp_b[i] for i in top_b})
        if d["n_common"]:
            assert 0 <= d["kl_ab"] <= full_kl + 1e-12 and 0 <= d["js"] <= full_js + 1e-12
        everything = topk_divergence(dict(enumerate(lp_a)), dict(enumerate(lp_b)))
        assert everything["kl_ab"] == pytest.approx(full_kl, rel=1e-6) and everything["js"] == pytest.approx(
            full_js, rel=1e-6
        )

    rows_a = rng.dirichlet(np.ones(12), size=(3, 2))  # [step, head, key]
    rows_b = rng.dirichlet(np.ones(12), size=(3, 2))
    n_keys = np.array([12, 12, 12])
    dense = attention_js_dense(rows_a, rows_b, n_keys)
    ids = np.broadcast_to(np.arange(12), rows_a.shape)
    np.testing.assert_allclose(attention_js_sparse(ids, rows_a, ids, rows_b), dense, rtol=1e-9, atol=1e-12)
    # keep the 4 largest keys per row: again a lower bound of the dense value
    k_a, k_b = np.argsort(-rows_a, -1)[..., :4], np.argsort(-rows_b, -1)[..., :4]
    sparse = attention_js_sparse(k_a, np.take_along_axis(rows_a, k_a, -1), k_b, np.take_along_axis(rows_b, k_b, -1))
    assert (sparse <= dense + 1e-12).all() and (sparse >= 0).all()


def test_a_sequence_that_stopped_earlier_diverges_by_length(runs, tmp_path):
    a = runs["parent"]
    short = shutil.copytree(a.path, tmp_path / "short")
    tokens = pq.read_table(short / "tokens.parquet")
    df = tokens.to_pandas()
    keep = ~((df.sequence == 0) & (df.step >= 3)).fillna(False)  # sequence 0 stopped after 3 tokens (say, on eos)
    pq.write_table(tokens.filter(pa.array(keep.to_numpy())), short / "tokens.parquet")
    rerecord_checksums(short)  # an archive made this way, not a damaged one
    cmp = compare_runs(a.path, short)
    p = cmp.pairs[0]
    assert p["first_divergence"]["step"] == 3 and p["first_divergence"]["kind"] == "length"
    assert p["first_divergence"]["token_b"] is None and p["paired_steps"] == 3
    steps = cmp.per_step.to_pandas()
    s0 = steps[steps.pair == 0].set_index("step")
    assert (s0.loc[:2, "kl_ab"] == 0).all() and pd.isna(s0.loc[3, "kl_ab"]) and s0.loc[3, "phase"] == "divergence"
    assert all(q["first_divergence"] is None for q in cmp.pairs[1:]) and not cmp.identical


# ---- verdicts (issue 22): sampling is not a model difference, different prompts, float noise -------------------
@pytest.fixture(scope="module")
def verdict_runs(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("verdicts")
    wide = {"max_new_tokens": 3, "temperature": 1.0, "top_k": 0}  # a random model: draws fall outside the top-10
    greedy = {"max_new_tokens": 3, "batch_size": 2}
    spec = {"model": str(tiny_llama_dir), "capture": "none"}
    return {
        "seed1": run_spec(root, {**spec, "prompts": [PROMPTS[0]], "generation": {**wide, "seed": 1}}),
        "seed2": run_spec(root, {**spec, "prompts": [PROMPTS[0]], "generation": {**wide, "seed": 2}}),
        "batch": run_spec(root, {**spec, "prompts": [PROMPTS[0], PROMPTS[2]], "generation": greedy}),
        "alone": run_spec(root, {**spec, "prompts": [PROMPTS[0]], "generation": greedy}),
        "other": run_spec(root, {**spec, "prompts": ["Berlin is a city in", PROMPTS[2]], "generation": greedy}),
    }


def test_sampling_outside_the_stored_top_k_is_not_called_a_model_difference(verdict_runs):
    a, b = verdict_runs["seed1"], verdict_runs["seed2"]
    ga, gb = _gen(a, 0), _gen(b, 0)
    first = _first_divergence(ga, gb)
    assert first is not None
    # independently: both stored top-10 lists are identical and a chosen token lies outside them
    assert ga.alt_ids[first].tolist() == gb.alt_ids[first].tolist()
    np.testing.assert_array_equal(ga.alt_logprobs[first], gb.alt_logprobs[first])
    assert int(gb.token_id.iloc[first]) not in ga.alt_ids[first].tolist()
    cmp = compare_runs(a.path, b.path)
    steps = cmp.per_step.to_pandas()
    assert steps[steps.context_identical].same_stored.all()
    assert "sampling, not by the model" in cmp.verdict and "differ (" not in cmp.verdict
    assert "sampling" in cmp.pairs[0]["first_divergence"]["explanation"]


def test_index_pairs_with_different_prompts_get_a_verdict_and_a_spec_difference(verdict_runs):
    a, b = verdict_runs["batch"], verdict_runs["other"]
    text_a = "".join(_gen(a, 0).token_text)
    text_b = "".join(_gen(b, 0).token_text)
    assert text_a != text_b
    cmp = compare_runs(a.path, b.path, pair="index")
    assert {"key": "prompts.texts[0]", "a": PROMPTS[0], "b": "Berlin is a city in"} in cmp.spec_differences
    assert "1 pair(s) have different prompt tokens, 1 of them generated different text" in cmp.verdict
    assert f"{text_a!r} vs {text_b!r}" in cmp.verdict
    assert "all 2 pair(s) generated the same tokens" not in cmp.verdict
    first = cmp.pairs[0]["first_step"]
    assert first["paired"] is False and first["token_a"] == int(_gen(a, 0).token_id.iloc[0])
    from typer.testing import CliRunner

    out = CliRunner().invoke(app, ["compare", str(a.path), str(b.path), "--pair", "index"])
    assert out.exit_code == 0 and "none in the resolved specs" not in out.output


def test_batch_composition_float_noise_is_called_float_noise(verdict_runs):
    a, b = verdict_runs["batch"], verdict_runs["alone"]
    ga, gb = _gen(a, 0), _gen(b, 0)
    assert ga.token_id.tolist() == gb.token_id.tolist()
    # independently: the stored logprobs differ (padding in the batch), by float noise only
    la, lb = np.stack(ga.alt_logprobs.to_numpy()), np.stack(gb.alt_logprobs.to_numpy())
    assert ga.alt_ids.map(list).tolist() == gb.alt_ids.map(list).tolist()
    diff = np.abs(la - lb).max()
    if diff == 0:
        pytest.skip("this torch build computes the padded batch bit-identically: no float noise to classify")
    assert diff < 1e-4
    cmp = compare_runs(a.path, b.path)
    assert "float noise" in cmp.verdict and "distributions differ" not in cmp.verdict
    assert not cmp.identical


def test_exact_kl_equals_the_full_vocabulary_kl_of_the_two_models(runs):
    from transformers import AutoModelForCausalLM

    a, b = runs["parent"], runs["child"]
    cmp = compare_runs(a.path, b.path, exact=True, exact_steps="0-3")
    steps = cmp.per_step.to_pandas()
    models = [
        AutoModelForCausalLM.from_pretrained(
            r.manifest["spec_resolved"]["model"]["ref"], dtype=torch.float32, attn_implementation="eager"
        ).eval()
        for r in (a, b)
    ]
    t = a.tokens().to_pandas()
    checked = 0
    for _, row in steps.iterrows():
        paired = bool(row.context_identical) and row.step <= 3
        if not paired:
            assert pd.isna(row.exact_kl_ab)
            continue
        seq = int(row.seq_a)
        s = t[t.sequence == seq]
        ids = (
            s[s.is_prompt].sort_values("position").token_id.tolist()
            + s[~s.is_prompt].sort_values("step").token_id.tolist()[: int(row.step)]
        )
        with torch.no_grad():
            la, lb = (m(torch.tensor([ids])).logits[0, -1].double().log_softmax(-1) for m in models)
        kl_ab = float((la.exp() * (la - lb)).sum())
        mix = (0.5 * (la.exp() + lb.exp())).log()
        js = float(0.5 * (la.exp() * (la - mix)).sum() + 0.5 * (lb.exp() * (lb - mix)).sum())
        assert row.exact_kl_ab == pytest.approx(kl_ab, abs=1e-5)
        assert row.exact_kl_ba == pytest.approx(float((lb.exp() * (lb - la)).sum()), abs=1e-5)
        assert row.exact_js == pytest.approx(js, abs=1e-5)
        if not pd.isna(row.kl_ab):
            assert row.kl_ab <= row.exact_kl_ab + 1e-6  # the archive-only figure is a lower bound
        checked += 1
    assert checked >= 3 and any("--exact" in n for n in cmp.notes)
    assert CliRunner().invoke(app, ["compare", str(a.path), str(b.path), "--exact-steps", "1"]).exit_code == 2


@pytest.mark.slow
def test_clean_and_corrupted_prompts_report_the_step0_logit_difference(tmp_path):
    """The patching normaliser: logit(clean answer) − logit(corrupted answer) in each run's step 0,
    against the model's own forward on each prompt."""
    import torch

    from tests.helpers.reference import Reference

    spec = {
        "prompts": ["The capital of France is the city of"],
        "generation": {"max_new_tokens": 1},
        "capture": {
            "alternatives": 1000,
            "attention": {"enabled": False},
            "qkv": False,
            "ffn": {"enabled": False},
            "lens": {"enabled": False},
        },
    }
    clean = run_spec(tmp_path / "clean", spec)
    corrupt = run_spec(tmp_path / "corrupt", {**spec, "prompts": ["The capital of Italy is the city of"]})
    ga, gb = _gen(clean, 0), _gen(corrupt, 0)
    x, y = int(ga.token_id.iloc[0]), int(gb.token_id.iloc[0])
    assert x != y, (ga.token_text.iloc[0], gb.token_text.iloc[0])
    cmp = compare_runs(clean.path, corrupt.path, pair="index")
    d = cmp.pairs[0]["step0_logit_diff"]
    assert (d["token_a"], d["token_b"]) == (x, y)
    ref = Reference("embedded:smollm2-135m")
    for run, key in ((clean, "under_a"), (corrupt, "under_b")):
        t = run.tokens().to_pandas()
        ids = t[t.is_prompt].sort_values("position").token_id.tolist()
        with torch.inference_mode():
            logits = ref.forward(ids)["logits"][-1]
        assert d[key] == pytest.approx(float(logits[x] - logits[y]), abs=1e-3)
    # with the default 10 alternatives the corrupted run does not store the clean answer: null, not a guess
    few = compare_runs(
        clean.path,
        run_spec(
            tmp_path / "few", {**spec, "capture": "none", "prompts": ["The capital of Italy is the city of"]}
        ).path,
        pair="index",
    ).pairs[0]["step0_logit_diff"]
    assert few["under_a"] == pytest.approx(d["under_a"], abs=1e-5) and few["under_b"] is None


def test_the_terminal_summary_fits_80_columns_and_names_what_it_left_out(runs):
    """The summary on an 80-column terminal (rich's width): no line wider, every table's first columns
    whole (each pair's and step's number, each layer and head that changed most), the columns left out
    for width named; at 200 columns none is left out."""
    import io

    from rich.console import Console

    from lmtrace.commands.compare_render import render_comparison

    cmp = compare_runs(runs["seed2"].path, runs["sampled"].path)
    diverged = [p for p in cmp.pairs if p["first_divergence"] is not None]
    assert diverged  # the pairs table has token cells to fold

    def drawn(width: int) -> list[str]:
        console = Console(file=io.StringIO(), width=width, color_system=None)
        render_comparison(cmp, console)
        return console.file.getvalue().splitlines()

    lines = drawn(80)
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    header = next(i for i, line in enumerate(lines) if line.startswith("pair  A↔B"))
    numbered = [
        line.split()[:2]
        for line in lines[header + 1 : header + 1 + 3 * len(cmp.pairs)]
        if line.split() and line.split()[0].isdigit()
    ]
    assert numbered == [[str(p["pair"]), f"{p['seq_a']}↔{p['seq_b']}"] for p in cmp.pairs]
    assert any(line.startswith("(left out to fit 80 columns: ") for line in lines)
    assert not any("left out" in line for line in drawn(200))

    cmp = compare_runs(runs["parent"].path, runs["child"].path)  # layers and heads that changed
    lines = drawn(80)
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    layers = next(i for i, line in enumerate(lines) if line.startswith("layer  Δ output norm"))
    changed = [r["layer"] for r in cmp.layers if r["changed"]][:5]
    assert [int(line.split()[0]) for line in lines[layers + 1 : layers + 1 + len(changed)]] == changed
    heads = next(i for i, line in enumerate(lines) if line.startswith("layer.head"))
    top = [f"{r['layer']}.{r['q_head']}" for r in cmp.heads if r["attn_js_mean"] > 0][:5]
    assert [line.split()[0] for line in lines[heads + 1 : heads + 1 + len(top)]] == top
