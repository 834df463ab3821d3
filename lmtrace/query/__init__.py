"""`lmtrace query`: DuckDB views over every run's tables (`catalog`: which runs and files; `views`:
the SQL views; `output`: the result as a table, CSV, JSON lines or Parquet)."""
