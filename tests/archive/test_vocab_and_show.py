"""The archive as text without the model: vocab.parquet, `Run.text`, effects' token texts, and
`lmtrace show` without colour (probabilities as numbers) and with --step.

References are the tokenizer itself (`AutoTokenizer.decode` of one id) and the archive's own
numbers read with pyarrow / zarr, never lmtrace's text lookup.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import zarr

from lmtrace.archive.reader import Run
from tests.helpers.runs import PROMPTS, run_spec, with_lens

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def decoded(tokenizer) -> list[str]:
    return [tokenizer.decode([i]) for i in range(len(tokenizer))]


@pytest.fixture(scope="module")
def run(tiny_llama_dir, tmp_path_factory) -> Run:
    """A sampled run (ranks above 0 occur), deferred lens not computed yet."""
    return run_spec(
        tmp_path_factory.mktemp("vocab"),
        {
            "model": str(tiny_llama_dir),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 6, "batch_size": 2, "temperature": 1.0, "seed": 1},
        },
    )


def lmtrace(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI as a user pipes it: stdout is not a terminal."""
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    for key in ("NO_COLOR", "FORCE_COLOR"):
        full_env.pop(key, None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "lmtrace.cli", *args], env=full_env, capture_output=True, text=True, timeout=300
    )


def generated(run: Run):
    t = run.tokens().to_pandas()
    return t[~t.is_prompt].sort_values(["sequence", "step"])


# ---- vocab.parquet and Run.text ------------------------------------------------------------------
def test_vocab_parquet_holds_every_id_as_the_tokenizer_decodes_it_alone(run, tokenizer, decoded):
    table = pq.read_table(run.path / "vocab.parquet")
    assert str(table.schema.field("id").type) == "int32" and str(table.schema.field("is_special").type) == "bool"
    assert table.column("id").to_pylist() == list(range(len(tokenizer)))
    assert table.column("text").to_pylist() == decoded
    special = set(np.flatnonzero(table.column("is_special").to_numpy()).tolist())
    assert special == set(tokenizer.all_special_ids) and special
    # tokens.parquet's token_text is the same decoding
    t = run.tokens().to_pandas()
    assert t.token_text.tolist() == [decoded[i] for i in t.token_id]
    assert run.vocab_size == len(tokenizer)
    assert not list(run.path.glob(".vocab.parquet*"))  # no temporary file left


def test_run_text_reads_ids_of_any_shape_fill_values_and_unknown_ids(run, tokenizer, decoded):
    alt = np.stack(generated(run).alt_ids.to_numpy())  # [tokens, k]
    assert run.text(alt) == [[decoded[i] for i in row] for row in alt.tolist()]
    assert run.text(alt[0].tolist()) == [tokenizer.decode([i]) for i in alt[0].tolist()]
    n = len(tokenizer)
    assert run.text([-1, 5, n, n + 7]) == ["", decoded[5], f"<id {n}>", f"<id {n + 7}>"]
    assert run.text(np.array([np.nan, 3.0])) == ["", decoded[3]]
    assert run.text(np.int32(4)) == [decoded[4]]


def test_a_run_without_vocab_parquet_reads_the_texts_its_tokens_table_saw(run, decoded, tmp_path):
    old = Path(shutil.copytree(run.path, tmp_path / run.path.name))
    (old / "vocab.parquet").unlink()  # as made before vocab.parquet (and checksums.json) existed
    (old / "checksums.json").unlink()
    manifest = json.loads((old / "manifest.json").read_text())
    manifest.pop("checksums", None)
    (old / "manifest.json").write_text(json.dumps(manifest))
    old_run = Run(old)
    seen = sorted(set(old_run.tokens().column("token_id").to_pylist()))
    never = next(i for i in range(len(decoded)) if i not in seen)
    assert old_run.text(seen + [never, -1]) == [decoded[i] for i in seen] + [f"<id {never}>", ""]
    assert old_run.vocab_size is None


def test_shards_and_a_run_that_lacks_it_get_vocab_parquet(tiny_llama_dir, tmp_path, decoded):
    import yaml

    from lmtrace.runner.generation import Shard, run_generate
    from lmtrace.spec.run_spec import build_spec

    data = {
        "model": str(tiny_llama_dir),
        "prompts": PROMPTS,
        "capture": "none",
        "generation": {"max_new_tokens": 3},
        "output": {"runs_dir": str(tmp_path), "run_id": "sharded"},
    }
    spec = build_spec(data, "test")
    run_generate(spec, yaml.safe_dump(data), shard=Shard(0, 2))
    vocab = tmp_path / "sharded" / "vocab.parquet"
    assert pq.read_table(vocab).column("text").to_pylist() == decoded
    vocab.unlink()  # the other shard joins a run without it (as one begun before it existed)
    result = run_generate(spec, yaml.safe_dump(data), shard=Shard(1, 2))
    assert result.status == "complete"
    assert pq.read_table(vocab).column("text").to_pylist() == decoded


def test_an_intervene_child_has_a_vocabulary_and_effects_as_text(run, decoded):
    from lmtrace.commands.intervene import run_intervene

    result, effects = run_intervene(str(run.path), [{"kind": "ablate_layer", "layer": 1}])
    assert pq.read_table(result.run_dir / "vocab.parquet").column("text").to_pylist() == decoded
    on_disk = pq.read_table(result.run_dir / "effects.parquet").to_pandas()
    for t in (on_disk, effects.to_pandas()):
        for col in ("parent_token", "child_token", "child_top1", "parent_top1"):
            assert t[f"{col}_text"].tolist() == [None if pd_null(i) else decoded[int(i)] for i in t[col]], col


def pd_null(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


# ---- `lmtrace show` without colour ---------------------------------------------------------------------
def parse_numbered(out: str, at: int, texts: list[str]) -> list[float]:
    """Walk `text[p]text[p]...\\n` from `at`, knowing each token's text (from the tokenizer)."""
    numbers = []
    for text in texts:
        assert out.startswith(text + "[", at), (out[at : at + 60], text)
        at += len(text) + 1
        end = out.index("]", at)
        numbers.append(float(out[at:end]))
        at = end + 1
    assert out[at] == "\n", out[at : at + 60]
    return numbers


def assert_two_significant_digits(shown: float, p: float) -> None:
    assert abs(shown - p) <= 0.5 * 10 ** (math.floor(math.log10(p)) - 1) * 1.0001, (shown, p)


@pytest.mark.parametrize("how", ["pipe", "NO_COLOR", "--no-color"])
def test_show_without_colour_prints_each_tokens_probability_and_no_legend(run, decoded, how):
    env = {"FORCE_COLOR": "1"} if how != "pipe" else {}  # rich then treats the pipe as a terminal
    if how == "NO_COLOR":
        env["NO_COLOR"] = "1"
    proc = lmtrace("show", str(run.path), *(["--no-color"] if how == "--no-color" else []), env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "token colour" not in out and "\x1b[" not in out
    g = generated(run)
    for seq, prompt in enumerate(PROMPTS):
        rows = g[g.sequence == seq]
        assert len(rows) > 0
        at = (
            out.index(f"\n{prompt}\n", out.index(f"sequence {seq} (")) + len(prompt) + 2
        )  # the strip follows the prompt
        shown = parse_numbered(out, at, [decoded[i] for i in rows.token_id])
        assert len(shown) == len(rows)
        for value, lp in zip(shown, rows.logprob):
            assert_two_significant_digits(value, math.exp(lp))


def test_show_with_colour_is_unchanged(run):
    proc = lmtrace("show", str(run.path), env={"FORCE_COLOR": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "token colour = probability" in proc.stdout and "\x1b[" in proc.stdout
    assert not re.search(r"\[0\.\d+\]|\[1\]", re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout))


# ---- `lmtrace show --step` -----------------------------------------------------------------------------
def test_show_step_prints_alternatives_as_text_and_says_the_lens_is_pending(run, decoded):
    row = generated(run).query("sequence == 1 and step == 2").iloc[0]
    proc = lmtrace("show", str(run.path), "--step", "2", "--sequence", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert (d["sequence"], d["step"], d["position"]) == (1, 2, int(row.position))
    assert d["token"]["text"] == decoded[int(row.token_id)] and d["token"]["rank"] == int(row["token_rank"])
    assert d["token"]["prob"] == pytest.approx(math.exp(row.logprob), rel=1e-6)
    assert [a["id"] for a in d["alternatives"]] == list(row.alt_ids)
    assert [a["text"] for a in d["alternatives"]] == [decoded[i] for i in row.alt_ids]
    assert [a["prob"] for a in d["alternatives"]] == pytest.approx(np.exp(row.alt_logprobs.astype(float)), rel=1e-6)
    assert d["lens"]["state"] == "pending" and f"lmtrace lens {run.id}" in d["lens"]["note"]

    text = lmtrace("show", str(run.path), "--step", "2", "--sequence", "1")
    assert text.returncode == 0, text.stderr
    assert f"lmtrace lens {run.id}" in text.stdout
    for a in d["alternatives"]:
        assert repr(a["text"]) in text.stdout


def test_show_step_prints_the_logit_lens_as_text(run, decoded, tmp_path):
    ready = with_lens(Run(shutil.copytree(run.path, tmp_path / run.path.name)))
    proc = lmtrace("show", str(ready.path), "--step", "0", "--json")  # sequence 0 by default
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    group = zarr.open_group(str(ready.path / "tensors.zarr"), mode="r")
    ids, probs = group["lens_ids"][0, 0], group["lens_probs"][0, 0]  # [layer, k]
    assert [r["layer"] for r in d["lens"]["layers"]] == list(group["layer"][:])
    for li, r in enumerate(d["lens"]["layers"]):
        assert [c["text"] for c in r["top"]] == [decoded[i] for i in ids[li]]
        assert [c["prob"] for c in r["top"]] == pytest.approx(probs[li].astype(float), rel=1e-6)
    text = lmtrace("show", str(ready.path), "--step", "0")
    assert text.returncode == 0, text.stderr
    assert "logit lens" in text.stdout and repr(decoded[int(ids[-1][0])]) in text.stdout
    # at 40 columns (rich's width: COLUMNS) a layer's tokens continue on lines indented under the first,
    # none split, every layer's tokens in order
    narrow = lmtrace("show", str(ready.path), "--step", "0", env={"COLUMNS": "40"}).stdout.splitlines()
    at = next(i for i, line in enumerate(narrow) if line.startswith("logit lens"))
    for r in d["lens"]["layers"]:
        head = f"  layer {r['layer']:3d}: "
        start = next(i for i, line in enumerate(narrow) if i > at and line.startswith(head))
        block = [narrow[start][len(head) :]]
        for line in narrow[start + 1 :]:
            if not line.startswith(" " * len(head)):
                break
            block.append(line[len(head) :])
        cells = [f"{c['text']!r} {c['prob']:.2g}" for c in r["top"]]
        assert "  ".join(block) == "  ".join(cells), (block, cells)
        assert all(len(head) + len(x) <= 40 or "  " not in x for x in block), block


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--step", "6"], "--step 6: sequence 0 of run"),  # max_new_tokens 6: steps 0..5
        (["--step", "0", "--sequence", "3"], "--sequence 3: run"),
        (["--sequence", "-1"], "--sequence -1"),
    ],
)
def test_show_refuses_a_step_or_sequence_the_run_lacks(run, args, fragment):
    proc = lmtrace("show", str(run.path), *args)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert fragment in lines[0] and "Traceback" not in proc.stderr


def test_show_step_counts_ranks_from_1_labels_both_margins_and_explains_stability(tiny_llama_dir, tmp_path, decoded):
    run = run_spec(
        tmp_path,
        {
            "model": str(tiny_llama_dir),
            "prompts": PROMPTS,  # top-k 5: ranks 0..4 are stored
            "generation": {"max_new_tokens": 8, "batch_size": 3, "temperature": 1.0, "top_k": 5, "seed": 2},
        },
    )
    g = generated(run)
    # a sampled step whose chosen token is not the top-1 but is among the stored alternatives
    row = next(r for r in g.itertuples() if 0 < r.token_rank < len(r.alt_ids) and r.alt_ids[r.token_rank] == r.token_id)
    text = lmtrace("show", str(run.path), "--step", str(row.step), "--sequence", str(row.sequence)).stdout
    numbered = {int(n): t for n, t in re.findall(r"^\s+(\d+)\. (\S.*?)\s{2}", text, re.M)}
    assert numbered[row.token_rank + 1] == repr(decoded[row.token_id])  # the alternatives count from 1 ...
    assert f"rank {row.token_rank + 1} (1 = the model's top-1)" in text  # ... and so does the chosen token's rank
    chosen = row.logprob - row.alt_logprobs[0]  # vs the best other token: the top-1, the first alternative
    m = re.search(r"the model's top-1 − top-2 (\S+) nats; the chosen token − the best other token (\S+) nats", text)
    assert m, text
    assert float(m.group(1)) == pytest.approx(row.margin, rel=1e-3)
    assert float(m.group(2)) == pytest.approx(chosen, rel=1e-3) and float(m.group(2)) < 0
    d = json.loads(
        lmtrace("show", str(run.path), "--step", str(row.step), "--sequence", str(row.sequence), "--json").stdout
    )
    assert d["token"]["margin_chosen"] == pytest.approx(chosen, rel=1e-6)
    stability = re.search(r"^stability: (\w+) \((.*)\)$", text, re.M)
    assert stability and stability.group(1) == row.stability, text
    for word in ("locked", "stable", "fragile", "tie"):  # every class is explained where it is shown
        assert f"{word} = " in stability.group(2)


# ---- colours a colour-blind reader can tell apart ------------------------------------------------------
# Machado, Oliveira & Fernandes (2009) at full severity, on linear RGB; the difference in CIE L*a*b* (ΔE76)
CVD = {
    "protanopia": [[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216], [-0.003882, -0.048116, 0.951998]],
    "deuteranopia": [[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413], [-0.011820, 0.042940, 0.968881]],
    "tritanopia": [[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602], [0.004733, 0.691367, 0.303900]],
}
XTERM = {
    30: (0, 0, 0),
    31: (205, 0, 0),
    32: (0, 205, 0),
    33: (205, 205, 0),
    34: (0, 0, 238),
    35: (205, 0, 205),
    36: (0, 205, 205),
    37: (229, 229, 229),
}


def _lab_as_seen(rgb, matrix) -> np.ndarray:
    c = np.asarray(rgb, np.float64) / 255
    linear = np.clip(np.asarray(matrix) @ np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4), 0, 1)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ linear
    t = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(t > (6 / 29) ** 3, np.cbrt(t), t / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def _apart_for_every_deficiency(a, b) -> float:
    return min(float(np.linalg.norm(_lab_as_seen(a, m) - _lab_as_seen(b, m))) for m in CVD.values())


def _ansi_rgb(codes: str):
    """The foreground colour of an SGR sequence: 24-bit, the 256-colour cube, or xterm's standard colours."""
    parts = [int(x) for x in codes.split(";") if x]
    for i, x in enumerate(parts):
        if x == 38 and parts[i + 1] == 2:
            return tuple(parts[i + 2 : i + 5])
        if x == 38 and parts[i + 1] == 5 and 16 <= parts[i + 2] < 232:
            n = parts[i + 2] - 16
            return tuple(0 if v == 0 else 55 + 40 * v for v in (n // 36, n // 6 % 6, n % 6))
        if x in XTERM:
            return XTERM[x]
    return None


def test_probability_colours_stay_apart_for_colour_blind_readers(run, tmp_path):
    proc = lmtrace("show", str(run.path), env={"FORCE_COLOR": "1", "COLORTERM": "truecolor"})
    assert proc.returncode == 0, proc.stderr
    legend = next(line for line in proc.stdout.splitlines() if "token colour = probability" in line)
    steps = [_ansi_rgb(codes) for codes, label in re.findall(r"\x1b\[([0-9;]*)m([<>]=?[0-9.]+)", legend)]
    assert len(steps) == 4 and None not in steps, legend
    for i in range(4):  # the terminal's four steps, each pair told apart under protan-, deuter- and tritanopia
        for j in range(i + 1, 4):
            assert _apart_for_every_deficiency(steps[i], steps[j]) >= 15, (steps[i], steps[j])
    strip = {_ansi_rgb(codes) for codes in re.findall(r"\x1b\[([0-9;]*)m", proc.stdout.split(legend)[0])}
    assert set(steps) & strip  # the tokens are drawn in the legend's colours

    from lmtrace.report import report_run

    page = report_run(str(run.path), out=tmp_path / "r.html").path.read_text()
    spans = re.findall(
        r"<span class='tok' style='background:([^']*)' data-seq='\d+' data-step='\d+' "
        r"data-prob='([^']*)'",
        page,
    )
    assert spans, "no coloured token on the page"
    least_likely = _css_rgb(min(spans, key=lambda s: float(s[1]))[0])
    assert min(float(p) for _, p in spans) < 0.1  # a sampled tiny model: unlikely tokens on the page
    legend = re.search(r"background:([^']*)'>p≈0</span>.*?background:([^']*)'>1</span>", page)
    assert legend, "the page's colour legend"
    unlikely, certain = (_css_rgb(c) for c in legend.groups())
    assert _apart_for_every_deficiency(unlikely, certain) >= 40
    assert _apart_for_every_deficiency(least_likely, certain) >= 30  # the least likely token shown vs a certain one


def _css_rgb(css: str):
    """`#rrggbb` or `hsl(h,s%,l%)` as (r, g, b) 0..255."""
    import colorsys

    if css.startswith("#"):
        return tuple(int(css[i : i + 2], 16) for i in (1, 3, 5))
    h, sat, light = (float(x.strip("%")) for x in re.fullmatch(r"hsl\((.*)\)", css).group(1).split(","))
    return tuple(255 * x for x in colorsys.hls_to_rgb(h / 360, light / 100, sat / 100))


def test_show_quiet_prints_the_generated_text_only(run):
    seqs = pq.read_table(run.path / "sequences.parquet").to_pylist()
    proc = lmtrace("show", str(run.path), "-q")
    assert proc.returncode == 0 and proc.stdout == "".join(s["generated_text"] + "\n" for s in seqs), proc.stdout
    one = lmtrace("show", str(run.path), "-q", "--sequence", "1")
    assert one.stdout == seqs[1]["generated_text"] + "\n"
    row = generated(run).query("sequence == 1 and step == 2").iloc[0]
    assert lmtrace("show", str(run.path), "-q", "--step", "2", "--sequence", "1").stdout == row.token_text + "\n"
