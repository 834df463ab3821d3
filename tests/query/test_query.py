"""`lmtrace query`: SQL over every run's tables.

References: pandas on the Parquet files read directly (paths built by the test from the documented
layout), and the manifests as JSON; never lmtrace/query.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.cli import assert_one_line_error, lmtrace
from tests.helpers.runs import rerecord_checksums, run_spec

PROMPTS = ["one two three one two three one two", "The cat sat on the mat and the cat", "Paris is the capital of"]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """A runs directory with: a generate run (heads computed, a sweep), an intervene child of it
    (effects), a copy with a prompt-metadata column in sequences.parquet, an unfinished copy whose
    tables are committed parts (plus a temporary part being written), and a damaged copy."""
    from lmtrace.commands.heads import heads_command
    from lmtrace.commands.intervene import run_intervene
    from lmtrace.commands.sweep import run_sweep
    from lmtrace.spec.sweep_spec import SweepSpec

    tmp = tmp_path_factory.mktemp("query")
    base = run_spec(
        tmp,
        {
            "model": str(tiny_llama_dir),
            "prompts": PROMPTS,
            "generation": {"max_new_tokens": 5, "batch_size": 3},
            "capture": {"lens": {"when": "inline"}},
            "output": {"run_id": "20260101-000000-000aaaaaa", "float_dtype": "float32"},
        },
    )
    heads_command(str(base.path), quiet=True, per_sequence=True)
    heads_command(str(base.path), quiet=True, by="stop_reason")  # analysis/heads_by_stop_reason.parquet
    run_sweep(str(base.path), SweepSpec(over="attn", metrics=["logprob"], sequences="0,1"))
    run_intervene(str(base.path), [{"kind": "ablate_layer", "layer": 1}], run_id="20260101-000001-000bbbbbb")
    root = base.path.parent

    meta = shutil.copytree(base.path, root / "20260101-000002-000cccccc")
    _rename(meta, "20260101-000002-000cccccc")
    seqs = pq.read_table(meta / "sequences.parquet")
    pq.write_table(seqs.append_column("topic", pa.array(["count", "animals", "geo"])), meta / "sequences.parquet")
    rerecord_checksums(meta)

    partial = shutil.copytree(base.path, root / "20260101-000003-000dddddd")
    _rename(partial, "20260101-000003-000dddddd")
    manifest = json.loads((partial / "manifest.json").read_text())
    manifest["status"] = "interrupted"
    (partial / "manifest.json").write_text(json.dumps(manifest))
    for table in ("tokens", "sequences", "steps"):
        (partial / f"{table}.parts").mkdir()
        t = pq.read_table(partial / f"{table}.parquet")
        first = t.filter(pa.compute.equal(t.column("sequence"), 0))
        pq.write_table(first, partial / f"{table}.parts" / "b000000.parquet")
        pq.write_table(t, partial / f"{table}.parts" / ".b000001.parquet.tmp.parquet")  # being written
        (partial / f"{table}.parquet").unlink()

    damaged = shutil.copytree(base.path, root / "20260101-000004-000eeeeee")
    _rename(damaged, "20260101-000004-000eeeeee")
    (damaged / "tokens.parquet").unlink()
    return root


def _rename(path: Path, run_id: str) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["run_id"] = run_id
    (path / "manifest.json").write_text(json.dumps(manifest))


def _query(root: Path, sql: str, *args: str):
    proc = lmtrace(root.parent, "query", sql, "--runs-dir", str(root), *args)
    return proc


def _frame(proc) -> pd.DataFrame:
    assert proc.returncode == 0, proc.stderr
    return pd.read_json(io.StringIO(proc.stdout), lines=True)


def _direct(root: Path, table: str) -> pd.DataFrame:
    """Every readable run's `table` read with pandas: the compacted file, else the committed parts."""
    frames = []
    for run in sorted(root.iterdir()):
        if run.name.endswith("eeeeee"):  # the damaged run is skipped
            continue
        full = run / f"{table}.parquet"
        files = [full] if full.is_file() else sorted((run / f"{table}.parts").glob("b*.parquet"))
        for f in files:
            frames.append(pd.read_parquet(f).assign(run_id=json.loads((run / "manifest.json").read_text())["run_id"]))
    return pd.concat(frames, ignore_index=True)


def test_tokens_view_equals_the_parquet_files_and_skips_the_damaged_run(runs_dir):
    proc = _query(
        runs_dir,
        "SELECT run_id, sequence, count(*) AS n, sum(logprob) AS lp, max(position) AS last "
        "FROM tokens GROUP BY ALL ORDER BY ALL",
        "--format",
        "json",
    )
    got = _frame(proc)
    t = _direct(runs_dir, "tokens")
    want = (
        t.groupby(["run_id", "sequence"])
        .agg(n=("position", "size"), lp=("logprob", "sum"), last=("position", "max"))
        .reset_index()
    )
    assert (
        got[["run_id", "sequence", "n", "last"]].values.tolist()
        == want[["run_id", "sequence", "n", "last"]].values.tolist()
    )
    np.testing.assert_allclose(got.lp.astype(float), want.lp.astype(float), rtol=1e-5)
    # the unfinished copy shows its committed part only (sequence 0), not the part being written
    assert sorted(got[got.run_id.str.endswith("dddddd")].sequence) == [0]
    warnings = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: run 20260101-000004-000eeeeee is damaged"), (
        proc.stderr
    )
    assert "tokens.parquet" in warnings[0]


def test_a_query_that_names_a_damaged_run_prints_what_it_has_and_fails_naming_the_run(runs_dir):
    """Asked for a damaged run by its id, the answer lacks what was asked: exit 2 after the (here empty)
    answer, the warning and one error line; the other runs' answer standing alone is not a failure."""
    damaged = "20260101-000004-000eeeeee"
    proc = _query(runs_dir, f"SELECT count(*) AS n FROM tokens WHERE run_id = '{damaged}'", "-f", "json")
    assert proc.returncode == 2, proc.stderr
    assert pd.read_json(io.StringIO(proc.stdout), lines=True).n.tolist() == [0]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith(f"warning: run {damaged} is damaged"), proc.stderr
    assert lines[1].startswith(f"error: the query names run {damaged}, which is damaged"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_runs_view_has_the_manifest_fields_and_the_shown_status(runs_dir):
    got = _frame(_query(runs_dir, "SELECT * FROM runs ORDER BY run_id", "-f", "json")).set_index("run_id")
    for run in sorted(runs_dir.iterdir()):
        m = json.loads((run / "manifest.json").read_text())
        if run.name.endswith("eeeeee"):
            assert m["run_id"] not in got.index
            continue
        row = got.loc[m["run_id"]]
        assert row.kind == m["kind"] and row.model == m["model"]["reference"]
        assert row.created == m["created"] and row.n_prompts == m["n_prompts"]
        assert (row.parent if isinstance(row.parent, str) else None) == (m.get("parent") or {}).get("run_id")
    assert got.loc["20260101-000003-000dddddd"].status == "interrupted"
    assert got.loc["20260101-000001-000bbbbbb"].edits.startswith("ablate-layer 1")


def test_sequences_view_reads_runs_with_different_columns_by_name(runs_dir):
    got = _frame(
        _query(
            runs_dir, "SELECT run_id, sequence, topic, prompt FROM sequences ORDER BY run_id, sequence", "-f", "json"
        )
    )
    want = _direct(runs_dir, "sequences").sort_values(["run_id", "sequence"])
    assert got.prompt.tolist() == want.prompt.tolist()
    topics = got.set_index(["run_id", "sequence"]).topic
    assert topics.loc["20260101-000002-000cccccc"].tolist() == ["count", "animals", "geo"]
    assert topics.drop("20260101-000002-000cccccc", level=0).isna().all()


def test_heads_sweeps_and_effects_views_equal_their_files(runs_dir):
    base = runs_dir / "20260101-000000-000aaaaaa"
    heads = _frame(_query(runs_dir, "SELECT * FROM heads WHERE run_id = '20260101-000000-000aaaaaa'", "-f", "json"))
    want = pd.read_parquet(base / "analysis" / "heads.parquet")
    assert len(heads) == len(want) and heads.label.tolist() == want.label.tolist()

    sweep_dir = next(p for p in (base / "sweeps").iterdir() if not p.name.startswith("."))
    sweeps = _frame(
        _query(
            runs_dir,
            "SELECT run_id, sweep_id, layer, avg(effect) AS e FROM sweeps GROUP BY ALL ORDER BY ALL",
            "-f",
            "json",
        )
    )
    s = pd.read_parquet(sweep_dir / "sweep.parquet")
    want = s.groupby("layer").effect.mean()
    mine = sweeps[sweeps.run_id == "20260101-000000-000aaaaaa"]
    assert set(mine.sweep_id) == {sweep_dir.name}
    np.testing.assert_allclose(mine.e.to_numpy(), want.to_numpy(), rtol=1e-9, atol=1e-12)

    effects = _frame(_query(runs_dir, "SELECT run_id, count(*) AS n FROM effects GROUP BY run_id", "-f", "json"))
    child = runs_dir / "20260101-000001-000bbbbbb"
    assert effects.set_index("run_id").n.to_dict() == {
        "20260101-000001-000bbbbbb": len(pd.read_parquet(child / "effects.parquet"))
    }


def test_views_missing_everywhere_are_empty_and_csv_parquet_outputs_agree(runs_dir, tmp_path):
    proc = _query(runs_dir, "SELECT count(*) AS n FROM explain", "-f", "csv")
    assert proc.returncode == 0 and proc.stdout.splitlines()[1:] == ["0"], proc
    sql = "SELECT run_id, sequence, position, token_text, alt_ids FROM tokens ORDER BY ALL"
    csv = _query(runs_dir, sql, "-f", "csv")
    out = tmp_path / "t.parquet"
    assert _query(runs_dir, sql, "--out", str(out)).returncode == 0
    frame = pd.read_csv(io.StringIO(csv.stdout), keep_default_na=False)
    parquet = pd.read_parquet(out)
    assert frame.token_text.tolist() == parquet.token_text.tolist()
    assert len(frame) == len(_direct(runs_dir, "tokens"))


def test_table_output_fits_80_columns_and_names_what_it_leaves_out(runs_dir):
    proc = _query(runs_dir, "SELECT * FROM tokens")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert lines[0].split()[:3] == ["run_id", "sequence", "position"]
    assert any("columns left out" in line for line in lines) and "first 100 rows" in proc.stdout


@pytest.mark.parametrize(
    "sql, fragment",
    [("SELEC 1", "Parser Error"), ("SELECT * FROM nope", "views: runs"), ("SELECT nope FROM runs", "Binder Error")],
)
def test_bad_sql_is_one_line_exit_2(runs_dir, sql, fragment):
    proc = lmtrace(runs_dir.parent, "query", sql, "--runs-dir", str(runs_dir), "-f", "csv")
    # the error is the last line and the only one but the damaged run's warning (when the SQL reads runs)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and proc.returncode == 2, proc.stderr
    assert lines[-1].startswith("error: ") and fragment in lines[-1]
    assert all(line.startswith("warning: run 20260101-000004-000eeeeee") for line in lines[:-1]) and len(lines) <= 2


def test_format_flags_are_checked(runs_dir, tmp_path):
    assert_one_line_error(lmtrace(tmp_path, "query", "SELECT 1", "-f", "parquet"), 2, "--out")
    assert_one_line_error(lmtrace(tmp_path, "query", "SELECT 1", "-f", "xml"), 2, "formats: table, csv")
    assert_one_line_error(lmtrace(tmp_path, "query", "SELECT 1", "--out", str(tmp_path / "x.txt")), 2, "--format")


def test_out_that_cannot_be_a_file_is_one_line_exit_2(tmp_path):
    assert_one_line_error(
        lmtrace(tmp_path, "query", "SELECT 1", "--out", str(tmp_path), "-f", "csv"), 2, "is a directory"
    )
    assert_one_line_error(
        lmtrace(tmp_path, "query", "SELECT 1", "--out", str(tmp_path / "no" / "x.csv")), 2, "does not exist"
    )


def test_a_file_damaged_without_a_size_change_skips_its_run_when_read(runs_dir, tmp_path):
    root = tmp_path / "runs"
    good = shutil.copytree(runs_dir / "20260101-000000-000aaaaaa", root / "20260101-000000-000aaaaaa")
    bad = shutil.copytree(good, root / "20260101-000009-000ffffff")
    _rename(bad, "20260101-000009-000ffffff")
    data = bytearray((bad / "sequences.parquet").read_bytes())
    data[4 : len(data) - 8] = bytes(len(data) - 12)  # same size: the stat check cannot see it
    (bad / "sequences.parquet").write_bytes(bytes(data))
    proc = _query(root, "SELECT run_id, count(*) AS n FROM sequences GROUP BY run_id", "-f", "json")
    assert _frame(proc).run_id.tolist() == ["20260101-000000-000aaaaaa"]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: run 20260101-000009-000ffffff is damaged"), proc.stderr


def test_a_file_duckdb_fails_to_read_is_pinned_to_its_own_run(runs_dir, tmp_path, monkeypatch, capsys):
    """Past the byte check (here: switched off), DuckDB's error quotes every file of the view; the run
    whose file fails is the one found by reading each file alone, not the first run the message names."""
    import lmtrace.commands.query as query

    root = tmp_path / "runs"
    shutil.copytree(runs_dir / "20260101-000000-000aaaaaa", root / "20260101-000000-000aaaaaa")
    bad = shutil.copytree(runs_dir / "20260101-000000-000aaaaaa", root / "20260101-000009-000ffffff")
    _rename(bad, "20260101-000009-000ffffff")
    data = bytearray((bad / "tokens.parquet").read_bytes())
    data[4 : len(data) - 8] = bytes(len(data) - 12)  # same size, does not decode
    (bad / "tokens.parquet").write_bytes(bytes(data))
    monkeypatch.setattr(query, "damaged_runs", lambda *args: [], raising=False)
    monkeypatch.delenv("LMTRACE_RUNS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # ./runs, as the views name the files: relative
    query.query_command("SELECT run_id, count(*) AS n FROM tokens GROUP BY ALL", fmt="json")
    captured = capsys.readouterr()
    got = pd.read_json(io.StringIO(captured.out), lines=True)
    assert got.run_id.tolist() == ["20260101-000000-000aaaaaa"]
    assert got.n.tolist() == [len(pd.read_parquet(root / "20260101-000000-000aaaaaa" / "tokens.parquet"))]
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "warning: run 20260101-000009-000ffffff is damaged (tokens.parquet does not decode"
    ), captured.err


def test_an_older_archive_s_head_column_reads_as_q_head(runs_dir, tmp_path):
    """Archives written before the rename call the query-head column `head` (pandas' DataFrame.head):
    the views, read_sweep and the report's heads read it as `q_head`, next to newer runs."""
    from lmtrace.archive.reader import Run
    from lmtrace.archive.sweeps import read_sweep

    root = tmp_path / "runs"
    new = shutil.copytree(runs_dir / "20260101-000000-000aaaaaa", root / "20260101-000000-000aaaaaa")
    old = shutil.copytree(new, root / "20260101-000008-000abcdef")
    _rename(old, "20260101-000008-000abcdef")
    sweep_file = next(p for p in (old / "sweeps").iterdir() if not p.name.startswith(".")) / "sweep.parquet"
    for f in (old / "analysis" / "heads.parquet", sweep_file):
        t = pq.read_table(f)
        assert "q_head" in t.column_names and "head" not in t.column_names
        pq.write_table(t.rename_columns(["head" if n == "q_head" else n for n in t.column_names]), f)
    heads = _frame(_query(root, "SELECT run_id, layer, q_head, label FROM heads ORDER BY ALL", "-f", "json"))
    want = (
        pd.read_parquet(new / "analysis" / "heads.parquet")[["layer", "q_head", "label"]]
        .sort_values(["layer", "q_head", "label"])
        .values.tolist()
    )
    for run_id in ("20260101-000000-000aaaaaa", "20260101-000008-000abcdef"):
        assert heads[heads.run_id == run_id][["layer", "q_head", "label"]].values.tolist() == want
    assert read_sweep(Run(old)).column_names == read_sweep(Run(new)).column_names
    assert read_sweep(Run(old)).column("q_head").to_pylist() == read_sweep(Run(new)).column("q_head").to_pylist()


def test_heads_by_view_has_every_group_and_head_of_the_heads_by_files(runs_dir):
    got = _frame(_query(runs_dir, "SELECT * FROM heads_by ORDER BY run_id, group_value, layer, q_head", "-f", "json"))
    frames = []
    for run in sorted(runs_dir.iterdir()):
        f = run / "analysis" / "heads_by_stop_reason.parquet"
        if run.name.endswith("eeeeee") or not f.is_file():
            continue
        t = pd.read_parquet(f)
        # the group's value: `group_value` (the group's own name space), or in files written before, the
        # column named after the sequences.parquet column, first
        value = t["group_value"] if "group_value" in t.columns else t[t.columns[0]]
        frames.append(
            pd.DataFrame(
                {
                    "run_id": run.name,
                    "group_value": value.astype(str),
                    "layer": t.layer,
                    "q_head": t.q_head,
                    "n_sequences": t.n_sequences,
                    "induction_score": t.induction_score,
                }
            )
        )
    want = pd.concat(frames).sort_values(["run_id", "group_value", "layer", "q_head"]).reset_index(drop=True)
    assert len(want) > 0 and len(got) == len(want)
    assert set(got.group_column) == {"stop_reason"}
    for col in ("run_id", "group_value", "layer", "q_head", "n_sequences"):
        assert got[col].astype(str).tolist() == want[col].astype(str).tolist(), col
    np.testing.assert_allclose(got.induction_score.astype(float), want.induction_score.astype(float), rtol=1e-6)


def test_runs_view_counts_an_unsharded_run_as_one_shard(runs_dir):
    got = _frame(_query(runs_dir, "SELECT run_id, status, shards_complete FROM runs ORDER BY run_id", "-f", "json"))
    for row in got.itertuples():
        manifest = json.loads((runs_dir / row.run_id / "manifest.json").read_text())
        assert manifest.get("shards", 1) == 1
        assert row.shards_complete == ("1/1" if manifest["status"] == "complete" else "0/1"), row


def test_csv_quotes_only_the_fields_that_need_it(tmp_path):
    import csv

    rows = [("a,b", 1, None), ('say "hi"', 2, "x"), ("two\nlines", 3, "plain"), ("café", -4, "tab\there")]
    values = ", ".join(
        "("
        + ", ".join(
            "NULL" if v is None else str(v) if isinstance(v, int) else "'" + v.replace("'", "''") + "'" for v in row
        )
        + ")"
        for row in rows
    )
    sql = f"SELECT * FROM (VALUES {values}) t(text, n, other) ORDER BY n DESC"
    want = io.StringIO()
    writer = csv.writer(want, quoting=csv.QUOTE_MINIMAL, lineterminator="\n")
    writer.writerow(["text", "n", "other"])
    writer.writerows(sorted(rows, key=lambda r: -r[1]))
    proc = lmtrace(tmp_path, "query", sql, "-f", "csv")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want.getvalue()
    assert lmtrace(tmp_path, "query", sql, "--out", str(tmp_path / "o.csv")).returncode == 0
    assert (tmp_path / "o.csv").read_text() == want.getvalue()


def test_csv_is_what_duckdb_s_own_writer_writes(tmp_path):
    import duckdb

    sql = (
        "SELECT i, i / 3 AS third, 1e-7 * i AS tiny, 0.0 AS zero, [i, i + 1] AS pair, {'k': i} AS rec, "
        "TIMESTAMP '2026-01-01 00:00:00' + INTERVAL (i) HOUR AS at, i % 2 = 0 AS even, "
        "CASE WHEN i = 1 THEN '' WHEN i = 2 THEN NULL ELSE 'a,b \"c\"' END AS text, 1.5::DECIMAL(5, 2) AS d "
        "FROM range(4) r(i) ORDER BY i"
    )
    duckdb.execute(f"COPY ({sql}) TO '{tmp_path / 'duck.csv'}' (HEADER)")
    proc = lmtrace(tmp_path, "query", sql, "-f", "csv")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (tmp_path / "duck.csv").read_text()


def test_a_changed_page_of_an_unfinished_run_s_part_fails_its_checksum_and_skips_the_run(runs_dir, tmp_path):
    """No checksums are recorded before completion: the parts' Parquet page checksums find the change."""
    root = tmp_path / "runs"
    good = shutil.copytree(runs_dir / "20260101-000003-000dddddd", root / "20260101-000003-000dddddd")
    bad = shutil.copytree(good, root / "20260101-000005-000ffffff")
    _rename(bad, "20260101-000005-000ffffff")
    part = bad / "tokens.parts" / "b000000.parquet"
    t = pq.read_table(part)
    # page checksums, as the writer stores parts; plain values, so a changed byte still decodes
    pq.write_table(t, part, compression="none", use_dictionary=False, write_page_checksum=True)
    probs = pq.ParquetFile(part).metadata.row_group(0).column(t.schema.get_field_index("prob"))
    raw = bytearray(part.read_bytes())
    raw[probs.data_page_offset + probs.total_compressed_size - 3] ^= 0x01  # the last value's byte
    part.write_bytes(bytes(raw))
    assert pq.read_table(part).num_rows == t.num_rows  # readers that skip the checksums see no damage
    proc = _query(root, "SELECT run_id, count(*) AS n FROM tokens GROUP BY run_id", "-f", "json")
    assert _frame(proc).run_id.tolist() == ["20260101-000003-000dddddd"]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "warning: run 20260101-000005-000ffffff is damaged (tokens.parts/b000000.parquet is changed"
    ), proc.stderr


# ---- the recipes of docs/query.md, each against pandas on the files ------------------------------


def _recipes() -> dict[int, str]:
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "query.md").read_text()
    found = re.findall(r"^### (\d+)\. [^\n]*\n(?:[^\n]*\n)*?```sql\n(.*?)```", text, flags=re.MULTILINE | re.DOTALL)
    return {int(n): sql for n, sql in found}


def _runs_direct(root: Path) -> pd.DataFrame:
    rows = []
    for run in sorted(root.iterdir()):
        m = json.loads((run / "manifest.json").read_text())
        if not run.name.endswith("eeeeee"):
            rows.append(
                {
                    "run_id": m["run_id"],
                    "kind": m["kind"],
                    "status": m["status"],
                    "parent": (m.get("parent") or {}).get("run_id"),
                }
            )
    return pd.DataFrame(rows)


def _analysis_direct(root: Path, name: str) -> pd.DataFrame:
    frames = [
        pd.read_parquet(run / "analysis" / name).assign(run_id=run.name)
        for run in sorted(root.iterdir())
        if not run.name.endswith("eeeeee") and (run / "analysis" / name).is_file()
    ]
    return pd.concat(frames, ignore_index=True)


def _sweeps_direct(root: Path) -> pd.DataFrame:
    frames = []
    for run in sorted(root.iterdir()):
        if run.name.endswith("eeeeee") or not (run / "sweeps").is_dir():
            continue
        for d in sorted(p for p in (run / "sweeps").iterdir() if not p.name.startswith(".")):
            frames.append(pd.read_parquet(d / "sweep.parquet").assign(run_id=run.name, sweep_id=d.name))
    return pd.concat(frames, ignore_index=True)


def _effects_direct(root: Path) -> pd.DataFrame:
    frames = [
        pd.read_parquet(run / "effects.parquet").assign(run_id=run.name)
        for run in sorted(root.iterdir())
        if (run / "effects.parquet").is_file()
    ]
    return pd.concat(frames, ignore_index=True)


def _expected(n: int, root: Path) -> pd.DataFrame:
    """Recipe n's answer, computed with pandas from the Parquet files and manifests."""
    tokens = _direct(root, "tokens")
    gen = tokens[~tokens.is_prompt.astype(bool)]
    if n == 1:
        return _runs_direct(root).groupby(["kind", "status"]).size().rename("runs").reset_index()
    if n == 2:
        seqs = _direct(root, "sequences")[["run_id", "sequence", "prompt"]]
        out = gen.merge(seqs, on=["run_id", "sequence"])
        out = out.sort_values(["prob", "run_id", "sequence", "step"]).head(10)
        return out[["run_id", "sequence", "step", "token_text", "prob", "prompt"]]
    if n == 3:
        g = gen.groupby(["run_id", "sequence"]).agg(mean_logprob=("logprob", "mean"), tokens=("logprob", "size"))
        return g.reset_index().sort_values(["mean_logprob", "run_id", "sequence"]).head(5)
    if n == 4:
        seqs = _direct(root, "sequences")
        return seqs.groupby(["run_id", "stop_reason"]).size().rename("sequences").reset_index()
    if n == 5:
        unsure = gen.stability.isin(["fragile", "tie"]).astype(float)
        g = gen.assign(u=unsure).groupby("run_id").agg(unsure_share=("u", "mean"), tokens=("u", "size"))
        return g.reset_index()
    if n == 6:
        h = _analysis_direct(root, "heads_per_sequence.parquet")
        h = h[h.n_induction_rows > 0]
        g = (
            h.groupby(["run_id", "layer", "q_head"])
            .agg(
                induction=("induction_score", "mean"),
                induction_sequences=("label", lambda x: int((x == "induction").sum())),
                sequences=("label", "size"),
            )
            .reset_index()
        )
        return g.sort_values(["induction", "run_id", "layer", "q_head"], ascending=[False, True, True, True]).head(5)
    if n == 7:
        e = _effects_direct(root)
        e = e[e.winner_changed.fillna(False).astype(bool)]
        runs = _runs_direct(root).set_index("run_id")
        g = e.groupby("run_id").step.min().rename("first_changed_step").reset_index()
        g["parent"] = [runs.parent[r] for r in g.run_id]
        return g.rename(columns={"run_id": "child"}).sort_values(["first_changed_step", "child"])[
            ["child", "parent", "first_changed_step"]
        ]
    if n == 8:
        w = _sweeps_direct(root)
        w = w[w.metric == "logprob"].merge(
            _direct(root, "sequences")[["run_id", "sequence", "stop_reason"]], on=["run_id", "sequence"]
        )
        g = (
            w.groupby(["run_id", "sweep_id", "layer", "stop_reason"])
            .agg(mean_effect=("effect", "mean"), rows=("effect", "size"))
            .reset_index()
        )
        return g.rename(columns={"stop_reason": "condition"})
    if n == 9:
        st = _direct(root, "steps").drop_duplicates(["run_id", "sequence", "step", "settle_layer"])
        return st.groupby(["run_id", "settle_layer"]).size().rename("steps").reset_index()
    if n == 10:
        e = _effects_direct(root)
        g = e.groupby("run_id").agg(mean_shift=("logprob_shift", "mean"), max_kl=("kl_parent_child_topk", "max"))
        return g.reset_index().sort_values(["mean_shift", "run_id"])
    raise AssertionError(n)


def test_docs_query_has_ten_recipes():
    assert sorted(_recipes()) == list(range(1, 11))


@pytest.mark.parametrize("n", range(1, 11))
def test_recipe_equals_pandas_on_the_files(runs_dir, n, capsys):
    from lmtrace.commands.query import query_command

    query_command(_recipes()[n], runs_dir=str(runs_dir), fmt="json")
    got = pd.read_json(io.StringIO(capsys.readouterr().out), lines=True, dtype=False)
    want = _expected(n, runs_dir).reset_index(drop=True)
    assert len(want) > 0, "the fixture must give every recipe something to find"
    assert set(want.columns) <= set(got.columns), (list(got.columns), list(want.columns))
    assert len(got) == len(want), (got, want)
    for col in want.columns:
        a, b = got[col].tolist(), want[col].tolist()
        if all(
            isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
            for v in a + b
            if v is not None
        ):
            np.testing.assert_allclose(
                np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=1e-5, err_msg=f"recipe {n}, column {col}"
            )
        else:
            assert a == b, f"recipe {n}, column {col}"
