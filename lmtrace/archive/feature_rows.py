"""The `features` view of `lmtrace query`: one row per active SAE latent of every archived token,
read from the runs' feature arrays (feat_<sae>_idx / _val, and the prompt's; docs/archive.md).

Columns: run_id, sequence, position (token position in the sequence), step (null for a prompt
position), sae (the run's name for the SAE), feature (the latent), activation. The arrays are Zarr,
not Parquet: their rows are built here (numpy, one pass per array) and handed to DuckDB as one Arrow
table; a damaged chunk fails its crc32c when read, and the run is left out and named as damaged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("sequence", pa.int32()),
        ("position", pa.int32()),
        ("step", pa.int32()),
        ("sae", pa.string()),
        ("feature", pa.int32()),
        ("activation", pa.float32()),
    ]
)


def _rows(run_id: str, sae: str, idx: np.ndarray, val: np.ndarray, prompt_len: np.ndarray, prompt: bool) -> pa.Table:
    """idx, val [sequence, step | prompt_pos, k]: the rows of the active entries (idx >= 0)."""
    seq, t, _ = np.nonzero(idx >= 0)
    position = t if prompt else prompt_len[seq] + t
    step = pa.nulls(len(seq), pa.int32()) if prompt else pa.array(t.astype(np.int32))
    return pa.table(
        {
            "run_id": pa.array([run_id] * len(seq), pa.string()),
            "sequence": seq.astype(np.int32),
            "position": position.astype(np.int32),
            "step": step,
            "sae": pa.array([sae] * len(seq), pa.string()),
            "feature": idx[idx >= 0].astype(np.int32),
            "activation": val[idx >= 0].astype(np.float32),
        },
        schema=SCHEMA,
    )


def run_feature_rows(run) -> list[pa.Table]:
    """The rows of one run (a reader.Run), every SAE its manifest names."""
    names = set(run.array_names())
    out = []
    prompt_len = np.asarray(run.prompt_len(), dtype=np.int64)
    for f in run.manifest.get("features") or []:
        for prefix, prompt in (("", False), ("prompt_", True)):
            idx_name, val_name = f"{prefix}feat_{f['name']}_idx", f"{prefix}feat_{f['name']}_val"
            if idx_name in names and val_name in names:
                out.append(
                    _rows(
                        run.id,
                        f["name"],
                        np.asarray(run.array(idx_name)[:]),
                        np.asarray(run.array(val_name)[:]),
                        prompt_len,
                        prompt,
                    )
                )
    return out


def features_table(catalog) -> pa.Table:
    """The view's rows over every readable run of the catalog (runs whose arrays fail to read are
    skipped and named in catalog.skipped)."""
    import warnings

    from .reader import IncompleteRunWarning, Run

    tables = []
    for row in list(catalog.runs):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", IncompleteRunWarning)
                run = Run(Path(row["path"]), check=False)
            if not run.manifest.get("features"):
                continue
            tables += run_feature_rows(run)
        except Exception as err:  # noqa: BLE001 - a damaged array: the run is left out, named
            catalog.skip(
                row["run_id"],
                f"feature arrays unreadable ({str(err).splitlines()[0] if str(err) else type(err).__name__})",
            )
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()
