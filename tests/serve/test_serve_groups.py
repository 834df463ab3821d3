"""The run page's groups: a run's sequences grouped by a column of sequences.parquet, with per group the
numbers `lmtrace stats --by COLUMN --json` and `lmtrace heads --by COLUMN --json` print (the CLI run
here, as a user runs it), read back from the route and from the page in Chromium at 1280 and 800 px."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.helpers.cli import lmtrace
from tests.helpers.serve_page import assert_fits, assert_no_placeholder_text, served_page
from tests.helpers.server import LiveServer

RUN = "every-table"


@pytest.fixture(scope="module")
def runs(every_table_runs, tmp_path_factory):
    """A copy of the every-table runs (the CLI's `heads` writes its files next to the run)."""
    root = tmp_path_factory.mktemp("groups")
    shutil.copytree(every_table_runs / "runs", root / "runs")
    return root


@pytest.fixture(scope="module")
def server(runs):
    s = LiveServer(runs / "runs")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cli(runs):
    """The terminal's answers: `stats --by topic --json` and `heads --by topic --json`."""
    stats = lmtrace(runs, "stats", RUN, "--by", "topic", "--json")
    assert stats.returncode == 0, stats.stderr
    heads = lmtrace(runs, "heads", RUN, "--by", "topic", "--json", "--out", str(runs / "heads-out"))
    assert heads.returncode == 0, heads.stderr
    return json.loads(stats.stdout), json.loads(heads.stdout)


def top_heads(heads_json: dict, value, n: int) -> list[tuple]:
    """The first n heads of a group in `heads --by`'s order, as (layer, head, label)."""
    rows = [r for r in heads_json["by"]["heads"] if r["group_value"] == value]
    return [(r["layer"], r["q_head"], r["label"]) for r in rows[:n]]


def test_groups_route_gives_the_numbers_stats_and_heads_by_print(server, cli):
    stats, heads = cli
    d = server.json(f"/api/runs/{RUN}/groups?by=topic")
    assert d["by"] == "topic" and "topic" in d["columns"]
    assert [g["group_value"] for g in d["groups"]] == [g["group_value"] for g in stats["groups"]] == ["a", "b"]
    for mine, theirs in zip(d["groups"], stats["groups"]):
        for k in ("sequences", "tokens", "mean_logprob", "mean_entropy", "settle", "lowest"):
            assert mine[k] == theirs[k], k
        got = [(h["layer"], h["q_head"], h["label"]) for h in mine["heads"]]
        assert got == top_heads(heads, mine["group_value"], 5)
        by_head = {
            (r["layer"], r["q_head"]): r for r in heads["by"]["heads"] if r["group_value"] == mine["group_value"]
        }
        for h in mine["heads"]:
            assert h["local_score"] == by_head[(h["layer"], h["q_head"])]["local_score"]
    assert server.json(f"/api/runs/{RUN}/groups")["groups"] is None


def test_grouping_by_a_column_the_run_lacks_is_a_404_naming_the_columns(server):
    status, _, body = server.request(f"/api/runs/{RUN}/groups?by=nope")
    assert status == 404
    assert "topic" in json.loads(body)["error"]


@pytest.mark.parametrize("width", [1280, 800])
def test_run_page_groups_by_the_picked_column_with_the_terminals_numbers(server, cli, width, tmp_path):
    stats, heads = cli
    with served_page(width) as (page, problems):
        page.goto(server.base + f"/#/run/{RUN}")
        page.wait_for_selector("#group-by option[value='topic']", state="attached")
        page.select_option("#group-by", "topic")
        page.wait_for_selector("#groups tr.group-row")
        assert "by=topic" in page.evaluate("location.hash")
        rows = page.eval_on_selector_all(
            "#groups tr.group-row",
            """rs => rs.map(r => ({
            group: r.querySelector('.group-value').textContent,
            sequences: +r.querySelector('.sequences').textContent, tokens: +r.querySelector('.tokens').textContent,
            mean_logprob: +r.querySelector('.mean-logprob').dataset.value, shown_logprob: r.querySelector('.mean-logprob').textContent,
            mean_entropy: +r.querySelector('.mean-entropy').dataset.value,
            settle: r.querySelector('.settle').textContent,
            heads: [...r.querySelectorAll('.group-head')].map(h => [+h.dataset.layer, +h.dataset.head, h.dataset.label]),
            lowest: [...r.querySelectorAll('.group-low a')].map(a => a.getAttribute('href'))}))""",
        )
        assert [r["group"] for r in rows] == ["a", "b"]
        for r, g in zip(rows, stats["groups"]):
            assert (r["sequences"], r["tokens"]) == (g["sequences"], g["tokens"])
            assert r["mean_logprob"] == g["mean_logprob"] and r["mean_entropy"] == g["mean_entropy"]
            assert r["shown_logprob"] == f"{g['mean_logprob']:.3f}"  # as the terminal's table writes it
            assert r["settle"] == ", ".join(
                f"{'never' if int(k) < 0 else k}: {n}" for k, n in sorted(g["settle"].items(), key=lambda x: int(x[0]))
            )
            assert [tuple(h) for h in r["heads"]] == top_heads(heads, g["group_value"], 5)
            assert r["lowest"] == [f"#/run/{RUN}/seq/{t['sequence']}/step/{t['step']}" for t in g["lowest"]]
        assert_no_placeholder_text(page)
        assert_fits(page, "#groups-box")
        shot = tmp_path / f"groups-{width}.png"
        page.locator("#groups-box").screenshot(path=str(shot))
        if os.environ.get("LMTRACE_SHOTS_DIR"):  # to look at them
            shutil.copy(shot, os.path.join(os.environ["LMTRACE_SHOTS_DIR"], shot.name))
        # a lowest-probability token opens its step's token view
        page.click("#groups tr.group-row .group-low a")
        page.wait_for_selector(".tokenview, #prompt")
        first = stats["groups"][0]["lowest"][0]
        assert page.evaluate("location.hash").endswith(f"/seq/{first['sequence']}/step/{first['step']}")
        assert problems == []
