"""A run's sequences summarised, whole or per group of a column of sequences.parquet (`lmtrace stats
[--by COLUMN]` and the groups of `lmtrace serve`'s run page): sequences, generated tokens, mean logprob
and entropy, how many steps the logit lens settles at each layer, and the lowest-probability
generated tokens. The numbers come from one DuckDB query per part over the run's committed tables
(the views of `lmtrace query`, archive/sql_views.py)."""

from __future__ import annotations

from ..archive import parquet_io
from ..archive.groups import GROUP_VALUE, sequence_groups
from ..archive.reader import read_table_files
from ..archive.sql_views import connect, ident
from ..archive.table_catalog import Catalog

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
