"""`lmtrace serve`'s page at 1280 and 800 px wide in a real headless Chromium (Debian's `chromium`,
driven by Playwright), over a tiny random model as wide as a 7B model's attention (32 layers × 32
heads): the layer × head grid is a canvas heatmap that fits its panel, its hover card and its numbers
equal the archive read here with zarr and pyarrow, clicks and keys pick heads, the view's state lives
in the address, every panel exports PNG and CSV, signed scales have legends, and no panel cuts its
content. The report (`lmtrace report`), a snapshot of the same page, marks the layers it embeds.

Screenshots go to $LMTRACE_LAYOUT_SHOTS when set (else the test's tmp_path).
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import zarr

from tests.helpers.browser import CHROMIUM, cell_point
from tests.helpers.cli import lmtrace
from tests.helpers.runs import PROMPTS, run_spec
from tests.helpers.server import LiveServer
from tests.helpers.wide import HEADS, LAYERS, wide_llama

WIDTHS = (1280, 800)
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def wide_runs(tmp_path_factory) -> Path:
    """runs/wide: 2 prompts (one with a long last word, so the strip must wrap), 5 generated tokens,
    dense attention and head DLA, then `lmtrace heads` (analysis/heads.parquet: the heads' labels)."""
    base = tmp_path_factory.mktemp("layout")
    model = wide_llama(base / "model")
    run = run_spec(
        base,
        {
            "model": str(model),
            "prompts": [PROMPTS[1], "Supercalifragilisticexpialidocious " * 6 + "France?"],
            "generation": {"max_new_tokens": 5, "batch_size": 2, "temperature": 0.8, "top_k": 20, "seed": 1},
            "capture": {"head_dla": True},
            "output": {"chunk_steps": 5, "run_id": "wide"},
        },
    )
    proc = lmtrace(base, "heads", str(run.path))
    assert proc.returncode == 0, proc.stderr
    return base / "runs"


@pytest.fixture(scope="module")
def wide_server(wide_runs):
    s = LiveServer(wide_runs)
    yield s
    s.stop()


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; it is in the `test` extra)")
    if CHROMIUM is None:
        pytest.skip("Debian's `chromium` is not installed (.ci/run installs it when run as root)")
    return sync_playwright


def shots_dir(tmp_path: Path) -> Path:
    d = Path(os.environ.get("LMTRACE_LAYOUT_SHOTS") or tmp_path / "shots")
    d.mkdir(parents=True, exist_ok=True)
    return d


# ---- the archive, read independently --------------------------------------------------------------
def archive_attention(run_dir: Path, seq: int, step: int) -> np.ndarray:
    group = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    n_keys = int(group["prompt_len"][seq]) + step
    return np.asarray(group["attn"][seq, step, :, :, :n_keys], dtype=np.float32)


def archive_texts(run_dir: Path, seq: int) -> list[str]:
    t = pq.read_table(run_dir / "tokens.parquet", columns=["sequence", "position", "token_text"]).to_pandas()
    return t[t.sequence == seq].sort_values("position").token_text.tolist()


def archive_labels(run_dir: Path) -> dict[tuple[int, int], str]:
    t = pq.read_table(run_dir / "analysis" / "heads.parquet", columns=["layer", "q_head", "label"]).to_pylist()
    return {(r["layer"], r["q_head"]): r["label"] for r in t}


def shown_token(text: str) -> str:
    body = text.replace("\n", "↵").replace("\t", "⇥")
    return "␣" * (len(body) - len(body.lstrip(" "))) + body.lstrip(" ")


# ---- the page's geometry ------------------------------------------------------------------------
OVERFLOW = """() => {
  const out = [];
  const page = document.scrollingElement;
  if (page.scrollWidth > innerWidth + 1) out.push(`page ${page.scrollWidth} > ${innerWidth}`);
  for (const p of document.querySelectorAll('.panel, #strip, .heatmap-box')) {
    // a panel's own content fits it: only boxes meant to scroll sideways (.scroll, .table-scroll) may be wider
    for (const n of p.querySelectorAll('*')) {
      if (n.closest('.scroll, .table-scroll, .hovercard')) continue;
      const r = n.getBoundingClientRect(), b = p.getBoundingClientRect();
      if (r.width && r.right > b.right + 1) out.push(`${p.id || p.className} cuts ${n.tagName}.${n.className} (${r.right} > ${b.right})`);
    }
  }
  return out;
}"""


def test_step_answer_carries_each_heads_label_from_lmtrace_heads(wide_server, wide_runs):
    labels = archive_labels(wide_runs / "wide")
    answer = wide_server.json("/api/runs/wide/sequences/0/steps/2")["attention"]["head_labels"]
    assert answer["file"] == "analysis/heads.parquet"
    assert len(answer["labels"]) == LAYERS and all(len(row) == HEADS for row in answer["labels"])
    assert {(layer, head): answer["labels"][layer][head] for layer in range(LAYERS) for head in range(HEADS)} == labels
    assert len(set(labels.values())) > 1  # the heads differ: the test tells labels apart


def test_layer_head_heatmap_fits_a_32_by_32_model_at_1280_and_800_px_with_the_archived_cells(
    wide_server, wide_runs, tmp_path
):
    sync_playwright = _playwright()
    run_dir = wide_runs / "wide"
    shots = shots_dir(tmp_path)
    labels = archive_labels(run_dir)
    texts = archive_texts(run_dir, 1)
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for width in WIDTHS:
            page = browser.new_page(viewport={"width": width, "height": 1000}, accept_downloads=True)
            page.on(
                "console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

            # the runs list and the run's sequences fit the window (tables too wide scroll in their own box)
            page.goto(wide_server.base + "/")
            page.wait_for_selector("#runs tr.run-row")
            assert page.evaluate(OVERFLOW) == []
            page.screenshot(path=str(shots / f"layout-runs-{width}.png"), full_page=True)
            created = page.evaluate("""() => { const c = document.querySelector('#runs td.created'), b = c.closest('.table-scroll');
              b.scrollLeft = b.scrollWidth; const r = c.getBoundingClientRect(), s = b.getBoundingClientRect();
              const text = document.createRange(); text.selectNodeContents(c);
              return [r.left >= s.left - 1, r.right <= s.right + 1, text.getClientRects().length]; }""")
            assert created == [True, True, 1]  # reachable, whole, on one line
            page.goto(wide_server.base + "/#/run/wide")
            page.wait_for_selector("#sequences tr.seq-row")
            assert page.evaluate(OVERFLOW) == []
            page.screenshot(path=str(shots / f"layout-run-{width}.png"), full_page=True)
            # scrolled to its last column, the sequences table keeps its first column in view
            first = page.evaluate("""() => { const b = document.querySelector('#sequences').closest('.table-scroll');
              b.scrollLeft = b.scrollWidth; const c = document.querySelector('#sequences tbody td');
              return c.getBoundingClientRect().left - b.getBoundingClientRect().left; }""")
            assert abs(first) <= 1

            # the sequence whose prompt has long words: the strip wraps, nothing is cut
            page.goto(wide_server.base + "/#/run/wide/seq/1/step/3")
            page.wait_for_selector("#detail[data-step='3'] #attention-heatmap")
            canvas = page.query_selector("#attention-heatmap")
            assert (canvas.get_attribute("data-rows"), canvas.get_attribute("data-cols")) == (str(LAYERS), str(HEADS))
            assert page.evaluate(OVERFLOW) == []
            strip = page.evaluate(
                "() => { const s = document.querySelector('#strip'); return [s.scrollWidth, s.clientWidth]; }"
            )
            assert strip[0] <= strip[1]
            assert "France?" in page.inner_text("#strip")
            # every head's column is inside the panel: the canvas is no wider than its box
            fit = page.evaluate("""() => { const c = document.querySelector('#attention-heatmap').getBoundingClientRect(),
              p = document.querySelector('#attention-panel').getBoundingClientRect(); return [c.left >= p.left, c.right <= p.right]; }""")
            assert fit == [True, True]
            if width == 800:  # the panels stack: the attention panel is below the chosen token's, not beside it
                left = page.evaluate("""() => [document.querySelector('#token-panel').getBoundingClientRect(),
                  document.querySelector('#attention-panel').getBoundingClientRect()].map(r => [r.left, r.top, r.bottom])""")
                assert abs(left[0][0] - left[1][0]) <= 1 and left[1][1] >= left[0][2]
            # 1024 cells: the table of numbers is off until asked for
            assert page.query_selector("#attention-grid") is None

            # the hover card of a few cells: layer, head, key text and position, weight, label
            attn = archive_attention(run_dir, 1, 3)
            for layer, head in ((0, 0), (17, 29), (31, 31)):
                page.mouse.move(*cell_point(page, "#attention-heatmap", layer, head))
                card = page.wait_for_selector(f".hovercard[data-row='{layer}'][data-col='{head}']:not([hidden])")
                lines = dict(x.split(" ", 1) for x in card.inner_text().splitlines())
                key = int(attn[layer, head].argmax())
                assert lines["layer"] == str(layer) and lines["head"] == str(head)
                assert lines["key"] == f"{shown_token(texts[key])} (position {key})"
                assert float(lines["weight"]) == pytest.approx(float(attn[layer, head].max()), abs=5e-5)
                assert lines["label"] == labels[(layer, head)]
            if width == 1280:
                page.mouse.move(*cell_point(page, "#attention-heatmap", 17, 29))
            page.screenshot(path=str(shots / f"layout-token-{width}.png"), full_page=True)

            # a click picks the head: its row over the keys (the archive's) and its pattern below
            page.mouse.click(*cell_point(page, "#attention-heatmap", 17, 29))
            page.wait_for_selector("#head-row .row-keys[data-layer='17'][data-head='29']")
            keys = page.eval_on_selector_all("#head-row .tok.key", "ks => ks.map(k => +k.dataset.w)")
            assert keys == pytest.approx(attn[17, 29].tolist(), abs=1e-6)
            page.wait_for_selector("#head-patterns .pattern[data-layer='17'][data-head='29'] canvas.pattern-image")
            # the keyboard: Shift + arrows walk the heads from there, Enter picks one, ← → still walk the tokens
            page.keyboard.press("Shift+ArrowDown")
            page.keyboard.press("Shift+ArrowRight")
            assert canvas.get_attribute("data-cursor") == "18,30"
            page.keyboard.press("Enter")
            page.wait_for_selector("#head-row .row-keys[data-layer='18'][data-head='30']")
            page.keyboard.press("ArrowRight")
            page.wait_for_selector("#detail[data-step='4'] #attention-heatmap")
            # the view's state is in the address: a reload reopens the step, both picked heads and the cursor
            page.check("#log-scale")
            page.check("#grid-numbers")
            assert (
                page.evaluate("location.hash") == "#/run/wide/seq/1/step/4?log=1&nums=1&heads=17.29%2C18.30&cell=18.30"
            )
            page.reload()
            page.wait_for_selector("#detail[data-step='4'] #attention-grid")
            page.wait_for_selector("#head-patterns .pattern[data-layer='18'][data-head='30'] canvas.pattern-image")
            assert page.eval_on_selector_all(
                "#head-patterns .pattern", "ps => ps.map(p => p.dataset.layer + '.' + p.dataset.head)"
            ) == ["17.29", "18.30"]
            assert page.is_checked("#log-scale") and page.is_checked("#grid-numbers")
            assert page.get_attribute("#attention-heatmap", "data-cursor") == "18,30"
            page.wait_for_selector("#head-row .row-keys[data-layer='18'][data-head='30']")
            # the numbers on demand: every cell, the archive's maximum and label
            attn = archive_attention(run_dir, 1, 4)
            cells = page.eval_on_selector_all(
                "#attention-grid td.cell",
                "cs => cs.map(c => [+c.dataset.layer, +c.dataset.head, +c.dataset.weight, c.dataset.label])",
            )
            assert len(cells) == LAYERS * HEADS
            for layer, head, w, label in cells:
                assert w == pytest.approx(float(attn[layer, head].max()), abs=1e-6) and label == labels[(layer, head)]
            page.uncheck("#grid-numbers")
            page.uncheck("#log-scale")

            # exports: the attention panel's CSV is every cell's numbers, its PNG an image of the panel
            with page.expect_download() as dl:
                page.click("#attention-panel .export-bar .csv")
            rows = list(csv.reader(io.StringIO(Path(dl.value.path()).read_text(encoding="utf-8"))))
            assert rows[0] == ["layer", "head", "key_position", "key_text", "weight", "label"]
            assert len(rows) == 1 + LAYERS * HEADS
            for r in rows[1:]:
                layer, head, key = int(r[0]), int(r[1]), int(r[2])
                assert float(r[4]) == pytest.approx(float(attn[layer, head].max()), abs=1e-6)
                assert attn[layer, head, key] == attn[layer, head].max() and r[5] == labels[(layer, head)]
            with page.expect_download() as dl:
                page.click("#attention-panel .export-bar .png")
            from PIL import Image

            with Image.open(dl.value.path()) as im:
                assert im.width >= 300 and im.height >= 300
                assert len(set(im.convert("RGB").resize((100, 100)).getdata())) > 20  # the heatmap's colours
            # the chosen token's CSV: its alternatives as the run has them (vocab.parquet's texts, exp(alt_logprobs))
            alt_csv = list(csv.reader(io.StringIO(page.evaluate("document.querySelector('#token-panel')._csv()"))))
            alts = alt_csv[alt_csv.index(["alternative", "p"]) + 1 :]
            tok = pq.read_table(run_dir / "tokens.parquet").to_pandas().query("sequence == 1 and step == 4").iloc[0]
            vocab = pq.read_table(run_dir / "vocab.parquet", columns=["id", "text"]).to_pydict()
            vocab = dict(zip(vocab["id"], vocab["text"]))
            assert [a for a, _ in alts] == [vocab[int(i)] for i in tok.alt_ids]
            assert [float(x) for _, x in alts] == pytest.approx(np.exp(tok.alt_logprobs).tolist(), rel=1e-6)
            # every panel of the step has both buttons
            panels = page.eval_on_selector_all(
                "#detail .panel",
                "ps => ps.map(p => [p.id, !!p.querySelector('.export-bar .png'), !!p.querySelector('.export-bar .csv')])",
            )
            assert {pid for pid, _, _ in panels} >= {"token-panel", "lens-panel", "attention-panel", "dla-panel"}
            assert all(png and csv_ for _, png, csv_ in panels), panels
            # the DLA's signed scale has its legend, from -max to +max of the step's values (the archive's)
            dla = np.asarray(
                zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")["head_dla"][1, 4], dtype=np.float64
            )
            hi = float(page.get_attribute("#dla-panel .scale-legend.signed", "data-hi"))
            assert hi == pytest.approx(float(np.abs(dla).max()), rel=1e-6)
            page.screenshot(path=str(shots / f"layout-heads-{width}.png"), full_page=True)
            page.close()
        browser.close()
    assert problems == []


def test_report_marks_the_layers_it_embeds_and_keeps_arrow_keys_after_a_click(wide_runs, tmp_path):
    """The report of the 32 × 32 run with --layer 3: the grid hatches the other layers' rows and says
    which it embeds; a cell of another layer gives a note (no error box); ← → keep walking the tokens
    after clicks in the grid."""
    from lmtrace.report import report_run

    sync_playwright = _playwright()
    run_dir = wide_runs / "wide"
    out = report_run(str(run_dir), out=tmp_path / "report.html", sequences=[1], layers=[3], attention_step=1).path
    shots = shots_dir(tmp_path)
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for width in WIDTHS:
            page = browser.new_page(viewport={"width": width, "height": 1000})
            page.on(
                "console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(out.as_uri())
            page.wait_for_selector("#s1-detail[data-step='1'] #s1-attention-heatmap")
            note = page.inner_text("#s1-embedded-layers")
            assert "layer 3;" in note and "layers 0, 1, 2, 4," in note
            fit = page.evaluate("""() => { const c = document.querySelector('#s1-attention-heatmap').getBoundingClientRect(),
              p = document.querySelector('#s1-attention-panel').getBoundingClientRect(); return [c.left >= p.left, c.right <= p.right]; }""")
            assert fit == [True, True]
            # a head of layer 3: its row; of layer 5: a note, not an error
            page.mouse.click(*cell_point(page, "#s1-attention-heatmap", 3, 7))
            page.wait_for_selector("#s1-head-row .row-keys[data-layer='3'][data-head='7']")
            keys = page.eval_on_selector_all("#s1-head-row .tok.key", "ks => ks.map(k => +k.dataset.w)")
            assert keys == pytest.approx(archive_attention(run_dir, 1, 1)[3, 7].tolist(), abs=5.1e-5)
            page.mouse.click(*cell_point(page, "#s1-attention-heatmap", 5, 0))
            assert (
                "layer 5, head 0 is not embedded" in page.wait_for_selector("#s1-head-row .not-embedded").inner_text()
            )
            assert page.query_selector("#s1-detail .error") is None
            page.screenshot(path=str(shots / f"layout-report-{width}.png"), full_page=True)
            # after those clicks (the focus is on the grid) → still walks the tokens
            page.keyboard.press("ArrowRight")
            page.wait_for_selector("#s1-detail[data-step='2'] #s1-attention-heatmap")
            page.keyboard.press("ArrowLeft")
            page.wait_for_selector("#s1-detail[data-step='1'] #s1-attention-heatmap")
            page.close()
        browser.close()
    assert problems == []
