"""Writing one SAE's feature arrays into a complete run (`lmtrace features RUN --sae DIR`): created like
the run's own (chunking, codec, shards, chunk checksums), as `lens_arrays.py` does for the lens.

What is computed lives in `analysis/features/deferred.py`; the command (`commands/features.py`) holds
the run's locks and records the checksums and the manifest afterwards.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from . import layout
from .layout import FeatureShape, feature_arrays


class FeatureArrays:
    """feat_<name>_idx / _val (and the prompt's) of one SAE, created anew: what an interrupted
    `lmtrace features` left (not recorded) is removed first and computed again."""

    def __init__(self, path: Path, like, feature: FeatureShape, sizes: dict[str, int], output: dict):
        """`like`: one of the run's per-step arrays, whose sharding and checksums these follow (None: the
        run has none, the spec's `output` says);
        `sizes`: the run's dimension sizes (sequence, step, prompt_pos, k_feat)."""
        import zarr

        from .shards import checksummed, sequences_per_shard
        from .writer import compressors_for, create_array

        self.specs = feature_arrays(feature)
        for s in self.specs:
            shutil.rmtree(path / layout.TENSORS / s.name, ignore_errors=True)
        # not the consolidated metadata: it lists the arrays of an interrupted run of the command
        group = zarr.open_group(str(path / layout.TENSORS), mode="a", zarr_format=3, use_consolidated=False)
        codec, level, chunk = output["codec"], int(output["level"]), int(output["chunk_steps"])
        self.arrays = {
            s.name: create_array(
                group,
                s,
                tuple(sizes[d] for d in s.dims),
                chunk,
                compressors_for(codec, level, s, checksum=like is None or checksummed(like)),
                chunk_sequences=output.get("chunk_sequences") if like is None else sequences_per_shard(like),
            )
            for s in self.specs
        }
        self.name = feature.name

    def write(self, seqs: slice, ids: np.ndarray, vals: np.ndarray, prompt: bool = False) -> None:
        """A block of whole sequences: ids, vals [n, step | prompt_pos, k_feat]."""
        prefix = "prompt_" if prompt else ""
        self.arrays[f"{prefix}feat_{self.name}_idx"][seqs] = ids
        self.arrays[f"{prefix}feat_{self.name}_val"][seqs] = vals

    @property
    def written(self) -> tuple[str, ...]:
        """The prefixes of the files these arrays wrote (for integrity.record_update)."""
        return tuple(f"{layout.TENSORS}/{s.name}/" for s in self.specs)
