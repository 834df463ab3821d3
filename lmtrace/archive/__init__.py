"""The run archive: layout (names, dims), writer (streaming), reader (typed access)."""
