"""One way to name steps (and sequences) on the command line, for every command that takes them.

`0,4,9`, ranges `2-5`, `all`, or a mix; where a command allows it, a stride on a range or on all:
`0-255:4`, `all:8`. Steps are checked against the steps the sequence has, sequences against the run's."""

from __future__ import annotations

from ..exits.errors import SpecError


def _span(body: str) -> tuple[int, int]:
    """`4` -> (4, 4), `2-5` -> (2, 5) (the end may come before the start: the caller says what that means);
    ValueError if either end is not an integer."""
    if "-" in body[1:]:
        a, b = body.split("-", 1)
        return int(a), int(b)
    return int(body), int(body)


def _expand(part: str, available: int, stride: bool) -> range:
    """One comma-separated part (`4`, `2-5`, `all`, with `stride`: `0-255:4`, `all:8`); ValueError if malformed."""
    body, colon, stride_text = part.partition(":")
    if colon and not stride:
        raise ValueError
    step = int(stride_text) if stride_text else 1
    if step < 1:
        raise ValueError
    if body == "all":
        lo, hi = 0, available - 1
    else:
        if colon and "-" not in body[1:]:  # a stride on a single step means nothing
            raise ValueError
        lo, hi = _span(body)
        if hi < lo:
            raise ValueError
    return range(lo, hi + 1, step)


def _indices(text: str, available: int, stride: bool) -> set[int]:
    """Every index the comma-separated parts of `text` name; ValueError if a part is malformed."""
    out: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        if part:
            out.update(_expand(part, available, stride))
    return out


def _parse(texts, available: int, *, stride: bool, syntax, empty: str, out_of_range) -> list[int]:
    """Sorted unique indices named by `texts`, each in 0 .. available - 1; else a SpecError with the line
    `syntax(text)`, `empty` or `out_of_range(sorted bad indices)`."""
    chosen: set[int] = set()
    for text in texts:
        try:
            chosen |= _indices(text, available, stride)
        except ValueError:
            raise SpecError(syntax(text)) from None
    if not chosen:
        raise SpecError(empty)
    bad = sorted(x for x in chosen if not 0 <= x < available)
    if bad:
        raise SpecError(out_of_range(bad))
    return sorted(chosen)


def parse_steps(
    text: str, available: int, *, option: str = "--steps", stride: bool = False, noun: str = "generated token(s)"
) -> list[int]:
    """Sorted unique steps named by `text`, each in 0 .. available - 1 (else a one-line SpecError)."""
    strides = ", or a stride like 0-255:4 or all:8" if stride else ""
    have = f"steps 0..{available - 1}" if available else "no steps"
    return _parse(
        [text],
        available,
        stride=stride,
        syntax=lambda t: f"{option} {t!r}: expected step numbers like 0,4,9, ranges like 2-5, or all{strides}",
        empty=f"{option} {text!r}: no steps given",
        out_of_range=lambda bad: (
            f"{option}: step(s) {bad[:5]}{' …' if len(bad) > 5 else ''} out of range: "
            f"this sequence has {available} {noun} ({have})"
        ),
    )


def parse_sequences(texts, n_sequences: int, *, option: str = "--sequence") -> list[int]:
    """Sorted unique sequences named by `texts` (each `0,3`, `0-15` or `all`, as steps are named), each in
    0 .. n_sequences - 1 (else a one-line SpecError)."""
    return _parse(
        list(texts),
        n_sequences,
        stride=False,
        syntax=lambda t: f"{option} {t!r}: expected sequence numbers like 0,3, ranges like 0-15, or all",
        empty=f"{option} {' '.join(map(str, texts))!r}: no sequences given",
        out_of_range=lambda bad: f"{option} {bad[0]} out of range: the run has sequences 0..{n_sequences - 1}",
    )


def parse_range_list(text: str, what: str) -> list[int]:
    """'3-9' or '3,5,7-8' -> [3, 4, ..., 9]: non-negative integers and inclusive ranges, in the order
    given, repeats kept (no `all`, no stride; the caller checks the bounds). `what` names the option in
    the one-line SpecError (the parts are read as steps are, `_span`)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            lo, hi = _span(part)
            if lo < 0:  # `-3`: not a position
                raise ValueError
            if hi < lo:
                raise SpecError(f"{what}: range {part} is empty (it ends before it starts); write {hi}-{lo}")
            out.extend(range(lo, hi + 1))
    except ValueError:
        raise SpecError(f"{what}: {text!r} is not a list of integers or ranges like 3-9") from None
    if not out:
        raise SpecError(f"{what}: {text!r} names no position; give integers or ranges like 3-9")
    return out
