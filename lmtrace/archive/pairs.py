"""Which sequence of a patch source pairs with which sequence of the patched run (`sweep --edit patch`):
by index (sequence i with sequence i), or by an id column both runs' sequences.parquet hold
(`--pair-by COLUMN`: prompt metadata such as `pair_id`)."""

from __future__ import annotations

from ..exits.errors import SpecError


def _ids(run, column: str, role: str) -> dict[object, int]:
    """id -> sequence of one run; an unknown column, a null or a repeated id is one line."""
    table = run.sequences()
    if column not in table.column_names or column == "sequence":
        available = [c for c in table.column_names if c != "sequence"]
        raise SpecError(
            f"--pair-by {column!r}: sequences.parquet of the {role} run {run.id} has no such column; "
            f"columns: {', '.join(available)}"
        )
    out: dict[object, int] = {}
    for seq, value in zip(table.column("sequence").to_pylist(), table.column(column).to_pylist()):
        if value is None:
            raise SpecError(
                f"--pair-by {column!r}: sequence {seq} of the {role} run {run.id} has no {column}; "
                f"every sequence needs an id to be paired"
            )
        if value in out:
            raise SpecError(
                f"--pair-by {column!r}: id {value!r} appears twice in the {role} run {run.id} "
                f"(sequences {out[value]} and {seq}); ids must be unique per run"
            )
        out[value] = seq
    return out


def pair_sequences(parent, source, seqs: list[int], pair_by: str | None) -> dict[int, tuple[int, str]]:
    """parent sequence -> (source sequence, pair id as text) for the swept parent sequences `seqs`.

    By index (pair_by None) the pair id is the sequence index. With pair_by every swept parent
    sequence's id must be in the source, and when every parent sequence is swept every source id
    must be in the parent (else one line naming the id that has no partner)."""
    n_src = source.sequences().num_rows
    if pair_by is None:
        for s in seqs:
            if s >= n_src:
                raise SpecError(
                    f"source run {source.id} has {n_src} sequences; sequence {s} of run {parent.id} has "
                    f"no partner (sequences are paired by index; pair by an id column with --pair-by)"
                )
        return {s: (s, str(s)) for s in seqs}
    mine, theirs = _ids(parent, pair_by, "patched"), _ids(source, pair_by, "source")
    by_seq = {seq: value for value, seq in mine.items()}
    missing = [by_seq[s] for s in seqs if by_seq[s] not in theirs]
    if missing:
        raise SpecError(
            f"--pair-by {pair_by!r}: id {missing[0]!r} of run {parent.id} is missing in the source run "
            f"{source.id} ({len(missing)} id(s) without a partner)"
        )
    if len(seqs) == len(mine):
        extra = [v for v in theirs if v not in mine]
        if extra:
            raise SpecError(
                f"--pair-by {pair_by!r}: id {extra[0]!r} of the source run {source.id} is missing in run "
                f"{parent.id} ({len(extra)} id(s) without a partner)"
            )
    return {s: (theirs[by_seq[s]], str(by_seq[s])) for s in seqs}
