from __future__ import annotations

import pytest

from cluster.prefill_lb import (
    Bandwidth,
    CostModel,
    PrefixInfo,
    ReplicaState,
    choose,
    estimate,
    fit_compute,
)

COST = CostModel(token_s=1e-3, attn_s=1e-6, unit_bytes=1 << 20, local_bps=1e9, remote_bps=1e8, load_latency_s=0)


def test_prefers_the_replica_that_holds_the_prefix():
    prefix = PrefixInfo(64 * 10 + 5, units=10, local_run={"B": 10})
    a, b = ReplicaState("a", "A"), ReplicaState("b", "B")
    got = choose([a, b], prefix, COST)
    assert got.replica == "b" and got.load_units == 10
    ea = estimate(a, prefix, COST)
    assert ea.load_units == 10 and ea.load_s > estimate(b, prefix, COST).load_s  # remote is slower


def test_queue_time_outweighs_locality_when_the_holder_is_busy():
    prefix = PrefixInfo(64 * 4 + 5, units=4, local_run={"B": 4})
    busy = ReplicaState("b", "B", queued=[(2000, 0)] * 3)
    idle = ReplicaState("a", "A")
    e = estimate(busy, prefix, COST)
    assert e.queue_s == pytest.approx(3 * (2000 * 1e-3 + 2000 * 2000 * 1e-6))
    assert choose([busy, idle], prefix, COST).replica == "a"


def test_declines_a_load_slower_than_recomputing():
    slow_net = CostModel(token_s=1e-4, attn_s=0, unit_bytes=64 << 20, local_bps=1e9, remote_bps=1e6)
    prefix = PrefixInfo(64 * 3 + 1, units=3, local_run={"B": 1})
    e = estimate(ReplicaState("a", "A"), prefix, slow_net)
    assert e.load_units == 0 and e.load_s == 0  # 192 MB at 1 MB/s vs 19 ms of compute
    e = estimate(ReplicaState("b", "B"), prefix, slow_net)
    assert e.load_units in (0, 1)  # never the remote part
    assert e.ttft_s <= slow_net.compute_s(prefix.prompt_tokens, 0)


def test_ties_go_to_the_least_loaded():
    prefix = PrefixInfo(100)
    states = [ReplicaState("a", "A", running=5), ReplicaState("b", "B", running=1), ReplicaState("c", "C", running=3)]
    assert choose(states, prefix, COST).replica == "b"
    with pytest.raises(ValueError, match="no replica"):
        choose([], prefix, COST)


def test_the_last_token_is_never_loaded():
    prefix = PrefixInfo(128, units=2, local_run={"A": 2})  # a prompt of exactly two units
    assert estimate(ReplicaState("a", "A"), prefix, COST).load_units == 1


def test_fit_compute_recovers_the_coefficients():
    truth = (2e-4, 3e-8)
    samples = [(n, c, truth[0] * n + truth[1] * n * (c + n)) for n, c in [(64, 0), (512, 0), (256, 1024), (2048, 0)]]
    token_s, attn_s = fit_compute(samples)
    assert token_s == pytest.approx(truth[0], rel=1e-6) and attn_s == pytest.approx(truth[1], rel=1e-6)
    assert fit_compute([]) == (CostModel().token_s, CostModel().attn_s)
    assert min(fit_compute([(10, 0, 1.0), (20, 0, 0.5), (30, 0, 0.1)])) >= 0  # noisy: clamped


def test_bandwidth_moves_towards_observations():
    bw = Bandwidth(1e9)
    for _ in range(50):
        bw.observe(100 << 20, 1.0)
    assert bw.bps == pytest.approx(100 << 20, rel=1e-3)
    bw.observe(0, 0)  # ignored
    assert bw.samples == 50
