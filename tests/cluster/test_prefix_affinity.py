"""Prefix affinity without a directory: shared first tokens, same replica; a replica leaving moves
only its own prompts; an overloaded replica is passed over."""

from __future__ import annotations

import random

import pytest

from cluster.prefix_affinity import SGLANG_QUEUE_GAP, SGLANG_QUEUE_RATIO, rank_by_prefix


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50_000) for _ in range(300)] for _ in range(n)]


def test_prompts_sharing_their_first_tokens_go_to_one_replica():
    replicas = ["r0", "r1", "r2"]
    for p in _prompts(50, 1):
        tail = [7] * 40
        assert rank_by_prefix(p[:256] + tail, replicas)[0] == rank_by_prefix(p, replicas)[0]
    firsts = [rank_by_prefix(p, replicas)[0] for p in _prompts(600, 2)]
    assert all(150 < firsts.count(i) < 250 for i in range(3)), [firsts.count(i) for i in range(3)]


def test_a_replica_leaving_moves_only_its_own_prompts():
    prompts = _prompts(300, 3)
    before = {i: ["a", "b", "c", "d"][rank_by_prefix(p, ["a", "b", "c", "d"])[0]] for i, p in enumerate(prompts)}
    after = {i: ["a", "b", "d"][rank_by_prefix(p, ["a", "b", "d"])[0]] for i, p in enumerate(prompts)}
    assert all(after[i] == before[i] for i in before if before[i] != "c")
    assert {after[i] for i in before if before[i] == "c"} <= {"a", "b", "d"}


def test_an_overloaded_replica_is_passed_over_and_every_replica_is_ranked():
    p = _prompts(1, 4)[0]
    order = rank_by_prefix(p, ["r0", "r1", "r2"])
    queued = [0, 0, 0]
    queued[order[0]] = 10
    shifted = rank_by_prefix(p, ["r0", "r1", "r2"], queued)
    assert shifted[0] == order[1] and shifted[-1] == order[0] and sorted(shifted) == [0, 1, 2]
    assert rank_by_prefix(p, []) == []
    # balanced as SGLang's router is by default: 10 queued over 0 is no imbalance yet, 70 over 2 is
    sglang = {"max_queue_ratio": SGLANG_QUEUE_RATIO, "slack": 0, "min_gap": SGLANG_QUEUE_GAP}
    assert rank_by_prefix(p, ["r0", "r1", "r2"], queued, **sglang) == order
    queued = [2, 2, 2]
    queued[order[0]] = 70
    assert rank_by_prefix(p, ["r0", "r1", "r2"], queued, **sglang)[0] == order[1]
    queued[order[0]] = 66  # 64 more, but not more than 64
    assert rank_by_prefix(p, ["r0", "r1", "r2"], queued, **sglang)[0] == order[0]
    with pytest.raises(ValueError, match="affinity_tokens"):
        rank_by_prefix(p, ["r0"], affinity_tokens=0)
