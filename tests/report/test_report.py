"""`lmtrace report`: the page's numbers are the archive's, read back from the page itself; the
page works offline in a real headless Chromium; every kind of run gets the sections it has data for.

The numbers are decoded here with base64 + numpy (not with lmtrace.report.blobs) and compared
with the archive read through zarr / pyarrow directly, and token texts with the tokenizer's own
decoding.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import zarr

from tests.helpers.browser import CHROMIUM, distinct_colours, external_urls, open_page, section_shots
from tests.helpers.cli import assert_one_line_error, lmtrace
from tests.helpers.page import blob, page_json
from tests.helpers.runs import PROMPTS, run_spec, with_lens

REPO = Path(__file__).resolve().parents[2]
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's `chromium` is not installed (.ci/run installs it when run as root)"
)


def token_spans(page: str) -> list[dict]:
    spans = re.findall(
        r"<span class='tok' style='[^']*' data-seq='(\d+)' data-step='(\d+)' data-prob='([^']*)' "
        r"title='[^']*'>(.*?)</span>",
        page,
        re.S,
    )
    return [{"seq": int(a), "step": int(b), "prob": float(c), "text": html.unescape(d)} for a, b, c, d in spans]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_llama_dir):
    run = run_spec(
        tmp_path_factory.mktemp("report"),
        {
            "model": str(tiny_llama_dir),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 7, "batch_size": 3, "temperature": 0.8, "top_k": 20, "seed": 3},
            "capture": {"prefill_attention": True, "head_dla": True},
            "output": {"chunk_steps": 3},
        },
    )
    return with_lens(run)


@pytest.fixture(scope="module")
def tiny_report(tiny_run, tmp_path_factory):
    from lmtrace.report import report_run

    result = report_run(str(tiny_run.path), sequences=[0, 2], layers=[1, 3])
    return tiny_run, result.path.read_text(encoding="utf-8")


def test_token_strip_holds_each_generated_token_with_its_archived_probability(tiny_report, tiny_llama_dir):
    from transformers import AutoTokenizer

    run, page = tiny_report
    tokens = pq.read_table(run.path / "tokens.parquet").to_pylist()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    spans = token_spans(page)
    assert {s["seq"] for s in spans} == {0, 2}
    for seq in (0, 2):
        gen = sorted((r for r in tokens if r["sequence"] == seq and not r["is_prompt"]), key=lambda r: r["step"])
        shown = [s for s in spans if s["seq"] == seq]
        assert [s["step"] for s in shown] == [r["step"] for r in gen]
        assert [s["text"] for s in shown] == [tok.decode([r["token_id"]]) for r in gen]
        assert [s["prob"] for s in shown] == [r["prob"] for r in gen]  # float32 values, exactly
    # the tooltip's alternatives are the tokenizer's texts of alt_ids
    first = next(r for r in tokens if r["sequence"] == 0 and r["step"] == 0)
    title = html.unescape(re.search(r"data-seq='0' data-step='0' data-prob='[^']*' title='([^']*)'", page).group(1))
    alts = title.split("alternatives: ")[1].split(" · ")
    assert [a.rsplit(" ", 1)[0] for a in alts] == [repr(tok.decode([i]).replace("\n", "⏎")) for i in first["alt_ids"]]
    assert [float(a.rsplit(" ", 1)[1]) for a in alts] == pytest.approx(
        [math.exp(x) for x in first["alt_logprobs"]], rel=2e-3
    )


def test_attention_figures_hold_the_archived_rows(tiny_report):
    run, page = tiny_report
    blobs = page_json(page, "lmtrace-blobs")
    attn = zarr.open_group(str(run.path / "tensors.zarr"), mode="r")["attn"]
    prompt_len = zarr.open_group(str(run.path / "tensors.zarr"), mode="r")["prompt_len"][:]
    n = pq.read_table(run.path / "sequences.parquet").to_pydict()
    gen_len = dict(zip(n["sequence"], n["generated_len"]))
    for seq in (0, 2):
        last = gen_len[seq] - 1
        keys = int(prompt_len[seq]) + last
        grid = blob(blobs, f"attn_grid_{seq}")
        np.testing.assert_array_equal(grid, np.asarray(attn[seq, last, :, :, :keys]).reshape(-1, keys))
        for layer in (1, 3):
            for head in range(4):
                z = blob(blobs, f"attn_steps_{seq}_L{layer}_H{head}")
                for s in range(gen_len[seq]):
                    ctx = int(prompt_len[seq]) + s
                    np.testing.assert_array_equal(z[s, :ctx], attn[seq, s, layer, head, :ctx])
                    assert np.isnan(z[s, ctx:]).all()
    figs = {f["id"]: f for f in page_json(page, "lmtrace-figures")}
    assert {"attn-grid-0", "attn-steps-0", "prefill-0", "attn-grid-2"} <= set(figs)
    labels = [v["label"] for v in figs["attn-steps-0"]["variants"]]
    assert labels[:3] == ["layer 1: mean over heads", "layer 1: max over heads", "layer 1, head 0"]
    prefill = zarr.open_group(str(run.path / "tensors.zarr"), mode="r")["prefill_attn"]
    p = int(prompt_len[0])
    np.testing.assert_array_equal(blob(blobs, "prefill_0_L3_H2"), prefill[0, 3, 2, :p, :p])


def test_logit_lens_grid_holds_the_archived_lens_with_token_texts(tiny_report, tiny_llama_dir):
    from transformers import AutoTokenizer

    run, page = tiny_report
    blobs = page_json(page, "lmtrace-blobs")
    group = zarr.open_group(str(run.path / "tensors.zarr"), mode="r")
    n = int(pq.read_table(run.path / "sequences.parquet").to_pydict()["generated_len"][0])
    probs = group["lens_probs"][0, :n]
    ids = group["lens_ids"][0, :n]
    np.testing.assert_array_equal(blob(blobs, "lens_top1_prob_0"), probs[:, :, 0].T)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    texts = blob(blobs, "lens_top1_text_0")
    expected = np.vectorize(
        lambda i: (tok.decode([int(i)]).replace("\n", "⏎").replace("\t", "⇥") or "∅")[:8], otypes=[object]
    )(ids[:, :, 0].T)
    assert (texts == expected).all()


def test_report_in_a_real_browser_offline_renders_every_figure(tiny_report, tmp_path):
    if CHROMIUM is None:
        pytest.skip("Debian's `chromium` is not installed (.ci/run installs it when run as root)")
    run, page = tiny_report
    visit = open_page(run.path / "report.html", tmp_path)
    n_figures = len(page_json(page, "lmtrace-figures"))
    body = re.search(r"<body[^>]*>", visit.dom).group(0)
    assert f'data-rendered="{n_figures}"' in body, body
    assert "data-errors" not in body, body
    assert visit.console == [], visit.console
    assert visit.requests == [], visit.requests
    assert distinct_colours(visit.screenshot) > 20
    spans = token_spans(page)
    dom_text = html.unescape(re.sub(r"<[^>]+>", "", visit.dom))
    for s in spans:
        assert s["text"] in dom_text
    assert visit.dom.count('class="main-svg"') >= n_figures  # plotly drew an SVG per figure


def test_the_browser_check_catches_a_request_and_a_script_error(tmp_path):
    """The offline check above can fail: a page that fetches and throws is caught."""
    if CHROMIUM is None:
        pytest.skip("Debian's `chromium` is not installed")
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><img src='http://192.0.2.1/x.png'><script>undefinedFunction()</script></body></html>")
    visit = open_page(bad, tmp_path / "visit")
    assert visit.requests == ["http://192.0.2.1/x.png"]
    assert any("undefinedFunction" in line for line in visit.console)


def test_page_has_no_external_address_outside_the_vendored_plotly(tiny_report):
    from lmtrace.report.page import plotly_js

    _, page = tiny_report
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert external_urls(page.replace(plotly_js(), "")) == []


def test_a_report_is_built_without_loading_the_web_server(tiny_run, tmp_path):
    """The report reads what its token view shows through viewdata, never through serve: building a page
    (the token view's script included) in a fresh interpreter imports neither lmtrace.serve nor starlette."""
    import subprocess
    import sys

    code = (
        "import sys; from lmtrace.report import report_run; "
        f"page = report_run({str(tiny_run.path)!r}, out={str(tmp_path / 'r.html')!r}, sequences=[0]).path.read_text(); "
        "assert 'window.lmtraceView' in page, 'no token view on the page'; "
        "print(sorted(m for m in sys.modules if m.startswith(('lmtrace.serve', 'starlette'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_capture_none_run_gets_the_text_sections_only(tmp_path, tiny_llama_dir):
    from lmtrace.report import report_run

    run = run_spec(
        tmp_path,
        {"model": str(tiny_llama_dir), "prompts": PROMPTS[:1], "capture": "none", "generation": {"max_new_tokens": 4}},
    )
    page = report_run(str(run.path)).path.read_text()
    assert page_json(page, "lmtrace-figures") == []
    assert len(token_spans(page)) == 4
    assert "forward-only (`capture: none`)" in html.unescape(page)


def test_deferred_lens_not_computed_names_the_command(tmp_path, tiny_llama_dir):
    from lmtrace.report import report_run

    run = run_spec(
        tmp_path, {"model": str(tiny_llama_dir), "prompts": PROMPTS[:1], "generation": {"max_new_tokens": 3}}
    )
    page = html.unescape(report_run(str(run.path)).path.read_text())
    assert f"run `lmtrace lens {run.id}`" in page
    assert not any(f["id"].startswith("lens-") for f in page_json(page, "lmtrace-figures"))


def test_intervention_child_and_explanations_get_their_sections(tiny_run, tiny_llama_dir):
    import pyarrow.parquet as pq

    from lmtrace.commands.explain import explain_run
    from lmtrace.commands.intervene import run_intervene
    from lmtrace.report import report_run

    result, effects = run_intervene(str(tiny_run.path), [{"kind": "ablate_head", "layer": 1, "head": 2}])
    explain_run(str(result.run_dir), "0,2", sequence=0, methods=["grad_x_input"])
    page = report_run(str(result.run_dir), sequences=[0]).path.read_text()
    blobs = page_json(page, "lmtrace-blobs")
    eff = pq.read_table(result.run_dir / "effects.parquet").to_pandas()
    eff = eff[eff.sequence == 0].sort_values("step")
    np.testing.assert_array_equal(blob(blobs, "effects_shift_0"), eff.logprob_shift.astype("float32").to_numpy())
    assert "ablate_head" in page
    scores = pq.read_table(next((result.run_dir / "explain" / "scores.parts").glob("*.parquet"))).to_pandas()
    raw = blob(blobs, "explain_raw_0")
    step2 = scores[scores.step == 2].sort_values("position")
    np.testing.assert_array_equal(raw[1, : len(step2)], step2.score.to_numpy())


def test_attributions_that_did_not_converge_are_marked(tiny_run):
    """An integrated-gradients result whose completeness check failed is labelled so on its row, with a note."""
    from lmtrace.analysis.attribution import Settings
    from lmtrace.commands.explain import explain_run
    from lmtrace.report import report_run

    explain_run(str(tiny_run.path), "1", sequence=0, methods=["grad_x_input"])
    explain_run(
        str(tiny_run.path),
        "1",
        sequence=0,
        methods=["integrated_gradients"],  # a 2-point grid cannot meet 1e-9
        settings=Settings(ig_rule="midpoint", ig_steps=2, ig_tolerance=1e-9),
    )
    manifest = json.loads((tiny_run.path / "manifest.json").read_text())
    assert [r["converged"] for e in manifest["explain"] for r in e["results"] if e["method"] != "grad_x_input"] == [
        False
    ]
    page = report_run(str(tiny_run.path), sequences=[0]).path.read_text()
    rows = list(blob(page_json(page, "lmtrace-blobs"), "explain_rows_0"))
    assert [r.startswith("NOT CONVERGED") for r in rows] == ["integrated_gradients" in r for r in rows] and len(
        rows
    ) == 2
    assert "rows marked NOT CONVERGED" in page


def test_attribution_rows_are_labelled_by_method_and_target_with_the_ids_in_a_note(tiny_run):
    """Rows say step, method, target and the explained token, never an unexplained id; two invocations of one
    method at one step are numbered, and a note says which explain id each number is."""
    from lmtrace.analysis.attribution import Settings
    from lmtrace.commands.explain import explain_run
    from lmtrace.report import report_run

    seq = 2  # a sequence no other test explains
    first = explain_run(str(tiny_run.path), "1", sequence=seq, methods=["grad_x_input", "rollout"])
    second = explain_run(str(tiny_run.path), "1", sequence=seq, methods=["grad_x_input"])
    contrast = explain_run(
        str(tiny_run.path),
        "1",
        sequence=seq,
        methods=["grad_x_input"],
        settings=Settings(target="contrast", quantity="logprob"),
    )
    page = html.unescape(report_run(str(tiny_run.path), sequences=[seq]).path.read_text())
    rows = list(blob(page_json(page, "lmtrace-blobs"), f"explain_rows_{seq}"))
    token = first.explanations[0].target_text.replace("\n", "⏎").replace("\t", "⇥").replace("\r", "␍") or "∅"
    ids = [first.explain_id, second.explain_id, contrast.explain_id]
    assert len(rows) == 4 and len(set(rows)) == 4
    assert not any(i[-4:] in r or i in r for r in rows for i in ids), rows  # no id fragments in the labels
    assert sorted(r for r in rows if "(chosen logit)" in r) == [
        f"s1 grad_x_input (chosen logit) {token} [1]",
        f"s1 grad_x_input (chosen logit) {token} [2]",
    ]
    assert [r for r in rows if "contrast" in r] == [f"s1 grad_x_input (contrast logprob) {token}"]
    assert [r for r in rows if "rollout" in r] == [f"s1 attention_rollout {token}"]
    order = sorted(ids[:2])  # invocations are numbered in the order of their ids (creation time)
    assert f"[1] = explain {order[0]}, [2] = explain {order[1]}" in page


def test_compare_report_and_compare_html_write_the_same_figures(tmp_path, tiny_llama_dir):
    base = {"model": str(tiny_llama_dir), "prompts": PROMPTS[:2], "generation": {"max_new_tokens": 5, "batch_size": 2}}
    a = run_spec(tmp_path / "a", {**base, "output": {"run_id": "cmp-a"}})
    b = run_spec(
        tmp_path / "b",
        {**base, "generation": {**base["generation"], "temperature": 1.5, "seed": 7}, "output": {"run_id": "cmp-b"}},
    )
    out = tmp_path / "c.html"
    proc = lmtrace(tmp_path, "report", str(a.path), str(b.path), "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["path"] == str(out)
    page = out.read_text()
    ids = {f["id"] for f in page_json(page, "lmtrace-figures")}
    assert {"cmp-timeline-0", "cmp-timeline-1", "cmp-layers", "cmp-heads"} <= ids
    from lmtrace.analysis.compare import compare_runs

    cmp = compare_runs(str(a.path), str(b.path))
    js = [r["js"] for r in cmp.per_step.to_pylist() if r["pair"] == 0 and r["context_identical"]]
    np.testing.assert_allclose(
        blob(page_json(page, "lmtrace-blobs"), "cmp_js_0"),
        np.asarray([np.nan if v is None else v for v in js], dtype=np.float32),
    )
    out2 = tmp_path / "c2.html"
    proc = lmtrace(tmp_path, "compare", str(a.path), str(b.path), "--html", str(out2))
    assert proc.returncode == 0, proc.stderr
    assert {f["id"] for f in page_json(out2.read_text(), "lmtrace-figures")} == ids


def test_compare_page_draws_the_paired_steps_only(tmp_path, tiny_llama_dir):
    """The divergence timeline compares identical contexts only: up to and including the first divergence.
    Checked against both archives' tokens.parquet read with pyarrow."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        json.dumps(
            {"model": str(tiny_llama_dir), "prompts": PROMPTS[:2], "generation": {"max_new_tokens": 6, "batch_size": 2}}
        )
    )
    assert lmtrace(tmp_path, "generate", str(spec), "-q", "--run-id", "greedy").returncode == 0
    proc = lmtrace(tmp_path, "intervene", "greedy", "--temperatures", "1.5", "--from-step", "2", "-q")
    assert proc.returncode == 0, proc.stderr
    child = proc.stdout.strip()
    out = tmp_path / "c.html"
    assert lmtrace(tmp_path, "report", "greedy", child, "--out", str(out), "-q").returncode == 0
    blobs = page_json(out.read_text(), "lmtrace-blobs")
    titles = {f["id"]: f["title"] for f in page_json(out.read_text(), "lmtrace-figures")}

    def generated(run_id):
        t = pq.read_table(tmp_path / "runs" / run_id / "tokens.parquet").to_pandas()
        return t[~t.is_prompt].sort_values(["sequence", "step"])

    a, b = generated("greedy"), generated(child)
    for seq in (0, 1):
        ta, tb = a[a.sequence == seq].reset_index(drop=True), b[b.sequence == seq].reset_index(drop=True)
        differ = np.flatnonzero(ta.token_id.to_numpy() != tb.token_id.to_numpy())
        assert differ.size and 2 <= differ[0] < len(ta) - 1, differ  # steps after the divergence exist
        first = int(differ[0])
        np.testing.assert_array_equal(blob(blobs, f"cmp_steps_{seq}"), np.arange(first + 1))
        expected = [float(tb.logprob[s] - ta.logprob[s]) for s in range(first)]  # the same token on both sides
        under_b = dict(zip(tb.alt_ids[first], tb.alt_logprobs[first]))  # A's token in B's distribution
        expected.append(
            float(under_b[ta.token_id[first]] - ta.logprob[first]) if ta.token_id[first] in under_b else np.nan
        )
        np.testing.assert_allclose(
            blob(blobs, f"cmp_dlp_{seq}"), np.asarray(expected, np.float32), rtol=1e-5, atol=1e-6
        )
        assert "identical contexts" in titles[f"cmp-timeline-{seq}"]


def test_report_sequence_takes_ranges_and_all_as_steps_do(tmp_path, tiny_run):
    for given, expected in ((["all"], {0, 1, 2}), (["1-2"], {1, 2}), (["0,2"], {0, 2}), (["2", "0-1"], {0, 1, 2})):
        out = tmp_path / "r.html"
        args = [a for x in given for a in ("-s", x)]
        proc = lmtrace(tmp_path, "report", str(tiny_run.path), *args, "--out", str(out), "-q")
        assert proc.returncode == 0 and proc.stdout == "", proc.stderr
        assert {t["seq"] for t in token_spans(out.read_text())} == expected, given


def test_report_cli_errors_are_one_line(tmp_path, tiny_run):
    (tmp_path / "runs").mkdir()  # a runs directory without that run (a missing directory is its own error)
    assert_one_line_error(lmtrace(tmp_path, "report", "no-such-run"), 2, "no-such-run")
    assert_one_line_error(lmtrace(tmp_path, "report", str(tiny_run.path), "--sequence", "9"), 2, "--sequence 9")
    assert_one_line_error(lmtrace(tmp_path, "report", str(tiny_run.path), "--sequence", "0-9"), 2, "--sequence 3")
    assert_one_line_error(lmtrace(tmp_path, "report", str(tiny_run.path), "-s", "x"), 2, "--sequence 'x'")
    assert_one_line_error(lmtrace(tmp_path, "report", str(tiny_run.path), "--steps", "0-99"), 2, "out of range")
    assert_one_line_error(lmtrace(tmp_path, "report", str(tiny_run.path), "--layer", "17"), 2, "--layer 17")


def test_still_images_are_written_for_every_figure(tiny_run, tmp_path):
    from lmtrace.report import report_run

    result = report_run(str(tiny_run.path), out=tmp_path / "r.html", sequences=[1], png_dir=tmp_path / "png")
    figures = page_json(result.path.read_text(), "lmtrace-figures")
    assert sorted(p.name for p in result.images) == sorted(f"{f['id']}.png" for f in figures)
    for p in result.images:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and distinct_colours(p) > 5
    svg = report_run(
        str(tiny_run.path), out=tmp_path / "r2.html", sequences=[1], png_dir=tmp_path / "svg", image_format="svg"
    )
    assert all(p.read_text().lstrip().startswith("<?xml") for p in svg.images)


def test_large_runs_embed_a_stride_of_steps_and_say_so():
    from lmtrace.report.selection import select

    sel = select(n_sequences=5, committed={s: 1000 for s in range(5)}, captured_layers=list(range(30)))
    assert sel.sequences == [0, 1] and sel.layers == [0, 15, 29]
    assert sel.steps[0] == list(range(0, 1000, 4)) and sel.attention_step[0] == 996
    assert sel.heatmap_steps[0] == list(range(0, 1000, 8))
    assert any("--sequence" in n for n in sel.notes) and any("every 4th of its 1000 steps" in n for n in sel.notes)
    assert any("one row for every 2nd step shown (125 rows)" in n for n in sel.notes)
    sel = select(
        n_sequences=5, committed={s: 1000 for s in range(5)}, captured_layers=[0, 1], steps="10-20:5", sequences=[3]
    )
    assert sel.steps == {3: [10, 15, 20]} and sel.notes == []


def test_killed_run_report_shows_the_committed_steps_under_a_banner(tmp_path, tiny_llama_dir):
    from tests.helpers.cli import start_cli as _cli
    from tests.helpers.cli import wait_committed as _wait_committed

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"model: {tiny_llama_dir}\nprompts: ['Count slowly from one to one hundred:']\n"
        "generation: {max_new_tokens: 400, eos_token_id: 0}\noutput: {chunk_steps: 4}\n"
    )
    runs = tmp_path / "runs"
    proc = _cli(["generate", str(spec)], runs)
    run_dir = _wait_committed(runs, 8)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    result = lmtrace(tmp_path, "report", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    page = Path(json.loads(result.stdout)["path"]).read_text()
    committed = json.loads((run_dir / "progress" / "shard-0-of-1.json").read_text())["batches"]["0"]["committed_steps"]
    assert "This run is <b>running</b>, not complete" in page
    assert len(token_spans(page)) == committed
    assert (
        blob(page_json(page, "lmtrace-blobs"), "lens_top1_prob_0").shape[1] == committed
        if "lens_top1_prob_0" in page
        else True
    )


@pytest.mark.slow
def test_demo_report_in_chromium_and_its_screenshots(tmp_path):
    """The embedded model, as `make demo` runs it; screenshots for docs/report.md when
    LMTRACE_DOC_SCREENSHOTS=1 (they are taken in tmp_path otherwise)."""
    if CHROMIUM is None:
        pytest.skip("Debian's `chromium` is not installed (.ci/run installs it when run as root)")
    proc = lmtrace(
        tmp_path,
        "generate",
        str(REPO / "configs" / "demo.yaml"),
        "--run-id",
        "demo",
        "--set",
        "capture.prefill_attention=true",
        "--set",
        "capture.head_dla=true",
        "-q",
    )
    assert proc.returncode == 0, proc.stderr
    assert lmtrace(tmp_path, "lens", "demo", "-q").returncode == 0
    proc = lmtrace(tmp_path, "report", "demo", "--json")
    assert proc.returncode == 0, proc.stderr
    path = Path(json.loads(proc.stdout)["path"])
    page = path.read_text()
    visit = open_page(path, tmp_path / "browser", height=1800, shot_name="report-top.png")
    assert visit.console == [] and visit.requests == []
    assert f'data-rendered="{len(page_json(page, "lmtrace-figures"))}"' in visit.dom
    assert " Paris" in html.unescape(visit.dom)
    assert distinct_colours(visit.screenshot) > 50
    shots = section_shots(
        path,
        tmp_path / "sections",
        {f"report-{name}.png": f"sec-{name}" for name in ("tokens", "attention", "lens", "layers", "dla")},
    )
    for shot in shots.values():
        assert distinct_colours(shot) > 50
    if os.environ.get("LMTRACE_DOC_SCREENSHOTS") == "1":
        for shot in [visit.screenshot, *shots.values()]:
            shutil.copy(shot, REPO / "docs" / "img" / shot.name)


def test_moe_run_gets_its_routing_grid(tmp_path, tiny_llama_dir):
    import torch
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    from lmtrace.report import report_run

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    path = tmp_path / "tiny-mixtral"
    MixtralForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    run = run_spec(tmp_path, {"model": str(path), "prompts": PROMPTS[:1], "generation": {"max_new_tokens": 4}})
    page = report_run(str(run.path)).path.read_text()
    blobs = page_json(page, "lmtrace-blobs")
    idx = zarr.open_group(str(run.path / "tensors.zarr"), mode="r")["router_topk_idx"][0, :4]
    np.testing.assert_array_equal(blob(blobs, "router_top1_0"), idx[:, :, 0].T.astype(np.float32))
    text = blob(blobs, "router_text_0")
    assert text[1, 2] == ",".join(str(e) for e in idx[2, 1])


def test_topk_attention_run_is_drawn_with_the_other_keys_at_zero(tmp_path, tiny_llama_dir):
    from lmtrace.report import report_run

    run = run_spec(
        tmp_path,
        {
            "model": str(tiny_llama_dir),
            "prompts": PROMPTS[:1],
            "generation": {"max_new_tokens": 4},
            "capture": {"attention": {"top_k": 3}},
        },
    )
    page = report_run(str(run.path)).path.read_text()
    group = zarr.open_group(str(run.path / "tensors.zarr"), mode="r")
    idx, prob = group["attn_topk_idx"][0, 3], group["attn_topk_prob"][0, 3]  # [layer, head, k] at the last step
    keys = int(group["prompt_len"][0]) + 3
    expected = np.zeros((4, 4, keys), dtype=prob.dtype)
    for layer in range(4):
        for head in range(4):
            for i, p in zip(idx[layer, head], prob[layer, head]):
                if i >= 0:
                    expected[layer, head, i] = p
    np.testing.assert_array_equal(blob(page_json(page, "lmtrace-blobs"), "attn_grid_0"), expected.reshape(16, keys))
    assert "other keys show as 0" in page


# What a person does on the page: pick every view of every figure. Injected into a copy of the page.
TRY_EVERY_VIEW = """<script>(async () => {
  const wait = ms => new Promise(r => setTimeout(r, ms));
  while (!document.body.dataset.rendered) await wait(50);
  let n = 0;
  for (const sel of document.querySelectorAll(".fig select")) {
    for (let i = sel.options.length - 1; i >= 0; i--) {
      sel.selectedIndex = i; sel.dispatchEvent(new Event("change")); await wait(30); n++;
    }
  }
  await wait(300);
  document.body.dataset.viewsTried = String(n);
})();</script>"""


def test_every_view_of_every_figure_draws_in_the_browser(tiny_report, tmp_path):
    if CHROMIUM is None:
        pytest.skip("Debian's `chromium` is not installed (.ci/run installs it when run as root)")
    _, page = tiny_report
    figures = page_json(page, "lmtrace-figures")
    views = sum(len(f["variants"]) for f in figures if len(f["variants"]) > 1)
    assert views > 20
    copy = tmp_path / "views.html"
    copy.write_text(page.replace("</body>", TRY_EVERY_VIEW + "</body>"))
    visit = open_page(copy, tmp_path / "visit")
    body = re.search(r"<body[^>]*>", visit.dom).group(0)
    assert f'data-views-tried="{views}"' in body, body
    assert "data-errors" not in body and visit.console == [], visit.console


def test_head_classification_is_drawn_from_heads_parquet(tiny_run, tmp_path):
    from lmtrace.report import report_run
    from lmtrace.report.analysis_sections import HEAD_LABELS

    assert "lmtrace heads" in html.unescape(
        report_run(str(tiny_run.path), out=tmp_path / "before.html").path.read_text()
    )  # the note names the command
    proc = lmtrace(tmp_path, "heads", str(tiny_run.path), "--json")
    assert proc.returncode == 0, proc.stderr
    page = report_run(str(tiny_run.path), out=tmp_path / "after.html").path.read_text()
    blobs = page_json(page, "lmtrace-blobs")
    heads = pq.read_table(tiny_run.path / "analysis" / "heads.parquet").to_pylist()
    label, sink = blob(blobs, "heads_label"), blob(blobs, "heads_sink_score")
    for r in heads:
        assert label[r["layer"], r["q_head"]] == HEAD_LABELS.index(r["label"])
        assert sink[r["layer"], r["q_head"]] == np.float32(r["sink_score"])


def test_head_dla_is_drawn_mean_and_at_the_attention_step_and_renders(tiny_report, tmp_path):
    """The DLA section's layer × head grids are the archive's `head_dla` / `head_dla_logit` (read with
    zarr): mean over each sequence's steps and at the attention grid's step (the browser tests above draw
    every figure and view of this page, the demo test screenshots the section)."""
    run, page = tiny_report
    blobs = page_json(page, "lmtrace-blobs")
    figures = {f["id"]: f for f in page_json(page, "lmtrace-figures")}
    tokens = pq.read_table(run.path / "tokens.parquet").to_pandas()
    for seq in (0, 2):
        n = int((~tokens[tokens.sequence == seq].is_prompt).sum())
        labels = [v["label"] for v in figures[f"dla-{seq}"]["variants"]]
        assert len(labels) == 4 and labels[0].endswith(f"mean over {n} steps"), labels
        step = int(labels[1].rsplit(" ", 1)[1])
        assert step == n - 1  # the attention grid's default step: the last one shown
        for name in ("head_dla", "head_dla_logit"):
            archived = zarr.open_array(str(run.path / "tensors.zarr" / name), mode="r")[seq, :n]
            np.testing.assert_allclose(blob(blobs, f"{name}_{seq}_mean"), archived.mean(0), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(blob(blobs, f"{name}_{seq}_step{step}"), archived[step])


def test_sweep_heatmap_is_the_mean_over_every_row_as_in_the_terminal_heads_and_effects_zarr(tiny_llama_dir, tmp_path):
    """A head sweep over a run whose sequences end at different steps (an eos): the report's heatmap,
    the sweep's ranking (`--json`, what the terminal table prints), `lmtrace heads`' sweep_effect and
    effects.zarr all give each head's mean effect over every (sequence, step) row of sweep.parquet,
    computed here with pandas; the mean of per-sequence means (sweep_mean.parquet), which weighs a
    short sequence's steps more, differs from it here, so a page drawing that would fail."""
    import pandas as pd

    from lmtrace.report import report_run

    gen = {"max_new_tokens": 6, "batch_size": 3, "temperature": 0.8, "top_k": 20, "seed": 3}
    base = run_spec(
        tmp_path / "base", {"model": str(tiny_llama_dir), "prompts": PROMPTS, "capture": "none", "generation": gen}
    )
    t = base.tokens().to_pandas()
    eos = int(t[(t.sequence == 0) & ~t.is_prompt].sort_values("step").token_id.iloc[1])
    run = run_spec(
        tmp_path,
        {
            "model": str(tiny_llama_dir),
            "prompts": PROMPTS,
            "generation": {**gen, "eos_token_id": eos},
            "capture": {"lens": {"enabled": False}},
            "output": {"run_id": "ragged"},
        },
    )
    lengths = run.sequences().to_pandas().generated_len.tolist()
    assert len(set(lengths)) > 1, lengths  # the point of the test: sequences with different numbers of steps
    proc = lmtrace(
        tmp_path,
        "sweep",
        str(run.path),
        "--over",
        "heads",
        "--edit",
        "zero",
        "--metric",
        "logprob",
        "--metric",
        "kl",
        "--top",
        "16",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    sweep_dir = Path(summary["path"])
    long = pd.read_parquet(sweep_dir / "sweep.parquet")
    assert sorted(long.groupby("sequence").step.nunique().tolist()) == sorted(lengths)
    proc = lmtrace(tmp_path, "heads", str(run.path), "--json")
    assert proc.returncode == 0, proc.stderr
    heads = {(h["layer"], h["q_head"]): h["sweep_effect"] for h in json.loads(proc.stdout)["heads"]}
    page = report_run(str(run.path), out=tmp_path / "r.html").path.read_text()
    blobs = page_json(page, "lmtrace-blobs")
    figs = {f["id"]: f for f in page_json(page, "lmtrace-figures")}
    assert [v["label"].split(":")[0] for v in figs["sweep-0"]["variants"]] == ["logprob", "kl"]
    effects = zarr.open_group(str(sweep_dir / "effects.zarr"), mode="r")
    per_sequence = pd.read_parquet(sweep_dir / "sweep_mean.parquet")
    for metric in ("logprob", "kl"):
        own = long[long.metric == metric].groupby(["layer", "q_head"]).effect.mean()  # every (sequence, step) row
        grid = blob(blobs, f"sweep_0_{metric}")
        archived = effects[f"effect_{metric}"][...]
        assert grid.shape == archived.shape == (4, 4)
        np.testing.assert_array_equal(grid, archived)
        for (layer, head), value in own.items():
            assert grid[int(layer), int(head)] == pytest.approx(value, rel=1e-5, abs=1e-9), (metric, layer, head)
        if metric == "logprob":
            top = {(r["layer"], r["q_head"]): r["effect"] for r in summary["top"]}
            assert len(top) == 16
            for key, value in own.items():
                key = (int(key[0]), int(key[1]))
                assert top[key] == pytest.approx(value, rel=1e-12, abs=1e-15)
                assert np.float32(top[key]) == grid[key]
                assert heads[key] == pytest.approx(value, rel=1e-6, abs=1e-9)
        old = per_sequence[per_sequence.metric == metric].groupby(["layer", "q_head"]).effect.mean()
        assert (np.abs(old - own) > 1e-3 * np.abs(own).max()).any()  # the other average really is another number


def test_attention_step_past_a_sequences_end_starts_it_at_its_last_step():
    from lmtrace.exits.errors import SpecError
    from lmtrace.report.selection import select

    sel = select(
        n_sequences=3, committed={0: 30, 1: 8, 2: 20}, captured_layers=[0, 1], sequences=["0-2"], attention_step=20
    )
    assert sel.attention_step == {0: 20, 1: 7, 2: 19}
    assert [n for n in sel.notes if "--attention-step" in n] == [
        "sequence 1 has steps 0..7: its token view and attention grid start at its last step, not --attention-step 20",
        "sequence 2 has steps 0..19: its token view and attention grid start at its last step, not --attention-step 20",
    ]
    with pytest.raises(SpecError, match="--attention-step -1"):
        select(n_sequences=3, committed={0: 30}, captured_layers=[0], attention_step=-1)


def test_token_view_steps_are_a_stride_with_the_first_selected_step():
    from lmtrace.report.token_view import rounded, view_steps

    assert view_steps(list(range(64)), 63, 40) == list(range(0, 64, 2)) + [63]
    assert view_steps(list(range(10)), 4) == list(range(10))
    assert rounded({"a": [0.123456, 1234.5678], "b": "x"}) == {"a": [0.1235, 1235.0], "b": "x"}
    assert rounded([0.000041, 0.5], decimals=4) == [0.0, 0.5]


def test_a_feature_sweeps_heatmap_names_each_feature_and_its_sae(tmp_path, sharp_llama_dir):
    """The report's heatmap of a feature sweep: one row (the SAE), a column per feature named 'feature F
    (sae)', each the mean of the feature's rows of sweep.parquet (pandas here)."""
    import pandas as pd

    from lmtrace.report import report_run
    from tests.helpers.sweep_runs import feature_sweep_run

    run, d = feature_sweep_run(tmp_path, sharp_llama_dir)
    long = pd.read_parquet(d / "sweep.parquet")
    page = report_run(str(run.path), out=tmp_path / "r.html").path.read_text()
    blobs = page_json(page, "lmtrace-blobs")
    assert blob(blobs, "sweep_0_x").tolist() == ["feature 1 (sae-l1)", "feature 4 (sae-l1)", "feature 9 (sae-l1)"]
    assert blob(blobs, "sweep_0_y").tolist() == ["sae-l1"]
    grid = blob(blobs, "sweep_0_logprob")
    for i, f in enumerate([1, 4, 9]):
        assert grid[0, i] == pytest.approx(long[long.neuron == f].effect.mean(), rel=1e-5)
