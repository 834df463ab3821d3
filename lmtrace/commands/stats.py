"""`lmtrace stats RUN [--by COLUMN]`: a run's sequences summarised, whole or per group of a column of
sequences.parquet: sequences, generated tokens, mean logprob and entropy, how many steps the logit
lens settles at each layer, and the lowest-probability generated tokens. The numbers come from one
DuckDB query per part over the run's committed tables (the views of `lmtrace query`)."""

from __future__ import annotations

import warnings
from pathlib import Path

from ..archive import parquet_io
from ..archive.groups import GROUP_VALUE, group_header, group_text, sequence_groups
from ..archive.reader import IncompleteRunWarning, open_run, read_table_files
from ..output.jsonout import json_line
from ..query.catalog import Catalog
from ..query.views import connect, ident

LOWEST = 5  # lowest-probability tokens listed per group


def compute_stats(run, by: str | None, lowest: int = LOWEST) -> dict:
    """{"groups": [{group_value, sequences, tokens, mean_logprob, mean_entropy, settle: {layer: steps},
    lowest: [{sequence, step, token_text, prob}]}], "lens": bool}; one group (None) without `by`.
    group_value: the value of `by`, of its type in sequences.parquet (archive/groups.py); groups in
    its order, NaN then null last."""
    if by is not None:
        sequence_groups(run, by)  # an unknown column: one line naming the columns there are
    for table in ("sequences", "tokens", "steps"):  # DuckDB reads pages without their checksums: checked here first
        read_table_files(run.path, table, parquet_io.check_pages)  # (listed again when a running writer merged a part)
    catalog = Catalog(run.path.parent, runs=[{"run_id": run.id, "path": str(run.path)}])
    con = connect(catalog, ["sequences", "tokens", "steps"])
    try:
        value = ident(by) if by is not None else "NULL"
        # gid: the group's place in order (a NaN or a null value is not equal to itself in Python)
        con.execute(
            f"CREATE TEMP VIEW g AS SELECT sequence, {value} AS grp, "
            f"dense_rank() OVER (ORDER BY {value} NULLS LAST) AS gid FROM sequences"
        )
        base = {
            r[0]: {GROUP_VALUE: r[1], "sequences": r[2]}
            for r in con.execute("SELECT gid, any_value(grp), count(*) FROM g GROUP BY gid ORDER BY gid").fetchall()
        }
        for gid, n, lp, ent in con.execute(
            "SELECT gid, count(*), avg(logprob), avg(entropy) FROM tokens JOIN g USING (sequence) "
            "WHERE NOT is_prompt GROUP BY gid"
        ).fetchall():
            base[gid].update(tokens=n, mean_logprob=lp, mean_entropy=ent)
        steps_columns = {r[0] for r in con.execute("DESCRIBE steps").fetchall()}
        lens = "settle_layer" in steps_columns
        if lens:
            for gid, layer, n in con.execute(
                "SELECT gid, settle_layer, count(*) FROM (SELECT DISTINCT sequence, step, settle_layer FROM steps) "
                "JOIN g USING (sequence) GROUP BY ALL ORDER BY ALL"
            ).fetchall():
                base[gid].setdefault("settle", {})[int(layer)] = n
        for gid, seq, step, text, prob in con.execute(
            "SELECT gid, sequence, step, token_text, prob FROM (SELECT g.gid, t.sequence, t.step, t.token_text, "
            "t.prob, row_number() OVER (PARTITION BY g.gid ORDER BY t.prob, t.sequence, t.step) AS k "
            "FROM tokens t JOIN g USING (sequence) WHERE NOT t.is_prompt) "
            f"WHERE k <= {int(lowest)} ORDER BY gid, k"
        ).fetchall():
            base[gid].setdefault("lowest", []).append({"sequence": seq, "step": step, "token_text": text, "prob": prob})
    finally:
        con.close()
    groups = []
    for g in base.values():
        groups.append(
            {
                GROUP_VALUE: g[GROUP_VALUE],
                "sequences": g["sequences"],
                "tokens": g.get("tokens", 0),
                "mean_logprob": g.get("mean_logprob"),
                "mean_entropy": g.get("mean_entropy"),
                "settle": g.get("settle", {}) if lens else None,
                "lowest": g.get("lowest", []),
            }
        )
    return {"run_id": run.id, "by": by, "lens": lens, "groups": groups}


def stats_command(
    ref: str, *, runs_dir: str | None = None, by: str | None = None, json_out: bool = False, lowest: int = LOWEST
) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)  # committed data only, as every view
        run = open_run(ref, runs_dir)
    result = compute_stats(run, by, lowest)
    if json_out:
        print(json_line(result))
    else:
        _print(result, Path(run.path))
    return result


def _print(result: dict, path: Path) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    by = result["by"]
    headers = ["seqs", "tokens", "mean logprob", "mean entropy", "lens settles at layer: steps"]
    group = group_header(by, headers) if by else None
    t = Table(title=escape(f"run {result['run_id']}" + (f" by {by}" if by else "")), title_justify="left")
    for col in ([group] if by else []) + headers:
        t.add_column(escape(col), justify="left" if col in (group, "lens settles at layer: steps") else "right")

    def f(v):
        return "-" if v is None else f"{v:.3f}"

    for g in result["groups"]:
        settle = (
            "(lens not computed)"
            if g["settle"] is None
            else ", ".join(f"{'never' if k < 0 else k}: {n}" for k, n in sorted(g["settle"].items()))
        )
        t.add_row(
            *([escape(group_text(g[GROUP_VALUE]))] if by else []),
            str(g["sequences"]),
            str(g["tokens"]),
            f(g["mean_logprob"]),
            f(g["mean_entropy"]),
            escape(settle),
        )
    console.print(t)
    low = Table(
        title="lowest-probability generated tokens" + (f" per {escape(by)}" if by else ""), title_justify="left"
    )
    headers = ["sequence", "step", "token", "prob"]
    group = group_header(by, headers) if by else None
    for col in ([group] if by else []) + headers:
        low.add_column(escape(col), justify="left" if col in (group, "token") else "right")
    for g in result["groups"]:
        for r in g["lowest"]:
            low.add_row(
                *([escape(group_text(g[GROUP_VALUE]))] if by else []),
                str(r["sequence"]),
                str(r["step"]),
                escape(repr(r["token_text"])),
                f"{r['prob']:.4f}",
            )
    console.print(low)
