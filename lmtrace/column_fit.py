"""Which columns of a terminal table fit the terminal's width: one rule for `lmtrace query`,
`lmtrace ls` and `lmtrace heads`.

Columns are left out in a drop order (`ls`: its lowest-priority column first; `query`: from the
right) while the others, side by side `gap` spaces apart, are wider than the terminal, down to the
first `keep` columns of the order's reverse. With `refill`, columns left out are then taken back,
most important first, where they still fit the room left (a narrow column after a wide one that
did not fit).
"""

from __future__ import annotations

from collections.abc import Sequence


def table_width(widths: Sequence[int], gap: int) -> int:
    """Cells taken by columns of these widths side by side, `gap` apart."""
    return sum(widths) + gap * max(len(widths) - 1, 0)


def fitting_columns(widths: Sequence[int], width: int, drop_order: Sequence[int], *, gap: int = 2, keep: int = 1,
                    refill: bool = False) -> list[int]:
    """The indices, in display order, of the columns of `widths` (in display order) shown in `width`
    cells. `drop_order`: every index, the first left out first; the last `keep` are never left out
    (they may still be wider than `width`)."""
    assert sorted(drop_order) == list(range(len(widths))), (drop_order, len(widths))
    kept = set(range(len(widths)))
    dropped: list[int] = []
    for i in drop_order[:max(len(drop_order) - keep, 0)]:
        if table_width([widths[j] for j in kept], gap) <= width:
            break
        kept.remove(i)
        dropped.append(i)
    if refill:
        for i in reversed(dropped):  # most important first
            if table_width([widths[j] for j in kept | {i}], gap) <= width:
                kept.add(i)
    return sorted(kept)


def fitted_table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int, drop_order: Sequence[int], *,
                 left: Sequence[int] = (), title: str | None = None):
    """A borderless rich table (columns two spaces apart, each cell on one line) of the columns of
    `headers` and `rows` (plain text, in display order) that fit `width`, left out in `drop_order`
    (see fitting_columns; the last one always stays); `left`: the indices justified left (the others
    right, as numbers). Returns the table and the headers of the columns left out."""
    from rich.markup import escape
    from rich.table import Table

    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    kept = fitting_columns(widths, width, drop_order, gap=2, keep=1)
    t = Table(title=None if title is None else escape(title), title_justify="left", show_edge=False, pad_edge=False,
              box=None, header_style="bold")
    for i in kept:
        t.add_column(escape(headers[i]), justify="left" if i in left else "right", no_wrap=True)
    for r in rows:
        t.add_row(*(escape(r[i]) for i in kept))
    return t, [h for i, h in enumerate(headers) if i not in kept]
