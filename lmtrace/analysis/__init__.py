"""The analyses: every quantity lmtrace computes from an archive (and, where needed, a loaded
model), as plain functions over arrays, tables and a model adapter. No printing, no paths, no
locks: commands resolve runs, lock, call these, write through `archive/` and print; the report
(and any other view) calls the same functions, so no two places can show different numbers for
one quantity.
"""
