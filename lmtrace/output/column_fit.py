"""Which columns of a terminal table fit the terminal's width: one rule for `lmtrace query`,
`lmtrace ls`, and (`fitted_table`, `print_fitted`) `heads`, `sweep`, `compare` and `intervene`.

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


def fitting_columns(
    widths: Sequence[int], width: int, drop_order: Sequence[int], *, gap: int = 2, keep: int = 1, refill: bool = False
) -> list[int]:
    """The indices, in display order, of the columns of `widths` (in display order) shown in `width`
    cells. `drop_order`: every index, the first left out first; the last `keep` are never left out
    (they may still be wider than `width`)."""
    assert sorted(drop_order) == list(range(len(widths))), (drop_order, len(widths))
    kept = set(range(len(widths)))
    dropped: list[int] = []
    for i in drop_order[: max(len(drop_order) - keep, 0)]:
        if table_width([widths[j] for j in kept], gap) <= width:
            break
        kept.remove(i)
        dropped.append(i)
    if refill:
        for i in reversed(dropped):  # most important first
            if table_width([widths[j] for j in kept | {i}], gap) <= width:
                kept.add(i)
    return sorted(kept)


EMPTY_CELLS = ("-", "–", "")  # a cell with nothing to show (`omit_empty`)
WRAP_WIDTH = 16  # the cells a wrapping column is counted at when fitting (its text folds onto more lines)


def drop_order(names: Sequence[str], drop_first: Sequence[str], keep: Sequence[str]) -> tuple[list[int], int]:
    """Every index of `names` once, the first left out first: the columns named in `drop_first` (in
    that order), then the others from the right, last the columns named in `keep` (the first column
    when none is); and how many of those last are never left out. Two columns may have one name
    (a name stands for every column that has it): each index is still in the order once."""
    kept = [j for j, n in enumerate(names) if n in keep] or list(range(len(names)))[:1]
    first = [j for n in dict.fromkeys(drop_first) for j, m in enumerate(names) if m == n and j not in kept]
    rest = [j for j in reversed(range(len(names))) if j not in first and j not in kept]
    return first + rest + kept, len(kept)


def fitted_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int,
    *,
    drop_first: Sequence[str] = (),
    keep: Sequence[str] = (),
    left: Sequence[str] = (),
    wrap: Sequence[str] = (),
    title: str | None = None,
    omit_empty: bool = False,
):
    """A borderless rich table (columns two spaces apart, each cell on one line) of the columns of
    `headers` and `rows` (plain text, in display order) that fit `width`. Columns are left out first
    those named in `drop_first` (in that order), then the others from the right, never those in `keep`
    (nor the first column when `keep` is empty); `omit_empty`: columns with nothing in any cell (`-`,
    not applicable to these rows) are left out whatever the width. `left`: the headers justified left (the
    others right, as numbers); `wrap`: text columns whose cells may fold onto more lines (counted at
    WRAP_WIDTH at most). Returns the table (under its `title`, when given) and the headers of the
    columns left out for width."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    present = [i for i in range(len(headers)) if not (omit_empty and rows and all(r[i] in EMPTY_CELLS for r in rows))]
    names = [headers[i] for i in present]
    widths = [max([len(headers[i]), *(len(r[i]) for r in rows)]) for i in present]
    widths = [min(w, WRAP_WIDTH) if headers[i] in wrap else w for i, w in zip(present, widths)]
    order, n_kept = drop_order(names, drop_first, keep)
    shown = [present[j] for j in fitting_columns(widths, width, order, gap=2, keep=n_kept)]
    t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for i in shown:
        folds = headers[i] in wrap
        t.add_column(
            escape(headers[i]),
            justify="left" if headers[i] in left or folds else "right",
            no_wrap=not folds,
            overflow="fold" if folds else "ellipsis",
        )
    for r in rows:
        t.add_row(*(escape(r[i]) for i in shown))
    left_out = [headers[i] for i in present if i not in shown]
    if title is None:
        return t, left_out
    # the title above the table at the terminal's width (a table's own title wraps at the table's)
    return Group(Text(title, style="italic"), t), left_out


def print_fitted(console, headers: Sequence[str], rows: Sequence[Sequence[str]], *, complete_in: str, **how) -> None:
    """`fitted_table` at the console's width, printed, then a line naming the columns it left out and
    where every column is (`complete_in`, e.g. "--json has them")."""
    from rich.text import Text

    table, left_out = fitted_table(headers, rows, console.width, **how)
    console.print(table)
    if left_out:
        console.print(
            Text(f"(left out to fit {console.width} columns: {', '.join(left_out)}; {complete_in})", style="dim")
        )
