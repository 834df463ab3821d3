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
from .shards import ShardFiles


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
        # lmtrace's own shard writer (archive/shards.py: the files zarr writes, one encode per inner chunk
        # and one file write per shard), where the arrays' layout allows; else zarr
        self.shards = {
            s.name: ShardFiles.for_array(path / layout.TENSORS / s.name, self.arrays[s.name], s.per_step)
            for s in self.specs
        }

    def write(self, seqs: slice, ids: np.ndarray, vals: np.ndarray, prompt: bool = False) -> None:
        """A block of whole sequences: ids, vals [n, step | prompt_pos, k_feat]."""
        prefix = "prompt_" if prompt else ""
        for name, data in ((f"{prefix}feat_{self.name}_idx", ids), (f"{prefix}feat_{self.name}_val", vals)):
            files = self.shards[name]
            if (
                files is None
                or seqs.start % files.sequences
                or (seqs.stop % files.sequences and seqs.stop != self.arrays[name].shape[0])
            ):
                self.arrays[name][seqs] = data  # not whole shards: zarr merges them
            elif prompt:
                files.write(list(range(seqs.start, seqs.stop)), data)
            else:
                block = files.shard_shape[1]
                for s0 in range(0, data.shape[1], block):
                    files.write(list(range(seqs.start, seqs.stop)), data[:, s0 : s0 + block], s0)

    @property
    def written(self) -> tuple[str, ...]:
        """The prefixes of the files these arrays wrote (for integrity.record_update)."""
        return tuple(f"{layout.TENSORS}/{s.name}/" for s in self.specs)


def _decoder_of(codecs):
    """bytes -> raw bytes for the inner codecs lmtrace writes (bytes little-endian, at most one of zstd /
    blosc, then optionally crc32c, checked), the inverse of `shards.encoder_of`; None for anything else."""
    import google_crc32c
    from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec

    codecs = list(codecs)
    if not codecs or not isinstance(codecs[0], BytesCodec) or getattr(codecs[0].endian, "value", None) != "little":
        return None
    checked = bool(codecs[1:]) and isinstance(codecs[-1], Crc32cCodec)
    rest = codecs[1:-1] if checked else codecs[1:]
    if not rest:
        inner = bytes
    elif len(rest) == 1 and isinstance(rest[0], ZstdCodec):
        from numcodecs import zstd

        # the module's function: the codec object's decode checks its input first, ~40 % slower a chunk
        inner = getattr(zstd, "decompress", None) or zstd.Zstd().decode
    elif len(rest) == 1 and isinstance(rest[0], BloscCodec):
        from numcodecs import Blosc

        inner = Blosc().decode
    else:
        return None
    if not checked:
        return inner

    def decode(blob: bytes):
        body, crc = blob[:-4], blob[-4:]
        if np.uint32(google_crc32c.value(body)).tobytes() != crc:
            raise ValueError("inner chunk checksum mismatch")
        return inner(body)

    return decode


def read_whole(array, sequences: np.ndarray | None = None) -> np.ndarray:
    """All of a sharded archive array (one inner chunk per sequence and block of steps, as the feature
    arrays are), read shard file by shard file and decoded inner chunk by inner chunk, with their
    checksums checked: the values `array[:]` gives, without zarr's per-chunk pipeline (~0.1 ms a chunk:
    seconds for a 10,000-sequence run). `sequences` (a boolean mask over the first dimension): only
    those sequences' inner chunks are decoded, the others read as the fill value. Anything this cannot
    read itself (another layout, a damaged file) is read by zarr, which names the damage as every read
    does."""
    from .shards import read_index, sharding_of

    sharding = sharding_of(array)
    decode = None if sharding is None else _decoder_of(sharding.codecs)
    root = getattr(array.store, "root", None)
    if decode is None or root is None or array.metadata.zarr_format != 3:
        return _zarr_read(array, sequences)
    try:
        return _read_shards(array, Path(root) / array.path, decode, read_index, sequences)
    except (OSError, ValueError, RuntimeError):
        return _zarr_read(array, sequences)


def _zarr_read(array, sequences: np.ndarray | None) -> np.ndarray:
    out = np.asarray(array[:])
    if sequences is not None:
        out[~np.asarray(sequences, dtype=bool)] = array.fill_value
    return out


def read_block(array, start: int, stop: int, pick: tuple[int, int] | None = None) -> np.ndarray:
    """Sequences start..stop-1 of a sharded archive array (as `array[start:stop]`), decoded by
    `read_whole`'s reader: only the shard files holding them are read. `pick` (axis, index): only that
    index of an axis every inner chunk holds whole (a layer of `resid`), the axis dropped (as
    `array[start:stop, ..., index]` on that axis); each inner chunk is still decoded and checked whole,
    but only the picked values are laid out."""
    from .shards import read_index, sharding_of

    sharding = sharding_of(array)
    decode = None if sharding is None else _decoder_of(sharding.codecs)
    root = getattr(array.store, "root", None)
    if decode is None or root is None or array.metadata.zarr_format != 3:
        return _zarr_block(array, start, stop, pick)
    try:
        rows = int(array.shards[0])
        first = start // rows
        block = _read_shards(array, Path(root) / array.path, decode, read_index, None, (first, -(-stop // rows)), pick)
        return block[start - first * rows : stop - first * rows]
    except (OSError, ValueError, RuntimeError):
        return _zarr_block(array, start, stop, pick)


def _zarr_block(array, start: int, stop: int, pick: tuple[int, int] | None) -> np.ndarray:
    if pick is None:
        return np.asarray(array[start:stop])
    axis, index = pick
    return np.asarray(array[(slice(start, stop),) + (slice(None),) * (axis - 1) + (index,)])


def _read_shards(
    array,
    folder: Path,
    decode,
    read_index,
    sequences: np.ndarray | None,
    rows: tuple[int, int] | None = None,
    pick: tuple[int, int] | None = None,
) -> np.ndarray:
    """The shards' inner chunks decoded and laid out shard by shard: a shard's chunks stacked as
    [*chunks per shard, *inner chunk], its axes interleaved into the shard's shape. `rows`: only the
    shards of that range along the first dimension (the result starts at the first's first row);
    `pick` (axis, index): that axis dropped, only `index` of it kept (ValueError unless each inner
    chunk holds the axis whole)."""
    from .shards import ABSENT

    shape, shard, inner = tuple(array.shape), tuple(array.shards), tuple(array.chunks)
    dtype = np.dtype(array.dtype).newbyteorder("<")
    grid = tuple(-(-n // s) for n, s in zip(shape, shard))
    lo, hi = rows if rows is not None else (0, grid[0])
    hi = min(hi, grid[0])
    per_shard = tuple(s // c for s, c in zip(shard, inner))
    n_inner, inner_bytes = int(np.prod(per_shard)), int(np.prod(inner)) * dtype.itemsize
    fill = np.full(inner, array.fill_value, dtype=dtype).tobytes()
    grid_rest, inner_whole, select = grid[1:], inner, None
    if pick is not None:
        axis, kept = pick
        if not 0 < axis < len(shape) or not inner[axis] == shard[axis] == shape[axis] or not 0 <= kept < shape[axis]:
            raise ValueError(f"cannot pick index {kept} of axis {axis} from inner chunks {inner}")
        select = (slice(None),) * axis + (kept,)
        shape, shard, inner, per_shard = (t[:axis] + t[axis + 1 :] for t in (shape, shard, inner, per_shard))
        grid_rest = grid[1:axis] + grid[axis + 1 :]
    out = np.full(((hi - lo) * shard[0],) + tuple(g * s for g, s in zip(grid_rest, shard[1:])), array.fill_value, dtype)
    nd = len(shape)
    interleave = [a for d in range(nd) for a in (d, nd + d)]
    # the sequence of each inner chunk of a shard, relative to the shard's first (C order, as indexed)
    rel_seq = np.asarray([c[0] * inner[0] for c in np.ndindex(*per_shard)])
    wanted = None if sequences is None else np.asarray(sequences, dtype=bool)
    absent = int(ABSENT)
    for coords in np.ndindex(hi - lo, *grid[1:]):
        coords = (coords[0] + lo,) + coords[1:]
        path = folder.joinpath("c", *map(str, coords))
        s0 = coords[0] * shard[0]
        if wanted is not None:
            first = np.minimum(s0 + rel_seq, len(wanted) - 1)
            take = [bool(wanted[a : a + inner[0]].any()) for a in first.tolist()]
            if not any(take):
                continue
        else:
            take = [True] * n_inner
        if not path.is_file():
            continue  # a shard never written reads as the fill value
        data = path.read_bytes()
        index = read_index(data, n_inner).tolist()
        blobs = []
        for (offset, nbytes), keep in zip(index, take):
            blob = fill if offset == absent or not keep else decode(data[offset : offset + nbytes])
            if len(blob) != inner_bytes:
                raise ValueError("inner chunk of unexpected size")
            blobs.append(blob if select is None else np.frombuffer(blob, dtype=dtype).reshape(inner_whole)[select])
        if select is None:
            block = np.frombuffer(b"".join(blobs), dtype=dtype).reshape(per_shard + inner)
        else:
            block = np.stack(blobs).reshape(per_shard + inner)
            coords = coords[: pick[0]] + coords[pick[0] + 1 :]
        at = tuple(slice(c * s, (c + 1) * s) for c, s in zip((coords[0] - lo,) + coords[1:], shard))
        out[at] = block.transpose(interleave).reshape(shard)
    size = (min(shape[0], hi * shard[0]) - lo * shard[0],) + shape[1:]
    return np.ascontiguousarray(out[tuple(slice(0, n) for n in size)], dtype=np.dtype(array.dtype))
