"""`lmtrace serve`'s pictures and long contexts: a head's whole attention pattern (the prompt's rows
from `prefill_attn`, then every step's row), a layer's heads as small multiples, the mean / max over
heads, the logit lens over the steps and a head's DLA over the steps, sent as the archive's own
bytes and drawn on canvases.

A tiny random model reads a prompt of ~600 tokens (a few hundred keys past one 512-key view, several
64-key chunks) and generates 10 steps in blocks of 4, so a selection crosses blocks. Every number is
compared with the archive read here with zarr and pyarrow, and in Chromium with what each canvas
keeps and its hover card says.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import zarr

from tests.helpers.browser import CHROMIUM, cell_point
from tests.helpers.runs import run_spec, with_lens
from tests.helpers.server import LiveServer

LONG_PROMPT = " ".join(["The river runs past the old mill and the bridge, and the town grows around it."] * 34)
STEPS = 10


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """runs/long (prefill attention and head DLA captured, lens computed) and runs/pending (the same run
    before `lmtrace lens`)."""
    base = tmp_path_factory.mktemp("patterns")
    run = run_spec(
        base,
        {
            "model": str(tiny_llama_dir),
            "prompts": [LONG_PROMPT, "A short prompt"],
            "generation": {"max_new_tokens": STEPS, "batch_size": 2, "temperature": 0.0, "seed": 1, "eos_token_id": []},
            "capture": {"head_dla": True, "prefill_attention": True},
            "output": {"chunk_steps": 4, "run_id": "long"},
        },
    )
    runs = base / "runs"
    shutil.copytree(runs / "long", runs / "pending")
    with_lens(run)
    return runs


@pytest.fixture(scope="module")
def server(runs_dir):
    s = LiveServer(runs_dir)
    yield s
    s.stop()


def group(runs_dir: Path, run: str = "long"):
    return zarr.open_group(str(runs_dir / run / "tensors.zarr"), mode="r")


def unpack(p: dict) -> np.ndarray:
    dtype = {"float16": "<f2", "float32": "<f4"}[p["dtype"]]
    return np.frombuffer(base64.b64decode(p["data"]), dtype=dtype).reshape(p["shape"])


def reference_pattern(g, seq: int, layer: int, head: int) -> np.ndarray:
    """The head's query x key matrix built here: prefill rows 0..P-2, then step s's row (query P-1+s)."""
    P, n = int(g["prompt_len"][seq]), int(g["generated_len"][seq])
    out = np.full((P - 1 + n, P + n - 1), np.nan, dtype=np.float32)
    pre = np.asarray(g["prefill_attn"][seq, layer, head, :P, :P], dtype=np.float32)
    for q in range(P - 1):
        out[q, : q + 1] = pre[q, : q + 1]
    for s in range(n):
        out[P - 1 + s, : P + s] = np.asarray(g["attn"][seq, s, layer, head, : P + s], dtype=np.float32)
    return out


def block_max(m: np.ndarray, stride: int) -> np.ndarray:
    """m max-pooled over stride x stride blocks (NaN only where a block has no number), by loops."""
    rows, cols = -(-m.shape[0] // stride), -(-m.shape[1] // stride)
    out = np.full((rows, cols), np.nan, dtype=np.float32)
    for r in range(rows):
        for k in range(cols):
            block = m[r * stride : (r + 1) * stride, k * stride : (k + 1) * stride]
            if not np.isnan(block).all():
                out[r, k] = np.nanmax(block)
    return out


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


# ---- the routes ------------------------------------------------------------------------------------
def test_head_pattern_is_the_prefill_rows_then_every_steps_row_in_the_archives_bytes(server, runs_dir):
    g = group(runs_dir)
    P = int(g["prompt_len"][0])
    assert P > 512 and g["attn"].dtype == np.float16
    d = server.json("/api/runs/long/sequences/0/pattern/2/3")
    assert d["weights"]["dtype"] == "float16" and d["query_start"] == 0 and d["prompt_rows"] is True
    assert d["stride"] == 1 and d["prompt_len"] == P and d["steps"] == STEPS
    assert same(unpack(d["weights"]).astype(np.float32), reference_pattern(g, 0, 2, 3))
    texts = (
        pq.read_table(runs_dir / "long" / "tokens.parquet").to_pandas().query("sequence == 0").sort_values("position")
    )
    assert d["keys"] == texts.token_text.tolist()[: P + STEPS - 1]
    assert d["chosen"] == texts.token_text.tolist()[P : P + STEPS]
    # the short sequence: its own context, not the long one's padding
    short = server.json("/api/runs/long/sequences/1/pattern/0/1")
    assert same(unpack(short["weights"]).astype(np.float32), reference_pattern(g, 1, 0, 1))


def test_a_layers_small_multiples_are_each_heads_pattern(server, runs_dir):
    g = group(runs_dir)
    d = server.json("/api/runs/long/sequences/0/pattern/1")
    w = unpack(d["weights"]).astype(np.float32)
    # ~600 x 600 cells a head: more than a tile gets (LAYER_CELLS), so each pixel is a 2 x 2 block's maximum
    assert d["heads"] == w.shape[0] == g["attn"].shape[3] and d["stride"] == 2
    for h in range(w.shape[0]):
        assert same(w[h], block_max(reference_pattern(g, 0, 1, h), 2))
    short = server.json("/api/runs/long/sequences/1/pattern/1")  # a short prompt: every cell
    assert short["stride"] == 1 and same(unpack(short["weights"])[3].astype(np.float32), reference_pattern(g, 1, 1, 3))


def test_patterns_404_for_a_layer_head_or_sequence_that_is_not_there(server):
    for path, says in (
        ("pattern/9/0", "layer 9 was not captured"),
        ("pattern/0/99", "heads 0-3, not 99"),
        ("pattern/9", "layer 9 was not captured"),
        ("head_dla/0/99", "heads 0-3, not 99"),
        ("steps/99/over_heads/packed", "not 99"),
    ):
        status, _, body = server.request(f"/api/runs/long/sequences/0/{path}")
        assert status == 404 and says in json.loads(body)["error"], (path, body)
    for path in ("/api/runs/long/sequences/5/pattern/0/0", "/api/runs/long/sequences/7/lens"):
        status, _, body = server.request(path)
        assert status == 404 and "sequences 0-1, not" in json.loads(body)["error"], (path, body)


def test_over_heads_packed_are_the_same_numbers_as_the_json_answer(server, runs_dir):
    g = group(runs_dir)
    P = int(g["prompt_len"][0])
    for step in (0, 5, 9):  # three blocks of 4 steps
        attn = np.asarray(g["attn"][0, step, :, :, : P + step])
        d = server.json(f"/api/runs/long/sequences/0/steps/{step}/over_heads/packed")
        assert d["mean"]["dtype"] == "float32" and d["max"]["dtype"] == "float16"
        assert np.array_equal(unpack(d["mean"]), attn.astype(np.float32).mean(axis=1))
        assert np.array_equal(unpack(d["max"]), attn.max(axis=1))
        assert len(d["keys"]) == P + step


def test_lens_over_the_steps_is_the_archived_top1_and_its_probability(server, runs_dir):
    g = group(runs_dir)
    vocab = dict(
        zip(*[pq.read_table(runs_dir / "long" / "vocab.parquet").column(c).to_pylist() for c in ("id", "text")])
    )
    d = server.json("/api/runs/long/sequences/0/lens")
    ids, probs = (
        np.asarray(g["lens_ids"][0, :STEPS, :, 0]),
        np.asarray(g["lens_probs"][0, :STEPS, :, 0], dtype=np.float32),
    )
    assert d["state"] == "ready" and d["steps"] == STEPS
    assert d["top1_id"] == ids.T.tolist()
    assert d["top1"] == [[vocab[int(i)] for i in row] for row in ids.T]
    assert d["prob"] == probs.T.tolist()
    pending = server.json("/api/runs/pending/sequences/0/lens")
    assert pending["state"] == "pending" and "lmtrace lens pending" in pending["note"]


def test_head_dla_over_the_steps_is_the_archived_column(server, runs_dir):
    g = group(runs_dir)
    d = server.json("/api/runs/long/sequences/0/head_dla/3/1")
    assert d["values"] == np.asarray(g["head_dla"][0, :STEPS, 3, 1], dtype=np.float32).tolist()


def test_selected_tokens_grid_is_the_archived_maximum_across_blocks_and_the_kept_blocks_stay_bounded(
    server, runs_dir, monkeypatch
):
    from lmtrace.viewdata import blocks

    blocks.clear()
    monkeypatch.setattr(blocks, "CACHE_BYTES", 1)  # at most one block kept
    g = group(runs_dir)
    P = int(g["prompt_len"][0])
    for step in (9, 0, 5, 4, 3, 8):  # out of order, across the blocks 0-3, 4-7, 8-9
        attn = np.asarray(g["attn"][0, step, :, :, : P + step], dtype=np.float32)
        cells = server.json(f"/api/runs/long/sequences/0/steps/{step}")["attention"]["cells"]
        assert [[c["weight"] for c in row] for row in cells] == attn.max(axis=-1).tolist()
        row = server.json(f"/api/runs/long/sequences/0/steps/{step}/attention/2/1")["keys"]
        assert [k["weight"] for k in row] == attn[2, 1].tolist()
        assert len(blocks._blocks) == 1


def test_pool_max_keeps_each_blocks_maximum():
    from lmtrace.analysis.attention_images import pool_max

    rng = np.random.default_rng(0)
    m = rng.random((7, 11)).astype(np.float16)
    m[0, :] = np.nan
    pooled, stride = pool_max(m, 12)
    assert stride == 3 and pooled.shape == (3, 4)
    for r in range(3):
        for k in range(4):
            block = m[r * 3 : r * 3 + 3, k * 3 : k * 3 + 3].astype(np.float32)
            want = np.nan if np.isnan(block).all() else np.nanmax(block)
            assert np.array_equal(np.float32(pooled[r, k]), np.float32(want), equal_nan=True)
    assert pool_max(m, 77) == (m, 1)


# ---- the page, in a real browser -------------------------------------------------------------------
def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; it is in the `test` extra)")
    if CHROMIUM is None:
        pytest.skip("Debian's `chromium` is not installed (.ci/run installs it when run as root)")
    return sync_playwright


def panel_csv(page, selector: str) -> list[list[str]]:
    """The rows of the CSV a panel's export button saves (headgrid.js's exportBar keeps it as panel._csv)."""
    return list(csv.reader(io.StringIO(page.eval_on_selector(selector, "p => p._csv()"))))


def canvas_values(page, selector: str) -> np.ndarray:
    return np.asarray(
        page.eval_on_selector(selector, "c => Array.from(c.lmtraceValues, (x) => Number.isNaN(x) ? null : x)"),
        dtype=np.float64,
    )


def hover_text(page, selector: str, row: int, col: int) -> str:
    """The hover card's text over the cell (row, col) of a canvas drawn one pixel a cell."""
    page.eval_on_selector(
        selector,
        """(c, row) => { const r = c.getBoundingClientRect();
        window.scrollBy(0, r.top + (row + 0.5) * r.height / +c.dataset.rows - innerHeight / 2); }""",
        row,
    )
    box = page.eval_on_selector(
        selector,
        """c => { const r = c.getBoundingClientRect();
        return [r.left, r.top, r.width, r.height, +c.dataset.rows, +c.dataset.cols]; }""",
    )
    left, top, width, height, rows, cols = box
    page.mouse.move(left + (col + 0.5) * width / cols, top + (row + 0.5) * height / rows)
    return page.eval_on_selector(selector, "c => c.parentElement.querySelector('.hover-card').textContent")


@pytest.mark.parametrize("width", [1280, 800])
def test_page_draws_patterns_small_multiples_lens_and_dla_as_the_archive_has_them(server, runs_dir, tmp_path, width):
    sync_playwright = _playwright()
    g = group(runs_dir)
    P = int(g["prompt_len"][0])
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": width, "height": 1000})
        page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(server.base + "/#/run/long/seq/0/step/6")
        page.wait_for_selector("#detail[data-step='6'] #attention-panel")

        # every head of layer 2 as small multiples: each tile is the head's whole pattern
        page.select_option("#layer-multiples", "2")
        page.wait_for_selector("#layer-heads-2 figure.tile canvas")
        tiles = page.eval_on_selector_all("#layer-heads-2 figure.tile", "ts => ts.map(t => +t.dataset.head)")
        assert tiles == list(range(g["attn"].shape[3]))
        for h in tiles:
            want = block_max(reference_pattern(g, 0, 2, h), 2)
            got = canvas_values(page, f"#layer-heads-2 figure.tile[data-head='{h}'] canvas")
            assert same(got.reshape(want.shape).astype(np.float32), want)

        texts = (
            pq.read_table(runs_dir / "long" / "tokens.parquet")
            .to_pandas()
            .query("sequence == 0")
            .sort_values("position")
            .token_text.tolist()
        )
        # a tile picks its head: the head's pattern image, the selected step's row outlined
        page.click("#layer-heads-2 figure.tile[data-head='1']")
        image = ".pattern[data-layer='2'][data-head='1'] canvas.pattern-image"
        page.wait_for_selector(image)
        ref = reference_pattern(g, 0, 2, 1)
        got = canvas_values(page, image).reshape(ref.shape).astype(np.float32)
        assert same(got, ref)
        assert page.eval_on_selector(image, "c => [c.tagName, +c.dataset.rows, +c.dataset.keys]") == [
            "CANVAS",
            *ref.shape,
        ]
        mark = page.eval_on_selector(".pattern[data-layer='2'][data-head='1'] .row-mark", "m => m.style.top")
        assert float(mark.rstrip("%")) == pytest.approx(100 * (P - 1 + 6) / ref.shape[0])
        # the hover card names the cell and its archived weight (4 decimals); a long row's pixel is its
        # pool's largest key
        row = P - 1 + 6
        pool = page.eval_on_selector(image, "c => +c.dataset.pool")
        x = 40 // pool
        text = hover_text(page, image, row, x)
        found = re.search(r'^step (\d+) .*query position (\d+) → key (\d+) (".*"): (\S+)$', text)
        assert found, text
        step, query, key = int(found[1]), int(found[2]), int(found[3])
        # the pixel under the mouse, give or take a rounding (a row or a key is about one screen pixel here)
        assert query == P - 1 + step and abs(query - row) <= 1 and abs(key // pool - x) <= 1
        assert found[5] == f"{ref[query, key]:.4f}" and json.loads(found[4]) == texts[key]
        assert all(
            ref[query, k] <= ref[query, key]
            for k in range(key // pool * pool, min(ref.shape[1], (key // pool + 1) * pool))
        )
        assert page.eval_on_selector_all("table.pattern-grid", "t => t.length") == 0  # no table of cells
        # its CSV: a row per query position (its step, or none for the prompt's rows), a column per key
        page.wait_for_selector(".pattern[data-layer='2'][data-head='1'] .export-bar .csv")
        rows = panel_csv(page, ".pattern[data-layer='2'][data-head='1']")
        assert rows[0] == ["query_position", "step", *[f"{k}:{t}" for k, t in enumerate(texts[: ref.shape[1]])]]
        assert [(int(r[0]), r[1]) for r in rows[1:]] == [
            (q, str(q - (P - 1)) if q >= P - 1 else "") for q in range(ref.shape[0])
        ]
        got = np.asarray([[float(x) if x else np.nan for x in r[2:]] for r in rows[1:]], dtype=np.float64)
        assert same(got, ref.astype(np.float64))

        # the mean and max over heads: images of the archive's numbers
        attn = np.asarray(g["attn"][0, 6, :, :, : P + 6])
        for view, want in (
            ("mean", attn.astype(np.float32).mean(axis=1)),
            ("max", attn.max(axis=1).astype(np.float32)),
        ):
            page.select_option("#grid-view", view)
            page.wait_for_selector(f"canvas#attention-{view}")
            assert np.array_equal(
                canvas_values(page, f"#attention-{view}").reshape(want.shape), want.astype(np.float64)
            )
            # the attention panel's CSV: the view shown, a row per layer, a column per key
            rows = panel_csv(page, "#attention-panel")
            assert rows[0] == ["layer", *[f"{k}:{t}" for k, t in enumerate(texts[: P + 6])]]
            assert [int(r[0]) for r in rows[1:]] == list(range(want.shape[0]))
            assert np.array_equal(np.asarray([[float(x) for x in r[1:]] for r in rows[1:]]), want.astype(np.float64))
        page.select_option("#grid-view", "heads")

        # the logit lens over the steps, and a column click selects its step
        page.wait_for_selector("#lens-grid")
        lens = page.eval_on_selector("#lens-grid", "c => c.lmtraceLens.prob")
        assert lens == np.asarray(g["lens_probs"][0, :STEPS, :, 0], dtype=np.float32).T.tolist()
        # its CSV: a row per layer and step, the archived top-1 and its probability
        vocab = dict(
            zip(*[pq.read_table(runs_dir / "long" / "vocab.parquet").column(c).to_pylist() for c in ("id", "text")])
        )
        ids = np.asarray(g["lens_ids"][0, :STEPS, :, 0])
        probs = np.asarray(g["lens_probs"][0, :STEPS, :, 0], dtype=np.float32)
        rows = panel_csv(page, "#lens-grid-panel")
        assert rows[0] == ["layer", "step", "chosen", "top1_id", "top1", "top1_prob"]
        assert [(int(r[0]), int(r[1]), r[2], int(r[3]), r[4], float(r[5])) for r in rows[1:]] == [
            (layer, s, texts[P + s], int(ids[s, layer]), vocab[int(ids[s, layer])], float(probs[s, layer]))
            for layer in range(ids.shape[1])
            for s in range(STEPS)
        ]
        panels = page.eval_on_selector_all(
            "#detail .panel",
            "ps => ps.map(p => [p.id, !!p.querySelector('.export-bar .png'), !!p.querySelector('.export-bar .csv')])",
        )
        assert {pid for pid, _, _ in panels} >= {"attention-panel", "dla-panel", "lens-grid-panel"}
        assert all(png and csv_ for _, png, csv_ in panels), panels
        page.screenshot(path=str(tmp_path / f"patterns-{width}.png"), full_page=True)

        # a cell of the DLA heatmap opens the head's DLA over the steps, and so does one of its numbers
        page.mouse.click(*cell_point(page, "#dla-heatmap", 3, 1))
        page.wait_for_selector("#dla-over-steps canvas[data-layer='3'][data-head='1']")
        dla = canvas_values(page, "#dla-over-steps canvas")
        assert dla.tolist() == np.asarray(g["head_dla"][0, :STEPS, 3, 1], dtype=np.float32).tolist()
        page.click("#dla-grid td.cell[data-layer='2'][data-head='0']")
        page.wait_for_selector("#dla-over-steps canvas[data-layer='2'][data-head='0']")
        dla = canvas_values(page, "#dla-over-steps canvas")
        assert dla.tolist() == np.asarray(g["head_dla"][0, :STEPS, 2, 0], dtype=np.float32).tolist()
        assert page.get_attribute("#dla-heatmap", "data-cursor") == "2,0"
        page.locator("#dla-panel").screenshot(path=str(tmp_path / f"dla-{width}.png"))

        # the lens grid's column 2 selects step 2
        page.locator("#lens-grid").click(position={"x": 34 + 2 * 46 + 10, "y": 30})
        page.wait_for_selector("#detail[data-step='2'] #attention-panel")
        browser.close()
    assert problems == []


def test_a_long_row_shows_its_heaviest_keys_as_tokens(server, runs_dir):
    sync_playwright = _playwright()
    g = group(runs_dir)
    P = int(g["prompt_len"][0])
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.goto(server.base + "/#/run/long/seq/0/step/3")
        page.wait_for_selector("#detail[data-step='3'] #attention-heatmap")
        page.mouse.click(*cell_point(page, "#attention-heatmap", 0, 2))
        page.wait_for_selector("#head-row .row-keys")
        keys = page.eval_on_selector_all("#head-row .tok.key", "ks => ks.map(k => +k.dataset.key)")
        browser.close()
    row = np.asarray(g["attn"][0, 3, 0, 2, : P + 3], dtype=np.float32)
    assert len(keys) == 512 < P + 3 and keys == sorted(keys)
    assert row[keys].min() >= np.sort(row)[-512]
