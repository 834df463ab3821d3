"""The fast top-k gives torch.topk's exact answer: the same values and indices in the same order,
ties and NaNs included, at every width the capture uses (FFN neurons, the vocabulary)."""

from __future__ import annotations

import pytest
import torch

from lmtrace.capture.topk import topk_last


def _same_as_torch(x: torch.Tensor, k: int) -> None:
    expected = x.topk(k, dim=-1)
    values, indices = topk_last(x, k)
    assert torch.equal(indices, expected.indices)
    # bit for bit, NaN included
    assert torch.equal(values.contiguous().view(torch.int32), expected.values.contiguous().view(torch.int32))


@pytest.mark.parametrize("seed", range(40))
def test_topk_equals_torch_topk_on_random_rows(seed):
    gen = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 40, (), generator=gen))
    n = int(torch.randint(8, 2500, (), generator=gen))
    k = int(torch.randint(1, max(2, n // 4), (), generator=gen))
    x = torch.randn(rows, n, generator=gen)
    _same_as_torch(x, k)
    _same_as_torch(x.abs(), k)


def test_topk_equals_torch_topk_where_values_tie():
    gen = torch.Generator().manual_seed(1)
    coarse = (torch.randn(64, 1536, generator=gen) * 2).round() / 2  # few distinct values: ties everywhere
    _same_as_torch(coarse, 32)
    _same_as_torch(coarse.abs(), 32)
    x = torch.randn(8, 1000, generator=gen)
    x[0, :] = 0.0
    x[0, 7] = -0.0
    x[1, 100:140] = 5.0  # the whole top ties
    x[2, 3] = x[2, 900] = x[2].max() + 1  # a tie at the top only
    x[3, 10] = x[3, 20] = float("inf")
    x[4, 5] = float("-inf")
    _same_as_torch(x, 10)


def test_topk_equals_torch_topk_with_nans():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(12, 1537, generator=gen)  # 1537: columns past the last whole group
    x[0, 4] = float("nan")
    x[1, 1536] = float("nan")  # in the columns past the groups
    x[2, :] = float("nan")
    _same_as_torch(x, 32)


def test_topk_equals_torch_topk_for_the_ffn_and_the_vocabulary():
    gen = torch.Generator().manual_seed(3)
    act = torch.nn.functional.silu(torch.randn(30, 32, 1536, generator=gen)) * torch.randn(30, 32, 1536, generator=gen)
    _same_as_torch(act.abs(), 32)  # [layer, batch, neuron]
    _same_as_torch(act.transpose(0, 1).abs(), 32)  # not contiguous
    logits = torch.randn(32, 49152, generator=gen) * 3
    _same_as_torch(logits, 10)
    _same_as_torch(logits, 1000)


def test_topk_a_row_alone_equals_the_row_among_others():
    """The fallback takes torch's answer for single rows: torch treats each row on its own."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(50, 1536, generator=gen) * 2).round()
    whole = x.topk(32, dim=-1)
    for r in (0, 17, 49):
        alone = x[r : r + 1].topk(32, dim=-1)
        assert torch.equal(alone.indices[0], whole.indices[r])
