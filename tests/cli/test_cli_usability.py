"""The CLI as a new user meets it: help that reads as POSIX usage, -h / --version, one compact
JSON line for every --json, ids printed with -q, `ls` telling runs and children apart, the lens
computed in the generating process, and a no-op `lmtrace lens` that never imports torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from tests.helpers.cli import REPO, assert_help_shows_no_python_types, lmtrace

COMMANDS = (
    "generate",
    "validate",
    "ls",
    "show",
    "verify",
    "intervene",
    "sweep",
    "explain",
    "lens",
    "heads",
    "compare",
    "report",
)


def _tiny_spec(tmp_path: Path, model_dir: Path, name: str = "tiny.yaml", **over) -> Path:
    data = {
        "model": str(model_dir),
        "prompts": ["The quick brown fox", "Paris is the capital of"],
        "generation": {"max_new_tokens": 5, "batch_size": 2},
        "capture": {"residual": {"vectors_at": "all"}},
    }
    data.update(over)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_help_shows_no_python_types_and_posix_arguments(tmp_path):
    env = {"COLUMNS": "200"}
    assert_help_shows_no_python_types(tmp_path, COMMANDS)
    assert (
        "Usage: python -m lmtrace.cli generate [OPTIONS] [SPEC]"
        in lmtrace(tmp_path, "generate", "--help", env=env).stdout
    )
    assert "RUN..." in lmtrace(tmp_path, "lens", "--help", env=env).stdout
    flags = lmtrace(tmp_path, "generate", "-h", env=env).stdout
    assert re.search(r"--json\s+Print", flags) and re.search(r"--set\s+KEY=VALUE\s+Override", flags), flags


def test_version_and_short_help(tmp_path):
    from lmtrace import __version__

    proc = lmtrace(tmp_path, "--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"lmtrace {__version__}", proc
    proc = lmtrace(tmp_path, "-h")
    assert proc.returncode == 0 and "Commands" in proc.stdout


def test_a_no_op_lens_answers_without_importing_torch(tmp_path, tiny_llama_dir):
    spec = _tiny_spec(tmp_path, tiny_llama_dir)
    gen = lmtrace(tmp_path, "generate", str(spec), "--lens", "--json")
    assert gen.returncode == 0, gen.stderr
    summary = json.loads(gen.stdout)
    assert summary["lens"]["computed"] is True and summary["status"] == "complete"
    code = (
        f"import sys; sys.argv = ['lmtrace', 'lens', {summary['run_id']!r}, '--json']\n"
        "from lmtrace.cli.main import app\n"
        "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {**os.environ, "LMTRACE_RUNS_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "run_id": summary["run_id"],
        "computed": False,
        "reason": "logit lens already present",
    }
    text = lmtrace(tmp_path, "lens", summary["run_id"])
    assert text.stdout.strip() == f"{summary['run_id']}: logit lens already present"  # the same words as JSON


def test_generate_lens_equals_a_separate_lens_run_bit_for_bit(tmp_path, tiny_llama_dir):
    from lmtrace.archive.reader import Run
    from lmtrace.commands.lens import compute_lens

    spec = _tiny_spec(tmp_path, tiny_llama_dir)
    inline = lmtrace(tmp_path, "generate", str(spec), "--lens", "-q", "--run-id", "same-process")
    assert inline.returncode == 0, inline.stderr
    assert inline.stdout.strip() == "same-process"  # -q prints the run id alone
    later = lmtrace(tmp_path, "generate", str(spec), "-q", "--run-id", "later")
    assert later.returncode == 0, later.stderr
    a, b = Run(tmp_path / "runs" / "same-process"), Run(tmp_path / "runs" / "later")
    assert a.manifest["lens"]["computed"]["model_load_s"] < 0.5  # the generating process's model, not a reload
    assert compute_lens(b)["computed"] is True
    b = Run(b.path)
    for name in ("lens_ids", "lens_probs"):
        np.testing.assert_array_equal(a.array(name)[:], b.array(name)[:])
    sa, sb = a.steps().to_pandas(), b.steps().to_pandas()
    assert sa.equals(sb)


def test_ls_tells_runs_and_children_apart_and_intervene_quiet_prints_child_ids(tmp_path, tiny_llama_dir):
    spec = _tiny_spec(tmp_path, tiny_llama_dir)
    assert lmtrace(tmp_path, "generate", str(spec), "-q", "--run-id", "parent").returncode == 0
    proc = lmtrace(tmp_path, "intervene", "parent", "--ablate-head", "1.2", "-q", "--lens")
    assert proc.returncode == 0, proc.stderr
    child = proc.stdout.strip()
    assert child and "\n" not in child and (tmp_path / "runs" / child / "manifest.json").is_file()
    temps = lmtrace(tmp_path, "intervene", "parent", "--temperatures", "0.5,1.0", "-q")
    assert temps.returncode == 0, temps.stderr
    assert len(temps.stdout.split()) == 2

    rows = {r["run_id"]: r for r in json.loads(lmtrace(tmp_path, "ls", "--json").stdout)}
    assert rows["parent"]["kind"] == "generate" and rows["parent"]["parent_id"] is None
    assert rows["parent"]["lens"] == "pending"
    assert rows[child]["kind"] == "intervene" and rows[child]["parent_id"] == "parent"
    assert rows[child]["edits"] == "ablate-head 1.2 (rescore)"
    assert rows[child]["lens"] == "ready"  # intervene --lens, with the model the child was written with
    kinds = {r["run_id"] for r in json.loads(lmtrace(tmp_path, "ls", "--kind", "intervene", "--json").stdout)}
    assert kinds == set(rows) - {"parent"} and len(kinds) == 3
    table = lmtrace(tmp_path, "ls", env={"COLUMNS": "250"}).stdout
    assert "intervene" in table and "ablate-head 1.2" in table and "pending" in table


def test_every_json_output_is_one_compact_line(tmp_path, tiny_llama_dir):
    spec = _tiny_spec(tmp_path, tiny_llama_dir)
    outputs = [lmtrace(tmp_path, "generate", str(spec), "--json", "--run-id", "r")]
    for args in (
        ("validate", str(spec)),
        ("ls",),
        ("show", "r"),
        ("verify", "r"),
        ("heads", "r"),
        ("compare", "r", "r"),
        ("report", "r"),
    ):
        outputs.append(lmtrace(tmp_path, *args, "--json"))
    for proc in outputs:
        assert proc.returncode == 0, (proc.args, proc.stderr)
        lines = proc.stdout.splitlines()
        assert len(lines) == 1, (proc.args, proc.stdout[:500])
        json.loads(lines[0])


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _many_runs(tmp_path: Path, tiny_llama_dir: Path, n: int = 29) -> dict[str, dict]:
    """A parent, three intervene children, and copies of them under other ids: n runs, as `ls --json` lists them."""
    import shutil

    spec = _tiny_spec(tmp_path, tiny_llama_dir, capture="none")
    assert lmtrace(tmp_path, "generate", str(spec), "-q", "--run-id", "parent").returncode == 0
    for args in (
        ("--ablate-head", "1.2", "--from-step", "1"),
        ("--ablate-mlp", "2:mean", "--mask-positions", "0-2", "--mode", "regenerate"),
        ("--ablate-neurons", "3:1,2,3,7", "--mask-positions", "prompt"),
    ):
        proc = lmtrace(tmp_path, "intervene", "parent", *args, "-q")
        assert proc.returncode == 0, proc.stderr
    runs = tmp_path / "runs"
    originals = sorted(p for p in runs.iterdir() if p.is_dir())
    for i in range(n - len(originals)):
        copy = shutil.copytree(originals[i % len(originals)], runs / f"20300101-{i:06d}-copy{i:05d}")
        manifest = json.loads((copy / "manifest.json").read_text())
        (copy / "manifest.json").write_text(json.dumps({**manifest, "run_id": copy.name}))
    rows = {r["run_id"]: r for r in json.loads(lmtrace(tmp_path, "ls", "--json").stdout)}
    assert len(rows) == n
    return rows


def test_ls_fits_80_columns_and_a_pipe_gets_one_whole_line_per_run(tmp_path, tiny_llama_dir):
    from lmtrace.capture.interventions import parse_entries, shorthand_entries

    rows = _many_runs(tmp_path, tiny_llama_dir)
    # a terminal 80 columns wide (rich takes FORCE_COLOR as a terminal, COLUMNS as its width)
    term = lmtrace(tmp_path, "ls", env={"COLUMNS": "80", "FORCE_COLOR": "1"})
    assert term.returncode == 0, term.stderr
    lines = ANSI.sub("", term.stdout).splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert len(lines) <= len(rows) + 5, term.stdout  # a title, the header, one line per run, a note
    for run_id, r in rows.items():
        mine = [line for line in lines if line.split(" ")[0] == run_id]
        assert len(mine) == 1, (run_id, lines)
        assert r["status"] in mine[0] and r["kind"] in mine[0]
        if r["edits"]:
            shown = mine[0].rstrip().rsplit("  ", 1)[-1]
            assert r["edits"] == shown or (shown.endswith("…") and r["edits"].startswith(shown[:-1])), (r, shown)
    assert "not shown at 80 columns:" in ANSI.sub("", term.stdout)
    wide = ANSI.sub("", lmtrace(tmp_path, "ls", env={"COLUMNS": "250", "FORCE_COLOR": "1"}).stdout)
    assert "not shown" not in wide and all(r["edits"] in wide for r in rows.values() if r["edits"])

    # piped: a header, then one whole line per run, tab-separated, every column
    piped = lmtrace(tmp_path, "ls", env={"COLUMNS": "80"})
    lines = piped.stdout.splitlines()
    header = lines[0].split("\t")
    assert header[:3] == ["run id", "kind", "status"] and len(lines) == len(rows) + 1
    for line in lines[1:]:
        cells = dict(zip(header, line.split("\t")))
        assert len(line.split("\t")) == len(header)
        r = rows[cells["run id"]]
        assert (cells["model"], cells["edits"], cells["parent"]) == (
            r["model"],
            r["edits"] or "-",
            r["parent_id"] or "-",
        )

    # edits in the CLI's own words: each label read back by intervene's own flag parser gives the stored entries
    flags = {
        "ablate-head": "ablate_head",
        "ablate-layer": "ablate_layer",
        "ablate-mlp": "ablate_mlp",
        "ablate-attn": "ablate_attn",
        "ablate-neurons": "ablate_neurons",
        "mask-positions": "mask_positions",
    }
    for r in rows.values():
        if r["kind"] != "intervene":
            continue
        m = json.loads((Path(r["path"]) / "manifest.json").read_text())
        label, mode = re.fullmatch(r"(.*) \((rescore|regenerate)\)", r["edits"]).groups()
        assert mode == m["mode"] and "{" not in label, r["edits"]
        from_step = None
        if m.get("from_step"):
            label, from_step = re.fullmatch(r"(.*) from (\d+)", label).groups()
            assert int(from_step) == m["from_step"]
        given = {name: [] for name in flags.values()}
        for part in label.split("; "):
            flag, value = part.split(" ")
            given[flags[flag]].append(value)
        entries = shorthand_entries(**given)
        if from_step is not None:
            entries = [{"steps": {"from": int(from_step)}, **e} for e in entries]
        key = lambda e: json.dumps(e, sort_keys=True)  # noqa: E731
        assert sorted(map(key, (e.model_dump(mode="json") for e in parse_entries(entries, "test")))) == sorted(
            map(key, m["interventions"])
        ), (r["edits"], m["interventions"])
    child = next(r["run_id"] for r in rows.values() if (r["edits"] or "").startswith("ablate-head"))
    diffs = json.loads(lmtrace(tmp_path, "compare", "parent", child, "--json").stdout)["spec_differences"]
    assert {"key": "interventions", "a": None, "b": "ablate-head 1.2 from 1"} in diffs  # compare says it alike


def test_every_command_takes_q_and_it_means_what_its_help_says(tmp_path, tiny_llama_dir):
    for command in COMMANDS:  # the README: every command has -q
        text = lmtrace(tmp_path, command, "-h", env={"COLUMNS": "200"}).stdout
        assert re.search(r"--quiet\s+-q\s", text), (command, text)
    spec = _tiny_spec(tmp_path, tiny_llama_dir)
    valid = lmtrace(tmp_path, "validate", str(spec), "-q")
    assert (valid.returncode, valid.stdout) == (0, ""), valid
    assert lmtrace(tmp_path, "generate", str(spec), "-q", "--run-id", "r").returncode == 0
    assert (
        lmtrace(
            tmp_path, "generate", str(spec), "-q", "--run-id", "s", "--set", "generation.temperature=1.5"
        ).returncode
        == 0
    )

    ls = lmtrace(tmp_path, "ls", "-q")
    assert ls.returncode == 0 and ls.stdout.split() == [
        r["run_id"] for r in json.loads(lmtrace(tmp_path, "ls", "--json").stdout)
    ]
    verify = lmtrace(tmp_path, "verify", "r", "-q")
    assert (verify.returncode, verify.stdout, verify.stderr) == (0, "", "")
    heads = lmtrace(tmp_path, "heads", "r", "-q")
    assert (heads.returncode, heads.stdout, heads.stderr) == (0, "", "")
    assert (tmp_path / "runs" / "r" / "analysis" / "heads.parquet").is_file()
    compare = lmtrace(tmp_path, "compare", "r", "s", "-q")
    verdict = json.loads(lmtrace(tmp_path, "compare", "r", "s", "--json").stdout)["verdict"]
    assert compare.returncode == 0 and compare.stdout == verdict + "\n", compare.stdout

    tokens = tmp_path / "runs" / "r" / "tokens.parquet"
    tokens.write_bytes(tokens.read_bytes()[:-100])  # damaged: nothing on stdout, one error line, exit 2
    damaged = lmtrace(tmp_path, "verify", "r", "-q")
    assert damaged.returncode == 2 and damaged.stdout == "" and damaged.stderr.startswith("error: "), damaged


def test_every_commands_help_reads_as_whole_paragraphs_at_80_columns():
    """On an 80-column terminal each line of a command's prose is as full as rich can make it: a line
    ends early only where a paragraph ends (a paragraph hard-wrapped at 100 columns in the source
    came out ragged, a long line and then a stub)."""
    from typer.testing import CliRunner

    from lmtrace.cli import app

    runner = CliRunner()
    names = [info.name or info.callback.__name__ for info in app.registered_commands]
    assert {"ls", "show", "query"} <= set(names)
    for name in names:
        text = runner.invoke(app, [name, "--help"], env={"COLUMNS": "80", "TERM": "dumb"}).stdout
        prose = text.split("Usage:", 1)[1].split("╭", 1)[0].splitlines()[1:]
        lines = [line.strip() for line in prose]
        for here, after in zip(lines, lines[1:]):
            if here and after:  # within a paragraph: the next line's first word did not fit on this one
                assert len(here) + 1 + len(after.split()[0]) > 78, (name, here, after)
