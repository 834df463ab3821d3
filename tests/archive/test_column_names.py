"""No table column is an attribute of pandas' DataFrame (or xarray's Dataset): `df.rank == 0`
compares a method, silently. Archives written with the old names (`rank`, `head`) read with
today's (`token_rank`, `head_rank`, `q_head`) through the reader, `lmtrace query` and serve's API."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import zarr

from tests.helpers.cli import lmtrace
from tests.helpers.runs import rerecord_checksums

EXPECTED_TABLES = {
    "tokens.parquet",
    "steps.parquet",
    "sequences.parquet",
    "vocab.parquet",
    "effects.parquet",
    "heads.parquet",
    "heads_per_sequence.parquet",
    "heads_by_topic.parquet",
    "sweep.parquet",
    "sweep_mean.parquet",
    "scores.parts",
    "per_step.parquet",
    "per_layer.parquet",
    "per_head.parquet",
    "pairs.parquet",
}


def _attribute_names(names) -> list[str]:
    """The names that are attributes of pandas.DataFrame, or of xarray.Dataset where xarray is installed."""
    try:
        import xarray
    except ImportError:
        xarray = None
    return [n for n in names if hasattr(pd.DataFrame, n) or (xarray is not None and hasattr(xarray.Dataset, n))]


def test_no_column_of_any_table_is_a_dataframe_attribute(every_table_runs):
    files = sorted(every_table_runs.rglob("*.parquet"))
    seen = {f.parent.name if f.parent.name == "scores.parts" else f.name for f in files}
    assert EXPECTED_TABLES <= seen, EXPECTED_TABLES - seen
    clashes = {str(f.relative_to(every_table_runs)): _attribute_names(pq.read_schema(f).names) for f in files}
    assert not {f: c for f, c in clashes.items() if c}
    # the Zarr stores' array and dimension names (xarray opens them as a Dataset's variables)
    stores = sorted(every_table_runs.rglob("*.zarr"))
    assert {s.name for s in stores} >= {"tensors.zarr", "effects.zarr", "scores.zarr"}
    for store in stores:
        names = set()
        for name, array in zarr.open_group(str(store), mode="r").arrays():
            names |= {name, *(array.metadata.dimension_names or ())}
        assert not _attribute_names(sorted(names)), store


def _old_archive(every_table_runs: Path, root: Path) -> tuple[Path, Path]:
    """runs `new` (as written today) and `old`, a copy whose Parquet files carry the names archives
    had before the renames: tokens' `rank`, heads' `head` and `rank`, sweeps' `head`."""
    new = shutil.copytree(every_table_runs / "runs" / "every-table", root / "new")
    old = shutil.copytree(new, root / "old")
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "run_id": "old"}))
    manifest = json.loads((new / "manifest.json").read_text())
    (new / "manifest.json").write_text(json.dumps({**manifest, "run_id": "new"}))
    before = {"token_rank": "rank", "head_rank": "rank", "q_head": "head"}
    files = [
        old / "tokens.parquet",
        old / "analysis" / "heads.parquet",
        old / "analysis" / "heads_per_sequence.parquet",
        *(old / "sweeps").glob("*/sweep*.parquet"),
    ]
    for f in files:
        t = pq.read_table(f)
        assert set(before) & set(t.column_names), f
        pq.write_table(t.rename_columns([before.get(n, n) for n in t.column_names]), f)
    rerecord_checksums(old)
    return old, new


def test_an_archive_with_the_old_column_names_reads_with_today_s(every_table_runs, tmp_path):
    from lmtrace.archive.reader import Run
    from lmtrace.archive.sweeps import read_sweep
    from tests.helpers.server import LiveServer

    root = tmp_path / "runs"
    old, new = _old_archive(every_table_runs, root)
    stored = pq.read_table(old / "tokens.parquet").to_pandas()  # the old file, read here with pandas
    assert "rank" in stored.columns and "token_rank" not in stored.columns

    # the reader
    assert Run(old).tokens().column_names == Run(new).tokens().column_names
    assert (
        Run(old).tokens().column("token_rank").to_pylist()
        == stored["rank"].astype(object).where(stored["rank"].notna(), None).tolist()
    )
    assert read_sweep(Run(old)).column_names == read_sweep(Run(new)).column_names
    # only some columns, named today: the old file's `rank` is read as `token_rank`
    picked = Run(old).table("tokens", columns=["sequence", "token_rank"])
    assert picked.column_names == ["sequence", "token_rank"]
    assert picked.equals(Run(new).table("tokens", columns=["sequence", "token_rank"]))
    assert read_sweep(Run(old)).column("q_head").to_pylist() == read_sweep(Run(new)).column("q_head").to_pylist()

    # lmtrace query: each run's rows under today's names, the old and the new run side by side
    def rows(sql: str) -> dict:
        proc = lmtrace(root.parent, "query", sql, "--runs-dir", str(root), "-f", "json")
        assert proc.returncode == 0, proc.stderr
        got = [json.loads(line) for line in proc.stdout.splitlines()]
        return {
            run: [{k: v for k, v in r.items() if k != "run_id"} for r in got if r["run_id"] == run]
            for run in ("old", "new")
        }

    tokens = rows("SELECT run_id, sequence, position, token_rank FROM tokens ORDER BY ALL")
    assert tokens["old"] == tokens["new"] and len(tokens["old"]) == len(stored)
    want = stored.sort_values(["sequence", "position"])
    assert [r["token_rank"] for r in tokens["old"]] == [None if pd.isna(x) else int(x) for x in want["rank"]]
    heads = rows("SELECT run_id, layer, q_head, head_rank FROM heads ORDER BY ALL")
    assert heads["old"] == heads["new"] and sorted(r["head_rank"] for r in heads["old"]) == list(range(1, 17))
    per = rows("SELECT run_id, sequence, layer, q_head FROM heads_per_sequence ORDER BY ALL")
    assert per["old"] == per["new"] and per["old"]
    sweeps = rows("SELECT run_id, sweep_id, q_head, metric, effect FROM sweeps ORDER BY ALL")
    assert sweeps["old"] == sweeps["new"] and any(r["q_head"] is not None for r in sweeps["old"])

    # `lmtrace show --step`: the token's rank, from the old column
    proc = lmtrace(root.parent, "show", str(old), "--step", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token"]["rank"] == int(
        want[(want.sequence == 0) & (want.step == 1)]["rank"].iloc[0]
    )

    # serve's API
    server = LiveServer(root)
    try:
        for run in ("old", "new"):
            strip = server.json(f"/api/runs/{run}/sequences/0")["tokens"]
            seq0 = want[want.sequence == 0]
            assert [t["token_rank"] for t in strip] == [None if pd.isna(x) else int(x) for x in seq0["rank"]]
            step = server.json(f"/api/runs/{run}/sequences/0/steps/1")
            assert step["token"]["token_rank"] == int(seq0[seq0.step == 1]["rank"].iloc[0])
        head_sweep = next(e["id"] for e in Run(old).manifest["sweeps"] if e["over"] == "heads")
        cells = [
            server.json(f"/api/runs/{run}/sweeps/{head_sweep}/cell?metric=rank&layer=1&head=2")
            for run in ("old", "new")
        ]
        assert cells[0] == cells[1] and cells[0]["rows"]
    finally:
        server.stop()
