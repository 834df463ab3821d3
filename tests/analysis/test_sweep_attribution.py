"""`lmtrace sweep --method attribution`: every estimate equals the test's own first-order formula (the
gradient of the metric w.r.t. the component, from the test's own hooks on the tiny model's eager
forward, dotted with the edit's change of the component); the QK-fixed position estimate equals the
test's own renormalised attention patterns; `--verify` equals the exact sweep."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmtrace.archive.sweeps import read_sweep
from lmtrace.commands.sweep import run_sweep
from lmtrace.spec.sweep_spec import SweepSpec
from tests.helpers.sweep_runs import CLEAN, CORRUPT, eager_model, sequence_ids, sweep_run

METRICS = ["logprob", "prob", "kl", "logit_diff:42,7"]


_run = sweep_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sharp_llama_dir):
    tmp = tmp_path_factory.mktemp("attribution")
    return _run(tmp, sharp_llama_dir, CLEAN, "clean"), _run(tmp, sharp_llama_dir, CORRUPT, "corrupt")


@pytest.fixture(scope="module")
def model(sharp_llama_dir):
    return eager_model(sharp_llama_dir)


_seq = sequence_ids


def _module(model, kind, L):
    layer = model.model.layers[L]
    return {
        "head": (layer.self_attn.o_proj, "pre"),
        "ffn": (layer.mlp.down_proj, "pre"),
        "mlp": (layer.mlp, "out"),
        "attn": (layer.self_attn, "out"),
        "resid": (layer, "out"),
    }[kind]


def _forward(model, ids, wanted, attentions=False):
    """The test's own forward with gradients: the output and (kind, layer) -> the component [1, T, width]
    (still in the graph)."""
    got, handles = {}, []
    for kind, L in wanted:
        module, how = _module(model, kind, L)
        if how == "pre":
            handles.append(module.register_forward_pre_hook(lambda m, a, key=(kind, L): got.__setitem__(key, a[0])))
        else:
            handles.append(
                module.register_forward_hook(
                    lambda m, a, o, key=(kind, L): got.__setitem__(key, o[0] if isinstance(o, tuple) else o)
                )
            )
    emb = model.model.embed_tokens.register_forward_hook(lambda m, a, o: o.detach().requires_grad_(True))
    try:
        with torch.enable_grad():
            out = model(torch.tensor([ids]), output_attentions=attentions)
    finally:
        emb.remove()
        for h in handles:
            h.remove()
    return out, got


def _scalar(logits, P, st, tok, metric):
    row = logits[0, P - 1 + st].float()
    if metric == "logit_diff:42,7":
        return row[42] - row[7]
    lp = row.log_softmax(-1)[tok]
    return lp if metric == "logprob" else lp.exp()


def _own_means(model, run, kind, L):
    total, n = 0, 0
    for s in range(2):
        p, g = _seq(run, s)
        with torch.no_grad():
            _, got = _forward(model, p + g, [(kind, L)])
        total = total + got[(kind, L)][0].double().sum(0)
        n += got[(kind, L)].shape[1]
    return (total / n).float()


def _rows(df, metric, seq, **cell):
    d = df[(df.metric == metric) & (df.sequence == seq)]
    for k, v in cell.items():
        d = d[d[k].isna()] if v is None else d[d[k] == v]
    return d.sort_values("step")


@pytest.mark.parametrize(
    "over,edit,positions,kind",
    [
        ("heads", "zero", None, "head"),
        ("mlp", "mean", None, "mlp"),
        ("neurons:2", "zero", "1,3", "ffn"),
        ("layers", "zero", None, "resid"),
    ],
)
def test_ablation_estimates_equal_the_tests_own_gradient_times_change(runs, model, over, edit, positions, kind):
    parent, _ = runs
    spec = SweepSpec(over=over, edit=edit, metrics=METRICS, method="attribution", positions=positions)
    df = read_sweep(parent, run_sweep(str(parent.path), spec).sweep_id).to_pandas()
    assert set(df.method) == {"attribution"}
    n_layers, hd = len(model.model.layers), model.config.hidden_size // model.config.num_attention_heads
    checked = 0
    for s in range(2):
        P, gen = len(_seq(parent, s)[0]), _seq(parent, s)[1]
        for L in [2] if kind == "ffn" else range(n_layers):
            out, got = _forward(model, _seq(parent, s)[0] + gen, [(kind, L)])
            x = got[(kind, L)]
            change = (_own_means(model, parent, kind, L) - x.detach()) if edit == "mean" else -x.detach()
            if kind == "resid":  # a zeroed layer: its output becomes its input
                inputs = {}
                h = model.model.layers[L].register_forward_pre_hook(
                    lambda m, a, k: inputs.__setitem__("x", a[0] if a else k["hidden_states"]), with_kwargs=True
                )
                with torch.no_grad():
                    model(torch.tensor([_seq(parent, s)[0] + gen]))
                h.remove()
                change = inputs["x"] - x.detach()
            for metric in ("logprob", "prob", "logit_diff:42,7"):
                for st in range(len(gen)):
                    grad = torch.autograd.grad(_scalar(out.logits, P, st, gen[st], metric), x, retain_graph=True)[0]
                    prod = (grad * change)[0].double()
                    if kind == "head":
                        for h in range(model.config.num_attention_heads):
                            own = float(prod[:, h * hd : (h + 1) * hd].sum())
                            r = _rows(df, metric, s, component="head", layer=L, q_head=h).iloc[st]
                            assert r.effect == pytest.approx(own, abs=1e-4, rel=1e-3)
                            checked += 1
                    elif kind == "ffn":
                        for n in (0, 5):
                            for p in (1, 3):
                                r = _rows(df, metric, s, component="neuron", layer=L, neuron=n, position=p).iloc[st]
                                assert r.effect == pytest.approx(float(prod[p, n]), abs=1e-4, rel=1e-3)
                                checked += 1
                    else:
                        r = _rows(df, metric, s, component="mlp" if kind == "mlp" else "layer", layer=L).iloc[st]
                        assert r.effect == pytest.approx(float(prod.sum()), abs=1e-4, rel=1e-3)
                        assert r.value == pytest.approx(r.baseline + float(prod.sum()), abs=1e-4, rel=1e-3)
                        checked += 1
    assert checked > 0
    kl = df[df.metric == "kl"]
    assert kl.value.isna().all() and kl.effect.isna().all()  # not estimated: its gradient is 0 there


@pytest.mark.parametrize("over,kind", [("attn", "attn"), ("resid:0-3", "resid")])
def test_patch_estimates_equal_the_tests_own_gradient_times_the_clean_minus_corrupted_activation(
    runs, model, over, kind
):
    clean, corrupt = runs
    spec = SweepSpec(
        over=over, edit="patch", source=str(clean.path), metrics=["logit_diff:42,7"], method="attribution", steps="0"
    )
    df = read_sweep(corrupt, run_sweep(str(corrupt.path), spec).sweep_id).to_pandas()
    for s in range(2):
        (P, gen), (cp, cg) = (lambda p, g: (len(p), g))(*_seq(corrupt, s)), _seq(clean, s)
        ids = _seq(corrupt, s)[0] + gen
        for L in range(len(model.model.layers)):
            with torch.no_grad():
                _, src = _forward(model, cp + cg, [(kind, L)])
            out, got = _forward(model, ids[:P], [(kind, L)])
            x = got[(kind, L)]
            grad = torch.autograd.grad(_scalar(out.logits, P, 0, gen[0], "logit_diff:42,7"), x)[0]
            prod = (grad * (src[(kind, L)][:, :P] - x.detach()))[0].double()
            if kind == "attn":
                cells = [(_rows(df, "logit_diff:42,7", s, component="attn", layer=L).iloc[0], float(prod.sum()))]
            else:  # one position at a time
                cells = [
                    (
                        _rows(df, "logit_diff:42,7", s, component="resid", layer=L, position=p).iloc[0],
                        float(prod[p].sum()),
                    )
                    for p in sorted(int(v) for v in df.position.dropna().unique())
                ]
            for r, own in cells:
                assert r.effect == pytest.approx(own, abs=1e-4, rel=1e-3)
                if not np.isnan(r.normalised):
                    assert r.normalised == pytest.approx(
                        (r.value - r.baseline) / (r.source_value - r.baseline), rel=1e-6
                    )


def test_position_estimates_are_the_tests_own_qk_fixed_patterns(runs, model):
    """--over positions: every layer's pattern recomputed with the key removed and renormalised, dotted
    with the gradient w.r.t. the pattern (the test's own eager attentions)."""
    parent, _ = runs
    spec = SweepSpec(over="positions", edit="zero", metrics=["logprob"], method="attribution", steps="0-1")
    df = read_sweep(parent, run_sweep(str(parent.path), spec).sweep_id).to_pandas()
    for s in range(2):
        prompt, gen = _seq(parent, s)
        P = len(prompt)
        out, _ = _forward(model, prompt + gen[:1], [], attentions=True)
        for st in range(2):
            grads = torch.autograd.grad(
                _scalar(out.logits, P, st, gen[st], "logprob"), out.attentions, retain_graph=True
            )
            for p in sorted(int(v) for v in df.position.dropna().unique()):  # the shortest prompt's positions
                own = 0.0
                for A, g in zip(out.attentions, grads):
                    a = A[0].detach()
                    new = a.clone()
                    new[..., p] = 0
                    total = new.sum(-1, keepdim=True)
                    new = torch.where(total > 0, new / total, a)
                    own += float((g[0] * (new - a)).double().sum())
                r = _rows(df, "logprob", s, component="position", position=p).iloc[st]
                assert r.effect == pytest.approx(own, abs=1e-4, rel=1e-3)


def test_graddrop_is_the_tests_own_mean_of_layer_dropped_magnitudes(runs, model):
    parent, _ = runs
    spec = SweepSpec(over="attn", edit="zero", metrics=["logprob"], method="attribution", steps="0", graddrop=True)
    df = read_sweep(parent, run_sweep(str(parent.path), spec).sweep_id).to_pandas()
    L_n = len(model.model.layers)
    prompt, gen = _seq(parent, 0)
    P = len(prompt)
    for L in range(L_n):
        total = 0.0
        for drop in range(L_n):
            handles = []
            if drop > L:  # the drop reaches the cell: zero the gradient through layer drop's blocks' outputs
                layer = model.model.layers[drop]
                for module in (layer.self_attn, layer.mlp):
                    handles.append(
                        module.register_forward_hook(
                            lambda m, a, o: (_no_grad(o[0]), *o[1:]) if isinstance(o, tuple) else _no_grad(o)
                        )
                    )
            try:
                out, got = _forward(model, prompt + gen[:1], [("attn", L)])
            finally:
                for h in handles:
                    h.remove()
            x = got[("attn", L)]
            grad = torch.autograd.grad(_scalar(out.logits, P, 0, gen[0], "logprob"), x)[0]
            total += abs(float((grad * -x.detach()).double().sum()))
        r = _rows(df, "logprob", 0, component="attn", layer=L).iloc[0]
        assert r.graddrop == pytest.approx(total / (L_n - 1), abs=1e-4, rel=1e-3)


def _no_grad(x):
    """x's value with no gradient flowing back through it (the test's own GradDrop)."""
    return x.detach() + (x - x.detach()) * 0


def test_verify_patches_the_top_cells_exactly_and_equals_the_exact_sweep(runs):
    parent, _ = runs
    att = run_sweep(
        str(parent.path),
        SweepSpec(over="heads", edit="zero", metrics=["logprob", "logit_diff:42,7"], method="attribution", verify=4),
    )
    exact = read_sweep(
        parent,
        run_sweep(
            str(parent.path), SweepSpec(over="heads", edit="zero", metrics=["logprob", "logit_diff:42,7"])
        ).sweep_id,
    ).to_pandas()
    df = read_sweep(parent, att.sweep_id).to_pandas()
    checked = df[df.exact_value.notna()]
    keys = ["layer", "q_head", "sequence", "step", "metric"]
    assert len(checked.groupby(["layer", "q_head"])) == 4
    merged = checked.merge(exact, on=keys, suffixes=("", "_x"))
    assert len(merged) == len(checked)
    assert np.allclose(merged.exact_value, merged.value_x, atol=1e-5)
    assert np.allclose(merged.exact_effect, merged.effect_x, atol=1e-5)
    # the top 4 by |mean estimate| are the ones verified
    est = df[df.metric == "logprob"].groupby(["layer", "q_head"]).effect.mean()
    assert set(est.abs().sort_values(ascending=False).index[:4]) == set(checked.groupby(["layer", "q_head"]).groups)
    verify = att.summary["verify"]["metrics"]["logit_diff:42,7"]
    g = checked[checked.metric == "logit_diff:42,7"].groupby(["layer", "q_head"])[["effect", "exact_effect"]].mean()
    ra, rb = g.effect.rank().to_numpy(), g.exact_effect.rank().to_numpy()
    assert verify["spearman"] == pytest.approx(float(np.corrcoef(ra, rb)[0, 1]))
    by_cell = {(c["layer"], c["q_head"]): c for c in verify["cells"]}
    for (L, h), r in g.iterrows():
        assert by_cell[(L, h)]["exact"] == pytest.approx(r.exact_effect)
        assert by_cell[(L, h)]["estimate"] == pytest.approx(r.effect)


@pytest.mark.parametrize(
    "spec,fragment",
    [
        (dict(over="heads", verify=3), "--verify is for --method attribution"),
        (dict(over="heads", method="attribution", metrics=["kl"]), "put logprob, prob or logit_diff:A,B first"),
    ],
)
def test_bad_attribution_sweeps_are_refused(runs, spec, fragment):
    from lmtrace.exits.errors import SpecError

    parent, _ = runs
    with pytest.raises(SpecError, match=fragment.replace("(", r"\(")):
        run_sweep(str(parent.path), SweepSpec(**spec))


def test_verify_in_a_real_process_prints_the_comparison_and_json_holds_it(runs, tmp_path):
    import json

    from tests.helpers.cli import assert_one_line_error, lmtrace

    parent, _ = runs
    common = [
        "sweep",
        str(parent.path),
        "--over",
        "attn",
        "--method",
        "attribution",
        "--metric",
        "logprob",
        "--steps",
        "0",
    ]
    text = lmtrace(tmp_path, *common, "--verify", "3")
    assert text.returncode == 0, text.stderr
    shown = " ".join(text.stdout.split())  # the table's title wraps at the terminal's width
    assert "estimated by attribution patching" in shown and "Spearman rank correlation" in shown
    out = lmtrace(tmp_path, *common, "--verify", "2", "--json")
    summary = json.loads(out.stdout)
    assert summary["method"]["name"] == "attribution" and summary["verify"]["n"] == 2
    assert len(summary["verify"]["metrics"]["logprob"]["cells"]) == 2
    bad = lmtrace(tmp_path, "sweep", str(parent.path), "--over", "heads", "--verify", "2")
    assert_one_line_error(bad, 2, "--verify is for --method attribution")


def test_sequences_of_one_layout_are_estimated_together_and_equal_one_at_a_time(tmp_path, sharp_llama_dir):
    run = _run(tmp_path, sharp_llama_dir, [CLEAN[0], CORRUPT[0]], "same-layout")  # prompts of one token length
    spec = dict(over="heads", edit="zero", metrics=["logprob", "logit_diff:42,7"], method="attribution", steps="0-2")
    both = read_sweep(run, run_sweep(str(run.path), SweepSpec(**spec)).sweep_id).to_pandas()
    keys = ["layer", "q_head", "sequence", "step", "metric"]
    for s in range(2):
        alone = read_sweep(run, run_sweep(str(run.path), SweepSpec(**spec, sequences=str(s))).sweep_id).to_pandas()
        merged = alone.merge(both, on=keys, suffixes=("", "_both"))
        assert len(merged) == len(alone) > 0
        assert np.allclose(merged.effect, merged.effect_both, atol=1e-4)
