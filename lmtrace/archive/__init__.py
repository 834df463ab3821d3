"""The run archive on disk: `layout` (names, dims, dtypes), `writer` (streaming blocks to Zarr and
Parquet), `reader` (typed access), `integrity` (checksums, verify), `runs` (run directories, ids,
manifests, locks) and `liveness` (is a run's owner still alive)."""
