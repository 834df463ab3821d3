"""`lmtrace report`: a run (or two runs compared) as one self-contained HTML page, and the same
figures as still images.

Reads the archive alone: no model is loaded and torch is not imported. Output is written
atomically (a temporary file renamed into place), so a report is either the old one or the new one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..exits.errors import SpecError
from .analysis_sections import dla_section, heads_section, sweeps_section
from .attention_sections import attention_section
from .blobs import Blobs
from .explain_sections import explain_section
from .feature_sections import features_section
from .page import render_page
from .run_data import RunData
from .sections import (
    Section,
    banner,
    intervention_section,
    layers_section,
    lens_section,
    manifest_section,
    router_section,
    text_section,
)
from .selection import select
from .token_view import token_view_section

REPORT_FILE = "report.html"


@dataclass
class ReportResult:
    path: Path
    bytes: int
    seconds: float
    figures: int
    images: list[Path]
    notes: list[str]

    def summary(self) -> dict:
        return {
            "path": str(self.path),
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "figures": self.figures,
            "images": [str(p) for p in self.images],
            "notes": self.notes,
        }


def _write(path: Path, text: str) -> int:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        data = text.encode("utf-8")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as err:
        raise SpecError(f"cannot write the report to {path}: {err.strerror or err}; choose another --out") from None
    return len(data)


def _finish(
    title: str,
    subtitle: str,
    sections: list[Section],
    blobs: Blobs,
    out: Path,
    *,
    banner_html: str = "",
    notes: list[str],
    png_dir: Path | None,
    t0: float,
    image_format: str = "png",
) -> ReportResult:
    page = render_page(title, subtitle, sections, blobs, banner=banner_html, notes=notes)
    size = _write(out, page)
    images = []
    if png_dir is not None:
        from .static import export_figures

        images = export_figures([f for s in sections for f in s.figures], blobs, Path(png_dir), image_format)
    from ..exits.interrupts import work_recorded

    work_recorded()  # the page (and its images) written: a signal now leaves the exit code at 0
    return ReportResult(Path(out), size, time.perf_counter() - t0, sum(len(s.figures) for s in sections), images, notes)


def report_run(
    ref,
    *,
    runs_dir=None,
    out: Path | None = None,
    sequences: list[int | str] | None = None,
    steps: str | None = None,
    layers: list[int] | None = None,
    attention_step: int | None = None,
    png_dir: Path | None = None,
    image_format: str = "png",
) -> ReportResult:
    """Write the report of one run (default: RUN_DIR/report.html)."""
    t0 = time.perf_counter()
    data = RunData.open(ref, runs_dir)
    sel = select(
        n_sequences=data.n_sequences,
        committed=data.committed,
        captured_layers=data.layers,
        sequences=sequences,
        steps=steps,
        layers=layers,
        attention_step=attention_step,
    )
    blobs = Blobs()
    capture_none = not data.has_steps
    sections = [manifest_section(data), text_section(data, sel)]
    if capture_none:
        sections.append(
            Section(
                "internals",
                "Internals",
                notes=[
                    "this run was forward-only (`capture: none`): it archived tokens, probabilities and alternatives only; "
                    "capture attention, the logit lens and per-layer statistics with the spec's `capture:` section"
                ],
            )
        )
    else:
        sections += [
            token_view_section(data, sel),
            *filter(None, [features_section(data, sel)]),  # None: the run has no feature arrays
            attention_section(data, sel, blobs),
            lens_section(data, sel, blobs),
            layers_section(data, sel, blobs),
        ]
        router = router_section(data, sel, blobs)
        if router is not None:
            sections.append(router)
        if {"attn", "attn_topk_idx"} & data.arrays:
            sections.append(heads_section(data, blobs))
        dla = dla_section(data, sel, blobs)
        if dla is not None:
            sections.append(dla)
    inter = intervention_section(data, sel, blobs)
    if inter is not None:
        sections.append(inter)
    sections.append(explain_section(data, sel, blobs))
    sweeps = sweeps_section(data, blobs)
    if sweeps is not None:
        sections.append(sweeps)
    m = data.manifest
    subtitle = (
        f"{(m.get('model') or {}).get('reference')} · {m.get('kind')} · {data.run.status} · created {m.get('created')}"
    )
    out = Path(out) if out is not None else data.run.path / REPORT_FILE
    return _finish(
        f"lmtrace run {data.run.id}",
        subtitle,
        sections,
        blobs,
        out,
        banner_html=banner(data, sel),
        notes=sel.notes,
        png_dir=png_dir,
        t0=t0,
        image_format=image_format,
    )


def report_compare(
    ref_a,
    ref_b,
    *,
    runs_dir=None,
    out: Path | None = None,
    pair: str = "auto",
    allow_incomplete: bool = False,
    png_dir: Path | None = None,
    image_format: str = "png",
    comparison=None,
) -> ReportResult:
    """Write the report of `lmtrace compare A B` (default: A's run directory, compare-<B>.html)."""
    from ..analysis.compare import compare_runs
    from .compare_sections import compare_sections

    t0 = time.perf_counter()
    cmp = comparison or compare_runs(ref_a, ref_b, runs_dir=runs_dir, allow_incomplete=allow_incomplete, pair=pair)
    blobs = Blobs()
    sections = compare_sections(cmp, blobs)
    out = Path(out) if out is not None else Path(cmp.a["path"]) / f"compare-{cmp.b['run_id']}.html"
    return _finish(
        f"lmtrace compare {cmp.a['run_id']} ↔ {cmp.b['run_id']}",
        cmp.verdict,
        sections,
        blobs,
        out,
        notes=list(cmp.notes),
        png_dir=png_dir,
        t0=t0,
        image_format=image_format,
    )


def report_runs(
    runs: list[str],
    *,
    runs_dir=None,
    out: Path | None = None,
    sequences: list[int | str] | None = None,
    steps: str | None = None,
    layers: list[int] | None = None,
    attention_step: int | None = None,
    png: Path | None = None,
    svg: Path | None = None,
    pair: str = "auto",
    allow_incomplete: bool = False,
) -> ReportResult:
    """`lmtrace report RUN [RUN_B]`: one run's report, or two runs' comparison (pair, allow_incomplete);
    the figures also as PNG or SVG files into png or svg (one of them). Raises SpecError."""
    if png is not None and svg is not None:
        raise SpecError("give --png DIR or --svg DIR, not both")
    images, fmt = (svg, "svg") if svg is not None else (png, "png")
    if len(runs) == 1:
        return report_run(
            runs[0],
            runs_dir=runs_dir,
            out=out,
            sequences=sequences,
            steps=steps,
            layers=layers,
            attention_step=attention_step,
            png_dir=images,
            image_format=fmt,
        )
    if len(runs) == 2:
        return report_compare(
            runs[0],
            runs[1],
            runs_dir=runs_dir,
            out=out,
            pair=pair,
            allow_incomplete=allow_incomplete,
            png_dir=images,
            image_format=fmt,
        )
    raise SpecError(f"give one run (a run report) or two (a comparison), not {len(runs)}")
