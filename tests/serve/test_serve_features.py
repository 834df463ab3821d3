"""`lmtrace serve`'s features (docs/serve.md, "A feature"): the feature route and the selected token's
feature list against the archive's feat_<sae>_idx / _val read here with zarr and numpy, the logit
effects against the test's own W_U · (W_dec[F] × the final norm's gain); the feature page and the
token view's feature list in headless Chromium at 1280 and 800 px (screenshots, no sideways overflow,
the links between them). Screenshots go to $LMTRACE_LAYOUT_SHOTS when set (else the test's tmp_path)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.helpers.feature_runs import SAE_NAME, arrays, feature_run, own_logit_effects
from tests.helpers.serve_page import assert_no_placeholder_text, served_page
from tests.helpers.server import LiveServer


@pytest.fixture(scope="module")
def feat(tmp_path_factory, tiny_llama_dir):
    made = feature_run(tmp_path_factory.mktemp("serve-features"), tiny_llama_dir)
    server = LiveServer(made["runs"])
    yield {**made, "server": server, "model": tiny_llama_dir}
    server.stop()


def _tokens(run_dir: Path) -> dict[int, list[str]]:
    t = pq.read_table(run_dir / "tokens.parquet", columns=["sequence", "position", "token_text"]).to_pandas()
    return {int(s): g.sort_values("position").token_text.tolist() for s, g in t.groupby("sequence")}


def _own_page(run_dir: Path, feature: int, top: int, window: int) -> dict:
    """The test's own feature page from the arrays: examples (largest activation first, then sequence,
    step), each context's activations, density and the histogram of the activations where active."""
    import zarr

    idx, val = arrays(run_dir)
    store = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    gen_len, prompt_len = np.asarray(store["generated_len"][:]), np.asarray(store["prompt_len"][:])
    hits = [(-float(val[s, t, k]), s, t) for s, t, k in zip(*np.nonzero(idx == feature))]
    texts = _tokens(run_dir)
    examples = []
    for neg, s, t in sorted(hits)[:top]:
        pos = int(prompt_len[s]) + int(t)
        lo, hi = max(0, pos - window), min(len(texts[s]), pos + 3)
        acts = []
        for p in range(lo, hi):
            step = p - int(prompt_len[s])
            row = idx[s, step] if step >= 0 else None
            acts.append(None if step < 0 else float(val[s, step][row == feature][0]) if (row == feature).any() else 0.0)
        examples.append((int(s), int(t), -neg, texts[s][lo:hi], acts))
    values = val[idx == feature].astype(np.float64)
    counts, edges = np.histogram(values, bins=20)
    n_tokens = int(np.maximum(gen_len, 0).sum())
    return {"examples": examples, "active": len(hits), "tokens": n_tokens, "counts": counts, "edges": edges}


def test_feature_route_is_the_archived_examples_density_and_histogram(feat):
    run_dir, f = feat["run"].path, feat["feature"]
    got = feat["server"].json(f"/api/runs/feat/features/{SAE_NAME}/{f}?top=7&window=3")
    want = _own_page(run_dir, f, 7, 3)
    assert [(e["sequence"], e["step"]) for e in got["examples"]] == [(s, t) for s, t, *_ in want["examples"]]
    np.testing.assert_allclose(
        [e["activation"] for e in got["examples"]], [a for _, _, a, *_ in want["examples"]], rtol=1e-6
    )
    for e, (_, _, _, texts, acts) in zip(got["examples"], want["examples"]):
        assert [c["text"] for c in e["context"]] == texts
        nan = [np.nan if a is None else a for a in acts]  # None: a prompt token (no activation archived)
        got_acts = [np.nan if c["activation"] is None else c["activation"] for c in e["context"]]
        np.testing.assert_allclose(got_acts, nan, rtol=1e-6)
        assert [c["position"] for c in e["context"] if c["step"] == e["step"]] == [e["position"]]
    assert (got["active_tokens"], got["tokens"]) == (want["active"], want["tokens"])
    assert got["density"] == pytest.approx(want["active"] / want["tokens"])
    assert got["histogram"]["counts"] == want["counts"].tolist()
    np.testing.assert_allclose(got["histogram"]["edges"], want["edges"], rtol=1e-6)


def test_feature_route_has_the_logit_effects_features_find_kept_and_names_the_command_elsewhere(feat):
    f = feat["feature"]
    got = feat["server"].json(f"/api/runs/feat/features/{SAE_NAME}/{f}")["logit_effects"]
    effects, order = own_logit_effects(feat["model"], feat["w"]["W_dec"][f], 5)
    assert [t["id"] for t in got["promoted"]] == order.tolist()
    np.testing.assert_allclose([t["effect"] for t in got["promoted"]], effects[order], rtol=1e-4)
    assert [t["id"] for t in got["suppressed"]] == np.argsort(effects)[:5].tolist()
    other = (f + 1) % 48
    page = feat["server"].json(f"/api/runs/feat/features/{SAE_NAME}/{other}")
    assert page["logit_effects"] is None
    assert f"lmtrace features feat --sae {SAE_NAME} --feature {other}" in page["logit_note"]


def test_a_latents_page_reads_the_feature_arrays_once_per_manifest_version(feat, tmp_path, monkeypatch):
    """Asking again (other top / window) reads no feature array; a run directory replaced by another run
    (a new manifest) is read afresh, its own numbers."""
    import shutil

    import lmtrace.archive.feature_arrays as feature_arrays
    from tests.helpers.runs import PROMPTS, run_spec

    reads: list[str] = []
    read_whole = feature_arrays.read_whole

    def counted(array, *args, **kwargs):
        reads.append(array.path)
        return read_whole(array, *args, **kwargs)

    monkeypatch.setattr(feature_arrays, "read_whole", counted)
    runs, f = tmp_path / "runs", feat["feature"]
    shutil.copytree(feat["run"].path, runs / "r")
    server = LiveServer(runs)
    try:
        for top, window in ((7, 3), (4, 1), (7, 3)):
            got = server.json(f"/api/runs/r/features/{SAE_NAME}/{f}?top={top}&window={window}")
            want = _own_page(runs / "r", f, top, window)
            assert [(e["sequence"], e["step"]) for e in got["examples"]] == [(s, t) for s, t, *_ in want["examples"]]
        assert len(reads) == 2  # the latent's ids and values, read once
        other = run_spec(
            tmp_path / "other",
            {
                "model": str(feat["model"]),
                "prompts": PROMPTS[::-1],
                "generation": {"max_new_tokens": 8, "batch_size": 3},
                "capture": {"features": [{"sae": str(feat["sae"]), "top_k": 5}]},
            },
        )
        shutil.rmtree(runs / "r")
        shutil.copytree(other.path, runs / "r")
        got = server.json(f"/api/runs/r/features/{SAE_NAME}/{f}?top=7&window=3")
        want = _own_page(runs / "r", f, 7, 3)
        assert len(reads) == 4
        assert [(e["sequence"], e["step"]) for e in got["examples"]] == [(s, t) for s, t, *_ in want["examples"]]
        assert (got["active_tokens"], got["histogram"]["counts"]) == (want["active"], want["counts"].tolist())
    finally:
        server.stop()


def test_selected_token_lists_each_saes_archived_latents_largest_first(feat):
    idx, val = arrays(feat["run"].path)
    for seq, step in ((0, 0), (1, 4), (2, 7)):
        got = feat["server"].json(f"/api/runs/feat/sequences/{seq}/steps/{step}")["features"]
        keep = idx[seq, step] >= 0
        order = sorted(zip(-val[seq, step][keep].astype(np.float64), idx[seq, step][keep]))
        assert [g["sae"] for g in got] == [SAE_NAME]
        assert [x["feature"] for x in got[0]["features"]] == [int(i) for _, i in order]
        np.testing.assert_allclose([x["activation"] for x in got[0]["features"]], [-v for v, _ in order], rtol=1e-6)
        assert got[0]["active"] == int(keep.sum())


@pytest.mark.parametrize(
    "path, status, says",
    [
        (f"/api/runs/feat/features/{SAE_NAME}/48", 404, "latents 0-47, not 48"),
        (f"/api/runs/feat/features/{SAE_NAME}/x", 404, "feature 'x' is not there"),
        ("/api/runs/feat/features/other-sae/0", 404, f"named 'other-sae' (its SAEs: {SAE_NAME})"),
        (f"/api/runs/feat/features/{SAE_NAME}/0?top=0", 400, "top=0: expected a whole number from 1 to 200"),
        (f"/api/runs/feat/features/{SAE_NAME}/0?window=abc", 400, "window='abc' is not a whole number"),
    ],
)
def test_bad_feature_addresses_get_one_json_line_saying_what_is_wrong(feat, path, status, says):
    code, _, body = feat["server"].request(path)
    assert code == status, body
    answer = json.loads(body)
    assert list(answer) == ["error"] and "\n" not in answer["error"] and says in answer["error"], answer


def _shots(tmp_path: Path) -> Path:
    d = Path(os.environ.get("LMTRACE_LAYOUT_SHOTS") or tmp_path / "shots")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _assert_no_sideways_overflow(page) -> None:
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), page.evaluate(
        "[document.documentElement.scrollWidth, window.innerWidth]"
    )


@pytest.mark.parametrize("width", [1280, 800])
def test_feature_page_and_token_feature_list_in_chromium(feat, tmp_path, width):
    f, base = feat["feature"], feat["server"].base
    want = _own_page(feat["run"].path, f, 20, 8)
    with served_page(width) as (page, problems):
        page.goto(f"{base}/#/run/feat/feature/{SAE_NAME}/{f}")
        page.wait_for_selector("table.feature-examples tbody tr")
        rows = page.eval_on_selector_all(
            "table.feature-examples tbody tr", "rs => rs.map(r => [+r.dataset.sequence, +r.dataset.step])"
        )
        assert rows == [[s, t] for s, t, *_ in want["examples"]]
        hits = page.eval_on_selector_all("td.context .tok.hit", "ts => ts.map(t => +t.dataset.activation)")
        assert hits == pytest.approx([a for _, _, a, *_ in want["examples"]], rel=1e-6)
        assert page.eval_on_selector_all(".hist-bar", "bs => bs.map(b => +b.dataset.count)") == want["counts"].tolist()
        assert page.locator("table.logit-table.promoted tbody tr").count() == 5
        assert_no_placeholder_text(page)
        _assert_no_sideways_overflow(page)
        page.screenshot(path=str(_shots(tmp_path) / f"feature-page-{width}.png"), full_page=True)
        # an example opens its token in the token view, whose feature list links back to the page
        s, t = want["examples"][0][:2]
        page.click("table.feature-examples tbody tr:first-child td.where a")
        page.wait_for_selector(f"#detail[data-step='{t}'] #features-panel table.feature-list")
        assert page.evaluate("location.hash").startswith(f"#/run/feat/seq/{s}/step/{t}")
        listed = page.eval_on_selector_all("#features-panel tbody tr", "rs => rs.map(r => +r.dataset.feature)")
        assert f in listed
        _assert_no_sideways_overflow(page)
        page.locator("#features-panel").screenshot(path=str(_shots(tmp_path) / f"token-features-{width}.png"))
        page.click(f"#features-panel tbody tr[data-feature='{f}'] a")
        page.wait_for_selector("table.feature-examples")
        assert page.evaluate("location.hash") == f"#/run/feat/feature/{SAE_NAME}/{f}"
        assert problems == []


@pytest.mark.skipif(
    os.environ.get("LMTRACE_DOC_SCREENSHOTS") != "1", reason="writes docs/img: set LMTRACE_DOC_SCREENSHOTS=1"
)
def test_doc_screenshot_of_a_feature_page_of_the_embedded_model(tmp_path):
    """docs/img/serve-feature.png: a BatchTopK SAE trained on layer 10 of the embedded SmolLM2-135M
    (the recipe of docs/features.md, smaller: 32 prompts of the Python docs, 768 latents, k = 16), a run
    of 8 more prompts generating 24 tokens each with it (`generate --sae`), the page of its latent
    with the largest activation among those active on at least 6 tokens, its logit effects computed."""
    import subprocess
    import sys

    import yaml

    from tests.helpers.cli import lmtrace

    repo = Path(__file__).resolve().parents[2]
    text = tmp_path / "sae-text.jsonl"
    subprocess.run(
        [sys.executable, str(repo / "scripts" / "sae_text_prompts.py"), str(text), "--limit", "40"], check=True
    )
    lines = text.read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:32]) + "\n")
    (tmp_path / "show.jsonl").write_text(
        "\n".join(
            json.dumps({**json.loads(x), "prompt": " ".join(json.loads(x)["prompt"].split()[:40])}) for x in lines[32:]
        )
        + "\n"
    )
    base = {
        "model": "embedded:smollm2-135m",
        "generation": {"temperature": 0.8, "top_p": 0.95, "seed": 0, "batch_size": 8},
    }
    for name, data in (
        ("train", {"prompts": {"file": "train.jsonl"}, "capture": "none", "max": 1}),
        ("show", {"prompts": {"file": "show.jsonl"}, "max": 24, "output": {"run_id": "docs"}}),
    ):
        spec = {**base, "prompts": data["prompts"], "generation": {**base["generation"], "max_new_tokens": data["max"]}}
        if "capture" in data:
            spec["capture"] = data["capture"]
        if "output" in data:
            spec["output"] = data["output"]
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    proc = lmtrace(tmp_path, "generate", str(tmp_path / "train.yaml"), "--run-id", "train", "-q", timeout=1200)
    assert proc.returncode == 0, proc.stderr
    proc = lmtrace(
        tmp_path, "sae", "train", "train", "--layer", "10", "--latents", "768", "--k", "16", "--arch", "batchtopk",
        "--source", "replay", "--epochs", "8", "--batch", "256", "--out", str(tmp_path / "l10-docs"), timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    proc = lmtrace(
        tmp_path, "generate", str(tmp_path / "show.yaml"), "--sae", str(tmp_path / "l10-docs"), "-q", timeout=1200
    )
    assert proc.returncode == 0, proc.stderr
    import zarr

    store = zarr.open_group(str(tmp_path / "runs" / "docs" / "tensors.zarr"), mode="r")
    idx, val = np.asarray(store["feat_l10-docs_idx"][:]), np.asarray(store["feat_l10-docs_val"][:])
    counts = np.bincount(idx[idx >= 0], minlength=768)
    peak = np.full(768, -np.inf)
    np.maximum.at(peak, idx[idx >= 0], val[idx >= 0])
    feature = int(np.argmax(np.where((counts >= 6) & (counts <= idx.shape[0] * idx.shape[1] // 4), peak, -np.inf)))
    proc = lmtrace(tmp_path, "features", "docs", "--sae", "l10-docs", "--feature", str(feature), "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    server = LiveServer(tmp_path / "runs")
    try:
        with served_page(1280, 900) as (page, problems):
            page.goto(f"{server.base}/#/run/docs/feature/l10-docs/{feature}?top=12")
            page.wait_for_selector("table.feature-examples tbody tr")
            page.screenshot(path=str(repo / "docs" / "img" / "serve-feature.png"))
            assert problems == []
    finally:
        server.stop()
