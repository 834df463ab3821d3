"""Compare's page and an intervention child's page draw what the verdict names: per pair, each per-layer
figure over the paired steps (a layer × step heatmap), every head's attention JS (small multiples), the
first divergence linked to both runs' token views. The numbers are those `lmtrace compare --json --out`
(run here as a user runs it) prints and writes, read back from the routes and from the page's canvases
in Chromium at 1280 and 800 px."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.helpers.cli import lmtrace
from tests.helpers.serve_page import assert_fits, assert_no_placeholder_text, served_page
from tests.helpers.server import LiveServer

BASE, CHILD, REGEN = "every-table", "every-table-child", "regen"
FIGURES = (
    "attn_js_mean",
    "delta_norm_delta",
    "resid_norm_rel_delta",
    "resid_dist",
    "lens_changed",
    "lens_top1_prob_delta",
    "margin_contrib_delta",
)


@pytest.fixture(scope="module")
def runs(every_table_runs, tmp_path_factory):
    """The every-table runs and REGEN: a child of the base run with layers 0 and 2 ablated from step 2,
    regenerated (its tokens part from the parent's)."""
    from lmtrace.commands.intervene import run_intervene

    root = tmp_path_factory.mktemp("compare-pages")
    shutil.copytree(every_table_runs / "runs", root / "runs")
    run_intervene(
        str(root / "runs" / BASE),
        [{"kind": "ablate_layer", "layer": 0}, {"kind": "ablate_layer", "layer": 2}],
        mode="regenerate",
        from_step=2,
        runs_dir=str(root / "runs"),
        run_id=REGEN,
    )
    return root


@pytest.fixture(scope="module")
def server(runs):
    s = LiveServer(runs / "runs")
    yield s
    s.stop()


def cli_compare(runs, a: str, b: str) -> dict:
    """`lmtrace compare A B --json --out DIR`: its JSON and the per_layer / per_head tables it wrote."""
    out = runs / f"cmp-{a}-{b}"
    proc = lmtrace(runs, "compare", a, b, "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return {
        "json": json.loads(proc.stdout),
        "per_layer": pq.read_table(out / "per_layer.parquet").to_pandas(),
        "per_head": pq.read_table(out / "per_head.parquet").to_pandas(),
    }


@pytest.fixture(scope="module")
def regen_cli(runs):
    return cli_compare(runs, BASE, REGEN)


@pytest.fixture(scope="module")
def child_cli(runs):
    return cli_compare(runs, BASE, CHILD)


def close(got, want) -> bool:
    """A value of the page (null for no value) against a table's (NaN or None for none)."""
    if want is None or (isinstance(want, float) and math.isnan(want)):
        return got is None
    return got is not None and got == pytest.approx(float(want), rel=1e-12, abs=1e-15)


def check_figures(d: dict, cli: dict, pair: int) -> None:
    """The figures of `pair` (an answer of the routes, or read from the canvases) are its rows of
    per_layer.parquet and per_head.parquet: figure[layer][step], head_js[layer][head][step]."""
    rows = cli["per_layer"][cli["per_layer"].pair == pair]
    assert d["steps"] == rows.step.max() + 1
    layers = d["layers"]
    for name in FIGURES:
        for r in rows.itertuples():
            want = getattr(r, name)
            if name == "margin_contrib_delta" and not r.same_final_top2:
                want = None  # the delta means something only where both sides' top-2 are the same tokens
            if name == "lens_changed" and want is not None and not (isinstance(want, float) and math.isnan(want)):
                want = float(want)
            assert close(d["figures"][name][layers.index(r.layer)][r.step], want), (name, r.layer, r.step)
    heads = cli["per_head"][cli["per_head"].pair == pair]
    assert heads.shape[0] == np.size(d["head_js"]) == np.size(d["head_dla_delta"])
    same = dict(zip(rows.step, rows.same_final_top2))
    for r in heads.itertuples():
        assert close(d["head_js"][layers.index(r.layer)][r.q_head][r.step], r.attn_js), (r.layer, r.q_head, r.step)
        want = r.head_dla_delta if same[r.step] else None
        assert close(d["head_dla_delta"][layers.index(r.layer)][r.q_head][r.step], want), (r.layer, r.q_head, r.step)


def check_head_dla_against_the_archives(cli: dict, runs, a: str, b: str) -> None:
    """per_head.parquet's head DLA delta is B's head_dla minus A's, read here with zarr."""
    import zarr

    dla = {
        side: zarr.open_array(str(runs / "runs" / name / "tensors.zarr" / "head_dla"), mode="r")[...]
        for side, name in (("a", a), ("b", b))
    }
    t = cli["per_head"]
    assert len(t) and t.head_dla_delta.notna().all()
    got = t.head_dla_delta.to_numpy()
    want = dla["b"][t.seq_b, t.step, t.layer, t.q_head].astype(np.float64) - dla["a"][
        t.seq_a, t.step, t.layer, t.q_head
    ].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=0)


def test_each_pairs_figures_are_the_per_layer_and_per_head_rows_compare_writes(server, regen_cli, runs):
    cli = regen_cli["json"]
    d = server.json(f"/api/compare?a={BASE}&b={REGEN}")
    for k in ("verdict", "identical", "first_changed_layer", "layers", "heads"):
        assert d[k] == cli[k], k
    assert [p["first_divergence"] for p in d["pairs"]] == [p["first_divergence"] for p in cli["pairs"]]
    assert any(p["first_divergence"] for p in cli["pairs"]), "the regenerated child should part from its parent"
    check_head_dla_against_the_archives(regen_cli, runs, BASE, REGEN)
    for p in regen_cli["json"]["pairs"]:
        d = server.json(f"/api/compare/pair?a={BASE}&b={REGEN}&pair={p['pair']}")
        assert (d["seq_a"], d["seq_b"], d["first_divergence"]) == (p["seq_a"], p["seq_b"], p["first_divergence"])
        check_figures(d, regen_cli, p["pair"])
    status, _, body = server.request(f"/api/compare/pair?a={BASE}&b={REGEN}&pair=9")
    assert status == 404 and "not 9" in json.loads(body)["error"]
    assert server.request(f"/api/compare/pair?a={BASE}&b={REGEN}&pair=x")[0] == 400


def test_a_childs_internals_are_its_pair_with_the_parent(server, child_cli):
    for p in child_cli["json"]["pairs"]:
        d = server.json(f"/api/runs/{CHILD}/sequences/{p['seq_b']}/parent/internals")
        assert (d["a"], d["b"], d["seq_a"]) == (BASE, CHILD, p["seq_a"])
        check_figures(d, child_cli, p["pair"])
    assert server.request(f"/api/runs/{BASE}/sequences/0/parent/internals")[0] == 404  # not a child
    assert server.request(f"/api/runs/{CHILD}/sequences/7/parent/internals")[0] == 404


def read_canvases(page, box: str) -> dict:
    """The numbers the page's heatmaps drew (each canvas keeps its matrix) and its links."""
    return page.evaluate(f"""() => {{
        const box = document.querySelector('{box}');
        const figs = {{}};
        for (const f of box.querySelectorAll('.figure')) figs[f.dataset.figure] = JSON.parse(f.querySelector('canvas.heatmap').dataset.values);
        const multiples = (cls) => [...box.querySelectorAll(`.${{cls}} .multiple`)].map(m => JSON.parse(m.querySelector('canvas.heatmap').dataset.values));
        const heads = multiples('head-js'), dla = multiples('head-dla');
        const fd = box.querySelector('#first-divergence');
        return {{figures: figs, head_js: heads, head_dla_delta: dla, step: fd.dataset.step,
                 links: [...fd.querySelectorAll('a')].map(a => a.getAttribute('href'))}};
    }}""")


def shot(page, selector: str, name: str, tmp_path) -> None:
    path = tmp_path / name
    page.locator(selector).screenshot(path=str(path))
    if os.environ.get("LMTRACE_SHOTS_DIR"):  # to look at them
        shutil.copy(path, os.path.join(os.environ["LMTRACE_SHOTS_DIR"], name))


@pytest.mark.parametrize("width", [1280, 800])
def test_compare_page_draws_each_pairs_figures_and_links_the_first_divergence_to_both_token_views(
    server, regen_cli, width, tmp_path
):
    cli = regen_cli["json"]
    pair = next(p for p in cli["pairs"] if p["first_divergence"])
    with served_page(width) as (page, problems):
        page.goto(server.base + f"/#/compare/{BASE}/{REGEN}")
        page.wait_for_selector("#pair-internals canvas.heatmap")
        assert page.eval_on_selector("#pair-pick", "s => +s.value") == pair["pair"]  # the first pair that diverges
        got = read_canvases(page, "#pair-internals")
        d = server.json(f"/api/compare/pair?a={BASE}&b={REGEN}&pair={pair['pair']}")
        shown = [k for k in FIGURES if d["has"][k]]
        assert sorted(got["figures"]) == sorted(shown) and "attn_js_mean" in shown
        check_figures(
            {
                **d,
                "figures": {**d["figures"], **got["figures"]},
                "head_js": got["head_js"],
                "head_dla_delta": got["head_dla_delta"],
            },
            regen_cli,
            pair["pair"],
        )
        step = pair["first_divergence"]["step"]
        assert got["step"] == str(step)
        assert got["links"] == [
            f"#/run/{BASE}/seq/{pair['seq_a']}/step/{step}",
            f"#/run/{REGEN}/seq/{pair['seq_b']}/step/{step}",
        ]
        assert_no_placeholder_text(page)
        assert_fits(page, "#pair-internals")
        # every panel exports PNG and CSV; a figure's CSV holds its layer x step values as the route gives them
        panels = "#pair-internals .panel.figure, #pair-internals .head-multiples"
        has_bars = "ps => ps.length > 0 && ps.every(p => p.querySelector('.export-bar .png') && p.querySelector('.export-bar .csv'))"
        assert page.eval_on_selector_all(panels, has_bars)
        csv = page.eval_on_selector("#pair-internals .panel.figure[data-figure='attn_js_mean']", "p => p._csv()")
        rows = [line.split(",") for line in csv.strip().splitlines()]
        for row, want in zip(rows[1:], d["figures"]["attn_js_mean"], strict=True):
            assert [float(x) if x else None for x in row[1:]] == pytest.approx(want, rel=1e-9)
        shot(page, "#pair-internals", f"compare-{width}.png", tmp_path)
        # the pairs table links the divergence to this view; the link to B's token view opens that step
        page.click("#first-divergence a.link-b")
        page.wait_for_selector(f".strip .tok.sel[data-step='{step}']")
        assert page.evaluate("location.hash") == f"#/run/{REGEN}/seq/{pair['seq_b']}/step/{step}"
        assert problems == []


@pytest.mark.parametrize("width", [1280, 800])
def test_child_page_draws_its_internals_against_the_parent(server, child_cli, width, tmp_path):
    p = child_cli["json"]["pairs"][1]
    with served_page(width) as (page, problems):
        page.goto(server.base + f"/#/run/{CHILD}/seq/{p['seq_b']}")
        page.wait_for_selector("#child-internals canvas.heatmap")
        got = read_canvases(page, "#child-internals")
        d = server.json(f"/api/runs/{CHILD}/sequences/{p['seq_b']}/parent/internals")
        check_figures(
            {
                **d,
                "figures": {**d["figures"], **got["figures"]},
                "head_js": got["head_js"],
                "head_dla_delta": got["head_dla_delta"],
            },
            child_cli,
            p["pair"],
        )
        assert got["step"] == ""  # the child kept its parent's tokens: no divergence
        assert_no_placeholder_text(page)
        assert_fits(page, "#child-internals")
        shot(page, "#against-parent", f"child-{width}.png", tmp_path)
        assert problems == []
