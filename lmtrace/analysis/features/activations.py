"""Activations at a site, streamed in bounded memory, and an on-disk store to train from.

`replay(...)` runs token sequences (a run's prompt + generated ids) through the model, right-padded in
batches of at most `batch_tokens` tokens, and yields each batch's activations at the site, every real
position but the first (position 0 is the attention sink, whose norm is tens of times the others';
SAELens's evaluations leave out BOS the same way); the forward stops at the site, so a site at layer L
costs the layers up to L only. Given several sites (a transcoder's MLP input and output), it yields their
activations side by side in one row per position, from one forward. `ActivationStore` keeps what a source yields in a
float16 memory-mapped file, so training can make several passes over more tokens than fit in memory.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from ...features.sites import Site, at_site


def batches_of(sequences: list[list[int]], batch_tokens: int) -> Iterator[list[list[int]]]:
    """Consecutive groups of sequences whose padded size (count × longest) stays within batch_tokens."""
    group: list[list[int]] = []
    longest = 0
    for seq in sequences:
        if group and max(longest, len(seq)) * (len(group) + 1) > batch_tokens:
            yield group
            group, longest = [], 0
        group.append(seq)
        longest = max(longest, len(seq))
    if group:
        yield group


def padded(group: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [batch, T] and attention mask [batch, T]."""
    width = max(len(s) for s in group)
    ids = torch.full((len(group), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    for i, s in enumerate(group):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def as_positions(tensor: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """A site tensor [batch, T, d] or flattened [batch*T, d] (OPT's fc2) -> [batch, T, d] (a view)."""
    return tensor if tensor.dim() == 3 else tensor.view(batch, width, tensor.shape[-1])


def kept_positions(mask: torch.Tensor) -> torch.Tensor:
    """[batch, T] bool: the real positions whose activations are used (all but position 0)."""
    keep = mask.bool().clone()
    keep[:, 0] = False
    return keep


@torch.inference_mode()
def replay(
    model, adapter, site: Site | tuple[Site, ...], sequences: list[list[int]], *, pad_id: int, batch_tokens: int = 2048
) -> Iterator[torch.Tensor]:
    """Yield [n, width] float32 CPU activations at `site`, batch by batch, for every kept position. `site` a
    tuple of sites (a transcoder's input and output): each row is their activations side by side, in that
    order, [n, width_1 + width_2 + ...]; the forward stops once every site has been seen."""
    sites = site if isinstance(site, tuple) else (site,)
    device = next(model.parameters()).device
    for group in batches_of(sequences, batch_tokens):
        ids, mask = padded(group, pad_id, device)
        seen: dict[int, torch.Tensor] = {}

        def grab(tensor, i, b=ids.shape[0], t=ids.shape[1]):
            seen[i] = as_positions(tensor, b, t).detach()  # noqa: B023 (runs in this iteration's forward)
            if len(seen) == len(sites):  # noqa: B023
                raise _Enough  # the layers above the sites are not needed

        try:
            with contextlib.ExitStack() as hooks:
                for i, one in enumerate(sites):
                    hooks.enter_context(at_site(adapter, one, lambda tensor, i=i: grab(tensor, i)))
                model(input_ids=ids, attention_mask=mask, use_cache=False)
        except _Enough:
            pass
        keep = kept_positions(mask)
        yield torch.cat([seen[i][keep].float().cpu() for i in range(len(sites))], dim=-1)


class _Enough(Exception):
    """Raised at the site to end a forward whose later layers nothing reads."""


class ActivationStore:
    """Rows [n, d] in a float16 memory-mapped file under `folder`, appended up to `limit` rows."""

    def __init__(self, folder: Path, d: int, limit: int):
        self.path = Path(folder) / "activations.f16"
        self.d, self.limit, self.n = d, limit, 0
        self.data = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.float16, shape=(max(limit, 1), d))

    def fill(self, source: Iterable[torch.Tensor]) -> int:
        """Append rows from `source` until it ends or the store is full; returns the rows stored."""
        for rows in source:
            take = min(len(rows), self.limit - self.n)
            if take <= 0:
                break
            self.data[self.n : self.n + take] = rows[:take].numpy().astype(np.float16)
            self.n += take
            if self.n >= self.limit:
                break
        return self.n

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.data[start:stop], dtype=np.float32))

    def close(self) -> None:
        del self.data
        self.path.unlink(missing_ok=True)
