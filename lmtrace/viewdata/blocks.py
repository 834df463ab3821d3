"""The attention rows of one block of steps, kept decompressed between requests of a long-lived reader.

`attn` is stored one sequence x one block of `output.chunk_steps` steps x every layer and head x 64
keys an inner chunk (docs/archive.md), so reading one step's rows decompresses its whole block:
at ~4,000 keys that is ~35 MB of float16 and ~100 ms of CPU for one step, the same for the block's
other 15. Selecting tokens walks a sequence step by step, and a head's pattern or the mean over
heads of the same block needs the same chunks, so the block read for one step is kept (a few
blocks, at most CACHE_BYTES in all, least recently used dropped first) and its neighbours are
served from memory. Only a complete run's blocks are kept (a running run's last block still grows).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..archive.reader import Run
from . import kept

CACHE_BYTES = 96 << 20  # decompressed attention blocks kept, in all

_blocks: OrderedDict[tuple, np.ndarray] = OrderedDict()
_lock = threading.Lock()
_size = 0


def _steps_per_block(run: Run) -> int:
    chunks = getattr(kept.array(run, "attn"), "chunks", None)
    return int(chunks[1]) if chunks and len(chunks) == 5 else 1


def step_rows(run: Run, seq: int, step: int, n_keys: int) -> np.ndarray:
    """attn[seq, step, :, :, :n_keys] ([layer, q_head, key], the archive's dtype), from the step's kept block."""
    per = _steps_per_block(run)
    if run.status != "complete" or per <= 1:
        return np.asarray(kept.array(run, "attn")[seq, step, :, :, :n_keys])
    block = step // per
    key = (str(run.path), run.manifest.get("created"), run.manifest.get("completed"), seq, block)
    global _size
    with _lock:
        found = _blocks.get(key)
        if found is not None:
            _blocks.move_to_end(key)
    if found is None:
        first = block * per
        last = min(first + per, int(kept.lengths(run, "generated_len")[seq])) - 1
        width = int(kept.lengths(run, "prompt_len")[seq]) + max(last, step)  # the last step's keys
        found = np.asarray(kept.array(run, "attn")[seq, first : max(last, step) + 1, :, :, :width])
        with _lock:
            if key not in _blocks:
                _blocks[key] = found
                _size += found.nbytes
            while _size > CACHE_BYTES and len(_blocks) > 1:
                _, dropped = _blocks.popitem(last=False)
                _size -= dropped.nbytes
    return found[step - block * per, :, :, :n_keys]


def clear() -> None:
    global _size
    with _lock:
        _blocks.clear()
        _size = 0


def steps_rows(run: Run, seq: int, n: int, n_keys: int, index: tuple = ()) -> np.ndarray | None:
    """attn[seq, :n, :, :, :n_keys][:, *index] ([step, (layer, q_head,) key]; NaN past each step's context) from kept
    blocks when the n steps span at most two blocks (a long prompt's few steps: the blocks its selected
    tokens read anyway); None otherwise, for the caller to read directly."""
    per = _steps_per_block(run)
    if run.status != "complete" or per <= 1 or n > 2 * per:
        return None
    p = int(kept.lengths(run, "prompt_len")[seq])
    first = step_rows(run, seq, 0, p)[index]
    out = np.full((n,) + first.shape[:-1] + (n_keys,), np.nan, dtype=first.dtype)
    for s in range(n):
        out[s, ..., : p + s] = step_rows(run, seq, s, p + s)[index]
    return out
