"""One thin module per command: resolve runs, lock, call `analysis` or a view, write through `archive`, print.

generate, intervene, sweep, lens, explain (+ explain_render), compare (+ compare_render, its
terminal and markdown rendering), heads, validate, ls, show, verify, serve, query, stats. `generate`
runs `lmtrace.runner.generation` (shared with intervene's replays and resume; `lmtrace.runner.resume`
rebuilds a run's spec for `generate --resume`); the report command lives in `lmtrace.report`. No
command module imports another."""
