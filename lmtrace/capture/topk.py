"""`torch.topk` along the last dim, exactly (the same values and indices in the same order), in a
fraction of its time for a few of many values per row on the CPU.

torch's CPU top-k copies every row into (value, index) pairs and partitions all of them: ~15 ms a
step for the FFN's 32 largest |a| of 32 rows × 30 layers × 1,536 neurons, the largest cost of a
batched step outside the forward. Here each row first gets a threshold no larger than its k-th
largest value: split into groups, the k-th largest of the groups' maxima is one (k groups hold an
element at least that large). The few elements at or above it are packed into a narrow matrix and
only they go through torch.topk. Where the result could depend on the order torch gives equal
values (two of a row's k + 1 largest equal, or a NaN in the row) the row is taken from torch.topk
itself, which treats every row on its own, so the result is torch's in every case.
"""

from __future__ import annotations

import numpy as np
import torch

_GROUP = 64  # elements per group at most: the threshold's pass reads every element once


def topk_last(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) = `x.topk(k, dim=-1)` (largest, sorted), bit for bit and ties as torch orders them."""
    n = x.shape[-1]
    if x.device.type != "cpu" or x.dtype != torch.float32 or k < 1 or 4 * k > n or x.numel() == 0 or x.requires_grad:
        return x.topk(k, dim=-1)
    lead = x.shape[:-1]
    rows = x.reshape(-1, n)
    values, indices = _topk_rows(rows, k)
    return values.reshape(*lead, k), indices.reshape(*lead, k)


def _largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """[R, n] float32 -> [R, k] int64: the columns of k largest values of each row, in no particular
    order, by numpy's introselect (a third of torch.topk's time for the FFN's [960, 128] group maxima).
    Which of several equal values it takes may differ from torch's; `_topk_rows` leaves any row where
    that could matter (more than k groups at the threshold, a NaN) to torch.topk itself."""
    return torch.from_numpy(np.argpartition(x.numpy(), x.shape[1] - k, axis=1)[:, x.shape[1] - k :])


def _topk_rows(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    R, n = rows.shape
    size = max(1, min(_GROUP, n // (4 * k)))  # elements per group, at least 4k groups
    groups = n // size
    body = groups * size  # group g: the columns g, g + groups, g + 2 groups, ... below `body`
    grid = rows[:, :body].reshape(R, size, groups)
    maxima = grid.amax(1)  # [R, groups]; NaN propagates
    group_ids = _largest(maxima, k)  # [R, k]: k groups with the largest maxima, in no order
    # <= the row's k-th largest; NaN where a group has one
    threshold = maxima.gather(1, group_ids).amin(-1, keepdim=True)
    # every element >= threshold is in these k groups (unless another group's maximum equals it:
    # checked below) or in the columns past `body`
    values = grid.gather(2, group_ids[:, None, :].expand(R, size, k)).reshape(R, size * k)
    if body < n:
        values = torch.cat([values, rows[:, body:]], 1)
    mask = values >= threshold
    counts = mask.sum(-1, dtype=torch.int32)
    width = max(int(counts.max()), k + 1)
    at_row, at = mask.nonzero(as_tuple=True)  # the candidates, row by row
    slot = torch.arange(at_row.shape[0]) - (counts.cumsum(0, dtype=torch.long) - counts)[at_row]
    packed = torch.full((R, width), float("-inf"))
    packed[at_row, slot] = values[at_row, at]
    in_group = at < size * k
    column = torch.where(
        in_group, group_ids[at_row, at % k] + groups * torch.div(at, k, rounding_mode="floor"), at - size * k + body
    )
    packed_columns = torch.zeros((R, width), dtype=torch.long)
    packed_columns[at_row, slot] = column
    top = packed.topk(k + 1, dim=-1)
    out_values = top.values[:, :k].contiguous()
    out_indices = packed_columns.gather(-1, top.indices[:, :k])
    # a row whose k + 1 largest are not all distinct, whose threshold another group reaches too, or
    # that holds a NaN: torch's own answer
    unsure = (top.values[:, 1:] == top.values[:, :-1]).any(-1) | threshold[:, 0].isnan()
    unsure |= (maxima >= threshold).sum(-1) > k
    if body < n:
        unsure |= rows[:, body:].isnan().any(-1)
    if bool(unsure.any()):
        which = unsure.nonzero(as_tuple=True)[0]
        exact = rows[which].topk(k, dim=-1)
        out_values, out_indices = out_values.clone(), out_indices.clone()
        out_values[which], out_indices[which] = exact.values, exact.indices
    return out_values, out_indices
