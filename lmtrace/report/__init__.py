"""`lmtrace report`: self-contained HTML pages (and still images) of runs and comparisons.

selection.py           what a page embeds (sequences, steps, layers) and the defaults for large runs
run_data.py            what is read from the archive, by chunks
sections.py            a run's sections: manifest, text, logit lens, layers, routing, interventions
attention_sections.py  its attention
explain_sections.py    its attributions (`lmtrace explain`)
compare_sections.py    a comparison's sections
figures.py             Plotly figure specifications whose numbers are blob references
blobs.py               the numbers embedded in a page (base64 typed arrays) and their reference decoder
page.py                the HTML page, with the vendored plotly.js inlined
static.py              the same figures as PNG / SVG with matplotlib
build.py               report_run / report_compare, and report_runs (`lmtrace report`: one run or two)
"""

from .build import ReportResult, report_compare, report_run, report_runs

__all__ = ["ReportResult", "report_compare", "report_run", "report_runs"]
