"""Sampling: filtering equals transformers' own logits processors; draws are seeded per (seed, sequence, step)."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from lmtrace.capture.sampling import Sampler, choose, draw_seed, stability_class, uniforms


def _reference_filter(logits, temperature, top_k, top_p):
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


def test_filtering_matches_transformers_warpers():
    torch.manual_seed(0)
    logits = torch.randn(6, 500) * 3
    for temperature, top_k, top_p in [(0.7, 0, 1.0), (1.0, 20, 1.0), (1.3, 0, 0.8), (0.5, 50, 0.9), (1.0, 1, 0.5)]:
        ours = Sampler(temperature, top_k, top_p).filtered_logits(logits)
        ref = _reference_filter(logits, temperature, top_k, top_p)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)), (temperature, top_k, top_p)
        torch.testing.assert_close(ours[torch.isfinite(ours)], ref[torch.isfinite(ref)])


def test_greedy_picks_argmax_with_probability_one():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 4.9]])
    c = choose(logits, Sampler(0.0, 0, 1.0), None, 2)
    assert c.token.tolist() == [1, 0]
    assert c.sampling_logprob.tolist() == [0.0, 0.0]
    assert c.eligible.tolist() == [1, 1]
    expected = logits.log_softmax(-1)
    torch.testing.assert_close(c.logprob, expected[[0, 1], [1, 0]])
    torch.testing.assert_close(c.margin, torch.tensor([2.0, 0.1]))


def test_sampled_frequencies_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(1.0, 3, 1.0)  # drops the 0.05 token, renormalises the rest
    g = torch.Generator()
    counts = torch.zeros(4)
    n = 4000
    for step in range(n):
        u = uniforms(g, 11, [0], step)
        counts[choose(logits, sampler, u, 2).token.item()] += 1
    freq = counts / n
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert (freq - expected).abs().max() < 0.03
    assert counts[3] == 0


def test_filter_changed_reports_a_different_choice_under_the_same_draw():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # u = 0.95 lands on the 4th token unfiltered; top_k=2 renormalises to [0.57, 0.43] -> token 1
    c = choose(logits, Sampler(1.0, 2, 1.0), torch.tensor([0.95], dtype=torch.float64), 2)
    assert c.token.item() == 1 and bool(c.filter_changed.item())
    c = choose(logits, Sampler(1.0, 2, 1.0), torch.tensor([0.1], dtype=torch.float64), 2)
    assert c.token.item() == 0 and not bool(c.filter_changed.item())
    assert c.eligible.item() == 2


def test_draws_depend_on_seed_sequence_and_step_only():
    g = torch.Generator()
    a = uniforms(g, 5, [0, 1, 2], 3)
    torch.manual_seed(123)  # global RNG use must not disturb the draws
    torch.rand(10)
    b = uniforms(torch.Generator(), 5, [0, 1, 2], 3)
    assert torch.equal(a, b)
    assert len({draw_seed(5, s, t) for s in range(20) for t in range(20)}) == 400
    assert not torch.equal(uniforms(g, 6, [0], 3), uniforms(g, 5, [0], 3))


def test_stability_classes():
    assert stability_class(0.95, 5.0) == "locked"
    assert stability_class(0.6, 1.5) == "stable"
    assert stability_class(0.4, 0.5) == "fragile"
    assert stability_class(0.3, 0.01) == "tie"


def test_entropy_counts_impossible_tokens_as_zero_and_equals_the_float64_formula():
    # rows with no, some and nearly all logits at -inf (probability 0, log p = -inf): each entropy is
    # -Σ p·log p over the possible tokens only, as numpy computes it in float64
    import numpy as np

    torch.manual_seed(1)
    logits = torch.randn(3, 400) * 4
    logits[1, ::3] = float("-inf")
    logits[2, 2:] = float("-inf")
    c = choose(logits, Sampler(0.0, 0, 1.0), None, 2)
    x = logits.double().numpy()
    for row, entropy in zip(x, c.entropy.tolist()):
        finite = row[np.isfinite(row)]
        p = np.exp(finite - finite.max())
        p /= p.sum()
        assert abs(entropy - float(-(p * np.log(p)).sum())) < 1e-5
    assert c.entropy.isfinite().all()
