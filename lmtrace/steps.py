"""One way to name steps on the command line, for every command that takes them.

`0,4,9`, ranges `2-5`, `all`, or a mix; where a command allows it, a stride on a range or on all:
`0-255:4`, `all:8`. Steps are checked against the steps the sequence has."""

from __future__ import annotations

from .errors import SpecError


def parse_steps(text: str, available: int, *, option: str = "--steps", stride: bool = False,
                noun: str = "generated token(s)") -> list[int]:
    """Sorted unique steps named by `text`, each in 0 .. available - 1 (else a one-line SpecError)."""
    steps: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        try:
            body, colon, stride_text = part.partition(":")
            if colon and not stride:
                raise ValueError
            step = int(stride_text) if stride_text else 1
            if step < 1:
                raise ValueError
            if body == "all":
                lo, hi = 0, available - 1
            elif "-" in body[1:]:
                a, b = body.split("-", 1)
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
            else:
                if colon:  # a stride on a single step means nothing
                    raise ValueError
                lo = hi = int(body)
            steps.update(range(lo, hi + 1, step))
        except ValueError:
            strides = ", or a stride like 0-255:4 or all:8" if stride else ""
            raise SpecError(f"{option} {text!r}: expected step numbers like 0,4,9, ranges like 2-5, or all"
                            f"{strides}") from None
    if not steps:
        raise SpecError(f"{option} {text!r}: no steps given")
    bad = sorted(s for s in steps if not 0 <= s < available)
    if bad:
        have = f"steps 0..{available - 1}" if available else "no steps"
        shown = f"{bad[:5]}{' …' if len(bad) > 5 else ''}"
        raise SpecError(f"{option}: step(s) {shown} out of range: this sequence has {available} {noun} ({have})")
    return sorted(steps)
