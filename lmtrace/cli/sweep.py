"""The `sweep` command's glue: flags and/or a YAML sweep spec -> `run_sweep` -> a ranked table or JSON."""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecError
from ..jsonout import json_line
from ..commands.sweep import grouped_cells, run_sweep, sweep_groups
from ..sweep_spec import build_sweep_spec, load_sweep_spec


def sweep_command(run_ref: str, *, spec_path: Path | None, flags: dict, runs_dir: str | None, run_id: str | None,
                  shard: str | None, resume: bool, top: int, json_out: bool, quiet: bool, note,
                  by: str | None = None) -> dict:
    data = load_sweep_spec(spec_path) if spec_path is not None else {}
    for key, value in flags.items():  # flags override the file
        if value is not None and value != []:
            data[key] = value
    if "over" not in data:
        raise SpecError("give --over (heads, attn, mlp, layers, neurons:LAYER, positions, resid:A-B) or --spec FILE")
    where = str(spec_path) if spec_path is not None else "sweep"
    spec = build_sweep_spec(data, where)
    index, count = 0, 1
    if shard is not None:
        from ..archive.rundir import parse_shard

        shard_obj, slurm_id = parse_shard(shard)
        index, count = shard_obj.index, shard_obj.count
        run_id = run_id or slurm_id
    groups = sweep_groups(run_ref, runs_dir, by) if by is not None else None  # an unknown column before any cell
    result = run_sweep(run_ref, spec, runs_dir=runs_dir, sweep_id=run_id, shard=(index, count), resume=resume,
                       top=top, note=note)
    summary = {"status": result.status, **result.summary}
    if groups is not None and result.status == "complete":
        summary["by"] = grouped_cells(run_ref, runs_dir, summary["sweep_id"], summary["metric"], by, groups)
    if json_out:
        print(json_line(summary))
    elif quiet:  # the id alone, for scripts
        print(summary["sweep_id"])
    else:
        _print(summary, spec)
        if "patching" in summary:
            _print_patching(summary["patching"], top)
        if "by" in summary:
            _print_grouped(summary["by"], top)
    return summary


def _print_patching(patching: dict, top: int) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(f"normalised patching effect on {patching['metric']} (patched - corrupted) / (clean - "
                           f"corrupted), clean = {patching['clean']}, corrupted = {patching['corrupted']}: mean over "
                           f"{patching['n_pairs']} pairs (by {patching['pair_by']}), 95 % bootstrap interval over "
                           f"pairs; top {top}"), title_justify="left")
    for col in ("component", "layer", "q_head", "neuron", "position", "normalised", "95 % interval", "pairs"):
        t.add_column(escape(col), justify="left" if col == "component" else "right")
    fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
    for c in patching["cells"][:top]:
        interval = "-" if c["low"] is None else f"[{c['low']:.4f}, {c['high']:.4f}]"
        t.add_row(c["component"], *(fmt(c[k]) for k in ("layer", "q_head", "neuron", "position")),
                  f"{c['effect']:.4f}", interval, str(c["n_pairs"]))
    Console().print(t)


def _print_grouped(by: dict, top: int) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    column = by["column"]
    t = Table(title=escape(f"by {column}: the top {top} cells of each group by |mean effect| on {by['metric']}, "
                           f"with a 95 % bootstrap interval over its sequences ({by['resamples']} resamples, "
                           f"seed {by['seed']})"), title_justify="left")
    for col in (column, "seqs", "component", "layer", "q_head", "neuron", "position", "effect", "95 % interval"):
        t.add_column(escape(col), justify="left" if col in (column, "component") else "right")
    fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
    groups: dict = {}
    for c in by["cells"]:
        groups.setdefault(c["group"], []).append(c)
    for group, cells in groups.items():
        cells = sorted(cells, key=lambda c: -abs(c["effect"]) if c["effect"] is not None else 0.0)[:top]
        for c in cells:
            interval = "-" if c["low"] is None else f"[{c['low']:.4f}, {c['high']:.4f}]"
            t.add_row(escape(fmt(group)), str(c["n_sequences"]), c["component"], *(fmt(c[k]) for k in
                      ("layer", "q_head", "neuron", "position")), f"{c['effect']:.4f}", interval)
    Console().print(t)


def _print(summary: dict, spec) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if summary["status"] != "complete":
        console.print(f"sweep {summary['sweep_id']}: this shard is complete; the sweep is assembled when the others are")
        return
    t = Table(title=f"sweep {summary['sweep_id']} of run {summary['run_id']}: {spec.over}, {spec.edit}; "
                    f"top {len(summary['top'])} by |mean effect| on {summary['metric']}")
    for col in ("component", "layer", "q_head", "neuron", "position", "baseline", "value", "effect"):
        t.add_column(col, justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in summary["top"]:
        t.add_row(r["component"], *(fmt(r[k]) for k in ("layer", "q_head", "neuron", "position", "baseline", "value",
                                                         "effect")))
    console.print(t)
    console.print(f"{summary['n_cells']} cells in {summary['sweep_s']:.1f} s (model load excluded); baseline matches "
                  f"the archived log-probs within {summary['baseline_max_abs_diff']:.1e}; tables in {summary['path']}")
