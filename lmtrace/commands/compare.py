"""`lmtrace compare A B`: compare two runs (lmtrace.analysis.compare), write the tables and reports
asked for, and print the summary (compare_render) or the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from ..analysis.compare import Comparison, compare_runs
from ..archive import parquet_io
from ..exits.errors import SpecError
from ..output.jsonout import json_line
from ..spec.run_spec import check_device_option
from .compare_render import comparison_markdown, render_comparison


def write_tables(cmp: Comparison, out_dir: str | Path) -> list[Path]:
    """per_step / per_layer / per_head / pairs Parquet tables (and summary.json) under out_dir."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpecError(f"cannot create output directory {out} ({err.strerror})") from None
    written = []
    for name, table in cmp.tables().items():
        path = out / f"{name}.parquet"
        parquet_io.write_table(table, path)
        written.append(path)
    path = out / "summary.json"
    path.write_text(json.dumps(cmp.summary(include_steps=False), indent=2))
    written.append(path)
    return written


def compare_view(
    run_a: str,
    run_b: str,
    *,
    runs_dir: str | None = None,
    allow_incomplete: bool = False,
    pair: str = "auto",
    json_out: bool = False,
    out_dir=None,
    top: int = 5,
    html_path=None,
    exact: bool = False,
    exact_steps: str | None = None,
    device: str | None = None,
    quiet: bool = False,
) -> None:
    """`lmtrace compare`: compute, optionally write the tables and report, then print the summary, the JSON,
    or (`quiet`) the verdict line alone."""

    def note(text: str) -> None:
        if not (json_out or quiet):
            print(text, file=sys.stderr)

    if exact_steps is not None and not exact:
        raise SpecError("--exact-steps needs --exact")
    check_device_option(device)  # before the archives are read
    cmp = compare_runs(
        run_a,
        run_b,
        runs_dir=runs_dir,
        allow_incomplete=allow_incomplete,
        pair=pair,
        exact=exact,
        exact_steps=exact_steps,
        device=device,
        note=note,
    )
    if out_dir is not None:
        write_tables(cmp, out_dir)
        (Path(out_dir) / "report.md").write_text(comparison_markdown(cmp, top=max(top, 10)))
    if html_path is not None:
        from ..report import report_compare

        report_compare(run_a, run_b, out=html_path, comparison=cmp)
    if json_out:
        print(json_line(cmp.summary()))
        return
    if quiet:
        print(cmp.verdict)
        return
    console = Console() if Console().is_terminal else Console(width=160, soft_wrap=True)
    render_comparison(cmp, console, top)
    if out_dir is not None:
        console.print(Text(f"wrote per_step/per_layer/per_head/pairs.parquet, summary.json and report.md to {out_dir}"))
