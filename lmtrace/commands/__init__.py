"""One thin module per command: resolve runs, lock, call `analysis`, write through `archive`, print.

generate (+ resume), intervene, sweep, lens, explain, compare (+ compare_render, its terminal and
markdown rendering), heads, validate, ls, show, verify. The report command lives in `lmtrace.report`."""
