"""Shard files of the archive's arrays, written by lmtrace itself, byte-identical to zarr's.

Format 3 stores every per-sequence array (per-step blocks, prompt-time arrays) with Zarr v3's
sharding codec: one file (a shard) holds `output.chunk_sequences` sequences × one block of steps,
and inside it one inner chunk per sequence (per key chunk for attention rows), so a reader of one
(sequence, step) decodes only that sequence's inner chunk. A shard file is

    inner chunk bytes, in Morton order of their coordinates in the shard (absent ones left out);
      from format 4 each ends in its own crc32c (zarr's `crc32c` codec, last of the inner codecs)
    index: uint64 (offset, nbytes) per inner chunk, C order, little-endian; 2**64-1 twice = absent
    crc32c of the index, 4 bytes little-endian

which is what `zarr.codecs.ShardingCodec` (index at the end, index codecs bytes + crc32c) writes
for the same inner chunks (tests compare the bytes). Writing it here costs one encode per inner
chunk and one file write per shard, against zarr's async pipeline per write (~2 ms a step).

A shard's sequences may arrive at different times (batches smaller than a shard, a batch split
after an out-of-memory error, an interrupted batch resumed): its writer then reads the shard
file, keeps the inner chunks of the other sequences, and replaces the file atomically (temporary
name, then rename). Only one process ever writes a shard: SLURM shards own whole groups of
`chunk_sequences` sequences (rundir.Shard.sequences).
"""

from __future__ import annotations

import os
from pathlib import Path

import google_crc32c
import numpy as np
import zarr

ABSENT = np.uint64(2**64 - 1)


def morton_order(chunks_per_shard: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The order in which zarr lays out a shard's inner chunks: Z-order of their coordinates, bits
    interleaved level by level from the first dimension on, each dimension giving bits only while
    it has them (zarr.core.indexing's morton order)."""
    bits = [(c - 1).bit_length() for c in chunks_per_shard]

    def code(coords: tuple[int, ...]) -> int:
        z, out = 0, 0
        for level in range(max(bits, default=0)):
            for d, nbits in enumerate(bits):
                if level < nbits:
                    z |= ((coords[d] >> level) & 1) << out
                    out += 1
        return z

    return sorted((tuple(int(x) for x in c) for c in np.ndindex(*chunks_per_shard)), key=code)


def with_crc32c(encode):
    """`encode`, then the crc32c of its output appended (4 bytes, little-endian): zarr's `crc32c` codec."""

    def encoded(chunk) -> bytes:
        blob = encode(chunk)
        return blob + np.uint32(google_crc32c.value(blob)).tobytes()

    return encoded


def encoder_of(codecs) -> "callable | None":
    """bytes (little-endian), then at most one of zstd / blosc, then optionally crc32c (format 4), as
    numcodecs and zarr encode them (byte-identical to zarr's own codecs); None for anything else."""
    from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec

    codecs = list(codecs)
    if (
        not codecs
        or not isinstance(codecs[0], BytesCodec)
        or codecs[0].endian is None
        or codecs[0].endian.value != "little"
    ):
        return None
    rest = codecs[1:]
    if rest and isinstance(rest[-1], Crc32cCodec):
        inner = encoder_of(codecs[:-1])
        return None if inner is None else with_crc32c(inner)
    if not rest:
        return bytes
    if len(rest) == 1 and isinstance(rest[0], ZstdCodec):
        from numcodecs import Zstd

        return Zstd(level=rest[0].level, checksum=rest[0].checksum).encode
    if len(rest) == 1 and isinstance(rest[0], BloscCodec):
        from numcodecs import Blosc

        c = rest[0]
        shuffle = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}[
            c.shuffle.value
        ]
        return Blosc(cname=c.cname.value, clevel=c.clevel, shuffle=shuffle, blocksize=c.blocksize or 0).encode
    return None


def sharding_of(array: zarr.Array):
    """The array's ShardingCodec when lmtrace can write its shards itself (index at the end, bytes +
    crc32c index codecs, default `/` chunk keys), else None."""
    from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec

    meta = array.metadata
    codecs = list(getattr(meta, "codecs", ()))
    if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
        return None
    sharding = codecs[0]
    key_encoding = getattr(meta, "chunk_key_encoding", None)
    if getattr(key_encoding, "name", None) != "default" or getattr(key_encoding, "separator", None) != "/":
        return None
    index = list(sharding.index_codecs)
    if (
        sharding.index_location.value != "end"
        or len(index) != 2
        or not isinstance(index[0], BytesCodec)
        or index[0].endian.value != "little"
        or not isinstance(index[1], Crc32cCodec)
    ):
        return None
    return sharding


def checksummed(array: zarr.Array) -> bool:
    """Whether the array's chunks (inner chunks, when sharded) end in their crc32c (format 4)."""
    from zarr.codecs import Crc32cCodec

    sharding = sharding_of(array)
    codecs = list(sharding.codecs if sharding is not None else getattr(array.metadata, "codecs", ()))
    return bool(codecs) and isinstance(codecs[-1], Crc32cCodec)


def sequences_per_shard(array: zarr.Array) -> int | None:
    """Sequences one shard file of the array holds (its shard's first dimension); None: not sharded."""
    return int(array.shards[0]) if sharding_of(array) is not None else None


def read_index(data: bytes, n_inner: int) -> np.ndarray:
    """A shard's index [n_inner, 2] (offset, nbytes), its crc32c checked."""
    size = n_inner * 16
    raw, crc = data[-size - 4 : -4], data[-4:]
    if len(data) < size + 4 or np.uint32(google_crc32c.value(raw)).tobytes() != crc:
        raise ValueError("shard index checksum mismatch")
    return np.frombuffer(raw, dtype="<u8").reshape(n_inner, 2)


class ShardFiles:
    """Writes whole shard files of one sharded array whose first dimension is `sequence`.

    `per_step` arrays have (sequence, step, ...) with a shard of (chunk_sequences, chunk_steps, ...)
    and inner chunks of (1, chunk_steps, ...); the others (prompt-time arrays) (sequence, ...) with
    inner chunks of (1, ...). Only the last dimension may hold several inner chunks (attention
    rows over `key`)."""

    def __init__(self, path: Path, array: zarr.Array, sharding, encode, per_step: bool):
        self.path, self.encode, self.per_step = path, encode, per_step
        self.shard_shape = tuple(int(c) for c in array.shards)
        self.inner = tuple(int(c) for c in sharding.chunk_shape)
        self.per_shard = tuple(s // i for s, i in zip(self.shard_shape, self.inner))
        self.order = morton_order(self.per_shard)
        self.dtype = np.dtype(array.dtype).newbyteorder("<")
        self.fill = array.fill_value
        self.lead = 2 if per_step else 1  # dims indexed by the shard's file name beyond `sequence`

    @classmethod
    def for_array(cls, path: Path, array: zarr.Array, per_step: bool) -> "ShardFiles | None":
        sharding = sharding_of(array)
        if sharding is None:
            return None
        encode = encoder_of(sharding.codecs)
        inner, shard = tuple(sharding.chunk_shape), tuple(array.shards)
        # one inner chunk per sequence, one block of steps per shard, the trailing dims whole but the last
        if encode is None or inner[0] != 1 or (per_step and inner[1] != shard[1]) or inner[1:-1] != shard[1:-1]:
            return None
        return cls(path, array, sharding, encode, per_step)

    @property
    def sequences(self) -> int:
        return self.shard_shape[0]

    def shard_path(self, group: int, s0: int | None) -> Path:
        trailing = ["0"] * (len(self.shard_shape) - self.lead)
        lead = [str(group)] + ([str(s0 // self.shard_shape[1])] if self.per_step else [])
        return self.path.joinpath("c", *lead, *trailing)

    def write(self, seqs: list[int], data: np.ndarray, s0: int | None = None, pace=lambda: None) -> None:
        """data [len(seqs), (steps,) ..., width]: rows of sequences `seqs`, of the block starting at
        step s0 (a block boundary) for per-step arrays. `width` may be less than the last dim: inner
        chunks past it are not written (they read as fill). Steps past data's own are fill."""
        groups: dict[int, list[int]] = {}
        for row, seq in enumerate(seqs):
            groups.setdefault(seq // self.sequences, []).append(row)
        for group, rows in groups.items():
            chunks = {}
            for row in rows:
                pace()  # between sequences: a forward that starts waits at most for one sequence's chunks
                for c, blob in self._inner_chunks(data[row]):
                    chunks[(seqs[row] % self.sequences,) + (0,) * (len(self.per_shard) - 2) + (c,)] = blob
            self._replace(self.shard_path(group, s0), chunks, {seqs[r] % self.sequences for r in rows})

    def _inner_chunks(self, rows: np.ndarray):
        width = self.inner[-1]
        shape = self.inner[1:]
        for c in range(-(-rows.shape[-1] // width)):
            piece = rows[..., c * width : (c + 1) * width]
            if piece.shape == shape:
                chunk = np.ascontiguousarray(piece, dtype=self.dtype)
            else:  # a block that ended early, the array's last block or last key chunk: fill the rest
                chunk = np.full(shape, self.fill, dtype=self.dtype)
                chunk[tuple(slice(0, n) for n in piece.shape)] = piece
            yield c, self.encode(chunk)

    def _replace(self, target: Path, chunks: dict, replaced: set[int]) -> None:
        """Write the shard file with `chunks`, keeping the inner chunks of sequences not in
        `replaced` that the file already holds."""
        if target.is_file():
            data = target.read_bytes()
            index = read_index(data, len(self.order))
            for i, coords in enumerate(np.ndindex(*self.per_shard)):
                offset, nbytes = index[i]
                if offset != ABSENT and coords[0] not in replaced and coords not in chunks:
                    chunks[coords] = data[int(offset) : int(offset + nbytes)]
        index = np.full(self.per_shard + (2,), ABSENT, dtype="<u8")
        blobs, offset = [], 0
        for coords in self.order:
            blob = chunks.get(coords)
            if blob is None or len(blob) == 0:
                continue
            index[coords] = (offset, len(blob))
            blobs.append(blob)
            offset += len(blob)
        raw = index.tobytes()
        blobs += [raw, np.uint32(google_crc32c.value(raw)).tobytes()]
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as fh:
                for blob in blobs:
                    fh.write(blob)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def chunk_files(array: zarr.Array, selection) -> list[str]:
    """The chunk (shard) files, relative to the array's directory, that reading `selection` (a
    basic selection: ints, slices, Ellipsis) of `array` touches; [] for any other selection."""
    from zarr.core.indexing import BasicIndexer

    meta = array.metadata
    try:
        indexer = BasicIndexer(
            selection if isinstance(selection, tuple) else (selection,), array.shape, meta.chunk_grid
        )
        return [meta.encode_chunk_key(p.chunk_coords) for p in indexer]
    except Exception:  # noqa: BLE001 - an index zarr itself refuses: no file to name
        return []


def chunk_problem(path: Path) -> str | None:
    """What is wrong with one chunk file of an array whose chunks end in their crc32c (format 4): a
    shard's index or one of its inner chunks, or an unsharded chunk, fails its checksum; None when it
    checks out, or when the array's chunks carry no checksum (its zarr.json says which)."""
    from zarr.codecs import Crc32cCodec

    meta = _array_meta(path)
    codecs = meta.get("codecs") or []
    sharded = len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed"
    inner = codecs[0]["configuration"]["codecs"] if sharded else codecs
    if not inner or inner[-1].get("name") != Crc32cCodec().to_dict()["name"]:
        return None
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # never written: reads as the fill value (a missing committed file is quick_problem's)
        return None
    if not sharded:
        return None if _crc_ok(data) else "chunk checksum mismatch"
    shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
    n_inner = int(np.prod([s // c for s, c in zip(shard, codecs[0]["configuration"]["chunk_shape"])]))
    try:
        index = read_index(data, n_inner)
    except ValueError:
        return "index checksum mismatch"
    for offset, nbytes in index:
        if offset != ABSENT and not _crc_ok(data[int(offset) : int(offset + nbytes)]):
            return "chunk checksum mismatch"
    return None


def _crc_ok(blob: bytes) -> bool:
    """Whether `blob` ends in the crc32c (4 bytes, little-endian) of what precedes it."""
    return len(blob) >= 4 and np.uint32(google_crc32c.value(blob[:-4])).tobytes() == blob[-4:]


def _array_meta(path: Path) -> dict:
    """The zarr.json of the array a chunk file belongs to ({} when none is found or it is unreadable)."""
    import json

    for parent in path.parents:
        meta = parent / "zarr.json"
        if meta.is_file():
            try:
                return json.loads(meta.read_text())
            except (OSError, ValueError):
                return {}
    return {}
