"""The report's features (docs/report.md, "Features"): the latents it embeds are the most active on the
tokens it shows, each latent's page (examples from within the report's sequences, density, histogram,
logit effects where `lmtrace features --feature` kept them) and each embedded selected token's feature
list equal the archive's feat_<sae>_idx / _val read here with zarr and numpy; in headless Chromium at
1280 and 800 px the pages are drawn, link to the token view and back, and nothing overflows sideways.
Screenshots go to $LMTRACE_LAYOUT_SHOTS when set (else the test's tmp_path)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.feature_runs import SAE_NAME, arrays, feature_run
from tests.helpers.serve_page import served_page

SEQUENCES = [0, 2]


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_llama_dir):
    from lmtrace.report import report_run

    base = tmp_path_factory.mktemp("report-features")
    made = feature_run(base, tiny_llama_dir)
    out = base / "report.html"
    report_run(str(made["run"].path), sequences=SEQUENCES, out=out)
    return {**made, "page": out, "text": out.read_text(encoding="utf-8")}


def _payload(text: str, data_id: str) -> dict:
    raw = re.search(rf"<script type='application/json' id='{data_id}'>(.*?)</script>", text, re.S).group(1)
    return json.loads(raw)["answers"]


def _sig(x: float) -> float:
    return float(f"{x:.4g}")  # the report's rounding of an inlined float


def test_report_embeds_the_latents_most_active_on_the_shown_tokens_with_their_pages(report):
    idx, val = arrays(report["run"].path)
    best: dict[int, float] = {}
    for s in SEQUENCES:
        for i, v in zip(idx[s][idx[s] >= 0].tolist(), val[s][idx[s] >= 0].tolist()):
            best[i] = max(best.get(i, -np.inf), v)
    chosen = [f for f, _ in sorted(best.items(), key=lambda x: (-x[1], x[0]))[:6]]
    answers = _payload(report["text"], "lmtrace-features")
    assert list(answers) == [f"features/{SAE_NAME}/{f}" for f in chosen]
    n_tokens = int(sum(np.isfinite(val[s, :, 0]).sum() for s in SEQUENCES))
    for f in chosen:
        got = answers[f"features/{SAE_NAME}/{f}"]
        hits = sorted((-float(val[s, t, k]), s, t) for s, t, k in zip(*np.nonzero(idx == f)) if s in SEQUENCES)
        assert [(e["sequence"], e["step"]) for e in got["examples"]] == [(int(s), int(t)) for _, s, t in hits[:10]]
        assert [e["activation"] for e in got["examples"]] == [_sig(-v) for v, _, _ in hits[:10]]
        assert (got["active_tokens"], got["tokens"], got["sequences"]) == (len(hits), n_tokens, SEQUENCES)
        counts, _ = np.histogram([-v for v, _, _ in hits], bins=20)
        assert got["histogram"]["counts"] == counts.tolist()
        # logit effects where `lmtrace features --feature` kept them (the fixture did for one latent)
        assert (got["logit_effects"] is not None) == (f == report["feature"])


def test_report_token_view_lists_each_shown_tokens_archived_latents(report):
    idx, val = arrays(report["run"].path)
    answers = _payload(report["text"], "lmtrace-tokenview")
    steps = [k for k in answers if re.fullmatch(r"sequences/\d+/steps/\d+", k)]
    assert steps
    for key in steps:
        s, t = map(int, key.split("/")[1::2])
        keep = idx[s, t] >= 0
        order = sorted(zip(-val[s, t][keep].astype(np.float64), idx[s, t][keep]))
        (got,) = answers[key]["features"]
        assert [x["feature"] for x in got["features"]] == [int(i) for _, i in order]
        assert [x["activation"] for x in got["features"]] == [_sig(-v) for v, _ in order]


@pytest.mark.parametrize("width", [1280, 800])
def test_report_feature_pages_in_chromium_link_to_the_token_view_and_back(report, tmp_path, width):
    answers = _payload(report["text"], "lmtrace-features")
    shots = Path(os.environ.get("LMTRACE_LAYOUT_SHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with served_page(width) as (page, problems):
        page.goto(report["page"].resolve().as_uri())
        page.wait_for_selector(".feature-snap table.feature-examples")
        blocks = page.eval_on_selector_all(
            ".feature-snap",
            "bs => bs.map(b => [b.dataset.feature, b.querySelectorAll('table.feature-examples tbody tr').length])",
        )
        assert blocks == [[k.split("/")[-1], len(a["examples"])] for k, a in answers.items()]
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        page.locator("#sec-features").screenshot(path=str(shots / f"report-features-{width}.png"))
        first = page.locator(".feature-snap").first
        seq, step = first.locator("table.feature-examples tbody tr").first.evaluate(
            "r => [r.dataset.sequence, r.dataset.step]"
        )
        first.locator("td.where a").first.click()
        page.wait_for_selector(f"#tv-{seq} #s{seq}-detail[data-step='{step}']:not([data-loading]) table.feature-list")
        link = page.locator(f"#tv-{seq} #s{seq}-features-panel a").first
        target = link.get_attribute("href")
        assert target.startswith("#feature-") and page.locator(target).count() == 1
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        assert problems == []
