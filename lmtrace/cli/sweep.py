"""The `sweep` command's glue: flags and/or a YAML sweep spec -> `run_sweep` -> a ranked table or JSON."""

from __future__ import annotations

from pathlib import Path

from ..analysis.sweep.feature_cells import feature_label
from ..commands.sweep import grouped_cells, run_sweep, sweep_groups
from ..exits.errors import SpecError
from ..output.jsonout import json_line
from ..spec.sweep_spec import build_sweep_spec, load_sweep_spec


def _cell(v) -> str:
    """A table cell: '-' for a missing value, else the value as text."""
    return "-" if v is None else str(v)


def _cell4(v) -> str:
    """A table cell with floats at 4 decimals."""
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def _named(cells: list[dict], summary: dict) -> list[dict]:
    """Feature cells named as serve and the report name them, 'feature 123 (sae-l10)', in `component` (their
    id is not repeated under `neuron`); other cells unchanged."""
    sae = (summary.get("features") or {}).get("sae")
    if sae is None:
        return cells
    return [
        {**c, "component": feature_label(c["neuron"], sae), "neuron": None} if c["component"] == "feature" else c
        for c in cells
    ]


def sweep_command(
    run_ref: str,
    *,
    spec_path: Path | None,
    flags: dict,
    runs_dir: str | None,
    run_id: str | None,
    shard: str | None,
    resume: bool,
    top: int,
    json_out: bool,
    quiet: bool,
    note,
    by: str | None = None,
) -> dict:
    data = load_sweep_spec(spec_path) if spec_path is not None else {}
    for key, value in flags.items():  # flags override the file
        if value is not None and value != []:
            data[key] = value
    if "over" not in data:
        raise SpecError(
            "give --over (heads, attn, mlp, layers, neurons:LAYER, positions, resid:A-B, features) or --spec FILE"
        )
    where = str(spec_path) if spec_path is not None else "sweep"
    spec = build_sweep_spec(data, where)
    index, count = 0, 1
    if shard is not None:
        from ..archive.rundir import parse_shard

        shard_obj, slurm_id = parse_shard(shard)
        index, count = shard_obj.index, shard_obj.count
        run_id = run_id or slurm_id
    groups = sweep_groups(run_ref, runs_dir, by) if by is not None else None  # an unknown column before any cell
    result = run_sweep(
        run_ref, spec, runs_dir=runs_dir, sweep_id=run_id, shard=(index, count), resume=resume, top=top, note=note
    )
    summary = {"status": result.status, **result.summary}
    if groups is not None and result.status == "complete":
        summary["by"] = grouped_cells(run_ref, runs_dir, summary["sweep_id"], summary["metric"], groups)
    if json_out:
        print(json_line(summary))
    elif quiet:  # the id alone, for scripts
        print(summary["sweep_id"])
    else:
        _print({**summary, "top": _named(summary.get("top") or [], summary)}, spec)
        if "patching" in summary:
            _print_patching({**summary["patching"], "cells": _named(summary["patching"]["cells"], summary)}, top)
        if "by" in summary:
            _print_grouped({**summary["by"], "cells": _named(summary["by"]["cells"], summary)}, top)
        if "verify" in summary:
            verify = summary["verify"]
            metrics = {k: {**v, "cells": _named(v["cells"], summary)} for k, v in verify["metrics"].items()}
            _print_verify({**verify, "metrics": metrics})
    return summary


def _print_fitted(console, title: str, headers: list[str], rows: list[list[str]], **how) -> None:
    """A sweep table at the console's width: coordinates no cell has (a layer sweep's heads, neurons,
    positions) left out, then `drop_first` where it does not fit, named in a line (the tables in the
    sweep's folder have every column)."""
    from ..output.column_fit import print_fitted

    print_fitted(console, headers, rows, complete_in="--json has them", title=title, omit_empty=True, **how)


def _print_patching(patching: dict, top: int) -> None:
    from rich.console import Console

    fmt = _cell
    rows = [
        [
            c["component"],
            *(fmt(c[k]) for k in ("layer", "q_head", "neuron", "position")),
            f"{c['effect']:.4f}",
            "-" if c["low"] is None else f"[{c['low']:.4f}, {c['high']:.4f}]",
            str(c["n_pairs"]),
        ]
        for c in patching["cells"][:top]
    ]
    _print_fitted(
        Console(),
        f"normalised patching effect on {patching['metric']} (patched - corrupted) / (clean - "
        f"corrupted), clean = {patching['clean']}, corrupted = {patching['corrupted']}: mean over "
        f"{patching['n_pairs']} pairs (by {patching['pair_by']}), 95 % bootstrap interval over pairs; "
        f"top {top}",
        ["component", "layer", "q_head", "neuron", "position", "normalised", "95 % interval", "pairs"],
        rows,
        drop_first=("pairs", "95 % interval"),
        keep=("component", "layer", "normalised"),
        left=("component",),
    )


def _print_grouped(by: dict, top: int) -> None:
    from rich.console import Console

    from ..archive.groups import GROUP_VALUE, group_header, group_text

    fmt = _cell
    groups: dict = {}
    for c in by["cells"]:
        groups.setdefault(group_text(c[GROUP_VALUE]), []).append(c)
    rows = []
    for group, cells in groups.items():
        cells = sorted(cells, key=lambda c: -abs(c["effect"]) if c["effect"] is not None else 0.0)[:top]
        for c in cells:
            interval = "-" if c["low"] is None else f"[{c['low']:.4f}, {c['high']:.4f}]"
            rows.append(
                [
                    group,
                    str(c["n_sequences"]),
                    c["component"],
                    *(fmt(c[k]) for k in ("layer", "q_head", "neuron", "position")),
                    f"{c['effect']:.4f}",
                    interval,
                ]
            )
    headers = ["seqs", "component", "layer", "q_head", "neuron", "position", "effect", "95 % interval"]
    column = group_header(by["column"], headers)
    _print_fitted(
        Console(),
        f"by {by['column']}: the top {top} cells of each group by |mean effect| on "
        f"{by['metric']}, with a 95 % bootstrap interval over its sequences ({by['resamples']} resamples, "
        f"seed {by['seed']})",
        [column, *headers],
        rows,
        drop_first=("95 % interval", "seqs"),
        keep=(column, "component", "layer", "effect"),
        left=(column, "component"),
    )


def _print_verify(verify: dict) -> None:
    from rich.console import Console

    console = Console()
    fmt = _cell
    for metric, found in verify["metrics"].items():
        rho = found["spearman"]
        if not found["cells"]:
            console.print(f"--verify {verify['n']}: {metric} is not estimated")
            continue
        rows = [
            [
                c["component"],
                *(fmt(c[k]) for k in ("layer", "q_head", "neuron", "position")),
                f"{c['estimate']:.4f}",
                f"{c['exact']:.4f}",
            ]
            for c in found["cells"]
        ]
        _print_fitted(
            console,
            f"--verify {verify['n']}: the estimate's top {verify['n']} cells (by {verify['ranked_by']}) "
            f"patched exactly, mean effect on {metric}; Spearman rank correlation "
            f"{'-' if rho is None else f'{rho:.3f}'}",
            ["component", "layer", "q_head", "neuron", "position", "estimate", "exact"],
            rows,
            drop_first=(),
            keep=("component", "layer", "estimate", "exact"),
            left=("component",),
        )


def _print(summary: dict, spec) -> None:
    from rich.console import Console

    console = Console()
    if summary["status"] != "complete":
        console.print(
            f"sweep {summary['sweep_id']}: this shard is complete; the sweep is assembled when the others are"
        )
        return
    fmt = _cell4
    rows = [
        [r["component"], *(fmt(r[k]) for k in ("layer", "q_head", "neuron", "position", "baseline", "value", "effect"))]
        for r in summary["top"]
    ]
    _print_fitted(
        console,
        f"sweep {summary['sweep_id']} of run {summary['run_id']}: {spec.over}"
        f"{' of ' + summary['features']['sae'] if 'features' in summary else ''}, {spec.edit}"
        f"{'' if spec.method == 'exact' else ', estimated by attribution patching'}; "
        f"top {len(summary['top'])} by |mean effect| on {summary['metric']}",
        ["component", "layer", "q_head", "neuron", "position", "baseline", "value", "effect"],
        rows,
        drop_first=("baseline", "value"),
        keep=("component", "layer", "effect"),
        left=("component",),
    )
    console.print(
        f"{summary['n_cells']} cells in {summary['sweep_s']:.1f} s (model load excluded); baseline matches "
        f"the archived log-probs within {summary['baseline_max_abs_diff']:.1e}; tables in {summary['path']}"
    )
