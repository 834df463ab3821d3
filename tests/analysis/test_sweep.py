"""`lmtrace sweep`: every cell is a real edit of the forward; each kind equals the test's own edited forward.

References are the tiny model's own transformers forward (eager attention, float32) over the parent's
final sequence, edited with the test's own hooks; never lmtrace's edit code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from lmtrace.archive.reader import Run
from lmtrace.archive.sweeps import read_sweep
from lmtrace.commands.sweep import run_sweep
from lmtrace.spec.sweep_spec import SweepSpec
from tests.helpers.runs import run_spec
from tests.helpers.sweep_runs import CLEAN, CORRUPT, eager_model, sequence_ids, sweep_run

REPO = Path(__file__).resolve().parents[2]
METRICS = ["logprob", "prob", "kl", "rank", "logit_diff:42,7"]


_run = sweep_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sharp_llama_dir):
    tmp = tmp_path_factory.mktemp("sweep")
    clean = _run(tmp, sharp_llama_dir, CLEAN, "clean")
    corrupt = _run(tmp, sharp_llama_dir, CORRUPT, "corrupt")
    assert list(clean.prompt_len()) == list(corrupt.prompt_len())  # patching pairs positions
    return clean, corrupt


@pytest.fixture(scope="module")
def model(sharp_llama_dir):
    return eager_model(sharp_llama_dir)


_seq = sequence_ids


@torch.inference_mode()
def _logits(model, ids, hooks=()):
    """The test's own forward; hooks: (module, kind, fn) registered here and removed after."""
    handles = []
    for module, kind, fn in hooks:
        handles.append(module.register_forward_pre_hook(fn) if kind == "pre" else module.register_forward_hook(fn))
    try:
        return model(torch.tensor([ids])).logits[0].float()
    finally:
        for h in handles:
            h.remove()


def _metrics(logits, base, P, gen):
    """metric -> [step] from the test's own logits at positions P-1+s."""
    rows = logits[P - 1 : P - 1 + len(gen)]
    brow = base[P - 1 : P - 1 + len(gen)]
    lp, blp = rows.log_softmax(-1), brow.log_softmax(-1)
    tok = torch.tensor(gen)[:, None]
    return {
        "logprob": lp.gather(-1, tok)[:, 0].numpy(),
        "prob": lp.gather(-1, tok)[:, 0].exp().numpy(),
        "rank": (rows > rows.gather(-1, tok)).sum(-1).float().numpy(),
        "kl": (blp.exp() * (blp - lp)).sum(-1).numpy(),
        "logit_diff:42,7": (rows[:, 42] - rows[:, 7]).numpy(),
    }


def _own_means(model, run, wanted):
    """(kind, layer) -> mean over every position of every final sequence, float64 (test's own hooks)."""
    sums, counts = {}, {}
    layers = model.model.layers

    def add(key, x):
        x = x.reshape(-1, x.shape[-1]).double()
        sums[key] = sums.get(key, 0) + x.sum(0)
        counts[key] = counts.get(key, 0) + x.shape[0]

    hooks = []
    for kind, L in wanted:
        key = (kind, L)
        if kind == "head":
            hooks.append((layers[L].self_attn.o_proj, "pre", lambda m, a, key=key: add(key, a[0])))
        elif kind == "attn":
            hooks.append((layers[L].self_attn, "fwd", lambda m, a, o, key=key: add(key, o[0])))
        elif kind == "mlp":
            hooks.append((layers[L].mlp, "fwd", lambda m, a, o, key=key: add(key, o)))
        elif kind == "layer":
            hooks.append(
                (layers[L], "fwd", lambda m, a, o, key=key: add(key, (o[0] if isinstance(o, tuple) else o) - a[0]))
            )
    for s in range(2):
        p, g = _seq(run, s)
        _logits(model, p + g, hooks)
    return {k: (sums[k] / counts[k]).float() for k in sums}


def _own_edit(model, cell, mode, means):
    """The test's own hook for one cell (zero or mean ablation at every position)."""
    comp, L, h = cell
    layer = model.model.layers[L]
    d = model.config.hidden_size // model.config.num_attention_heads
    if comp == "head":

        def fn(m, a):
            x = a[0].clone()
            x[..., h * d : (h + 1) * d] = 0 if mode == "zero" else means[("head", L)][h * d : (h + 1) * d]
            return (x,)

        return [(layer.self_attn.o_proj, "pre", fn)]
    if comp == "attn":
        return [
            (
                layer.self_attn,
                "fwd",
                lambda m, a, o: (
                    torch.zeros_like(o[0]) if mode == "zero" else means[("attn", L)].expand_as(o[0]).clone(),
                    *o[1:],
                ),
            )
        ]
    if comp == "mlp":
        return [
            (
                layer.mlp,
                "fwd",
                lambda m, a, o: torch.zeros_like(o) if mode == "zero" else means[("mlp", L)].expand_as(o).clone(),
            )
        ]
    if comp == "layer":

        def skip(m, a, o):
            x = a[0] if mode == "zero" else a[0] + means[("layer", L)]
            return (x, *o[1:]) if isinstance(o, tuple) else x

        return [(layer, "fwd", skip)]
    if comp == "neuron":

        def neuron(m, a):
            x = a[0].clone()
            x[..., h] = 0
            return (x,)

        return [(layer.mlp.down_proj, "pre", neuron)]
    raise AssertionError(comp)


def _cell_rows(df, comp, L, h=None, position=None, seq=0):
    rows = df[(df.component == comp) & (df.layer == L) & (df.sequence == seq)]
    col = "neuron" if comp == "neuron" else "q_head"
    rows = rows[rows[col] == h] if h is not None else rows
    rows = rows[rows.position == position] if position is not None else rows[rows.position.isna()]
    return rows


def _compare(df, cell, own, seq):
    comp, L, h = cell
    for metric, values in own.items():
        r = _cell_rows(df, comp, L, h, seq=seq)
        r = r[r.metric == metric].sort_values("step")
        assert len(r) == len(values), (cell, metric)
        # a rank counts the tokens scored above the chosen one: deep in the vocabulary (rank ~10,000) two
        # logits can sit within float32 noise of each other, and either order is the same forward's answer
        tolerance = 1 if metric == "rank" else 1e-4
        np.testing.assert_allclose(r.value.to_numpy(), values, atol=tolerance, rtol=0, err_msg=f"{cell} {metric}")


@pytest.mark.parametrize(
    "over,mode,sample",
    [
        ("heads", "zero", [("head", 0, 1), ("head", 2, 3), ("head", 3, 0)]),
        ("heads", "mean", [("head", 1, 2), ("head", 3, 3)]),
        ("attn", "mean", [("attn", 0, None), ("attn", 3, None)]),
        ("mlp", "zero", [("mlp", 1, None), ("mlp", 2, None)]),
        ("layers", "mean", [("layer", 0, None), ("layer", 2, None)]),
        ("layers", "zero", [("layer", 1, None)]),
        ("neurons:2", "zero", [("neuron", 2, 5), ("neuron", 2, 77)]),
    ],
)
def test_ablation_cells_equal_the_tests_own_edited_forward(runs, model, over, mode, sample):
    clean, _ = runs
    seqs = [1] if over.startswith("neurons") else [0, 1]  # 128 neurons: one sequence is enough
    result = run_sweep(
        str(clean.path),
        SweepSpec(
            over=over, edit=mode, metrics=METRICS, batch=32 if seqs == [1] else 5, sequences=",".join(map(str, seqs))
        ),
    )
    df = read_sweep(clean, result.sweep_id).to_pandas()
    n_cells = {"heads": 16, "attn": 4, "mlp": 4, "layers": 4, "neurons:2": 128}[over]
    assert len(df) == n_cells * len(seqs) * 4 * len(METRICS)  # cells x sequences x steps x metrics
    means = _own_means(model, clean, {(c[0], c[1]) for c in sample}) if mode == "mean" else {}
    for seq in seqs:
        p, g = _seq(clean, seq)
        base = _logits(model, p + g)
        own_base = _metrics(base, base, len(p), g)
        r = df[(df.sequence == seq) & (df.metric == "logprob")].groupby("step").baseline.first()
        np.testing.assert_allclose(r.to_numpy(), own_base["logprob"], atol=1e-4, rtol=0)
        for cell in sample:
            _compare(
                df, cell, _metrics(_logits(model, p + g, _own_edit(model, cell, mode, means)), base, len(p), g), seq
            )
    # the edits matter far beyond the tolerance, so a wrong edit or metric cannot pass
    assert df[df.metric == "kl"].effect.max() > 1e-2 and df[df.metric == "logprob"].effect.abs().max() > 1e-1
    # the effect column is value - baseline and the mean table / Zarr array agree with it
    np.testing.assert_allclose(df.effect, df.value - df.baseline, atol=1e-12)
    info = json.loads((result.path / "sweep.json").read_text())
    assert info["kind"] == "sweep" and info["parent"]["run_id"] == "clean" and info["baseline_max_abs_diff"] < 1e-4
    assert Run(clean.path).manifest["sweeps"][-1]["id"] == result.sweep_id


def test_a_sweep_cell_equals_the_intervene_child(runs):
    from lmtrace.commands.intervene import run_intervene

    clean, _ = runs
    result = run_sweep(str(clean.path), SweepSpec(over="heads", edit="mean", metrics=["logprob"], batch=16))
    df = read_sweep(clean, result.sweep_id).to_pandas()
    _, effects = run_intervene(str(clean.path), [{"kind": "ablate_head", "layer": 2, "head": 1, "mode": "mean"}])
    effects = effects.to_pandas()
    for seq in range(2):
        child = effects[effects.sequence == seq].sort_values("step").child_logprob_of_parent_token.to_numpy()
        cell = _cell_rows(df, "head", 2, 1, seq=seq).sort_values("step").value.to_numpy()
        np.testing.assert_allclose(cell, child, atol=1e-4, rtol=0)
        assert np.abs(cell - _cell_rows(df, "head", 2, 0, seq=seq).sort_values("step").value.to_numpy()).max() > 1e-6
    # effects.zarr as xarray reads it: [layer, q_head] (`head` would hide Dataset.head()), the mean of the table
    import xarray as xr

    ds = xr.open_zarr(result.path / "effects.zarr")
    assert ds.effect_logprob.dims == ("layer", "q_head")
    mean = df[(df.component == "head") & (df.layer == 2) & (df["q_head"] == 1)].effect.mean()
    assert abs(float(ds.effect_logprob.sel(layer=2, q_head=1)) - mean) < 1e-5


def test_batched_rows_equal_unbatched_rows(runs):
    clean, _ = runs
    a = run_sweep(str(clean.path), SweepSpec(over="heads", edit="zero", metrics=METRICS, batch=1, sequences="1"))
    b = run_sweep(str(clean.path), SweepSpec(over="heads", edit="zero", metrics=METRICS, batch=16, sequences="1"))
    key = ["component", "layer", "q_head", "sequence", "step", "metric"]
    da = read_sweep(clean, a.sweep_id).to_pandas().sort_values(key).reset_index(drop=True)
    db = read_sweep(clean, b.sweep_id).to_pandas().sort_values(key).reset_index(drop=True)
    assert len(da) == len(db) == 16 * 4 * len(METRICS)
    np.testing.assert_allclose(da.value, db.value, atol=1e-5, rtol=0)  # docs/sweep.md: batched within 1e-5


def test_residual_patching_grid_equals_the_tests_own_causal_tracing(runs, model):
    clean, corrupt = runs
    # corrupted run, clean activations patched in (clean -> corrupted), at every layer and prompt position
    result = run_sweep(
        str(corrupt.path),
        SweepSpec(over="resid:0-3", edit="patch", source="clean", metrics=["logit_diff:42,7", "logprob"], steps="0,1"),
    )
    df = read_sweep(corrupt, result.sweep_id).to_pandas()
    layers = model.model.layers
    for seq in range(2):
        cp, cg = _seq(clean, seq)
        p, g = _seq(corrupt, seq)
        P = len(p)
        saved = {}
        _logits(
            model,
            (cp + cg)[: P + 1],
            [
                (
                    layers[L],
                    "fwd",
                    (lambda L: lambda m, a, o: saved.__setitem__(L, (o[0] if isinstance(o, tuple) else o)[0].clone()))(
                        L
                    ),
                )
                for L in range(4)
            ],
        )
        base = _logits(model, p + g)
        for L in range(4):
            for pos in range(min(clean.prompt_len())):

                def patch(m, a, o, L=L, pos=pos):
                    x = (o[0] if isinstance(o, tuple) else o).clone()
                    x[0, pos] = saved[L][pos]
                    return (x, *o[1:]) if isinstance(o, tuple) else x

                own = _metrics(_logits(model, p + g, [(layers[L], "fwd", patch)]), base, P, g)
                for metric in ("logit_diff:42,7", "logprob"):
                    r = _cell_rows(df, "resid", L, position=pos, seq=seq)
                    r = r[r.metric == metric].sort_values("step")
                    np.testing.assert_allclose(
                        r.value.to_numpy(), own[metric][:2], atol=1e-4, rtol=0, err_msg=f"{seq} {L} {pos} {metric}"
                    )
    # the source's own logit difference (the normaliser of patching effects) is in sweep.json; patching
    # the last layer at the last prompt position gives step 0 exactly that value
    info = json.loads((result.path / "sweep.json").read_text())
    for seq in range(2):
        cp, cg = _seq(clean, seq)
        own = _metrics(_logits(model, cp + cg), _logits(model, cp + cg), len(cp), cg)["logit_diff:42,7"][:2]
        np.testing.assert_allclose(info["source_baseline"][str(seq)]["logit_diff:42,7"], own, atol=1e-4, rtol=0)
        if len(cp) == min(clean.prompt_len()):
            r = _cell_rows(df, "resid", 3, position=len(cp) - 1, seq=seq)
            r = r[(r.metric == "logit_diff:42,7") & (r.step == 0)]
            assert abs(r.value.item() - own[0]) < 1e-4


def test_head_and_block_patching_at_every_position_equals_the_tests_own(runs, model):
    clean, corrupt = runs
    layers = model.model.layers
    d = model.config.hidden_size // model.config.num_attention_heads
    for over, cell in (("heads", ("head", 1, 2)), ("mlp", ("mlp", 2, None))):
        result = run_sweep(str(corrupt.path), SweepSpec(over=over, edit="patch", source="clean", metrics=METRICS))
        df = read_sweep(corrupt, result.sweep_id).to_pandas()
        comp, L, h = cell
        for seq in range(2):
            cp, cg = _seq(clean, seq)
            p, g = _seq(corrupt, seq)
            T = len(p) + len(g) - 1  # the sweep's input: up to the last step's query position
            src = {}
            module = layers[L].self_attn.o_proj if comp == "head" else layers[L].mlp
            if comp == "head":
                _logits(model, (cp + cg)[:T], [(module, "pre", lambda m, a: src.__setitem__("x", a[0][0].clone()))])

                def fn(m, a):
                    x = a[0].clone()
                    n = min(x.shape[1], T)
                    x[0, :n, h * d : (h + 1) * d] = src["x"][:n, h * d : (h + 1) * d]
                    return (x,)

                hooks = [(module, "pre", fn)]
            else:
                _logits(model, (cp + cg)[:T], [(module, "fwd", lambda m, a, o: src.__setitem__("x", o[0].clone()))])

                def fn(m, a, o):
                    x = o.clone()
                    n = min(x.shape[1], T)
                    x[0, :n] = src["x"][:n]
                    return x

                hooks = [(module, "fwd", fn)]
            base = _logits(model, p + g)
            _compare(df, cell, _metrics(_logits(model, p + g, hooks), base, len(p), g), seq)


FROM = 2  # the from-step tests: edits at steps 2 and 3 of the 4 generated ones


def _embedded_lengths(monkeypatch) -> list[tuple[int, int]]:
    """Records the (rows, tokens) of every forward the model runs (its token embedding's input)."""
    seen = []
    real = torch.nn.Embedding.forward

    def forward(self, ids):
        seen.append(tuple(ids.shape))
        return real(self, ids)

    monkeypatch.setattr(torch.nn.Embedding, "forward", forward)
    return seen


def test_from_step_sweep_reuses_the_prefix_and_equals_intervene_from_step_and_the_tests_own(
    runs, model, tmp_path, monkeypatch
):
    """--from-step S: edits only at the positions of steps >= S. Each cell equals the `lmtrace intervene --from-step S`
    child (its KV-cached loop) and the test's own full forward (no cache) edited at positions >= P - 1 + S; the
    prefix is run once per sequence and every batch computes only the suffix."""
    from typer.testing import CliRunner

    from lmtrace.cli.main import app
    from lmtrace.commands.intervene import run_intervene

    clean, _ = runs
    spec = tmp_path / "sweep.yaml"  # the YAML spec's from_step
    spec.write_text(f"over: heads\nedit: zero\nfrom_step: {FROM}\nbatch: 6\nmetrics: {json.dumps(METRICS)}\n")
    seen = _embedded_lengths(monkeypatch)
    out = CliRunner().invoke(app, ["sweep", str(clean.path), "--spec", str(spec), "--run-id", "from2", "--json"])
    monkeypatch.undo()
    assert out.exit_code == 0, out.output
    df = read_sweep(clean, "from2").to_pandas()
    assert sorted(df.step.unique()) == [2, 3] and len(df) == 16 * 2 * 2 * len(METRICS)  # only steps >= S are reported
    lengths = {s: len(_seq(clean, s)[0]) for s in range(2)}
    # one prefix forward per sequence (prompt + steps < S: P - 1 + S tokens), then only the 2-token suffix
    prefixes = sorted(n for rows, n in seen if n > 2)
    assert prefixes == sorted(P - 1 + FROM for P in lengths.values()), seen
    assert {n for rows, n in seen if n <= 2} == {2} and max(rows for rows, _ in seen) == 6, seen
    info = json.loads((clean.path / "sweeps" / "from2" / "sweep.json").read_text())
    assert info["spec"]["from_step"] == FROM and info["baseline_max_abs_diff"] < 1e-4

    d = model.config.hidden_size // model.config.num_attention_heads
    every_step = None
    for seq in range(2):
        p, g = _seq(clean, seq)
        P = len(p)
        base = _logits(model, p + g)
        for L, h in ((0, 1), (2, 3), (3, 0)):

            def fn(m, a, L=L, h=h):
                x = a[0].clone()
                x[0, P - 1 + FROM :, h * d : (h + 1) * d] = 0  # the positions of steps >= S only
                return (x,)

            own = _metrics(_logits(model, p + g, [(model.model.layers[L].self_attn.o_proj, "pre", fn)]), base, P, g)
            _compare(df, ("head", L, h), {k: v[FROM:] for k, v in own.items()}, seq)
    # the same head, edited at every step, is another experiment: the values differ far beyond the tolerance
    every_step = read_sweep(
        clean,
        run_sweep(str(clean.path), SweepSpec(over="attn", metrics=["logprob"], steps="2-3", sequences="0")).sweep_id,
    ).to_pandas()
    later = read_sweep(
        clean,
        run_sweep(str(clean.path), SweepSpec(over="attn", metrics=["logprob"], from_step=FROM, sequences="0")).sweep_id,
    ).to_pandas()
    key = ["layer", "step"]
    assert np.abs(every_step.sort_values(key).value.to_numpy() - later.sort_values(key).value.to_numpy()).max() > 1e-2

    # intervene --from-step 2 children: a head ablation and a position hidden from the later queries
    _, effects = run_intervene(str(clean.path), [{"kind": "ablate_head", "layer": 2, "head": 3}], from_step=FROM)
    masked = run_sweep(str(clean.path), SweepSpec(over="positions", positions="1", metrics=["logprob"], from_step=FROM))
    mdf = read_sweep(clean, masked.sweep_id).to_pandas()
    _, mask_effects = run_intervene(str(clean.path), [{"kind": "mask_positions", "mask": [1]}], from_step=FROM)
    for eff, rows, cell in (
        (effects.to_pandas(), df[df.metric == "logprob"], ("head", 2, 3)),
        (mask_effects.to_pandas(), mdf, ("position", None, None)),
    ):
        for seq in range(2):
            child = eff[(eff.sequence == seq) & (eff.step >= FROM)].sort_values("step")
            if cell[0] == "head":
                mine = _cell_rows(rows, "head", 2, 3, seq=seq)
            else:
                mine = rows[(rows.sequence == seq) & (rows.position == 1)]
            mine = mine.sort_values("step")
            assert mine.step.tolist() == child.step.tolist() == [2, 3]
            np.testing.assert_allclose(
                mine.value.to_numpy(),
                child.child_logprob_of_parent_token.to_numpy(),
                atol=1e-4,
                rtol=0,
                err_msg=f"{cell} {seq}",
            )
            # steps before S are the parent's own in the child: the edit really starts at S
            early = eff[(eff.sequence == seq) & (eff.step < FROM)]
            np.testing.assert_allclose(early.child_logprob_of_parent_token, early.parent_logprob, atol=1e-4, rtol=0)
    assert mdf.effect.abs().max() > 1e-3  # hiding the position matters


def test_from_step_residual_patching_equals_the_tests_own_forward_without_a_cache(runs, model):
    clean, corrupt = runs
    result = run_sweep(
        str(corrupt.path),
        SweepSpec(
            over="resid:1-2",
            edit="patch",
            source="clean",
            from_step=FROM,
            metrics=["logit_diff:42,7", "logprob"],
            batch=4,
        ),
    )
    df = read_sweep(corrupt, result.sweep_id).to_pandas()
    P0 = min(corrupt.prompt_len())
    longest = max(corrupt.prompt_len()) + 3  # the longest measured context: prompt + steps 0..2 as input
    assert sorted(df.position.unique()) == list(range(P0 - 1 + FROM, longest))  # the suffix positions by default
    layers = model.model.layers
    checked = 0
    for seq in range(2):
        cp, cg = _seq(clean, seq)
        p, g = _seq(corrupt, seq)
        P = len(p)
        saved = {}
        _logits(
            model,
            cp + cg,
            [
                (
                    layers[L],
                    "fwd",
                    (lambda L: lambda m, a, o: saved.__setitem__(L, (o[0] if isinstance(o, tuple) else o)[0].clone()))(
                        L
                    ),
                )
                for L in (1, 2)
            ],
        )
        base = _logits(model, p + g)
        for L in (1, 2):
            for pos in sorted(df.position.unique()):
                r = _cell_rows(df, "resid", L, position=int(pos), seq=seq)
                if not P - 1 + FROM <= pos < P + 3:  # in this sequence's unedited prefix or past it: nothing changes
                    assert r.effect.abs().max() < 1e-5
                    continue

                def patch(m, a, o, L=L, pos=int(pos)):
                    x = (o[0] if isinstance(o, tuple) else o).clone()
                    x[0, pos] = saved[L][pos]
                    return (x, *o[1:]) if isinstance(o, tuple) else x

                own = _metrics(_logits(model, p + g, [(layers[L], "fwd", patch)]), base, P, g)
                for metric in ("logit_diff:42,7", "logprob"):
                    mine = r[r.metric == metric].sort_values("step")
                    np.testing.assert_allclose(
                        mine.value.to_numpy(),
                        own[metric][FROM:],
                        atol=1e-4,
                        rtol=0,
                        err_msg=f"{seq} {L} {pos} {metric}",
                    )
                checked += 1
    assert checked == 8 and df[df.metric == "logprob"].effect.abs().max() > 1e-2


def test_a_shared_prefix_is_computed_once_and_block_patching_still_equals_the_tests_own(
    runs, model, sharp_llama_dir, tmp_path, monkeypatch
):
    """Prompts of a pair that begin with the same tokens have the same activations there (a causal model):
    those positions run once per sequence into a KV cache every row continues, and each attention-block
    patch (all positions) still equals the test's own full forward patched at every position."""
    words = "one two three four five six seven"
    clean = _run(tmp_path, sharp_llama_dir, [f"{words} red"], "shared-clean")
    corrupt = _run(tmp_path, sharp_llama_dir, [f"{words} blue"], "shared-corrupt")
    cp, cg = _seq(clean, 0)
    p, g = _seq(corrupt, 0)
    assert len(cp) == len(p)
    shared = next(i for i, (a, b) in enumerate(zip(cp, p)) if a != b)
    assert shared >= 5
    seen = _embedded_lengths(monkeypatch)
    result = run_sweep(str(corrupt.path), SweepSpec(over="attn", edit="patch", source="shared-clean", metrics=METRICS))
    monkeypatch.undo()
    T = len(p) + len(g) - 1
    assert {n for rows, n in seen if rows > 1} == {T - shared}  # every multi-row forward computes the rest only
    assert {n for _, n in seen} == {shared, T - shared}  # the prefix once; the baseline and the source continue it
    df = read_sweep(corrupt, result.sweep_id).to_pandas()
    base = _logits(model, p + g)
    for L in range(4):
        attn = model.model.layers[L].self_attn
        src = {}
        _logits(model, (cp + cg)[:T], [(attn, "fwd", lambda m, a, o: src.__setitem__("x", o[0][0].clone()))])

        def fn(m, a, o):
            x = o[0].clone()
            x[0, :T] = src["x"][:T]
            return (x, *o[1:])

        _compare(df, ("attn", L, None), _metrics(_logits(model, p + g, [(attn, "fwd", fn)]), base, len(p), g), 0)


def test_layer_groups_are_the_cheapest_contiguous_split():
    """The split of a batch of cells into forwards (each from its own lowest edited layer) is the cheapest of
    every contiguous split, enumerated here, under the documented cost."""
    from itertools import combinations

    from lmtrace.analysis.sweep.engine import FORWARD_OVERHEAD_POSITIONS, layer_groups

    def cost(groups, starts, n_layers, positions):
        return sum((n_layers - starts[i]) * ((j - i) * positions + FORWARD_OVERHEAD_POSITIONS) for i, j in groups)

    rng = np.random.default_rng(0)
    for _ in range(40):
        n, n_layers, positions = int(rng.integers(1, 10)), 30, int(rng.integers(1, 40))
        starts = sorted(rng.integers(0, n_layers, n).tolist())
        groups = layer_groups(starts, n_layers, positions)
        assert [i for i, _ in groups] == [0, *[j for _, j in groups[:-1]]] and groups[-1][1] == n
        best = min(
            cost(list(zip((0, *cuts), (*cuts, n))), starts, n_layers, positions)
            for k in range(n)
            for cuts in combinations(range(1, n), k)
        )
        assert cost(groups, starts, n_layers, positions) == best
    assert len(layer_groups(list(range(30)), 30, 5)) > 1  # one attention block per layer: worth splitting


def test_a_run_patched_from_itself_changes_nothing(runs):
    clean, _ = runs
    result = run_sweep(
        str(clean.path), SweepSpec(over="heads", edit="patch", source="clean", metrics=["logprob", "kl"])
    )
    df = read_sweep(clean, result.sweep_id).to_pandas()
    assert np.abs(df.effect).max() < 1e-5


def test_two_logit_diff_metrics_each_get_their_own_effects_array(runs):
    """Several logit_diff:A,B in one sweep: each has its own effects.zarr array, equal to the test's own
    mean over every row of sweep.parquet (one array name per metric used to make the second fail)."""
    import zarr

    clean, _ = runs
    metrics = ["logit_diff:42,7", "logit_diff:3,9"]
    result = run_sweep(str(clean.path), SweepSpec(over="attn", edit="zero", metrics=metrics, sequences="0"))
    df = read_sweep(clean, result.sweep_id).to_pandas()
    folder = clean.path / "sweeps" / result.sweep_id
    for metric, name in zip(metrics, ["effect_logit_diff_42_7", "effect_logit_diff_3_9"]):
        stored = zarr.open_array(str(folder / "effects.zarr" / name), mode="r")[...]
        own = df[df.metric == metric].groupby("layer").effect.mean().sort_index().to_numpy()
        np.testing.assert_allclose(stored, own, atol=1e-6, rtol=0)


def test_sequences_of_one_layout_run_packed_and_equal_one_sequence_at_a_time(sharp_llama_dir, tmp_path, monkeypatch):
    """Sequences of the same prompt length and steps run in one forward (row q * cells + b: sequence q, cell b);
    every value equals the sweep of that sequence alone, also when shards pack different subsets."""
    run = _run(
        tmp_path, sharp_llama_dir, ["one two three four", "five six seven eight", "nine ten eleven twelve"], "packed"
    )
    seqs = [_seq(run, i) for i in range(3)]
    assert len({(len(p), len(g)) for p, g in seqs}) == 1  # one layout
    spec = dict(over="heads", edit="zero", batch=6, metrics=METRICS)
    seen = _embedded_lengths(monkeypatch)
    whole = read_sweep(run, run_sweep(str(run.path), SweepSpec(**spec)).sweep_id).to_pandas()
    monkeypatch.undo()
    assert max(rows for rows, _ in seen) == 3 * 6  # three sequences' rows of one block in one forward
    key = ["component", "layer", "q_head", "sequence", "step", "metric"]

    def same(a, b):
        a, b = a.sort_values(key).reset_index(drop=True), b.sort_values(key).reset_index(drop=True)
        assert a[key].equals(b[key])
        # float32 rows of a larger batch: rounding differs (measured up to 1.6e-5 on logits of ~9)
        np.testing.assert_allclose(a.value.to_numpy(), b.value.to_numpy(), atol=1e-4, rtol=0)

    alone = [
        read_sweep(run, run_sweep(str(run.path), SweepSpec(**spec, sequences=str(i))).sweep_id).to_pandas()
        for i in range(3)
    ]
    same(whole, pd.concat(alone))
    run_sweep(str(run.path), SweepSpec(**spec), sweep_id="packed-shards", shard=(0, 2))
    run_sweep(str(run.path), SweepSpec(**spec), sweep_id="packed-shards", shard=(1, 2))
    same(whole, read_sweep(run, "packed-shards").to_pandas())


def test_sharded_and_resumed_sweeps_equal_the_unsharded_one(runs, monkeypatch):
    import lmtrace.commands.sweep as sweep_mod

    clean, _ = runs
    spec = SweepSpec(over="mlp", edit="zero", metrics=METRICS, batch=1)
    whole = read_sweep(clean, run_sweep(str(clean.path), spec).sweep_id).to_pandas()
    key = ["component", "layer", "sequence", "step", "metric"]

    def same(a, b):
        a, b = a.sort_values(key).reset_index(drop=True), b.sort_values(key).reset_index(drop=True)
        np.testing.assert_array_equal(a.value.to_numpy(), b.value.to_numpy())

    first = run_sweep(str(clean.path), spec, sweep_id="sharded", shard=(0, 2))
    assert first.status == "shard-complete" and first.path is None
    second = run_sweep(str(clean.path), spec, sweep_id="sharded", shard=(1, 2))
    assert second.status == "complete"
    same(whole, read_sweep(clean, "sharded").to_pandas())

    # a sweep that dies after 3 committed blocks continues from them
    calls = {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    real = sweep_mod.write_block
    monkeypatch.setattr(sweep_mod, "write_block", dying)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(clean.path), spec, sweep_id="killed")
    monkeypatch.setattr(sweep_mod, "write_block", real)
    partial = clean.path / "sweeps" / ".partial-killed" / "blocks"
    assert len(list(partial.glob("*.parquet"))) == 3
    done = run_sweep(str(clean.path), spec, sweep_id="killed", resume=True)
    assert done.status == "complete" and not partial.parent.exists()
    same(whole, read_sweep(clean, "killed").to_pandas())


def _cli(tmp, *args, env: dict | None = None):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "lmtrace.cli", *args],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_finishes_the_block_raises_interrupted_and_resume_completes(runs):
    from lmtrace.exits.errors import EXIT_INTERRUPTED, Interrupted

    clean, _ = runs
    spec = SweepSpec(over="heads", edit="zero", batch=1)
    seen = {"blocks": 0}

    def note(text):  # SIGTERM arrives while the sweep runs, after its second block
        if text.startswith("block"):
            seen["blocks"] += 1
            if seen["blocks"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Interrupted) as err:
        run_sweep(str(clean.path), spec, sweep_id="term", note=note)
    assert err.value.exit_code == EXIT_INTERRUPTED == 3 and "--resume" in str(err.value)
    blocks = clean.path / "sweeps" / ".partial-term" / "blocks"
    assert len(list(blocks.glob("*.parquet"))) == 2  # the block in flight was committed, nothing after it
    done = run_sweep(str(clean.path), spec, sweep_id="term", resume=True)
    assert done.status == "complete"
    whole = run_sweep(str(clean.path), spec)
    key = ["component", "layer", "q_head", "sequence", "step", "metric"]
    a = read_sweep(clean, "term").to_pandas().sort_values(key).reset_index(drop=True)
    b = read_sweep(clean, whole.sweep_id).to_pandas().sort_values(key).reset_index(drop=True)
    assert len(a) == 16 * 2 * 4 * 4
    np.testing.assert_array_equal(a.value.to_numpy(), b.value.to_numpy())


def test_two_shard_processes_started_together_equal_the_unsharded_sweep(runs):
    """`--shard 0/2` and `--shard 1/2` with one --run-id, as two real processes at once: both exit 0, exactly one
    assembles, `sweeps/<id>/` appears once and whole, and its sweep.parquet equals the unsharded sweep bit for bit
    (same --batch, so the same blocks: docs/sweep.md, "Equal to the unsharded sweep, bit for bit")."""
    import pandas as pd
    import pyarrow.parquet as pq

    clean, _ = runs
    sweep_id = "cli-two-shards"
    args = [
        "--over",
        "mlp",
        "--edit",
        "zero",
        "--batch",
        "2",
        "--steps",
        "0-2",
        "--run-id",
        sweep_id,
        "--json",
        *[a for m in METRICS for a in ("--metric", m)],
    ]
    procs = [_cli(clean.path.parent, "sweep", str(clean.path), *args, "--shard", f"{i}/2") for i in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "Traceback" not in out + err, err
    # exactly one of the two assembled (the other finished first, or found the sweep done)
    statuses = sorted(json.loads(out.strip().splitlines()[-1])["status"] for out, _ in outs)
    assert statuses == ["complete", "shard-complete"], outs
    root = clean.path / "sweeps"
    assert sorted(p.name for p in root.iterdir() if sweep_id in p.name) == [sweep_id]  # no partial / temp left
    assert [e["id"] for e in Run(clean.path).manifest["sweeps"]].count(sweep_id) == 1
    info = json.loads((root / sweep_id / "sweep.json").read_text())
    assert info["timings"]["shards"] == 2 and info["n_cells"] == 4

    whole = run_sweep(str(clean.path), SweepSpec(over="mlp", edit="zero", metrics=METRICS, batch=2, steps="0-2"))
    key = ["component", "layer", "q_head", "neuron", "position", "sequence", "step", "metric"]

    def table(path):
        return pq.read_table(path / "sweep.parquet").to_pandas().sort_values(key).reset_index(drop=True)

    sharded, unsharded = table(root / sweep_id), table(whole.path)
    assert len(sharded) == 4 * 2 * 3 * len(METRICS)  # MLP blocks x sequences x steps x metrics
    pd.testing.assert_frame_equal(sharded, unsharded, check_exact=True)
    assert unsharded[unsharded.metric == "kl"].effect.max() > 1e-2  # the cells differ: a wrong cell cannot pass


def test_a_second_process_of_the_same_sweep_exits_2_naming_the_first(runs):
    """Two `lmtrace sweep --run-id S` of one run: the first holds the sweep (a test-only pause keeps it
    inside, after it took ownership), the second exits 2 at once with one line naming the first's pid,
    while the first is still running; the first then completes the sweep alone. (Shards of one sweep
    hold keys of their own: test_two_shard_processes_started_together_equal_the_unsharded_sweep.)"""
    import time

    clean, _ = runs
    sweep_id = "one-writer"
    args = [
        "sweep",
        str(clean.path),
        "--over",
        "attn",
        "--edit",
        "zero",
        "--steps",
        "0-1",
        "--run-id",
        sweep_id,
        "--json",
    ]
    first = _cli(clean.path.parent, *args, env={"LMTRACE_TEST_PAUSE_AFTER_CREATE": "45"})
    try:
        lock = clean.path / "owners" / f"sweep-{sweep_id}.lock"
        deadline = time.time() + 180
        while not (lock.is_file() and f'"pid": {first.pid}' in lock.read_text()):
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.2)
        second = _cli(clean.path.parent, *args)
        out, err = second.communicate(timeout=120)
        lines = _error_lines(err)
        assert second.returncode == 2 and len(lines) == 1, err
        assert lines[0].startswith("error: ") and f"pid {first.pid}" in lines[0] and f"sweep-{sweep_id}" in lines[0], (
            err
        )
        assert "Traceback" not in out + err and out == ""
        assert first.poll() is None  # refused while the first one runs, not after it
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["status"] == "complete"
    assert [e["id"] for e in Run(clean.path).manifest["sweeps"]].count(sweep_id) == 1
    assert sorted(p.name for p in (clean.path / "sweeps").iterdir() if sweep_id in p.name) == [sweep_id]


BAD = [
    (["--over", "resid:0-9", "--edit", "patch", "--source", "corrupt"], "layer 4 is out of range"),
    (["--over", "heads", "--edit", "patch", "--source", "short"], "same token length"),
    (["--over", "heads", "--metric", 'logit_diff:" Paris is",7'], "not one"),
    (["--over", "heads", "--sequences", ""], "--sequences"),  # an empty sweep
    (["--over", "heads", "--metric", "entropy"], "unknown"),
    (["--over", "neurons:1", "--edit", "patch", "--source", "corrupt"], "zero or mean"),
    (["--over", "heads", "--spec", "missing.yaml"], "not found"),
    (["--over", "heads", "--from-step", "4"], "none is edited"),
    (["--over", "heads", "--from-step", "2", "--steps", "1-3"], "before --from-step"),
    (
        ["--over", "resid:0-1", "--edit", "patch", "--source", "corrupt", "--from-step", "2", "--positions", "0-2"],
        "unedited prefix",
    ),
    (["--over", "heads", "--from-step", "-1"], "from_step"),
]


def _error_lines(stderr: str) -> list[str]:
    """stderr without the progress lines (`[HH:MM:SS] importing torch`, printed before any check runs)."""
    import re

    return [line for line in stderr.splitlines() if line.strip() and not re.match(r"\[\d\d:\d\d:\d\d\] ", line)]


def _sweep_names(run):
    return sorted(p.name for p in (run.path / "sweeps").iterdir()) if (run.path / "sweeps").exists() else []


@pytest.mark.parametrize("args,fragment", BAD)
def test_bad_sweeps_exit_2_with_one_line_and_write_nothing(runs, sharp_llama_dir, args, fragment):
    from typer.testing import CliRunner

    from lmtrace.cli.main import app

    clean, _ = runs
    if "short" in args and not (clean.path.parent / "short").exists():
        _run(clean.path.parent.parent, sharp_llama_dir, ["The fox", "Paris is"], "short")
    before = _sweep_names(clean)
    result = CliRunner().invoke(app, ["sweep", str(clean.path), "--runs-dir", str(clean.path.parent), *args])
    lines = _error_lines(result.stderr)
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], (
        result.stderr
    )
    assert _sweep_names(clean) == before


def test_a_bad_sweep_in_a_real_process_prints_one_line_without_traceback(runs, tmp_path):
    clean, _ = runs
    before = _sweep_names(clean)
    proc = _cli(tmp_path, "sweep", str(clean.path), "--over", "heads", "--metric", "logit_diff:7,99999999")
    out, err = proc.communicate(timeout=120)
    lines = _error_lines(err)
    assert proc.returncode == 2 and len(lines) == 1 and "outside the vocabulary" in lines[0], err
    assert "Traceback" not in out + err and _sweep_names(clean) == before


@pytest.mark.slow
def test_causal_tracing_grid_on_the_embedded_model_equals_the_tests_own(tmp_path):
    """Clean -> corrupted residual patching at every layer and prompt position of SmolLM2-135M."""
    from lmtrace.runner.models import load_model
    from lmtrace.spec.run_spec import ModelSpec

    def run(prompts, run_id):
        return run_spec(
            tmp_path,
            {
                "prompts": prompts,
                "capture": "none",
                "output": {"run_id": run_id},
                "generation": {"max_new_tokens": 2, "temperature": 0},
            },
        )

    clean = run(["The Eiffel Tower is located in the city of"], "clean")
    corrupt = run(["The Colosseum is located in the city of"], "corrupt")
    assert list(clean.prompt_len()) == list(corrupt.prompt_len())
    P = int(clean.prompt_len()[0])
    paris = _seq(clean, 0)[1][0]
    rome = _seq(corrupt, 0)[1][0]
    assert paris != rome
    metric = f"logit_diff:{paris},{rome}"
    result = run_sweep(
        str(corrupt.path),
        SweepSpec(over="resid:0-29", edit="patch", source="clean", steps="0", metrics=[metric, "logprob"]),
    )
    df = read_sweep(corrupt, result.sweep_id).to_pandas()
    assert len(df) == 30 * P * 2
    model = load_model(ModelSpec(attn_implementation="eager")).model
    layers = model.model.layers
    cp = _seq(clean, 0)[0]
    p, g = _seq(corrupt, 0)
    saved = {}
    _logits(
        model,
        cp,
        [
            (
                layers[L],
                "fwd",
                (lambda L: lambda m, a, o: saved.__setitem__(L, (o[0] if isinstance(o, tuple) else o)[0].clone()))(L),
            )
            for L in range(30)
        ],
    )
    grid = df[df.metric == metric].set_index(["layer", "position"]).value
    for L in list(range(0, 30, 3)) + [29]:
        for pos in range(P):

            def patch(m, a, o, L=L, pos=pos):
                x = (o[0] if isinstance(o, tuple) else o).clone()
                x[0, pos] = saved[L][pos]
                return (x, *o[1:]) if isinstance(o, tuple) else x

            logits = _logits(model, p, [(layers[L], "fwd", patch)])[P - 1]
            assert abs(grid[(L, pos)] - (logits[paris] - logits[rome]).item()) < 1e-3, (L, pos)
    # the classic picture: patching the last layer at the last position restores the clean answer
    baseline = df[df.metric == metric].baseline.iloc[0]
    assert baseline < 0 < grid[(29, P - 1)]


PAIRS = [
    ("p0", "The quick brown fox", "The slow brown cat"),
    ("p1", "Paris is the capital of", "Rome is the capital of"),
    ("p2", "She gave the red book to her best friend", "He gave the red book to her best friend"),
]


def _pair_run(tmp, model_dir, rows, run_id):
    f = tmp / f"{run_id}.jsonl"
    f.write_text("".join(json.dumps({"prompt": text, "pair_id": pid}) + "\n" for pid, text in rows))
    return run_spec(
        tmp,
        {
            "model": str(model_dir),
            "prompts": {"file": str(f)},
            "capture": "none",
            "generation": {"max_new_tokens": 3, "batch_size": 3, "temperature": 0.9, "seed": 5},
            "output": {"run_id": run_id},
        },
    )


@pytest.fixture(scope="module")
def paired_runs(tmp_path_factory, sharp_llama_dir):
    """Three clean/corrupted prompt pairs; the corrupted run lists them in reverse order, so pairing by
    index would pair the wrong prompts and only `--pair-by pair_id` pairs them right."""
    tmp = tmp_path_factory.mktemp("pairs")
    clean = _pair_run(tmp, sharp_llama_dir, [(p, c) for p, c, _ in PAIRS], "clean-set")
    corrupt = _pair_run(tmp, sharp_llama_dir, [(p, x) for p, _, x in reversed(PAIRS)], "corrupt-set")
    return clean, corrupt


def test_dataset_patching_equals_per_pair_sweeps_averaged_by_the_test(paired_runs, model):
    """One sweep over every pair (by id) = one sweep per pair, normalised by the clean run's own logit
    difference (the test's forward) and averaged, with the test's own bootstrap interval over pairs."""
    clean, corrupt = paired_runs
    metric = "logit_diff:42,7"
    spec = dict(
        over="attn", edit="patch", source="clean-set", pair_by="pair_id", metrics=[metric, "logprob"], steps="0,1"
    )
    result = run_sweep(str(corrupt.path), SweepSpec(**spec))
    df = read_sweep(corrupt, result.sweep_id).to_pandas()
    ids_clean = clean.sequences().column("pair_id").to_pylist()
    ids_corrupt = corrupt.sequences().column("pair_id").to_pylist()
    own = {}  # (pair, layer) -> [normalised per step], from per-pair sweeps and the test's own clean forward
    for seq, pid in enumerate(ids_corrupt):
        cp, cg = _seq(clean, ids_clean.index(pid))
        p, g = _seq(corrupt, seq)
        logits = _logits(model, cp + cg[:1])  # the clean run's own forward at the measured positions
        clean_value = (logits[len(cp) - 1 : len(cp) + 1, 42] - logits[len(cp) - 1 : len(cp) + 1, 7]).numpy()
        one = run_sweep(str(corrupt.path), SweepSpec(**spec, sequences=str(seq)))
        single = read_sweep(corrupt, one.sweep_id).to_pandas()
        single = single[single.metric == metric]
        for layer in range(4):
            r = single[single.layer == layer].sort_values("step")
            own[(pid, layer)] = (r.value.to_numpy() - r.baseline.to_numpy()) / (clean_value - r.baseline.to_numpy())
            d = df[(df.metric == metric) & (df.layer == layer) & (df.sequence == seq)].sort_values("step")
            assert list(d.pair) == [pid, pid] and list(d.source_sequence) == [ids_clean.index(pid)] * 2
            np.testing.assert_allclose(d.normalised, own[(pid, layer)], atol=1e-4, rtol=0)
    info = json.loads((result.path / "sweep.json").read_text())["patching"]
    assert (info["clean"], info["corrupted"], info["n_pairs"]) == ("clean-set", "corrupt-set", 3)
    order = ids_corrupt  # the bootstrap draws pairs in sequence order
    draws = np.random.default_rng(0).integers(0, 3, size=(1000, 3))
    for cell in info["cells"]:
        per_pair = np.array([own[(pid, cell["layer"])] for pid in order])  # [pair, step]
        assert abs(cell["effect"] - per_pair.mean()) < 1e-4
        boot = per_pair[draws].mean(axis=(1, 2))
        low, high = np.percentile(boot, [2.5, 97.5])
        assert abs(cell["low"] - low) < 1e-4 and abs(cell["high"] - high) < 1e-4
        assert cell["n_pairs"] == 3
    assert len(info["cells"]) == 4 and max(abs(c["effect"]) for c in info["cells"]) > 1e-2


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--pair-by", "nope"], "has no such column"),
        ([], "same token length"),  # by index the reversed pairs have prompts of different lengths
    ],
)
def test_bad_pairs_exit_2_with_one_line(paired_runs, args, fragment):
    _, corrupt = paired_runs
    out = _cli(
        corrupt.path.parent.parent,
        "sweep",
        str(corrupt.path),
        "--over",
        "attn",
        "--edit",
        "patch",
        "--source",
        "clean-set",
        *args,
    )
    _, stderr = out.communicate(timeout=300)
    lines = _error_lines(stderr)
    assert out.returncode == 2 and len(lines) == 1 and fragment in lines[0], stderr


class _Ids:
    """A run as pair_sequences reads it: an id and sequences.parquet's rows."""

    def __init__(self, run_id, ids):
        import pyarrow as pa

        self.id = run_id
        self.table = pa.table({"sequence": list(range(len(ids))), "pair_id": ids})

    def sequences(self):
        return self.table


def test_pairing_by_id_matches_ids_and_refuses_ids_without_a_partner_in_one_line():
    from lmtrace.archive.pairs import pair_sequences
    from lmtrace.exits.errors import SpecError

    parent, source = _Ids("corrupt", ["a", "b", "c"]), _Ids("clean", ["c", "a", "b"])
    assert pair_sequences(parent, source, [0, 1, 2], "pair_id") == {0: (1, "a"), 1: (2, "b"), 2: (0, "c")}
    assert pair_sequences(parent, source, [0, 2], None) == {0: (0, "0"), 2: (2, "2")}
    for p, s, seqs, fragment in (
        (parent, _Ids("clean", ["a", "b"]), [0, 1, 2], "id 'c' of run corrupt is missing"),
        (_Ids("corrupt", ["a", "b"]), source, [0, 1], "id 'c' of the source run clean"),
        (_Ids("corrupt", ["a", "a"]), source, [0, 1], "appears twice"),
        (_Ids("corrupt", ["a", None]), source, [0, 1], "has no pair_id"),
        (parent, _Ids("clean", ["a"]), [0, 1], None),
    ):
        with pytest.raises(SpecError) as err:
            pair_sequences(p, s, seqs, "pair_id" if fragment else None)
        assert "\n" not in str(err.value) and (fragment or "has no partner") in str(err.value)


def test_intervene_edits_and_sweep_patches_install_the_same_component_hooks(model):
    """The patching hooks exist once: an intervene ablation and a sweep patch of the same head, block and
    residual install the same hook functions on the same modules (the numbers are pinned by the tests
    above, against the test's own hooks)."""
    from lmtrace.analysis.sweep.cells import Cell
    from lmtrace.analysis.sweep.engine import SourceValues, _Patches
    from lmtrace.capture.arch import adapter_for
    from lmtrace.capture.interventions import EditSet, parse_entries

    adapter = adapter_for(model)
    modules = {"head": adapter.o_proj(1), "attn": adapter.attn(1), "mlp": adapter.mlp(0), "resid": adapter.layers[1]}

    def installed():
        """module -> the qualified names of the hooks and taps on it."""
        out = {}
        for kind, m in modules.items():
            taps = m.__dict__.get("_lmtrace_taps")
            out[kind] = sorted(
                [f.__qualname__ for f in m._forward_pre_hooks.values()]
                + [f.__qualname__ for f in m._forward_hooks.values()]
                + ([f.__qualname__ for f in taps.fns] if taps is not None else [])
            )
        return out

    entries = parse_entries(
        [
            {"kind": "ablate_head", "layer": 1, "head": 0},
            {"kind": "ablate_attention", "layer": 1},
            {"kind": "ablate_mlp", "layer": 0},
            {"kind": "steer", "layer": 1, "alpha": 1.0, "vector": "unused.npy"},
        ],
        "test",
    )
    edits = EditSet(entries, adapter, {0: 1}, {3: torch.zeros(adapter.model.config.hidden_size)})
    with edits.attached():
        by_intervene = installed()
    cells = [Cell("head", 1, head=0), Cell("attn", 1), Cell("mlp", 0), Cell("resid", 1)]
    with _Patches(adapter, cells, [SourceValues({})] * len(cells)).attached():
        by_sweep = installed()
    assert installed() == {kind: [] for kind in modules}
    assert by_intervene == by_sweep
    assert {names[0].split(".<locals>.")[0] for names in by_sweep.values()} == {"edit_component"}
