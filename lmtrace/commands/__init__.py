"""One module per command, built on `capture` (the loop) and `archive` (the files).

generate (+ resume), intervene, sweep, lens, explain, compare (+ compare_render, its terminal and
markdown rendering), heads, validate, ls, show, verify. The report command lives in `lmtrace.report`."""
