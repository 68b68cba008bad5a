"""Decode load balancer: balances KV occupancy, never over-commits a replica, queues instead."""

from __future__ import annotations

import random

import pytest

from cluster.decode_lb import DecodeBalancer


def test_spreads_by_occupancy_then_running():
    lb = DecodeBalancer({"a": 1000, "b": 1000})
    assert lb.choose(300) == "a"
    assert lb.choose(300) == "b"
    assert lb.choose(100) == "a"  # a and b at 0.3: the tie goes by running count, then id
    lb.check_integrity()


def test_never_admits_beyond_capacity():
    lb = DecodeBalancer({"a": 500, "b": 300})
    assert lb.choose(400) == "a"
    assert lb.choose(200) == "b"
    assert lb.choose(150) is None  # a has 100 left, b 100: queue
    lb.release("a", 400)
    assert lb.choose(150) == "a"
    assert not lb.fits_anywhere(501)


def test_randomized_reserve_release_keeps_invariants():
    rng = random.Random(0)
    lb = DecodeBalancer({f"r{i}": rng.randrange(500, 2000) for i in range(4)})
    placed = []
    for _ in range(2000):
        if placed and rng.random() < 0.45:
            rid, need = placed.pop(rng.randrange(len(placed)))
            lb.release(rid, need)
        else:
            need = rng.randrange(1, 600)
            rid = lb.choose(need)
            if rid is not None:
                placed.append((rid, need))
        lb.check_integrity()
        for rid, r in lb.replicas.items():
            assert r.reserved_tokens == sum(n for p, n in placed if p == rid)


def test_reservations_are_whole_pages():
    lb = DecodeBalancer({"a": 64}, page_size=16)
    assert lb.choose(17) == "a" and lb.replicas["a"].reserved_tokens == 32
    assert lb.choose(33) is None  # 48 more tokens do not fit in the 32 left
    lb.release("a", 17)
    assert lb.replicas["a"].reserved_tokens == 0


def test_bad_capacity_is_named():
    with pytest.raises(ValueError, match="'x'"):
        DecodeBalancer({"x": 0})


def test_rank_orders_by_occupancy_and_reserve_holds_pages():
    lb = DecodeBalancer({"a": 64, "b": 128}, page_size=16)
    assert lb.rank(20) == ["b", "a"]  # 32 of 128 beats 32 of 64
    lb.reserve("b", 20)  # two pages
    assert lb.replicas["b"].reserved_tokens == 32 and lb.replicas["b"].running == 1
    assert lb.rank(90) == ["b"]  # 96 tokens: only b has the room (96 left)
    lb.reserve("b", 90)
    assert lb.rank(17) == ["a"] and lb.rank(70) == []
    lb.release("b", 20)
    lb.release("b", 90)
    lb.check_integrity()
    assert lb.replicas["b"].reserved_tokens == 0
