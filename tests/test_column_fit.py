"""The one rule `lmtrace query` and `lmtrace ls` fit their terminal tables with (lmtrace/column_fit.py),
against widths added up by hand."""

from __future__ import annotations

from lmtrace.column_fit import fitting_columns


def test_columns_are_left_out_in_the_drop_order_until_the_rest_fit():
    # 10 + 30 + 5 + 5 and three gaps of 2 = 56 > 25; without the last two: 10 + 30 + 2 = 42; the first alone: 10
    assert fitting_columns([10, 30, 5, 5], 25, [3, 2, 1, 0]) == [0]
    # another drop order: the wide column goes first, and then the rest fit (10 + 5 + 5 + 4 = 24)
    assert fitting_columns([10, 30, 5, 5], 25, [1, 3, 2, 0]) == [0, 2, 3]
    assert fitting_columns([10, 30, 5, 5], 56, [3, 2, 1, 0]) == [0, 1, 2, 3]  # exactly the width


def test_refill_takes_back_narrow_columns_that_fit_the_room_left():
    # from the right: 3, 2 and 1 are left out; then 2 (10 + 5 + 2 = 17) and 3 (+ 5 + 2 = 24) fit again, 1 does not
    assert fitting_columns([10, 30, 5, 5], 25, [3, 2, 1, 0], refill=True) == [0, 2, 3]
    assert fitting_columns([10, 30, 5, 6], 25, [3, 2, 1, 0], refill=True) == [0, 2, 3]  # 10 + 5 + 6 + 4 = 25 fits
    assert fitting_columns([10, 30, 5, 7], 25, [3, 2, 1, 0], refill=True) == [0, 2]  # 26 does not


def test_the_last_keep_columns_of_the_drop_order_stay_even_when_too_wide():
    assert fitting_columns([40, 40, 5], 50, [2, 1, 0], keep=2) == [0, 1]
    assert fitting_columns([40, 40, 5], 10, [2, 1, 0]) == [0]
    assert fitting_columns([], 80, []) == []
