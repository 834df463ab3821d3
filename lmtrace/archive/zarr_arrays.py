"""The archive's Zarr arrays: their compressors, chunking and sharding, the coordinate arrays, and
the consolidated metadata (docs/archive.md, "Files")."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from . import layout
from .layout import RunShape


def compressors_for(codec: str, level: int, spec: layout.ArraySpec, checksum: bool = True):
    """The compressors of one array; `auto` is the layout's choice for it (`ArraySpec.auto_codec`).
    `checksum` (format 4): each chunk ends in its crc32c (zarr's `crc32c` codec), so a reader that
    decodes a damaged chunk fails instead of returning its bytes."""
    if codec == "auto":
        codec = spec.auto_codec
    if codec == "zstd":
        out = [ZstdCodec(level=level)]
    elif codec == "blosc":
        out = [BloscCodec(cname="zstd", clevel=min(level, 9), shuffle="shuffle")]
    else:
        out = []
    return out + [Crc32cCodec()] if checksum else (out or None)


# Coordinates, prompt_len and generated_len: zarr's default compressor, then each chunk's crc32c
SMALL_ARRAY_COMPRESSORS = (ZstdCodec(level=0), Crc32cCodec())


def checked_array(group, name: str, **kwargs):
    """`group.create_array` for an analysis output written whole (a sweep's effects, explain's scores):
    each chunk zstd-compressed and ending in its crc32c, so a changed byte fails the read instead of
    reaching a view as a number."""
    return group.create_array(name, compressors=SMALL_ARRAY_COMPRESSORS, **kwargs)


def consolidate(run_dir: Path) -> None:
    """Consolidate the run's Zarr metadata (after the last array is created)."""
    with warnings.catch_warnings():  # "consolidated metadata is not part of the v3 spec": known, wanted
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(run_dir / layout.TENSORS))


def create_array(
    group: zarr.Group,
    spec: layout.ArraySpec,
    shape: tuple[int, ...],
    chunk_steps: int,
    compressors,
    chunk_keys: int | None = None,
    chunk_sequences: int | None = None,
) -> zarr.Array:
    """An archive array (or the existing one of that name), chunked as every writer chunks it.

    With `chunk_sequences` (format 3) an array over `sequence` is sharded: one shard file per
    `chunk_sequences` sequences (and block of steps), one inner chunk per sequence in it (docs/archive.md,
    "Files"); without it (format 2) every inner chunk is its own file."""
    if spec.name in group:
        return group[spec.name]
    # One chunk per block of steps and sequence, all layers in it. Per-layer inner chunks made a
    # layer slice cheaper to read, but cost ~7 ms of CPU per step to write on the default capture,
    # a sixth of a decode step (docs/archive.md, "Cost").
    chunks = [1, chunk_steps] + list(shape[2:]) if spec.per_step else [1] + list(shape[1:])
    chunks = [max(1, c) for c in chunks]
    if spec.key_chunked:
        # Attention rows, padded to the longest context of the run, are also split along their
        # keys: a block writes only the key chunks its context reaches (ShardFiles.write) and a
        # chunk never written reads as the fill value (NaN), so the padding costs neither bytes
        # nor compression.
        chunks[-1] = layout.key_chunk_width(chunk_keys, shape[-1])
    shards = None
    if chunk_sequences is not None:
        shards = list(chunks)
        shards[0] = max(1, min(chunk_sequences, shape[0]))
        if spec.key_chunked:  # the whole row in one shard, in whole key chunks
            shards[-1] = -(-shape[-1] // chunks[-1]) * chunks[-1]
    return group.create_array(
        spec.name,
        shape=shape,
        chunks=tuple(chunks),
        shards=tuple(shards) if shards else None,
        dtype=spec.dtype,
        fill_value=spec.fill,
        compressors=compressors,
        dimension_names=spec.dims,
        # every chunk is written once, whole: skip zarr's is-it-all-fill scan (NaN-aware, slow)
        config={"write_empty_chunks": True},
    )


def create_coordinates(group: zarr.Group, s: RunShape) -> None:
    """The coordinate arrays of a run's dims, and prompt_len / generated_len (filled with -1 until
    each batch writes its sequences'), unless the group has them."""
    coords = {
        "layer": np.asarray(s.layers, dtype=np.int32),
        "q_head": np.arange(s.n_heads, dtype=np.int32),
        "kv_head": np.arange(s.n_kv_heads, dtype=np.int32),
        "kv_head_of_head": np.asarray(s.kv_head_of_head, dtype=np.int32),
        "step": np.arange(s.n_steps, dtype=np.int32),
        "sequence": np.arange(s.n_sequences, dtype=np.int32),
        # token positions (left-aligned: position p is the p-th token of the sequence)
        "key": np.arange(s.max_len, dtype=np.int32),
    }
    if s.prefill_attention or s.qkv:
        for name in ("prompt_pos", "query_pos", "key_pos"):
            coords[name] = np.arange(s.max_prompt, dtype=np.int32)
    dims = {"kv_head_of_head": ("q_head",)}
    if s.resid_layers:
        coords["resid_layer"] = np.asarray(s.resid_layers, dtype=np.int32)
    for name, values in coords.items():
        if name not in group:
            arr = group.create_array(
                name,
                shape=values.shape,
                dtype=values.dtype,
                chunks=values.shape or (1,),
                dimension_names=dims.get(name, (name,)),
                fill_value=-1,
                compressors=SMALL_ARRAY_COMPRESSORS,
            )
            arr[...] = values
    for name in ("prompt_len", "generated_len"):
        if name not in group:
            group.create_array(
                name,
                shape=(s.n_sequences,),
                dtype="int32",
                chunks=(max(1, min(s.n_sequences, 4096)),),
                dimension_names=("sequence",),
                fill_value=-1,
                compressors=SMALL_ARRAY_COMPRESSORS,
            )
