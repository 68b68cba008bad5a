"""The fitted cost of a prefill chunk, and the longest chunk within a budget."""

from __future__ import annotations

import pytest

from cluster.chunk_sizing import ChunkCost, chunk_within


def test_the_three_terms_are_recovered_from_chunks_of_a_growing_prompt():
    fixed_s, token_s, attn_s = 0.0015, 2e-4, 3e-7
    cost = ChunkCost(window=16)
    start = 0
    for n in (40, 36, 30, 26, 22, 20, 18, 16, 14, 13, 12):
        cost.observe(n, start, fixed_s + token_s * n + attn_s * n * (start + n))
        start += n * 40
    got = cost.coefficients()
    assert got == pytest.approx((fixed_s, token_s, attn_s), rel=1e-6)
    assert cost.predict(100, 5000) == pytest.approx(fixed_s + token_s * 100 + attn_s * 100 * 5100, rel=1e-6)
    assert ChunkCost().predict(100, 0) is None  # nothing observed
    # the longest chunk at 8K context fits the budget and one more token would not
    n = cost.longest_within(0.02, 8000, 2048)
    assert fixed_s + token_s * n + attn_s * n * (8000 + n) <= 0.02
    assert fixed_s + token_s * (n + 1) + attn_s * (n + 1) * (8001 + n) > 0.02


def test_a_fixed_overhead_is_not_taken_for_a_cost_per_token():
    """Small chunks with a per-pass overhead: a per-token fit alone would charge the overhead to
    every token and shrink the chunks further (a spiral); the fixed term keeps them long."""
    cost = ChunkCost()
    for n in (1, 2, 4, 8, 3, 6, 24):
        cost.observe(n, 100, 0.007 + 0.001 * n)
    assert cost.longest_within(0.05, 100, 512) == 43  # (50 - 7) / 1 ms


def test_a_chunk_grows_at_most_twice_the_longest_observed():
    """Chunks of like sizes cannot tell a fixed cost from a cost per token: a fit that puts the
    cost in its fixed term would answer a chunk three times as long (at 5K context, where each
    token attends over the whole prefix, a step several times the budget); the answer stays
    within twice what was seen, and grows from there as longer chunks are observed."""
    cost = ChunkCost()
    for i, n in enumerate((10, 11, 9, 10, 11, 10, 9, 11)):
        cost.observe(n, 4800 + 10 * i, 0.055 + 0.0003 * n)  # what a noisy machine may measure
    fixed_s, token_s, _ = cost.coefficients()
    assert int((0.064 - fixed_s) / token_s) > 22  # the fit alone would take a far longer chunk
    assert cost.longest_within(0.064, 4900, 512) == 22
    cost.observe(22, 4900, 0.0616)
    assert cost.longest_within(0.064, 4922, 512) > 22


def test_samples_that_fit_several_models_alike_take_the_cost_per_token():
    cost = ChunkCost()
    cost.observe(512, 0, 0.512)
    cost.observe(512, 512, 0.512)  # a fixed 0.512 s fits these two as well
    assert cost.coefficients() == pytest.approx((0.0, 0.001, 0.0))
    assert cost.longest_within(0.05, 1024, 512) == 50


def test_coefficients_never_go_negative_on_noisy_samples():
    import random

    rnd = random.Random(0)
    cost = ChunkCost()
    for _ in range(40):
        n, start = rnd.randint(1, 64), rnd.randint(0, 8000)
        cost.observe(n, start, max(0.0, 0.002 * n + rnd.gauss(0, 0.02)))
        assert all(c >= 0 for c in cost.coefficients())
    assert cost.longest_within(0.0, 0, 512) == 0  # no time: no token (the engine's floor applies)
    assert ChunkCost().longest_within(1.0, 0, 512) is None  # nothing observed yet


def test_chunk_within_solves_the_quadratic_without_cancellation():
    assert chunk_within(0.05, 800, 0.001, 1.4e-21, 512) == 49  # a vanishing attention term
    assert chunk_within(0.05, 0, 0.0, 0.0, 512) == 512  # free: the cap
    assert chunk_within(1.0, 1000, 0.0, 1e-6, 4096) == 618  # n (1000 + n) = 1e6
    assert chunk_within(-1.0, 0, 0.001, 0.0, 512) == 0
