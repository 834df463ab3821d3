"""The one rule `lmtrace query`, `ls`, `heads` and `sweep` fit their terminal tables with
(lmtrace/output/column_fit.py), against widths added up by hand, and the tables as rich draws them."""

from __future__ import annotations

import io

from rich.console import Console

from lmtrace.output.column_fit import fitted_table, fitting_columns


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


def _drawn(renderable, width: int) -> list[str]:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue().splitlines()


def test_a_fitted_table_draws_the_columns_that_fit_two_spaces_apart_and_names_the_rest():
    headers = ["component", "layer", "q_head", "baseline", "value", "effect"]
    rows = [["layer", "0", "-", "-0.9356", "-10.8698", "-9.9342"], ["layer", "12", "-", "-0.9356", "-1.0", "0.1"]]
    # natural widths 9, 5, 6, 8, 8, 7: q_head is all "-" and left out whatever the width
    table, left_out = fitted_table(headers, rows, 80, omit_empty=True, left=("component",))
    assert left_out == [] and _drawn(table, 80) == [
        "component  layer  baseline     value   effect",
        "layer          0   -0.9356  -10.8698  -9.9342",
        "layer         12   -0.9356      -1.0      0.1",
    ]
    # 30 cells: baseline (named first) goes, then from the right: value; effect is kept, and the title
    # wraps at the width given, not at the table's
    table, left_out = fitted_table(
        headers,
        rows,
        30,
        omit_empty=True,
        drop_first=("baseline",),
        keep=("component", "effect"),
        left=("component",),
        title="a title of some words",
    )
    assert left_out == ["baseline", "value"]
    assert _drawn(table, 30) == [
        "a title of some words",
        "component  layer   effect",
        "layer          0  -9.9342",
        "layer         12      0.1",
    ]
    table, left_out = fitted_table(headers, rows, 10)  # the first column stays when nothing is kept
    assert left_out == headers[1:] and _drawn(table, 10)[0] == "component"


def test_intervene_and_sweep_tables_fit_80_columns(monkeypatch, capsys):
    """The tables `lmtrace intervene` and `lmtrace sweep` print, on an 80-column terminal (COLUMNS is
    rich's width): no line wider, the identifying columns whole, a layer sweep without the coordinates
    no cell has."""
    from types import SimpleNamespace

    from lmtrace.cli import intervene, sweep

    monkeypatch.setenv("COLUMNS", "80")
    intervene._print(
        [
            {
                "run_id": "20261205-091111-4249c3f4a",
                "mode": "regenerate",
                "sequences": [
                    {
                        "sequence": 0,
                        "first_divergence_step": None,
                        "first_divergence": None,
                        "winner_changes": 0,
                        "mean_logprob_shift": -0.163,
                        "max_kl_topk": 0.42,
                    },
                    {
                        "sequence": 1,
                        "first_divergence_step": 1,
                        "first_divergence": {"parent": " waves", "child": " sea"},
                        "winner_changes": 1,
                        "mean_logprob_shift": -0.3627,
                        "max_kl_topk": 0.5,
                    },
                ],
            }
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert [line.split()[:2] for line in lines if line.split()[:1] in (["0"], ["1"])] == [["0", "-"], ["1", "1"]]

    top = [
        {
            "component": "layer",
            "layer": i,
            "q_head": None,
            "neuron": None,
            "position": None,
            "baseline": -0.9356,
            "value": -10.8698,
            "effect": -9.9342,
        }
        for i in range(3)
    ]
    sweep._print(
        {
            "status": "complete",
            "sweep_id": "20261205-090624-366b8fff2",
            "run_id": "demo-20261205T014326",
            "top": top,
            "metric": "logprob",
            "n_cells": 30,
            "sweep_s": 27.3,
            "baseline_max_abs_diff": 5e-6,
            "path": "/runs/demo/sweeps/20261205-090624-366b8fff2",
        },
        SimpleNamespace(over="layers", edit="zero", method="exact"),
    )
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert "component  layer  baseline     value   effect" in lines
    assert "layer          0   -0.9356  -10.8698  -9.9342" in lines


def test_two_columns_with_one_header_are_fitted_as_two_columns():
    """Headers need not be unique (a group column named like another column): every column is fitted
    once, a name in `keep` or `drop_first` standing for each column of that name."""
    headers = ["label", "seqs", "layer", "label", "entropy"]
    rows = [["x", "2", "0", "local", "1.93"], ["y", "1", "3", "sink", "2.00"]]
    # natural widths 5, 4, 5, 5, 7 and four gaps: 34
    table, left_out = fitted_table(headers, rows, 34, keep=("label", "layer"), left=("label",))
    assert left_out == [] and _drawn(table, 34) == [
        "label  seqs  layer  label  entropy",
        "x         2      0  local     1.93",
        "y         1      3  sink      2.00",
    ]
    # 19 cells: entropy and seqs go (from the right), both label columns and layer stay
    table, left_out = fitted_table(headers, rows, 19, keep=("label", "layer"), left=("label",))
    assert left_out == ["seqs", "entropy"] and _drawn(table, 19) == [
        "label  layer  label",
        "x          0  local",
        "y          3  sink ",
    ]  # label: left-justified
    # drop_first by a repeated name leaves out both columns of that name, first of all
    table, left_out = fitted_table(headers, rows, 26, drop_first=("label",), keep=("layer",))
    assert left_out == ["label", "label"] and _drawn(table, 26)[0] == "seqs  layer  entropy"
