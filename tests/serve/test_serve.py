"""`lmtrace serve`: a real uvicorn server on an ephemeral loopback port, over a tiny run.

Every number the server sends is compared with the archive read here directly with zarr and
pyarrow (not through lmtrace's reader); the browser test reads the numbers back from the page's
DOM in a real headless Chromium (Debian's `chromium`, driven by Playwright). Security: traversal
attempts, symlinks out of the runs directory, foreign Host headers, writes, a non-loopback bind
without a token and requests without the token are all refused.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pyarrow.parquet as pq
import pytest
import zarr

from tests.helpers.browser import CHROMIUM
from tests.helpers.cli import assert_help_shows_no_python_types, assert_one_line_error, lmtrace
from tests.helpers.runs import PROMPTS, run_spec, with_lens
from tests.helpers.server import LiveServer

REPO = Path(__file__).resolve().parents[2]
INJECTIONS = ["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>']
CHILD_EDITS = [
    {"kind": "ablate_mlp", "layer": 0, "steps": {"from": 2}},
    {"kind": "ablate_head", "layer": 1, "head": 2, "steps": {"from": 2}},
]
RUN_IDS = ["child", "damaged", "tiny"]


# ---- fixtures: a runs directory and live servers ----------------------------------------------------
@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """runs/tiny (2 prompts + the 2 injection prompts, lens computed, head DLA), runs/damaged (a copy
    with a chunk file deleted) and runs/escaped (a symlink to a run outside the runs directory)."""
    base = tmp_path_factory.mktemp("serve")
    run = run_spec(
        base,
        {
            "model": str(tiny_llama_dir),
            "prompts": PROMPTS[:2] + INJECTIONS,
            "generation": {"max_new_tokens": 6, "batch_size": 4, "temperature": 0.8, "top_k": 20, "seed": 3},
            "capture": {"head_dla": True},
            "output": {"chunk_steps": 3, "run_id": "tiny"},
        },
    )
    with_lens(run)
    runs = base / "runs"
    for name, where in (("damaged", runs / "damaged"), ("escaped", base / "outside" / "escaped")):
        shutil.copytree(runs / "tiny", where)
        manifest = json.loads((where / "manifest.json").read_text())
        manifest["run_id"] = name
        (where / "manifest.json").write_text(json.dumps(manifest))
    chunk = sorted((runs / "damaged" / "tensors.zarr" / "attn").rglob("c/*/*/*/*/*"))[0]
    chunk.unlink()
    (runs / "escaped").symlink_to(base / "outside" / "escaped", target_is_directory=True)
    add_sweep_child_and_explanations(base, runs)
    return runs


def add_sweep_child_and_explanations(base: Path, runs: Path) -> None:
    """On runs/tiny (after the copies): a head sweep measuring logprob and kl, attributions of
    sequence 1's steps 1 and 2 (and lrp of step 2, with its per-layer and per-head relevance), and runs/child, its intervention child (an MLP and a head ablated
    from step 2, regenerated, so the tokens can part from the parent's)."""
    from lmtrace.commands.explain import explain_run
    from lmtrace.commands.intervene import run_intervene

    proc = lmtrace(
        base, "sweep", str(runs / "tiny"), "--over", "heads", "--edit", "zero", "--metric", "logprob", "--metric", "kl"
    )
    assert proc.returncode == 0, proc.stderr
    explain_run(runs / "tiny", "1,2", sequence=1, methods=["grad_x_input,occlusion"])
    explain_run(runs / "tiny", "2", sequence=1, methods=["lrp"])
    run_intervene(str(runs / "tiny"), CHILD_EDITS, mode="regenerate", runs_dir=str(runs), run_id="child")


@pytest.fixture(scope="module")
def server(runs_dir):
    s = LiveServer(runs_dir)
    yield s
    s.stop()


# ---- the archive, read independently -------------------------------------------------------------
def archive_attention(run_dir: Path, seq: int, step: int) -> np.ndarray:
    """[layer, q_head, key] attention of the query of `step`, straight from the zarr store."""
    group = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    n_keys = int(group["prompt_len"][seq]) + step
    return np.asarray(group["attn"][seq, step, :, :, :n_keys], dtype=np.float32)


def archive_tokens(run_dir: Path, seq: int):
    t = pq.read_table(run_dir / "tokens.parquet").to_pandas()
    return t[t.sequence == seq].sort_values("position").reset_index(drop=True)


def vocab_text(run_dir: Path) -> dict[int, str]:
    t = pq.read_table(run_dir / "vocab.parquet", columns=["id", "text"])
    return dict(zip(t.column("id").to_pylist(), t.column("text").to_pylist()))


def check_grid(grid: dict, run_dir: Path, seq: int, step: int) -> None:
    """Each cell is the archived row's maximum: its weight, a key holding it, and that key's text."""
    attn = archive_attention(run_dir, seq, step)
    texts = archive_tokens(run_dir, seq).token_text.tolist()
    assert grid["n_keys"] == attn.shape[-1] and len(grid["cells"]) == attn.shape[0]
    for li, cells in enumerate(grid["cells"]):
        assert len(cells) == attn.shape[1]
        for h, cell in enumerate(cells):
            assert cell["weight"] == float(attn[li, h].max())
            assert attn[li, h, cell["key"]] == attn[li, h].max()
            assert cell["text"] == texts[cell["key"]]


# ---- the JSON API ----------------------------------------------------------------------------------
def test_attention_grid_is_the_archived_rows_maximum_for_every_step(server, runs_dir):
    run_dir = runs_dir / "tiny"
    lengths = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")["generated_len"][:]
    for seq in range(4):
        for step in range(int(lengths[seq])):
            d = server.json(f"/api/runs/tiny/sequences/{seq}/steps/{step}")
            check_grid(d["attention"], run_dir, seq, step)
            assert d["attention"]["query_position"] == d["attention"]["n_keys"] - 1


def test_head_row_is_the_archived_row_with_key_texts(server, runs_dir):
    run_dir = runs_dir / "tiny"
    attn = archive_attention(run_dir, 2, 4)
    texts = archive_tokens(run_dir, 2).token_text.tolist()
    d = server.json("/api/runs/tiny/sequences/2/steps/4/attention/3/1")
    assert [k["key"] for k in d["keys"]] == list(range(attn.shape[-1]))
    assert [k["weight"] for k in d["keys"]] == [float(w) for w in attn[3, 1]]
    assert [k["text"] for k in d["keys"]] == texts[: attn.shape[-1]]
    assert math.isclose(sum(k["weight"] for k in d["keys"]), 1.0, abs_tol=5e-3)


def test_alternatives_lens_and_dla_are_the_archived_values(server, runs_dir):
    run_dir = runs_dir / "tiny"
    seq, step = 1, 3
    d = server.json(f"/api/runs/tiny/sequences/{seq}/steps/{step}")
    row = archive_tokens(run_dir, seq).query("step == @step").iloc[0]
    vocab = vocab_text(run_dir)
    assert d["token"]["token"] == row.token_text and math.isclose(d["token"]["prob"], float(row.prob), rel_tol=1e-6)
    assert [a["text"] for a in d["token"]["alternatives"]] == [vocab[i] for i in row.alt_ids]
    assert [a["prob"] for a in d["token"]["alternatives"]] == pytest.approx(np.exp(row.alt_logprobs).tolist(), rel=1e-6)
    group = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    ids, probs = group["lens_ids"][seq, step], group["lens_probs"][seq, step]
    steps = pq.read_table(run_dir / "steps.parquet").to_pandas().query("sequence == @seq and step == @step")
    assert d["lens"]["state"] == "ready" and len(d["lens"]["rows"]) == ids.shape[0]
    for li, r in enumerate(d["lens"]["rows"]):
        assert r["top1"] == vocab[int(ids[li, 0])] and r["top1_prob"] == float(probs[li, 0])
        target = steps[steps.layer == r["layer"]].iloc[0]
        assert r["target_rank"] == int(target.lens_target_rank)
        assert math.isclose(r["target_prob"], float(target.lens_target_prob), rel_tol=1e-6)
    assert d["head_dla"]["values"] == np.asarray(group["head_dla"][seq, step], dtype=np.float32).tolist()


def test_sequences_sort_by_lowest_probability_and_search_prompt_text(server, runs_dir):
    tokens = pq.read_table(runs_dir / "tiny" / "tokens.parquet").to_pandas()
    gen = tokens[~tokens.is_prompt]
    lowest = gen.groupby("sequence").prob.min().sort_values(kind="stable")
    d = server.json("/api/runs/tiny/sequences?sort=lowest_prob")
    assert [r["sequence"] for r in d["rows"]] == lowest.index.tolist()
    entropy = gen.groupby("sequence").entropy.max().sort_values(ascending=False, kind="stable")
    assert [
        r["sequence"] for r in server.json("/api/runs/tiny/sequences?sort=highest_entropy")["rows"]
    ] == entropy.index.tolist()
    hits = server.json("/api/runs/tiny/sequences?q=ONERROR")
    assert hits["total"] == 1 and hits["rows"][0]["sequence"] == 3
    assert server.json("/api/runs/tiny/sequences?q=no+such+text")["total"] == 0
    status, _, body = server.request("/api/runs/tiny/sequences?sort=drop+table")
    assert status == 400 and b"expected one of" in body


def test_injection_prompts_come_back_as_json_strings(server, runs_dir):
    rows = server.json("/api/runs/tiny/sequences")["rows"]
    assert [r["prompt"] for r in rows[2:]] == INJECTIONS
    assert server.json("/api/runs/tiny/sequences/3")["prompt"] == INJECTIONS[1]
    assert [r["run_id"] for r in server.json("/api/runs?q=%3Cscript%3E")["runs"]] == RUN_IDS


def test_runs_list_filters_and_leaves_out_a_symlink_out_of_the_runs_dir(server):
    runs = server.json("/api/runs")["runs"]
    assert sorted(r["run_id"] for r in runs) == RUN_IDS
    assert {r["run_id"]: r["status"] for r in runs} == {"child": "complete", "damaged": "damaged", "tiny": "complete"}
    assert all("path" not in r for r in runs)
    assert [r["run_id"] for r in server.json("/api/runs?status=complete")["runs"]] == ["child", "tiny"]
    assert [r["run_id"] for r in server.json("/api/runs?kind=intervene")["runs"]] == ["child"]
    assert {r["run_id"]: r["children"] for r in runs}["tiny"] == ["child"]


def test_damaged_run_shows_its_one_line_damage_message(server, runs_dir):
    info = server.json("/api/runs/damaged")
    missing = [
        p
        for p in json.loads((runs_dir / "damaged" / "checksums.json").read_text())["files"]
        if not (runs_dir / "damaged" / p).exists()
    ]
    assert info["damaged"] == f"run damaged is damaged: {missing[0]} is missing; `lmtrace verify damaged`"
    status, _, body = server.request("/api/runs/damaged/sequences/0/steps/0")
    assert status == 409 and json.loads(body)["error"] == info["damaged"]


@pytest.mark.parametrize(
    "path",
    [
        "/api/runs/..",
        "/api/runs/%2e%2e",
        "/api/runs/%2E%2E/tiny",
        "/api/runs/..%2f..%2fetc%2fpasswd",
        "/api/runs/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/api/runs/tiny/../../../../etc/passwd",
        "/api/runs//etc/passwd",
        "/api/runs/%2Fetc%2Fpasswd",
        "/api/runs/ti",
        "/api/runs/escaped",
        "/api/runs/escaped/sequences/0/steps/0",
        "/api/runs/tiny/sequences/0/steps/99",
        "/api/runs/tiny/sequences/-1",
        "/api/runs/tiny/sequences/0/steps/0/attention/9/0",
        "/static/..%2fapp.py",
        "/static/%2e%2e%2fguard.py",
        "/static/../../cli/main.py",
        "/static/index.html/..",
        "/../../etc/passwd",
        "/%2e%2e/%2e%2e/etc/passwd",
    ],
)
def test_traversal_attempts_get_a_4xx(server, runs_dir, path):
    status, _, body = server.request(path)
    assert 400 <= status < 500, (path, status, body[:200])
    assert b"root:" not in body and b"import" not in body


def test_an_absolute_run_path_gets_a_4xx(server, runs_dir):
    for path in (str(runs_dir / "tiny"), str(runs_dir.parent / "outside" / "escaped")):
        status, _, _ = server.request("/api/runs/" + path.replace("/", "%2F"))
        assert status == 404, path


NODE = shutil.which("node")
# probabilities where the scale's arithmetic is tested: its stops, between them, halves that round
# (at 0.75 the green channel is 196.5: Python rounds halves to even, JavaScript up), out of range, missing
SCALE_PROBES = [0, 0.05, 0.1, 0.25, 1 / 3, 0.5, 0.51, 0.625, 0.75, 0.99, 1, -0.5, 1.5, None, "nan", "inf"]


def _prob_colours_in_node(code: str) -> list[str]:
    """probColour of `code` (a page's token view script) at SCALE_PROBES, run by node with a bare `document`."""
    import subprocess

    probes = json.dumps(SCALE_PROBES)
    script = (
        "globalThis.window = globalThis; globalThis.document = {getElementById: () => null, "
        "querySelectorAll: () => []};\n" + code + "\n;const v = {nan: NaN, inf: Infinity};"
        f"console.log(JSON.stringify({probes}.map((p) => window.lmtraceView.probColour(p in v ? v[p] : p))));"
    )
    proc = subprocess.run([NODE, "-"], input=script, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.skipif(NODE is None, reason="needs node to run the page's script")
def test_served_and_inlined_token_view_colour_probabilities_as_the_python_scale(server):
    """The token view's probability colours (serve's /static/tokenview.js, and the script the report
    inlines) are output/prob_colours.py's page_colour at every probe, a missing value included."""
    from lmtrace.output.prob_colours import page_colour
    from lmtrace.report.page import token_view_code

    status, _, served = server.request("/static/tokenview.js")
    assert status == 200
    expected = [page_colour(float("nan") if p is None else float(p)) for p in SCALE_PROBES]
    # the scale's ends and middle, and the missing colour, as written in prob_colours.py's docstring
    assert expected[0] == "#fdb863" and expected[5] == "#f7f7f7" and expected[10] == "#92c5de"
    assert expected[13] == expected[14] == expected[15] == "#eeeeee"
    assert _prob_colours_in_node(served.decode()) == expected
    assert _prob_colours_in_node(token_view_code()[1]) == expected


def test_writes_foreign_hosts_and_cross_origin_reads_are_refused(server):
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert server.request("/api/runs", method=method)[0] == 405
    assert server.request("/api/runs", headers={"Host": "evil.example:80"})[0] == 403
    status, headers, _ = server.request("/api/runs", headers={"Origin": "http://evil.example"})
    assert status == 200 and not any(k.startswith("access-control-") for k in headers)
    status, headers, page = server.request("/")
    assert (
        "script-src 'self'" in headers["content-security-policy"]
        and "unsafe-inline" not in headers["content-security-policy"]
    )
    assert b'<script src="/static/app.js"' in page and b"<script>" not in page


def test_token_is_checked_on_every_request(runs_dir):
    s = LiveServer(runs_dir, token="s3cret-token")
    try:
        for path in ("/", "/static/app.js", "/api/runs", "/api/runs/tiny/sequences/0/steps/0"):
            assert s.request(path)[0] == 401, path
            assert s.request(path, headers={"Authorization": "Bearer wrong-token"})[0] == 401, path
            assert s.request(path, headers={"Authorization": "Bearer s3cret-token"})[0] == 200, path
            assert s.request(path, headers={"Cookie": "lmtrace_token=s3cret-token"})[0] == 200, path
        status, headers, _ = s.request("/?token=s3cret-token")
        assert status == 303 and headers["location"] == "/"
        assert headers["set-cookie"].startswith("lmtrace_token=s3cret-token;") and "HttpOnly" in headers["set-cookie"]
        assert s.request("/?token=wrong-token")[0] == 401
    finally:
        s.stop()


def test_non_loopback_bind_without_a_token_is_refused(tmp_path):
    proc = lmtrace(tmp_path, "serve", "--host", "0.0.0.0", "--port", "0", timeout=60)
    assert_one_line_error(proc, 2, "--host 0.0.0.0 is not a loopback address", "--token")
    proc = lmtrace(tmp_path, "serve", "--host", "127.0.0.1", "--token", "short", timeout=60)
    assert_one_line_error(proc, 2, "--token must be at least 8 characters")


def test_twenty_concurrent_clients_get_correct_answers(server, runs_dir):
    run_dir = runs_dir / "tiny"
    jobs = [(seq, step) for seq in range(4) for step in range(5)]  # 20 different (sequence, step) pairs
    expected = {j: archive_attention(run_dir, *j) for j in jobs}

    def client(job):
        seq, step = job
        for _ in range(3):
            grid = server.json(f"/api/runs/tiny/sequences/{seq}/steps/{step}")["attention"]
            row = server.json(f"/api/runs/tiny/sequences/{seq}/steps/{step}/attention/2/{step % 4}")
            ref = expected[job]
            assert [[c["weight"] for c in cells] for cells in grid["cells"]] == ref.max(axis=-1).tolist()
            assert [k["weight"] for k in row["keys"]] == ref[2, step % 4].tolist()
        return job

    with ThreadPoolExecutor(max_workers=20) as pool:
        assert sorted(pool.map(client, jobs)) == jobs


# ---- sweeps, an intervention child, compare, head patterns, attributions ----------------------------
def sweep_dir_of(run_dir: Path) -> Path:
    [d] = [p for p in (run_dir / "sweeps").iterdir() if not p.name.startswith(".")]
    return d


def as_none(values) -> list:
    """An array as the JSON has it: NaN -> None, nested lists."""
    return [as_none(v) for v in values] if np.ndim(values) > 1 else [None if np.isnan(v) else float(v) for v in values]


def test_sweep_heatmaps_are_effects_zarr_and_the_terminal_ranking(server, runs_dir):
    """Per metric, the heatmap is effects.zarr's array, which is the mean over every (sequence, step)
    row of sweep.parquet, computed here with pandas, the number `lmtrace sweep` ranks and prints."""
    run_dir = runs_dir / "tiny"
    d = sweep_dir_of(run_dir)
    info = server.json("/api/runs/tiny")
    assert [s["id"] for s in info["sweeps"]] == [d.name] and info["sweeps"][0]["metrics"] == ["logprob", "kl"]
    assert server.json("/api/runs/child")["sweeps"] == []
    sweep = server.json(f"/api/runs/tiny/sweeps/{d.name}")
    effects = zarr.open_group(str(d / "effects.zarr"), mode="r")
    long = pq.read_table(d / "sweep.parquet").to_pandas()
    top = json.loads((d / "sweep.json").read_text())["top"]  # what the terminal table printed
    assert [m["metric"] for m in sweep["metrics"]] == ["logprob", "kl"]
    for m in sweep["metrics"]:
        archived = effects[f"effect_{m['metric']}"][...]
        assert m["dims"] == ["layer", "head"] and m["coords"] == {"layer": [0, 1, 2, 3], "head": [0, 1, 2, 3]}
        assert m["values"] == as_none(archived)
        own = long[long.metric == m["metric"]].groupby(["layer", "q_head"]).effect.mean()
        for (layer, head), value in own.items():
            assert m["values"][int(layer)][int(head)] == pytest.approx(value, rel=1e-5, abs=1e-9)
        if m["metric"] == "logprob":
            for r in top:
                assert np.float32(r["effect"]) == np.float32(m["values"][r["layer"]][r["q_head"]])
    status, _, body = server.request("/api/runs/tiny/sweeps/..%2f..%2fmanifest.json")
    assert status == 404
    assert server.request("/api/runs/tiny/sweeps/nope")[0] == 404


def test_sweep_cell_is_its_rows_of_sweep_parquet_with_the_chosen_tokens(server, runs_dir):
    run_dir = runs_dir / "tiny"
    d = sweep_dir_of(run_dir)
    long = pq.read_table(d / "sweep.parquet").to_pandas()
    tokens = pq.read_table(run_dir / "tokens.parquet").to_pandas()
    text = {(r.sequence, r.step): r.token_text for r in tokens[~tokens.is_prompt].itertuples()}
    for metric, layer, head in (("kl", 2, 1), ("logprob", 0, 3)):
        cell = server.json(f"/api/runs/tiny/sweeps/{d.name}/cell?metric={metric}&layer={layer}&head={head}")
        own = long[(long.metric == metric) & (long.layer == layer) & (long["q_head"] == head)].sort_values(
            ["sequence", "step"]
        )
        assert cell["component"] == "head" and cell["n_rows"] == len(own) > 0
        assert [(r["sequence"], r["step"]) for r in cell["rows"]] == list(zip(own.sequence, own.step))
        for key in ("value", "baseline", "effect"):
            assert [r[key] for r in cell["rows"]] == own[key].tolist()
        assert [r["token"] for r in cell["rows"]] == [text[(s, t)] for s, t in zip(own.sequence, own.step)]
        mean = server.json(f"/api/runs/tiny/sweeps/{d.name}")["metrics"][["logprob", "kl"].index(metric)]
        assert mean["values"][layer][head] == pytest.approx(float(own.effect.mean()), rel=1e-5, abs=1e-9)
    status, _, body = server.request(f"/api/runs/tiny/sweeps/{d.name}/cell?metric=kl&layer=9&head=0")
    assert status == 404 and b"measured no cell" in body
    assert server.request(f"/api/runs/tiny/sweeps/{d.name}/cell?metric=kl&layer=x")[0] == 400  # a bad parameter


def test_child_against_its_parent_aligns_tokens_by_step_with_edits_and_logprob_shift(server, runs_dir):
    parent = pq.read_table(runs_dir / "tiny" / "tokens.parquet").to_pandas()
    child = pq.read_table(runs_dir / "child" / "tokens.parquet").to_pandas()
    effects = pq.read_table(runs_dir / "child" / "effects.parquet").to_pandas()
    manifest = json.loads((runs_dir / "child" / "manifest.json").read_text())
    proc = lmtrace(runs_dir.parent, "ls", "--json", env={"LMTRACE_RUNS_DIR": str(runs_dir)})
    assert proc.returncode == 0, proc.stderr
    [ls_row] = [r for r in json.loads(proc.stdout) if r["run_id"] == "child"]  # the label `lmtrace ls` prints
    assert server.json("/api/runs/child")["edits"]["label"] == ls_row["edits"]
    differing = 0
    for seq in range(4):
        d = server.json(f"/api/runs/child/sequences/{seq}/parent")
        assert d["parent_id"] == "tiny" and d["interventions"] == manifest["interventions"]
        assert d["label"] == ls_row["edits"] and d["label"].startswith("ablate-mlp ") and "ablate-head " in d["label"]
        p = parent[(parent.sequence == seq) & ~parent.is_prompt].set_index("step").token_text
        c = child[(child.sequence == seq) & ~child.is_prompt].set_index("step").token_text
        e = effects[effects.sequence == seq].set_index("step")
        steps = sorted(set(p.index) | set(c.index))
        assert [r["step"] for r in d["rows"]] == steps
        for r in d["rows"]:
            s = r["step"]
            assert r["parent"] == p.get(s) and r["child"] == c.get(s)
            assert r["differs"] == (p.get(s) != c.get(s))
            shift = e.logprob_shift.get(s)
            assert r["logprob_shift"] == (None if shift is None or np.isnan(shift) else float(shift))
            differing += r["differs"]
        assert all(not r["differs"] for r in d["rows"][:2])  # edited from step 2 on
    assert differing > 0, "the edits changed no token: the test would not see a difference marked"
    status, _, body = server.request("/api/runs/tiny/sequences/0/parent")
    assert status == 404 and b"not an intervention child" in body


def test_compare_route_gives_compare_runs_verdict_first_divergence_and_texts(server, runs_dir):
    a = pq.read_table(runs_dir / "tiny" / "tokens.parquet").to_pandas()
    b = pq.read_table(runs_dir / "child" / "tokens.parquet").to_pandas()
    d = server.json("/api/compare?a=tiny&b=child")
    assert d["a"]["run_id"] == "tiny" and d["b"]["run_id"] == "child" and d["n_pairs"] == 4
    assert d["identical"] is False and d["verdict"]
    for pair in d["pairs"]:
        ga = a[(a.sequence == pair["seq_a"]) & ~a.is_prompt].sort_values("step")
        gb = b[(b.sequence == pair["seq_b"]) & ~b.is_prompt].sort_values("step")
        ids_a, ids_b = ga.token_id.tolist(), gb.token_id.tolist()
        first = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), None)
        if first is None and len(ids_a) != len(ids_b):
            first = min(len(ids_a), len(ids_b))
        got = pair["first_divergence"]
        assert (got and got["step"]) == first if first is not None else got is None
        cut = first if first is not None else len(ids_a)
        assert pair["text"]["common"] == "".join(ga.token_text[:cut])
        assert pair["text"]["a"] == "".join(ga.token_text[cut:]) and pair["text"]["b"] == "".join(gb.token_text[cut:])
    same = server.json("/api/compare?a=tiny&b=tiny")
    assert same["identical"] is True and all(p["first_divergence"] is None for p in same["pairs"])
    assert server.request("/api/compare?a=tiny")[0] == 404
    assert server.request("/api/compare?a=tiny&b=..%2Ftiny")[0] == 404


def test_head_pattern_over_steps_is_the_archived_rows(server, runs_dir):
    run_dir = runs_dir / "tiny"
    group = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    texts = archive_tokens(run_dir, 1).token_text.tolist()
    n, P = int(group["generated_len"][1]), int(group["prompt_len"][1])
    d = server.json("/api/runs/tiny/sequences/1/attention/2/3")
    assert d["steps"] == list(range(n)) and d["keys"] == texts[: P + n - 1] and d["chosen"] == texts[P : P + n]
    for s, row in enumerate(d["rows"]):
        ref = np.asarray(group["attn"][1, s, 2, 3, : P + s], dtype=np.float32)
        assert row[: P + s] == ref.tolist() and row[P + s :] == [None] * (n - 1 - s)
    assert server.request("/api/runs/tiny/sequences/1/attention/2/9")[0] == 404


def archived_lrp(run_dir: Path, seq: int, step: int) -> dict:
    """The lrp explanation of (seq, step) read here: manifest.json's entry, its component arrays read with
    zarr at the step's index, and the step's conservation numbers."""
    entry = next(
        e
        for e in json.loads((run_dir / "manifest.json").read_text())["explain"]
        if e["method"] == "lrp" and e["sequence"] == seq and step in e["steps"]
    )
    k = entry["steps"].index(step)
    arrays = {name: zarr.open_array(str(run_dir / path), mode="r")[k] for name, path in entry["components"].items()}
    return {"id": entry["id"], "arrays": arrays, "result": next(r for r in entry["results"] if r["step"] == step)}


def test_mean_and_max_over_heads_and_attributions_of_the_step(server, runs_dir):
    run_dir = runs_dir / "tiny"
    d = server.json("/api/runs/tiny/sequences/1/steps/2")
    assert "over_heads" not in d  # its own route: the step's answer stays small on long contexts
    d["over_heads"] = server.json("/api/runs/tiny/sequences/1/steps/2/over_heads")
    assert server.request("/api/runs/tiny/sequences/1/steps/999/over_heads")[0] == 404
    attn = archive_attention(run_dir, 1, 2)
    assert d["over_heads"]["mean"] == attn.mean(axis=1, dtype=np.float32).tolist()
    assert d["over_heads"]["max"] == attn.max(axis=1).tolist()
    assert d["over_heads"]["keys"] == archive_tokens(run_dir, 1).token_text.tolist()[: attn.shape[-1]]
    scores = pq.read_table(run_dir / "explain" / "scores.parts").to_pandas()
    own = scores[(scores.sequence == 1) & (scores.step == 2)]
    assert sorted(a["method"] for a in d["attributions"]) == ["grad_x_input", "lrp", "occlusion"]
    for a in d["attributions"]:
        rows = own[own.method == a["method"]].sort_values("position")
        assert [s["position"] for s in a["scores"]] == rows.position.tolist()
        assert [s["text"] for s in a["scores"]] == rows.token_text.tolist()
        assert [s["score"] for s in a["scores"]] == [float(x) for x in rows.score]
        assert ("components" in a) == (a["method"] == "lrp")
    # lrp's components: the zarr arrays at this step, and the conservation numbers of manifest.json
    lrp = next(a for a in d["attributions"] if a["method"] == "lrp")
    ref = archived_lrp(run_dir, 1, 2)
    c = lrp["components"]
    assert lrp["explain_id"] == ref["id"] and lrp["target"] == "chosen" and lrp["quantity"] == "logit"
    assert c["heads"] == ref["arrays"]["heads"].tolist() and len(c["heads"]) == len(c["layers"])
    assert c["per_layer"] == {n: ref["arrays"][n].tolist() for n in ("attention", "mlp", "attention_bias")}
    assert c["layers"] == list(range(ref["arrays"]["heads"].shape[0]))
    assert c["conservation"] == {
        k: ref["result"][k]
        for k in ("f_x", "sum_scores", "bias_relevance", "conservation_error", "conservation_error_relative")
    }
    assert abs(c["conservation"]["conservation_error_relative"]) < 1e-4
    assert server.json("/api/runs/tiny/sequences/1/steps/3")["attributions"] == []
    assert server.json("/api/runs/child/sequences/1/steps/2")["attributions"] is None


def test_kept_reads_follow_a_rewritten_table_and_a_run_damaged_after_opening(runs_dir, tmp_path, monkeypatch):
    import pyarrow as pa

    from lmtrace.serve.catalog import Catalog
    from lmtrace.viewdata import kept, queries

    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), table)
    assert kept.dataset([table]).to_table().column("x").to_pylist() == [1, 2]
    pq.write_table(pa.table({"x": [3, 4, 5]}), table)  # another size: another dataset
    assert kept.dataset([table]).to_table().column("x").to_pylist() == [3, 4, 5]

    shutil.copytree(runs_dir / "tiny", tmp_path / "runs" / "tiny")
    catalog = Catalog(tmp_path / "runs")
    run = catalog.open("tiny")
    assert queries.run_info(run)["damaged"] is None
    victim = min((run.path / "tensors.zarr" / "attn").rglob("c/*/*/*/*/*"))
    victim.unlink()
    assert queries.run_info(run)["damaged"] is None  # the check made on opening is trusted RECHECK_S
    monkeypatch.setattr(kept, "RECHECK_S", 0.0)
    rel = victim.relative_to(run.path).as_posix()
    assert queries.run_info(run)["damaged"] == f"run tiny is damaged: {rel} is missing; `lmtrace verify tiny`"


# ---- the page, in a real browser ------------------------------------------------------------------
def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; it is in the `test` extra)")
    if CHROMIUM is None:
        pytest.skip("Debian's `chromium` is not installed (.ci/run installs it when run as root)")
    return sync_playwright


CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def open_page(p, problems: list, requests: list):
    """Debian's chromium with one 1400 x 1000 page whose console errors and warnings, page errors
    and request addresses are collected."""
    browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.on(
        "console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: requests.append(r.url))
    return browser, page


def assert_no_placeholder_text(page) -> None:
    """No value the page failed to fill in: a JavaScript null, undefined or NaN written as text."""
    import re

    text = page.inner_text("main")
    assert not re.search(r"\b(null|undefined|NaN)\b", text), text


def shown(text: str) -> str:
    """A text as the page writes it in running text (strip, prompts): newlines and tabs as visible marks."""
    return text.replace("\n", "↵").replace("\t", "⇥")


def shown_token(text: str) -> str:
    """A token as the page writes it on its own (grid cells, alternatives, lens): its leading spaces as ␣ too."""
    body = shown(text)
    return "␣" * (len(body) - len(body.lstrip(" "))) + body.lstrip(" ")


def test_page_in_chromium_shows_the_archived_grid_and_prompts_as_text(server, runs_dir, tmp_path):
    sync_playwright = _playwright()
    run_dir = runs_dir / "tiny"
    shots = tmp_path / "shots"
    shots.mkdir()
    problems, requests, dialogs = [], [], []
    with sync_playwright() as p:
        browser, page = open_page(p, problems, requests)
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))

        # runs list, and a search by prompt text
        page.goto(server.base + "/")
        page.wait_for_selector("#runs tr.run-row")
        assert sorted(page.eval_on_selector_all("#runs tr.run-row", "rows => rows.map(r => r.dataset.run)")) == RUN_IDS
        page.screenshot(path=str(shots / "serve-runs.png"))
        page.fill("#run-search", "onerror")
        page.press("#run-search", "Enter")
        page.wait_for_function("location.hash.includes('q=onerror')")
        page.wait_for_selector("#runs tr.run-row")
        assert sorted(page.eval_on_selector_all("#runs tr.run-row", "rows => rows.map(r => r.dataset.run)")) == RUN_IDS

        # a damaged run: its one line
        page.goto(server.base + "/#/run/damaged")
        assert page.wait_for_selector("#damaged").inner_text().startswith("run damaged is damaged: tensors.zarr/attn/")

        # the run page: the injection prompts are text
        page.goto(server.base + "/#/run/tiny")
        page.wait_for_selector("#sequences tr.seq-row")
        prompts = page.eval_on_selector_all("#sequences td.prompt", "cells => cells.map(c => c.textContent)")
        assert prompts == PROMPTS[:2] + INJECTIONS
        assert_no_placeholder_text(page)
        page.screenshot(path=str(shots / "serve-run.png"))

        # one sequence: click a token, read the grid back from the DOM
        page.click("#sequences tr.seq-row[data-seq='2']")
        page.wait_for_selector("#strip .tok.gen")
        assert page.inner_text("#prompt") == INJECTIONS[0]
        page.click("#strip .tok.gen[data-step='2']")
        for step in (2, 3):
            page.wait_for_selector(f"#detail[data-step='{step}'] #attention-grid")
            cells = page.eval_on_selector_all(
                "#attention-grid td.cell",
                """cells => cells.map(c => ({
                layer: +c.dataset.layer, head: +c.dataset.head, key: +c.dataset.key,
                w: c.querySelector('.w').textContent, k: c.querySelector('.k').textContent}))""",
            )
            attn = archive_attention(run_dir, 2, step)
            texts = archive_tokens(run_dir, 2).token_text.tolist()
            assert len(cells) == attn.shape[0] * attn.shape[1]
            for c in cells:
                row = attn[c["layer"], c["head"]]  # the tiny run captures layers 0-3: layer == index
                assert float(c["w"]) == pytest.approx(float(row.max()), abs=5e-4)
                assert row[c["key"]] == row.max() and c["k"] == shown_token(texts[c["key"]])
            if step == 2:
                page.keyboard.press("ArrowRight")
        assert page.get_attribute("#strip .tok.sel", "data-step") == "3"
        assert page.evaluate("location.hash") == "#/run/tiny/seq/2/step/3"
        # the chosen token's rank (tokens.parquet's token_rank, counted from 1) in its tooltip and the step's facts
        rank = int(archive_tokens(run_dir, 2).query("step == 3").token_rank.iloc[0]) + 1
        assert f" rank {rank} " in page.get_attribute("#strip .tok.gen[data-step='3']", "title")
        facts = dict(
            page.eval_on_selector_all(
                "#detail table.list tr",
                """rs => rs.filter(r => r.querySelector('th')
            && r.querySelector('td')).map(r => [r.querySelector('th').textContent, r.querySelector('td').textContent])""",
            )
        )
        assert facts["rank (1 = top-1)"] == str(rank)

        # one head's row over the keys
        page.click("#attention-grid td.cell[data-layer='1'][data-head='2']")
        page.wait_for_selector("#head-row .row-keys")
        keys = page.eval_on_selector_all(
            "#head-row .tok.key", "ks => ks.map(k => [+k.dataset.key, k.querySelector('small').textContent])"
        )
        attn = archive_attention(run_dir, 2, 3)
        assert [k for k, _ in keys] == list(range(attn.shape[-1]))
        assert [float(w) for _, w in keys] == pytest.approx(attn[1, 2].tolist(), abs=5e-4)

        # the lens column
        vocab = vocab_text(run_dir)
        ids = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")["lens_ids"][2, 3]
        lens = page.eval_on_selector_all("#lens tbody tr", "rows => rows.map(r => r.children[1].textContent)")
        assert lens == [shown_token(vocab[int(i)]) for i in ids[:, 0]]
        assert_no_placeholder_text(page)
        page.screenshot(path=str(shots / "serve-token.png"), full_page=True)

        # the other injection prompt, as the sequence page's prompt
        page.goto(server.base + "/#/run/tiny/seq/3/step/0")
        page.wait_for_selector("#detail[data-step='0'] #attention-grid")
        assert page.inner_text("#prompt") == INJECTIONS[1]
        assert page.eval_on_selector_all("img", "n => n.length") == 0
        assert page.eval_on_selector_all("script", "s => s.map(x => x.getAttribute('src'))") == [
            "/static/tokenview.js",
            "/static/groups.js",
            "/static/compare.js",
            "/static/app.js",
        ]
        browser.close()

    assert problems == [] and dialogs == []
    assert requests and all(u.startswith(server.base + "/") or u.startswith("data:") for u in requests), requests


def test_serve_command_prints_its_address_serves_and_stops_on_ctrl_c(runs_dir, tmp_path):
    import re
    import signal
    import subprocess
    import sys
    import urllib.request

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmtrace.cli", "serve", "--runs-dir", str(runs_dir), "--port", "0"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line).group(0)
        with urllib.request.urlopen(url + "api/runs", timeout=30) as r:
            assert sorted(x["run_id"] for x in json.loads(r.read())["runs"]) == RUN_IDS
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_serve_help_shows_no_python_types(tmp_path):
    assert_help_shows_no_python_types(tmp_path, ("serve",))


def test_killed_run_is_shown_up_to_its_last_committed_block(tmp_path, tiny_llama_dir):
    """A writer SIGKILLed mid-run: the page shows the steps its progress record commits, no more."""
    import signal

    import yaml

    from tests.helpers.cli import start_cli as _cli
    from tests.helpers.cli import wait_committed as _wait_committed

    spec = tmp_path / "long.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_llama_dir),
                "prompts": ["Count slowly from one to one hundred:"],
                "generation": {"max_new_tokens": 400, "eos_token_id": 0},
                "output": {"chunk_steps": 4},
            }
        )
    )
    runs = tmp_path / "runs"
    writer = _cli(["generate", str(spec)], runs)
    run_dir = _wait_committed(runs, 8)
    writer.send_signal(signal.SIGKILL)
    writer.communicate(timeout=60)
    [progress] = (run_dir / "progress").glob("*.json")
    committed = json.loads(progress.read_text())["batches"]["0"]["committed_steps"]
    s = LiveServer(runs)
    try:
        [row] = s.json("/api/runs")["runs"]
        assert row["status"] == "killed" and row["live"] is None  # as `lmtrace ls` says it
        head = s.json(f"/api/runs/{run_dir.name}")  # the run's own page says what the list says
        assert head["status"] == "killed" and head["live"] is None
        seq = s.json(f"/api/runs/{run_dir.name}/sequences/0")
        assert seq["steps"] == committed
        # its batch never finished (no row of sequences.parquet): the prompt is the spec's
        assert seq["prompt"] == "Count slowly from one to one hundred:" and seq["prompt_source"] == "spec"
        assert not list(run_dir.glob("sequences.parts/*.parquet"))
        # and the run page lists the sequence, with the steps committed so far
        [listed] = s.json(f"/api/runs/{run_dir.name}/sequences")["rows"]
        assert listed["sequence"] == 0 and listed["prompt"] == seq["prompt"] and listed["generated_len"] == committed
        # prompts read from a file (not in the manifest): the committed prompt tokens, joined
        shutil.copytree(run_dir, runs / "from-file")
        manifest = json.loads((runs / "from-file" / "manifest.json").read_text())
        manifest["spec_resolved"]["prompts"] = {
            **manifest["spec_resolved"]["prompts"],
            "texts": None,
            "file": "prompts.txt",
        }
        (runs / "from-file" / "manifest.json").write_text(json.dumps(manifest))
        parts = pq.read_table(runs / "from-file" / "tokens.parts").to_pandas()
        own = "".join(parts[(parts.sequence == 0) & parts.is_prompt].sort_values("position").token_text)
        seq = s.json("/api/runs/from-file/sequences/0")
        assert seq["prompt"] == own and seq["prompt_source"] == "tokens" and own.endswith("one hundred:")
        assert s.json("/api/runs/from-file/sequences")["rows"][0]["prompt"] == own
        shutil.rmtree(runs / "from-file")
        grid = s.json(f"/api/runs/{run_dir.name}/sequences/0/steps/{committed - 1}")["attention"]
        attn = archive_attention(run_dir, 0, committed - 1)
        assert [[c["weight"] for c in cells] for cells in grid["cells"]] == attn.max(axis=-1).tolist()
        status, _, body = s.request(f"/api/runs/{run_dir.name}/sequences/0/steps/{committed}")
        assert status == 404 and f"steps 0-{committed - 1} committed" in json.loads(body)["error"]
    finally:
        s.stop()


def first_divergence(a, b) -> int | None:
    """The first step at which two generated token-id lists differ (one ending first counts), or None."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if first is None and len(a) != len(b) else first


def check_lrp_components(page, prefix: str, run_dir: Path, seq: int, step: int, rel: float = 0.0) -> None:
    """The lrp attribution's per-layer table, head grid and conservation line on the page equal the zarr
    arrays and manifest.json read here (the numbers from data-value, within `rel`: 0 for serve, the
    report's rounding to 4 significant digits for its inlined answers; the shown text to 4 decimals)."""
    ref = archived_lrp(run_dir, seq, step)
    same = lambda a, b: a == pytest.approx(b, rel=rel, abs=1e-30)  # noqa: E731
    box = f"#{prefix}attribution-panel .attribution[data-method='lrp'][data-explain='{ref['id']}']"
    heads = ref["arrays"]["heads"]
    cells = page.eval_on_selector_all(
        f"{box} .head-relevance td.cell",
        "cs => cs.map(c => [+c.dataset.layer, +c.dataset.head, +c.dataset.value, c.textContent])",
    )
    assert len(cells) == heads.size
    for layer, head, value, text in cells:
        assert same(value, float(heads[layer, head])) and float(text) == pytest.approx(value, abs=5.1e-5)
    rows = page.eval_on_selector_all(
        f"{box} .per-layer td.cell",
        "cs => cs.map(c => [+c.closest('tr').dataset.layer, c.dataset.component, +c.dataset.value])",
    )
    assert sorted({r[1] for r in rows}) == ["attention", "attention_bias", "mlp"] and len(rows) == 3 * heads.shape[0]
    for layer, name, value in rows:
        assert same(value, float(ref["arrays"][name][layer]))
    # attention[l] = Σ_h heads[l, h] + attention_bias[l], from the page's own numbers
    got = {(r[0], r[1]): r[2] for r in rows}
    for layer in range(heads.shape[0]):
        terms = [c[2] for c in cells if c[0] == layer] + [got[(layer, "attention_bias")]]
        assert got[(layer, "attention")] == pytest.approx(sum(terms), abs=1e-5 + (rel + 1e-6) * sum(map(abs, terms)))
    line = page.eval_on_selector(f"{box} .conservation", "n => [+n.dataset.error, +n.dataset.relative, n.textContent]")
    assert same(line[0], ref["result"]["conservation_error"]) and same(
        line[1], ref["result"]["conservation_error_relative"]
    )
    assert float(re.search(r"f = (\S+),", line[2]).group(1)) == pytest.approx(ref["result"]["f_x"], rel=rel, abs=5.1e-5)


def test_page_in_chromium_shows_sweeps_child_compare_head_patterns_and_attributions(server, runs_dir, tmp_path):
    """The views over a sweep, an intervention child, compare, picked heads and attributions, read back
    from the DOM and compared with the archive read here."""
    sync_playwright = _playwright()
    run_dir = runs_dir / "tiny"
    shots = tmp_path / "shots"
    shots.mkdir()
    problems, requests = [], []
    group = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    parent_tokens = pq.read_table(run_dir / "tokens.parquet").to_pandas()
    child_tokens = pq.read_table(runs_dir / "child" / "tokens.parquet").to_pandas()
    gen = lambda t, seq: t[(t.sequence == seq) & ~t.is_prompt].sort_values("step")  # noqa: E731
    with sync_playwright() as p:
        browser, page = open_page(p, problems, requests)

        # the sweep's heatmaps on the run page: effects.zarr's numbers; a cell's rows
        d = sweep_dir_of(run_dir)
        page.goto(server.base + "/#/run/tiny")
        page.wait_for_selector(".sweep-metric[data-metric='kl'] td.cell")
        for metric in ("logprob", "kl"):
            archived = zarr.open_array(str(d / "effects.zarr" / f"effect_{metric}"), mode="r")[...]
            cells = page.eval_on_selector_all(
                f".sweep-metric[data-metric='{metric}'] td.cell",
                "cs => cs.map(c => [+c.dataset.layer, +c.dataset.head, c.textContent])",
            )
            assert len(cells) == archived.size
            for layer, head, text in cells:
                assert float(text) == pytest.approx(float(archived[layer, head]), rel=5e-3, abs=1e-12), (
                    metric,
                    layer,
                    head,
                )
        page.click(".sweep-metric[data-metric='kl'] td.cell[data-layer='2'][data-head='1']")
        page.wait_for_selector(".sweep-rows tbody tr")
        long = pq.read_table(d / "sweep.parquet").to_pandas()
        own = long[(long.metric == "kl") & (long.layer == 2) & (long["q_head"] == 1)].sort_values(["sequence", "step"])
        rows = page.eval_on_selector_all(
            ".sweep-rows tbody tr", "rs => rs.map(r => [...r.children].map(c => c.textContent))"
        )
        assert [(int(r[0]), int(r[1])) for r in rows] == list(zip(own.sequence, own.step))
        assert [float(r[5]) for r in rows] == pytest.approx(own.effect.tolist(), abs=5e-5)
        assert [r[2] for r in rows] == [
            shown_token(gen(parent_tokens, s).set_index("step").token_text[t]) for s, t in zip(own.sequence, own.step)
        ]
        assert_no_placeholder_text(page)
        page.locator(".sweep").first.screenshot(path=str(shots / "serve-sweep.png"))

        # compare: tick two runs on the runs page
        page.goto(server.base + "/")
        page.wait_for_selector("#runs tr.run-row")
        assert page.is_disabled("#compare-runs")
        page.check("input.pick[data-run='tiny']")
        page.check("input.pick[data-run='child']")
        page.click("#compare-runs")
        page.wait_for_selector("#pairs tr.pair-row")
        assert page.evaluate("location.hash") == "#/compare/tiny/child"
        firsts = page.eval_on_selector_all("#pairs tr.pair-row", "rs => rs.map(r => r.dataset.first)")
        expected = [
            first_divergence(gen(parent_tokens, s).token_id.tolist(), gen(child_tokens, s).token_id.tolist())
            for s in range(4)
        ]
        assert firsts == ["" if f is None else str(f) for f in expected]
        assert page.inner_text("#verdict") == server.json("/api/compare?a=tiny&b=child")["verdict"]
        assert_no_placeholder_text(page)
        page.screenshot(path=str(shots / "serve-compare.png"), full_page=True)

        # the child against its parent: tokens by step, the differing ones marked, the logprob shift
        seq = next(s for s, f in enumerate(expected) if f is not None)
        page.goto(server.base + f"/#/run/child/seq/{seq}")
        page.wait_for_selector("#parent-steps tbody tr")
        rows = page.eval_on_selector_all(
            "#parent-steps tbody tr",
            """rs => rs.map(r => [+r.dataset.step,
            r.querySelector('.parent').textContent, r.querySelector('.child').textContent, r.classList.contains('differs'),
            r.querySelector('.shift').textContent])""",
        )
        pt, ct = (
            gen(parent_tokens, seq).set_index("step").token_text,
            gen(child_tokens, seq).set_index("step").token_text,
        )
        effects = (
            pq.read_table(runs_dir / "child" / "effects.parquet")
            .to_pandas()
            .query("sequence == @seq")
            .set_index("step")
        )
        assert [r[0] for r in rows] == sorted(set(pt.index) | set(ct.index))
        for step, ptext, ctext, differs, shift in rows:
            assert ptext == shown_token(pt.get(step, "")) and ctext == shown_token(
                ct.get(step, "")
            )  # missing: an empty box
            assert differs == (pt.get(step) != ct.get(step))
            ref = effects.logprob_shift.get(step)
            assert shift == "" if ref is None or np.isnan(ref) else float(shift) == pytest.approx(ref, abs=5e-5)
        assert any(r[3] for r in rows)
        assert page.eval_on_selector_all("#interventions li", "ls => ls.length") == 2
        assert_no_placeholder_text(page)
        page.locator("#against-parent").screenshot(path=str(shots / "serve-child.png"))

        # picked heads' patterns over steps, mean / max over heads, the log scale, attributions
        page.goto(server.base + "/#/run/tiny/seq/1/step/2")
        page.wait_for_selector("#detail[data-step='2'] #attribution-panel .attribution")
        scores = pq.read_table(run_dir / "explain" / "scores.parts").to_pandas().query("sequence == 1 and step == 2")
        for method in ("grad_x_input", "occlusion", "lrp"):
            got = page.eval_on_selector_all(
                f".attribution[data-method='{method}'] .tok",
                "ts => ts.map(t => [+t.dataset.position, +t.dataset.score, t.firstChild.textContent])",
            )
            own = scores[scores.method == method].sort_values("position")
            assert [g[0] for g in got] == own.position.tolist() and [g[2] for g in got] == [
                shown_token(t) for t in own.token_text
            ]
            assert [g[1] for g in got] == [float(x) for x in own.score]
        check_lrp_components(page, "", run_dir, 1, 2)
        page.locator(".attribution[data-method='lrp']").screenshot(path=str(shots / "serve-lrp.png"))
        P, n = int(group["prompt_len"][1]), int(group["generated_len"][1])
        for layer, head in ((2, 3), (0, 1)):
            page.click(f"#attention-grid td.cell[data-layer='{layer}'][data-head='{head}']")
            image = f".pattern[data-layer='{layer}'][data-head='{head}'] canvas.pattern-image"
            page.wait_for_selector(image)  # the head's pattern image (its numbers: tests/serve/test_serve_patterns.py)
            rows = page.eval_on_selector(
                image,
                """c => { const n = +c.dataset.keys, v = Array.from(c.lmtraceValues, (x) =>
                Number.isNaN(x) ? null : x); return Array.from({ length: +c.dataset.rows }, (_, r) => v.slice(r * n, (r + 1) * n)); }""",
            )
            assert len(rows) == n  # no prefill_attn captured: a row per step
            for s, row in enumerate(rows):
                ref = np.asarray(group["attn"][1, s, layer, head, : P + s], dtype=np.float32)
                assert row[: P + s] == ref.tolist() and row[P + s :] == [None] * (n - 1 - s)
        assert_no_placeholder_text(page)
        page.screenshot(path=str(shots / "serve-heads.png"), full_page=True)
        page.keyboard.press("ArrowRight")
        page.wait_for_selector("#detail[data-step='3'] .pattern[data-layer='0'][data-head='1'] canvas.pattern-image")
        top = page.eval_on_selector("#detail .pattern[data-layer='0'][data-head='1'] .row-mark", "m => m.style.top")
        assert float(top.rstrip("%")) == pytest.approx(100 * 3 / n)  # step 3's row outlined
        assert page.eval_on_selector_all(".pattern", "ps => ps.length") == 2
        attn = archive_attention(run_dir, 1, 3)
        for view, ref in (("mean", attn.mean(axis=1, dtype=np.float32)), ("max", attn.max(axis=1))):
            page.select_option("#grid-view", view)
            page.wait_for_selector(f"canvas#attention-{view}")
            got = page.eval_on_selector(f"#attention-{view}", "c => Array.from(c.lmtraceValues)")
            assert got == ref.astype(np.float32).ravel().tolist()
        page.select_option("#grid-view", "heads")
        # the pattern image's pixels: the log scale draws a small weight darker than the linear one
        small = "#detail .pattern[data-layer='0'][data-head='1'] canvas.pattern-image"
        pixels = """c => { const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
            return Array.from(c.lmtraceValues, (w, i) => [w, d[4 * i] + d[4 * i + 1] + d[4 * i + 2]]); }"""
        before = page.eval_on_selector(small, pixels)
        page.check("#log-scale")
        after = page.eval_on_selector(small, pixels)
        assert any(0.001 < w < 0.99 for w, _ in before)
        for (w, b), (_, a) in zip(before, after):
            if w is not None and 0.001 < w < 0.99:
                assert a < b, (w, a, b)
        browser.close()

    assert problems == []
    assert requests and all(u.startswith(server.base + "/") or u.startswith("data:") for u in requests), requests


# ---- the report's token view: the same frontend, from data inlined in a file:// page ----------------
def test_report_token_view_in_chromium_shows_the_archived_grid_offline_and_prompts_as_text(runs_dir, tmp_path):
    """`lmtrace report` of the same run: click tokens and use the arrow keys in the page's token view
    (serve's tokenview.js over the answers the page inlined); the grid, a head's row and the lens
    equal the archive read with zarr; the page asks no host for anything; the injection prompts stay text."""
    from lmtrace.report import report_run

    sync_playwright = _playwright()
    run_dir = runs_dir / "tiny"
    group = zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")
    lengths = group["generated_len"][:]
    out = report_run(
        str(run_dir), out=tmp_path / "report.html", sequences=[1, 2, 3], layers=[1], attention_step=100
    ).path
    text = out.read_text(encoding="utf-8")
    for prompt in INJECTIONS:  # neither prompt is in the page's source as written: escaped in markup and JSON
        assert prompt not in text
    answers = json.loads(re.search(r"id='lmtrace-tokenview'>(.*?)</script>", text).group(1))["answers"]
    steps = [p for p in answers if re.fullmatch(r"sequences/\d+/steps/\d+", p)]
    assert steps and all("over_heads" not in answers[p] and answers[p + "/over_heads"]["mean"] for p in steps)
    problems, requests, dialogs = [], [], []
    with sync_playwright() as p:
        browser, page = open_page(p, problems, requests)
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(out.as_uri())
        for seq in (1, 2, 3):  # --attention-step past every sequence's end: each starts at its last step
            page.wait_for_selector(f"#s{seq}-detail[data-step='{int(lengths[seq]) - 1}'] #s{seq}-attention-grid")
        for seq in (2, 3):
            prompt = archive_tokens(run_dir, seq).query("is_prompt").token_text.tolist()
            got = page.eval_on_selector_all(f"#s{seq}-strip .tok.prompt", "ts => ts.map(t => t.textContent)")
            assert got == [shown(t) for t in prompt] and "".join(got).endswith(INJECTIONS[seq - 2])

        page.click("#s2-strip .tok.gen[data-step='1']")
        for step in (1, 2):
            page.wait_for_selector(f"#s2-detail[data-step='{step}'] #s2-attention-grid")
            cells = page.eval_on_selector_all(
                "#s2-attention-grid td.cell",
                """cells => cells.map(c => ({
                layer: +c.dataset.layer, head: +c.dataset.head, key: +c.dataset.key, weight: +c.dataset.weight,
                w: c.querySelector('.w').textContent, k: c.querySelector('.k').textContent}))""",
            )
            attn = archive_attention(run_dir, 2, step)
            texts = archive_tokens(run_dir, 2).token_text.tolist()
            assert len(cells) == attn.shape[0] * attn.shape[1]
            for c in cells:
                row = attn[c["layer"], c["head"]]
                assert c["weight"] == pytest.approx(float(row.max()), abs=5e-5)
                assert float(c["w"]) == pytest.approx(float(row.max()), abs=5e-4)
                assert row[c["key"]] == row.max() and c["k"] == shown_token(texts[c["key"]])
            if step == 1:
                page.keyboard.press("ArrowRight")  # the strip has the focus since the click
        assert page.get_attribute("#s2-strip .tok.sel", "data-step") == "2"

        # a head of an embedded layer: its row at this step, read from its embedded pattern
        page.click("#s2-attention-grid td.cell[data-layer='1'][data-head='2']")
        page.wait_for_selector("#s2-head-row .row-keys")
        keys = page.eval_on_selector_all("#s2-head-row .tok.key", "ks => ks.map(k => [+k.dataset.key, +k.dataset.w])")
        attn = archive_attention(run_dir, 2, 2)
        assert [k for k, _ in keys] == list(range(attn.shape[-1]))
        assert [w for _, w in keys] == pytest.approx(attn[1, 2].tolist(), abs=5e-5)
        page.wait_for_selector("#s2-head-patterns .pattern[data-layer='1'][data-head='2'] canvas.pattern-image")
        # a head of a layer the report did not embed: one line saying so
        page.click("#s2-attention-grid td.cell[data-layer='0'][data-head='0']")
        assert "not embedded" in page.wait_for_selector("#s2-head-row .not-embedded").inner_text()

        # the lens column, alternatives and head DLA of the selected step
        vocab = vocab_text(run_dir)
        ids = group["lens_ids"][2, 2]
        lens = page.eval_on_selector_all("#s2-lens tbody tr", "rows => rows.map(r => r.children[1].textContent)")
        assert lens == [shown_token(vocab[int(i)]) for i in ids[:, 0]]
        tok = archive_tokens(run_dir, 2).query("step == 2").iloc[0]
        alts = page.eval_on_selector_all(
            "#s2-alternatives tbody tr", "rows => rows.map(r => [...r.children].map(c => c.textContent))"
        )
        assert [a for a, _ in alts] == [shown_token(vocab[int(i)]) for i in tok.alt_ids]
        assert [float(p) for _, p in alts] == pytest.approx([math.exp(x) for x in tok.alt_logprobs], abs=1e-4)
        dla = page.eval_on_selector_all("#s2-dla-grid td.cell", "cs => cs.map(c => +c.textContent)")
        assert dla == pytest.approx(np.asarray(group["head_dla"][2, 2], dtype=np.float64).ravel().tolist(), abs=1e-3)
        # the mean / max over heads: its own inlined answer (steps/S/over_heads), read when the view is chosen
        attn = archive_attention(run_dir, 2, 2)
        for view, ref in (("mean", attn.mean(axis=1, dtype=np.float32)), ("max", attn.max(axis=1))):
            page.select_option("#s2-grid-view", view)
            page.wait_for_selector(f"canvas#s2-attention-{view}")
            got = page.eval_on_selector(f"#s2-attention-{view}", "c => Array.from(c.lmtraceValues)")
            assert got == pytest.approx(ref.astype(np.float64).ravel().tolist(), abs=5.1e-5)
        page.select_option("#s2-grid-view", "heads")

        # attributions of sequence 1's step 2 (lmtrace explain), from a click in the "Generated text" section
        page.click("#sec-text .tok[data-seq='1'][data-step='2']")
        page.wait_for_selector("#s1-detail[data-step='2'] #s1-attribution-panel .attribution")
        check_lrp_components(page, "s1-", run_dir, 1, 2, rel=5.1e-4)  # the report inlines 4 significant digits
        assert page.eval_on_selector_all("img", "n => n.length") == 0
        assert page.evaluate("document.body.dataset.errors") is None
        assert_no_placeholder_text(page)
        browser.close()
    assert problems == [] and dialogs == []
    assert requests == [out.as_uri()], requests


def test_sweep_over_three_coordinates_shows_a_chosen_pair_at_the_others_values(runs_dir, tmp_path):
    """A head sweep at two positions (effects.zarr [layer, q_head, position]): the page draws one pair
    of coordinates at a chosen value of the third; every slice read from the page equals effects.zarr
    and the terminal's ranking (sweep.json's `top`); clicking a cell gives that cell's rows."""
    sync_playwright = _playwright()
    runs = tmp_path / "runs"
    shutil.copytree(runs_dir / "tiny", runs / "tiny", ignore=shutil.ignore_patterns("sweeps", "explain"))
    proc = lmtrace(
        tmp_path,
        "sweep",
        str(runs / "tiny"),
        "--over",
        "heads",
        "--edit",
        "zero",
        "--positions",
        "1-2",
        "--metric",
        "logprob",
    )
    assert proc.returncode == 0, proc.stderr
    d = sweep_dir_of(runs / "tiny")
    archived = zarr.open_group(str(d / "effects.zarr"), mode="r")["effect_logprob"][...]
    assert archived.shape == (4, 4, 2)
    top = json.loads((d / "sweep.json").read_text())["top"]
    live = LiveServer(runs)
    problems, requests = [], []
    try:
        with sync_playwright() as p:
            browser, page = open_page(p, problems, requests)
            page.goto(live.base + "/#/run/tiny")
            page.wait_for_selector(".sweep-metric[data-metric='logprob'] td.cell")

            def cells():
                return page.eval_on_selector_all(
                    ".sweep-metric td.cell", "cs => cs.map(c => [{...c.dataset}, c.textContent])"
                )

            def check(index_of):  # every cell drawn: its coordinates' value in effects.zarr
                got = cells()
                assert len(got) == 16
                for data, text in got:
                    ref = float(archived[index_of(data)])
                    assert float(text) == pytest.approx(ref, rel=5e-3, abs=1e-12) and float(
                        data["value"]
                    ) == pytest.approx(ref, rel=1e-6)

            # layer × head at position 1, then at position 2
            for i, position in enumerate((1, 2)):
                page.select_option(".sweep-axes select.axis-fixed[data-dim='position']", str(i))
                check(lambda c, i=i: (int(c["layer"]), int(c["head"]), i))
                assert {c["position"] for c, _ in cells()} == {str(position)}
            # layer × position at head 3
            page.select_option(".sweep-axes select.axis-col", "position")
            page.select_option(".sweep-axes select.axis-fixed[data-dim='head']", "3")
            got = cells()
            assert len(got) == 8 and {c["head"] for c, _ in got} == {"3"}
            for c, text in got:
                assert float(text) == pytest.approx(
                    float(archived[int(c["layer"]), 3, int(c["position"]) - 1]), rel=5e-3
                )
            # the terminal's ranking: its top cells, found on the page with the same numbers
            for r in top[:3]:
                page.select_option(".sweep-axes select.axis-row", "layer")
                page.select_option(".sweep-axes select.axis-col", "head")
                page.select_option(".sweep-axes select.axis-fixed[data-dim='position']", str(r["position"] - 1))
                cell = page.locator(f".sweep-metric td.cell[data-layer='{r['layer']}'][data-head='{r['q_head']}']")
                assert np.float32(float(cell.get_attribute("data-value"))) == np.float32(r["effect"])
            cell.click()
            page.wait_for_selector(".sweep-rows tbody tr")
            long = pq.read_table(d / "sweep.parquet").to_pandas()
            r = top[2]
            own = long[(long.layer == r["layer"]) & (long["q_head"] == r["q_head"]) & (long.position == r["position"])]
            rows = page.eval_on_selector_all(".sweep-rows tbody tr", "rs => rs.map(r => +r.children[5].textContent)")
            assert rows == pytest.approx(own.sort_values(["sequence", "step"]).effect.tolist(), abs=5e-5)
            assert_no_placeholder_text(page)
            browser.close()
    finally:
        live.stop()
    assert problems == []


# ---- the screenshots of docs/serve.md: a small run of the embedded model ----------------------------
@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("LMTRACE_DOC_SCREENSHOTS") != "1",
    reason="retakes docs/img/serve-*.png; set LMTRACE_DOC_SCREENSHOTS=1",
)
def test_doc_screenshots_of_the_embedded_model(tmp_path):
    """2 chat prompts x 12 tokens of the embedded SmolLM2-135M (configs/demo.yaml) with the lens, head
    DLA, a head sweep, attributions and an intervention child; each page of docs/serve.md drawn
    without an error and screenshotted into docs/img."""
    from lmtrace.commands.explain import explain_run
    from lmtrace.commands.intervene import run_intervene

    sync_playwright = _playwright()
    runs = tmp_path / "runs"
    proc = lmtrace(
        tmp_path,
        "generate",
        str(REPO / "configs" / "demo.yaml"),
        "--run-id",
        "demo",
        "--lens",
        "-q",
        "--set",
        "generation.max_new_tokens=12",
        "--set",
        "capture.head_dla=true",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    proc = lmtrace(
        tmp_path,
        "sweep",
        "demo",
        "--over",
        "heads",
        "--edit",
        "zero",
        "--metric",
        "logprob",
        "--metric",
        "kl",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    explain_run(runs / "demo", "3,4", sequence=0, methods=["grad_x_input"])
    run_intervene(
        str(runs / "demo"),
        [{"kind": "ablate_mlp", "layer": 0, "steps": {"from": 3}}],
        mode="regenerate",
        runs_dir=str(runs),
        run_id="demo-no-mlp0",
    )
    img = REPO / "docs" / "img"
    live = LiveServer(runs)
    problems = []
    try:
        with sync_playwright() as p:
            browser, page = open_page(p, problems, [])
            page.goto(live.base + "/")
            page.wait_for_selector("#runs tr.run-row")
            page.screenshot(path=str(img / "serve-runs.png"))
            page.goto(live.base + "/#/run/demo")
            page.wait_for_selector(".sweep-metric td.cell")
            page.screenshot(path=str(img / "serve-run.png"))
            page.click(".sweep-metric[data-metric='kl'] td.cell[data-layer='0'][data-head='0']")
            page.wait_for_selector(".sweep-rows tbody tr")
            page.locator(".sweep").first.screenshot(path=str(img / "serve-sweep.png"))

            # picked heads and the grid's cursor from the address (the view's state), as a link reopens them
            page.goto(live.base + "/#/run/demo/seq/0/step/4?heads=5.3&cell=5.3")
            page.wait_for_selector("#detail[data-step='4'] #attention-heatmap")
            page.wait_for_selector("#head-row .row-keys")
            page.wait_for_selector(".pattern canvas.pattern-image")
            page.screenshot(path=str(img / "serve-token.png"), full_page=True)
            page.goto(live.base + "/#/run/demo/seq/0/step/4?heads=5.3,12.0&cell=12.0")
            page.reload()
            page.wait_for_selector(".pattern[data-layer='12'][data-head='0'] canvas.pattern-image")
            page.wait_for_selector("#attribution-panel .attribution")
            page.screenshot(path=str(img / "serve-heads.png"), full_page=True)

            page.goto(live.base + "/#/compare/demo/demo-no-mlp0")
            page.wait_for_selector("#pairs tr.pair-row")
            page.screenshot(path=str(img / "serve-compare.png"), full_page=True)
            page.goto(live.base + "/#/run/demo-no-mlp0/seq/0")
            page.wait_for_selector("#parent-steps tbody tr")
            page.locator("#against-parent").screenshot(path=str(img / "serve-child.png"))
            assert_no_placeholder_text(page)
            browser.close()
    finally:
        live.stop()
    assert problems == []


# ---- hostile and odd addresses: JSON errors with the documented codes, never a 5xx ----------------
TOKEN = "s3cret-token"
HOSTILE = [
    # (address, the documented status: 303 for a first visit with the token, 4xx for the rest)
    (f"//evil.example.com?token={TOKEN}", 303),
    (f"///evil.example.com/x?token={TOKEN}", 303),
    (f"/\\evil.example.com?token={TOKEN}", 303),
    (f"/%2F%2Fevil.example.com?token={TOKEN}", 303),
    (f"/%5C%5Cevil.example.com?token={TOKEN}", 303),
    (f"/%E2%82%AC?token={TOKEN}", 303),
    (f"/api/runs/tiny/sequences/%E2%82%AC?token={TOKEN}", 303),
    ("/%E2%82%AC", 404),
    ("/%FF%FE", 404),
    ("/api/runs/%E2%82%AC", 404),
    ("/api/runs/tiny%00", 404),
    ("/api/runs/tiny/sequences/%E2%82%AC", 404),
    ("/api/runs/tiny/sequences/%D9%A3", 404),  # an Arabic-Indic 3
    ("/api/runs/tiny/sequences/" + "9" * 5000, 404),
    ("/api/runs/tiny/sequences/0/steps/" + "1" * 4400, 404),
    ("/api/runs/tiny/sequences/0/steps/0/attention/" + "2" * 4301 + "/0", 404),
    ("/api/runs/tiny/sequences/1/attention/0/" + "7" * 6000, 404),
    ("/api/runs/tiny/sequences?page=" + "9" * 5000, 400),
    ("/api/runs/tiny/sequences?page=abc", 400),
    ("/api/runs/tiny/sequences?page=%E2%82%AC", 400),
    ("/api/runs/tiny/sequences?sort=nope", 400),
    ("/api/runs/tiny/sequences/abc", 404),
    ("/api/runs/tiny/sequences/-5", 404),
    ("/api/runs/tiny/sequences/0x1", 404),
    ("/api/runs/tiny/sequences/0/steps/x", 404),
    ("/api/runs/tiny/sequences/0/steps/-1", 404),
    ("/api/runs/tiny/sequences/0/steps/0/attention/x/0", 404),
    ("/api/runs/tiny/sequences/0/steps/0/attention/0/99", 404),
    ("/api/runs/tiny/sequences/99", 404),
    ("/api/runs/nope", 404),
    ("/api/runs/nope/sequences/0", 404),
    ("/api/nothing", 404),
    ("/nothing/at/all", 404),
    ("/static/nope.js", 404),
    ("/api/runs/tiny/sweeps/nope", 404),
    ("/api/compare?a=tiny&b=nope", 404),
    ("/api/runs/tiny/sweeps/x/cell?metric=kl&layer=" + "9" * 5000, 400),
]


@pytest.fixture(scope="module")
def token_server(runs_dir):
    s = LiveServer(runs_dir, token=TOKEN)
    yield s
    s.stop()


def test_hostile_and_odd_addresses_get_json_errors_never_a_5xx_a_redirect_away_or_a_server_path(token_server, runs_dir):
    """Each address of HOSTILE (sent only to this loopback server) gets its documented status, a JSON
    body, a Location (if any) on this server, and no absolute path of the runs directory."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    secrets = {str(runs_dir), str(runs_dir.resolve()), str(runs_dir.parent.resolve())}
    for path, expected in HOSTILE:
        status, headers, body = token_server.request(path, headers=None if "token=" in path else auth)
        assert status < 500, (path, status, body[:200])
        assert status == expected, (path, status, body[:200])
        assert headers["content-type"] == "application/json", (path, headers["content-type"])
        answer = json.loads(body)
        if status >= 400:
            assert set(answer) == {"error"} and answer["error"] and "\n" not in answer["error"], (path, answer)
        location = headers.get("location")
        if location is not None:
            assert location.startswith("/") and location[1:2] not in ("/", "\\"), (path, location)
            assert location.isascii() and urlsplit(location).netloc == "" and urlsplit(location).scheme == "", location
        assert not any(s.encode() in body for s in secrets), (path, body[:300])
    # the redirect keeps the path on this server, percent-encoded, the token left out
    assert token_server.request(f"//evil.example.com?token={TOKEN}")[1]["location"] == "/evil.example.com"
    assert token_server.request(f"/%E2%82%AC?token={TOKEN}&x=1")[1]["location"] == "/%E2%82%AC?x=1"
    # the guard's own refusals are JSON too
    for status, kwargs in ((401, {}), (405, {"method": "POST", "headers": auth})):
        got, headers, body = token_server.request("/api/runs", **kwargs)
        assert got == status and headers["content-type"] == "application/json" and json.loads(body)["error"]
    got, headers, body = token_server.request("/api/runs", headers={**auth, "Host": "evil.example"})
    assert got == 403 and json.loads(body)["error"]


def test_no_answer_names_where_the_runs_directory_is(server, runs_dir):
    status, _, body = server.request("/api/runs/nope/sequences/0")
    assert status == 404 and json.loads(body)["error"] == "no run 'nope' in the runs directory"
    assert server.json("/api/runs")["runs_dir"] == runs_dir.resolve().name
    where = str(runs_dir.resolve().parent).encode()
    for path in (
        "/api/runs",
        "/api/runs/tiny",
        "/api/runs/child",
        "/api/runs/damaged",
        "/api/compare?a=tiny&b=child",
        "/api/runs/child/sequences/0/parent",
        "/api/runs/tiny/sequences/1/steps/2",
        "/api/runs/tiny/sequences",
        "/api/runs/damaged/sequences/0/steps/0",
        "/api/runs/nope/sequences/0",
        "/api/runs/tiny/sweeps/x",
    ):
        status, _, body = server.request(path)
        assert status in (200, 404, 409) and where not in body, (
            path,
            status,
            body[max(0, body.find(where) - 200) :][:400],
        )


# ---- a loopback --host other than 127.0.0.1 answers its own requests ------------------------------
def serve_process(runs_dir: Path, tmp_path: Path, *args: str):
    """`lmtrace serve --port 0 ARGS` started; (process, the address it printed)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmtrace.cli", "serve", "--runs-dir", str(runs_dir), "--port", "0", *args],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stderr.readline()
    found = re.search(r"http://(\S+?):(\d+)/", line)
    assert found, line
    return proc, found.group(1), int(found.group(2))


@pytest.mark.parametrize("host", ["127.0.0.2", "::1"])
def test_serve_on_another_loopback_address_answers_requests_addressed_to_it(runs_dir, tmp_path, host):
    import signal

    proc, shown, port = serve_process(runs_dir, tmp_path, "--host", host)
    try:
        assert shown == (f"[{host}]" if ":" in host else host)
        for host_header in (
            f"{shown}:{port}",
            f"localhost:{port}",
            f"127.0.0.1:{port}",
            f"127.9.8.7:{port}",
            f"[::1]:{port}",
        ):
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("GET", "/api/runs", headers={"Host": host_header})
            r = conn.getresponse()
            assert r.status == 200, (host_header, r.status, r.read())
            assert sorted(x["run_id"] for x in json.loads(r.read())["runs"]) == RUN_IDS
            conn.close()
        for host_header in (f"evil.example:{port}", f"127.0.0.2.evil.example:{port}", f"localhost.evil.example:{port}"):
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("GET", "/api/runs", headers={"Host": host_header})
            r = conn.getresponse()
            assert r.status == 403 and json.loads(r.read())["error"], host_header
            conn.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


def test_a_loopback_name_the_server_was_bound_to_is_an_accepted_host(runs_dir, monkeypatch):
    """`--host ip6-localhost` (resolving to ::1, as /etc/hosts has it on Debian; this machine's resolver
    is given that entry): requests naming it pass the Host check; other names do not, even ones that
    resolve to loopback (what a DNS-rebinding page sends)."""
    import asyncio
    import socket

    from lmtrace.serve import create_app, guard

    resolve = socket.getaddrinfo

    def hosts_file(name, *args, **kwargs):
        if name in ("ip6-localhost", "rebound.example"):
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0))]
        return resolve(name, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hosts_file)
    guard.check_bind("ip6-localhost", None)  # a loopback name: no token needed
    app = create_app(runs_dir, host="ip6-localhost")

    def status_for(host_header: str) -> int:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "GET",
            "path": "/api/runs",
            "raw_path": b"/api/runs",
            "query_string": b"",
            "headers": [(b"host", host_header.encode())],
            "root_path": "",
            "scheme": "http",
            "http_version": "1.1",
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 8765),
        }
        asyncio.run(app(scope, receive, send))
        return next(m["status"] for m in sent if m["type"] == "http.response.start")

    assert status_for("ip6-localhost:8765") == 200 and status_for("IP6-LOCALHOST") == 200
    assert status_for("[::1]:8765") == 200 and status_for("127.0.0.1:8765") == 200
    assert status_for("evil.example:8765") == 403 and status_for("ip6-localhost.evil.example") == 403
    assert status_for("rebound.example:8765") == 403


def test_a_host_that_resolves_to_nothing_is_refused_at_start_in_one_line(tmp_path):
    proc = lmtrace(tmp_path, "serve", "--host", "no-such-host.invalid", "--port", "0", timeout=60)
    assert_one_line_error(proc, 2, "--host no-such-host.invalid: not an address this machine can bind")


# ---- a run's address is its directory's name: a copy opens, a symlink is listed once ---------------
def test_a_copy_of_a_run_opens_under_its_own_name_and_a_symlink_to_a_run_is_listed_once(runs_dir, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(runs_dir / "tiny", runs / "tiny", ignore=shutil.ignore_patterns("sweeps", "explain"))
    shutil.copytree(runs / "tiny", runs / "tiny-copy")  # the same manifest, run_id "tiny"
    (runs / "latest").symlink_to("tiny", target_is_directory=True)
    s = LiveServer(runs)
    try:
        rows = s.json("/api/runs")["runs"]
        assert sorted(r["run_id"] for r in rows) == ["tiny", "tiny-copy"]  # each directory once
        by_id = {r["run_id"]: r for r in rows}
        assert by_id["tiny"]["links"] == ["latest"] and by_id["tiny-copy"]["links"] == []
        assert by_id["tiny-copy"]["manifest_run_id"] == "tiny" and "manifest_run_id" not in by_id["tiny"]
        # the copy opens under its own name, with its own (identical) archive
        head = s.json("/api/runs/tiny-copy")
        assert head["run_id"] == "tiny-copy" and head["manifest_run_id"] == "tiny" and head["status"] == "complete"
        copy_tokens = archive_tokens(runs / "tiny-copy", 1)
        seq = s.json("/api/runs/tiny-copy/sequences/1")
        assert [t["text"] for t in seq["tokens"]] == copy_tokens.token_text.tolist()
        grid = s.json("/api/runs/tiny-copy/sequences/1/steps/2")["attention"]
        check_grid(grid, runs / "tiny-copy", 1, 2)
        # the symlink's name still opens the run it points to
        assert s.json("/api/runs/latest")["run_id"] == "latest"
        assert s.json("/api/runs/latest/sequences/1") == s.json("/api/runs/tiny/sequences/1")
    finally:
        s.stop()


def test_a_killed_run_is_killed_on_its_pages_and_a_running_runs_sequence_page_follows_it_to_the_end(
    tmp_path, tiny_llama_dir
):
    """A writer SIGKILLed mid-run: its run and sequence pages say `killed`, as the list does, with the
    spec's prompt. Resumed, it is `running · live` while its writer holds the owner lock; the sequence page
    opened then, never reloaded, follows it to the end: every generated token, and `complete`."""
    import signal

    import yaml

    from tests.helpers.cli import start_cli as _cli
    from tests.helpers.cli import wait_committed as _wait_committed

    sync_playwright = _playwright()
    prompt = "Count slowly from one to one hundred:"
    spec = tmp_path / "long.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_llama_dir),
                "prompts": [prompt],
                "generation": {"max_new_tokens": 96, "eos_token_id": 0},
                "output": {"chunk_steps": 4},
            }
        )
    )
    runs = tmp_path / "runs"
    writer = _cli(["generate", str(spec)], runs)
    run_dir = _wait_committed(runs, 8)
    writer.send_signal(signal.SIGKILL)
    writer.communicate(timeout=60)
    [progress] = (run_dir / "progress").glob("*.json")
    committed = json.loads(progress.read_text())["batches"]["0"]["committed_steps"]
    name = run_dir.name
    s = LiveServer(runs)
    shots = tmp_path / "shots"
    problems, requests = [], []
    strip_steps = "ts => ts.map(t => +t.dataset.step)"
    try:
        with sync_playwright() as p:
            browser, page = open_page(p, problems, requests)
            page.goto(s.base + "/")
            page.wait_for_selector("#runs tr.run-row")
            assert page.inner_text("#runs tr.run-row td.status-killed") == "killed"
            for address in (f"/#/run/{name}", f"/#/run/{name}/seq/0"):
                page.goto(s.base + address)
                page.wait_for_selector(".meta")
                assert "status: killed" in page.inner_text(".meta")
                assert page.get_attribute("#run-meta", "data-status") == "killed"
            page.wait_for_selector("#strip .tok.gen")
            assert page.inner_text("#prompt") == prompt
            assert page.eval_on_selector_all("#strip .tok.gen", strip_steps) == list(range(committed))
            for width in (1280, 800):
                page.set_viewport_size({"width": width, "height": 900})
                page.screenshot(path=str(shots / f"killed-seq-{width}.png"), full_page=True)
            page.set_viewport_size({"width": 1400, "height": 1000})

            # resumed: the writer holds its owner lock, paused before it writes (the test's window)
            resume = _cli(["generate", "--resume", name], runs, env={"LMTRACE_TEST_PAUSE_AFTER_CREATE": "8"})
            deadline = time.monotonic() + 60
            while s.json(f"/api/runs/{name}")["live"] is not True:
                assert time.monotonic() < deadline and resume.poll() is None, "the resumed writer never held its lock"
                time.sleep(0.1)
            assert s.json(f"/api/runs/{name}")["status"] == "running"
            page.reload()
            page.wait_for_selector("#strip .tok.gen")
            assert page.get_attribute("#run-meta", "data-status") == "running"
            assert "running · live" in page.inner_text("#run-meta") and "adds new ones" in page.inner_text("#run-note")
            page.screenshot(path=str(shots / "running-seq.png"), full_page=True)
            out, err = resume.communicate(timeout=600)
            assert resume.returncode == 0, err
            # the open page polls: it turns complete with every generated token, without a reload
            page.wait_for_selector("#run-meta[data-status='complete']", timeout=60_000)
            n = int(zarr.open_group(str(run_dir / "tensors.zarr"), mode="r")["generated_len"][0])
            assert n > committed
            assert page.eval_on_selector_all("#strip .tok.gen", strip_steps) == list(range(n))
            generated = archive_tokens(run_dir, 0).query("not is_prompt").token_text.tolist()
            assert page.eval_on_selector_all("#strip .tok.gen", "ts => ts.map(t => t.textContent)") == [
                shown(t) for t in generated
            ]
            assert page.query_selector("#run-note") is None and page.inner_text("#prompt") == prompt
            browser.close()
    finally:
        s.stop()
    assert problems == []


# ---- a token "-" and a missing value look different --------------------------------------------------
MISSING_VS_DASH = {
    "sequence": 0,
    "step": 0,
    "attention": None,
    "head_dla": None,
    "attributions": None,
    "token": {
        "token": "-",
        "token_id": 12,
        "position": 1,
        "prob": 0.5,
        "token_rank": 0,
        "entropy": 1.0,
        "margin": None,
        "greedy": None,
        "alternatives": [{"id": 12, "text": "-", "prob": 0.5}, {"id": 13, "text": "–", "prob": None}],
    },
    "lens": {
        "state": "ready",
        "rows": [
            {"layer": 0, "top1": "-", "top1_id": 12, "top1_prob": 0.4, "target_rank": None, "target_prob": None},
            {"layer": 1, "top1": "–", "top1_id": 13, "top1_prob": 0.3, "target_rank": 0, "target_prob": 0.3},
        ],
    },
}


def test_a_lens_token_dash_is_drawn_unlike_a_missing_value(server, tmp_path):
    """The page's own token view (tokenview.js, in Chromium) given a step whose lens top-1 tokens are
    "-" and "–" and whose chosen rank, probability, margin and greedy choice are missing: each token is a
    boxed token with its text; each missing value an empty box titled "no value", drawn differently."""
    sync_playwright = _playwright()
    shots = tmp_path / "shots"
    problems = []
    with sync_playwright() as p:
        browser, page = open_page(p, problems, [])
        page.goto(server.base + "/#/run/tiny/seq/1/step/1")
        page.wait_for_selector("#detail[data-step='1'] #lens")
        page.evaluate(
            """answer => {
            const view = window.lmtraceView.tokenView(async () => answer, {sequence: 0, prompt: "p", tokens: [
                {position: 0, step: null, text: "a"},
                {position: 1, step: 0, text: "-", prob: 0.5, entropy: 1, token_rank: 0}]}, {prefix: "dash-"});
            document.getElementById("app").prepend(view.strip, view.detail);
            view.select(0, false);
        }""",
            MISSING_VS_DASH,
        )
        page.wait_for_selector("#dash-lens tbody tr")
        cells = page.eval_on_selector_all(
            "#dash-lens tbody tr",
            """rows => rows.map(r => [...r.children].map(c => ({
            text: c.textContent, token: c.querySelector('.t') ? c.querySelector('.t').textContent : null,
            none: c.querySelector('.none') ? c.querySelector('.none').getAttribute('aria-label') : null})))""",
        )
        # layer 0: top-1 "-" (a token), chosen rank and p missing; layer 1: top-1 "–" (a token), rank 1
        assert [cells[0][1]["token"], cells[1][1]["token"]] == ["-", "–"]
        assert cells[0][1]["none"] is None and cells[1][1]["none"] is None
        assert cells[0][3] == {"text": "", "token": None, "none": "no value"} and cells[0][4]["none"] == "no value"
        assert cells[1][3]["text"] == "1" and cells[1][3]["none"] is None
        facts = dict(
            page.eval_on_selector_all(
                "#dash-token-panel table.list tr",
                """rs => rs.filter(r => r.querySelector('th')
            && r.querySelector('td')).map(r => [r.querySelector('th').textContent,
            r.querySelector('td .none') ? 'none' : r.querySelector('td .t') ? 'token ' + r.querySelector('td .t').textContent
            : r.querySelector('td').textContent])""",
            )
        )
        assert facts["greedy choice"] == "none" and facts["margin (top-1 − top-2)"] == "none"
        alts = page.eval_on_selector_all(
            "#dash-alternatives tbody tr",
            """rs => rs.map(r => [r.children[0].querySelector('.t').textContent,
            r.children[1].querySelector('.none') ? 'none' : r.children[1].textContent])""",
        )
        assert alts == [["-", "0.5000"], ["–", "none"]]
        # drawn differently: a token is a bordered box with its text, a missing value an empty hatched box
        token_style = page.eval_on_selector(
            "#dash-lens tbody tr .t", "n => [getComputedStyle(n).borderTopStyle, getComputedStyle(n).backgroundImage]"
        )
        none_style = page.eval_on_selector(
            "#dash-lens tbody tr .none",
            "n => [getComputedStyle(n).borderTopStyle, getComputedStyle(n).backgroundImage]",
        )
        assert token_style[0] == "solid" and token_style[1] == "none"
        assert none_style[0] == "none" and "repeating-linear-gradient" in none_style[1]
        token_shot = page.locator("#dash-lens tbody tr").nth(0).locator("td").nth(1).screenshot()
        none_shot = page.locator("#dash-lens tbody tr").nth(0).locator("td").nth(3).screenshot()
        assert token_shot != none_shot
        shots.mkdir()
        for width in (1280, 800):
            page.set_viewport_size({"width": width, "height": 900})
            page.locator("#dash-detail").screenshot(path=str(shots / f"dash-vs-missing-{width}.png"))
            page.screenshot(path=str(shots / f"token-page-{width}.png"), full_page=True)
        browser.close()
    assert problems == []
