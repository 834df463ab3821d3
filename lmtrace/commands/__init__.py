"""One thin module per command: resolve runs, lock, call `analysis`, write through `archive`, print.

intervene, sweep, lens, explain (+ explain_render), compare (+ compare_render, its terminal and
markdown rendering), heads, validate, resume (a run's spec for `generate --resume`), ls, show,
verify, serve. `generate` runs `lmtrace.generation` (shared with intervene's replays and resume);
the report command lives in `lmtrace.report`. No command module imports another."""
