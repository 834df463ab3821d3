"""`lmtrace query` at scale (issue 34's speed targets): a query over 1,000 runs in <= 5 s, and a
GROUP BY over every token of a 10,000-sequence run in <= 2 s.

The runs are copies of one real small run (by default one the bench generates with the embedded
model: 2 prompts, 24 new tokens, the default capture): every file hard-linked (so the archive's
size checks see the real files), the manifest rewritten with a new run id. The 10,000-sequence run
is the same run with its tables repeated, sequence numbers renumbered (tokens.parquet,
sequences.parquet, steps.parquet; its tensors are the source's, which a query never reads).
Times are of `lmtrace query` as a user runs it: a process, Python's start and imports included
(printed apart: `SELECT 1` with no view).

    .venv/bin/python bench/query_bench.py [--source RUN_DIR] [--runs 1000] [--sequences 10000] [--repeats 3]
                                          [--out bench/results/query.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
SPEC = """\
prompts: ["The history of the city of Paris begins with", "A short poem about the sea:"]
generation: {max_new_tokens: 24, batch_size: 2}
"""


def lmtrace(runs: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    env = {
        **os.environ,
        "LMTRACE_RUNS_DIR": str(runs),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lmtrace", *args], env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"lmtrace {' '.join(args)} failed: {proc.stderr.strip()}")
    return took, proc


def make_source(tmp: Path) -> Path:
    spec = tmp / "spec.yaml"
    spec.write_text(SPEC)
    lmtrace(tmp / "source", "generate", str(spec), "-q")
    return next(p for p in (tmp / "source").iterdir() if (p / "manifest.json").is_file())


def link_copy(source: Path, dest: Path, run_id: str) -> None:
    """`source` as `dest`: every file hard-linked, except the manifest, rewritten with `run_id`."""
    for base, _dirs, files in os.walk(source):
        rel = Path(base).relative_to(source)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for f in files:
            if rel == Path(".") and f == "manifest.json":
                continue
            os.link(Path(base) / f, dest / rel / f)
    manifest = json.loads((source / "manifest.json").read_text())
    manifest["run_id"] = run_id
    (dest / "manifest.json").write_text(json.dumps(manifest))


def widen(source: Path, dest: Path, sequences: int) -> int:
    """A copy of `source` whose tables hold `sequences` sequences (the source's repeated, renumbered);
    returns the token rows."""
    link_copy(source, dest, "20270101-000000-000wide00")
    n0 = pq.read_table(source / "sequences.parquet").num_rows
    rows = 0
    for name in ("tokens", "sequences", "steps"):
        path = source / f"{name}.parquet"
        if not path.is_file():
            continue
        t = pq.read_table(path)
        copies = []
        for k in range(-(-sequences // n0)):
            shifted = pc.add(t.column("sequence"), pa.scalar(k * n0, t.schema.field("sequence").type))
            copies.append(t.set_column(t.schema.get_field_index("sequence"), "sequence", shifted))
        big = pa.concat_tables(copies)
        big = big.filter(pc.less(big.column("sequence"), sequences))
        (dest / f"{name}.parquet").unlink()
        pq.write_table(big, dest / f"{name}.parquet")
        rows = big.num_rows if name == "tokens" else rows
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest.pop("checksums", None)  # its tables were rewritten: a run completed before checksums existed
    (dest / "checksums.json").unlink(missing_ok=True)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return rows


def best(runs: Path, repeats: int, *args: str) -> float:
    return min(lmtrace(runs, "query", *args)[0] for _ in range(repeats))


def in_process(root: Path, sql: str, repeats: int) -> dict:
    """The same query inside this process, split into reading the catalog (manifests, the files'
    stat checks), checking the bytes of the files it reads (query/check.py) and DuckDB (building the
    views the SQL names, running it, the result as Arrow)."""
    sys.path.insert(0, str(REPO))
    from lmtrace.archive.sql_views import connect, named_views
    from lmtrace.archive.table_catalog import read_catalog
    from lmtrace.query.check import damaged_runs

    catalog_s, check_s, duckdb_s = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        catalog = read_catalog(root)
        t1 = time.perf_counter()
        views = named_views(sql)
        damaged = damaged_runs(catalog, views, set())
        assert not damaged, damaged
        t2 = time.perf_counter()
        con = connect(catalog, views)
        con.sql(sql).to_arrow_table()
        con.close()
        catalog_s.append(t1 - t0)
        check_s.append(t2 - t1)
        duckdb_s.append(time.perf_counter() - t2)
    return {"catalog_s": min(catalog_s), "check_s": min(check_s), "duckdb_s": min(duckdb_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, help="a small complete run to copy (default: generate one)")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--sequences", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="query-bench-") as tmp_name:
        tmp = Path(tmp_name)
        source = args.source or make_source(tmp)
        many = tmp / "many"
        t0 = time.perf_counter()
        for i in range(args.runs):
            link_copy(source, many / f"20270101-{i:06d}-000{i:06x}", f"20270101-{i:06d}-000{i:06x}")
        print(f"{args.runs} runs made in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        wide = tmp / "wide"
        token_rows = widen(source, wide / "20270101-000000-000wide00", args.sequences)
        results = {
            "runs": args.runs,
            "sequences": args.sequences,
            "token_rows": token_rows,
            "source": str(source),
            "startup_s": best(many, args.repeats, "SELECT 1", "-f", "csv"),
            "runs_view_s": best(many, args.repeats, "SELECT status, count(*) FROM runs GROUP BY status", "-f", "csv"),
            "tokens_over_runs_s": best(
                many,
                args.repeats,
                "SELECT run_id, count(*), avg(logprob) FROM tokens WHERE NOT is_prompt GROUP BY run_id",
                "-f",
                "csv",
                "--out",
                str(tmp / "o.csv"),
            ),
            "group_by_tokens_s": best(
                wide,
                args.repeats,
                "SELECT sequence, count(*), avg(logprob), min(prob) FROM tokens WHERE NOT is_prompt GROUP BY sequence",
                "-f",
                "csv",
                "--out",
                str(tmp / "o2.csv"),
            ),
            "in_process_tokens_over_runs": in_process(
                many,
                "SELECT run_id, count(*), avg(logprob) FROM tokens WHERE NOT is_prompt GROUP BY run_id",
                args.repeats,
            ),
            "in_process_group_by_tokens": in_process(
                wide,
                "SELECT sequence, count(*), avg(logprob), min(prob) FROM tokens WHERE NOT is_prompt GROUP BY sequence",
                args.repeats,
            ),
        }
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
