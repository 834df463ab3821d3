"""`lmtrace query`: DuckDB views over every run's tables (which runs and files: archive/table_catalog.py;
the SQL views: archive/sql_views.py, shared with `lmtrace stats`), `check`: the files' checksums before
DuckDB reads them, `guard`: a connection that reads only those files, `output`: the result as a table, CSV,
JSON lines or Parquet."""
