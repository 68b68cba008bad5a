"""The expert placement's version state on a fake clock: join, poll, switch, what may be dropped,
when a placement has nobody left to follow it."""

from __future__ import annotations

import pytest
import torch

from cluster.ep_versions import PlacementVersions, Poll
from cluster.eplb import Placement


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _placement(seed: int) -> Placement:
    g = torch.Generator().manual_seed(seed)
    return Placement.from_phy2log(torch.stack([torch.randperm(8, generator=g) for _ in range(2)]), 8, 2)


@pytest.fixture
def state():
    clock = Clock()
    versions = PlacementVersions(replica_timeout_s=30.0, clock=clock)
    versions.add(1, _placement(1), ["s0", "s1"])
    return versions, clock


def test_replicas_learn_to_switch_and_a_version_stays_while_a_live_replica_serves_it(state):
    versions, clock = state
    versions.join("a")
    versions.join("b")
    assert versions.poll("a", 1) is None and versions.live() == {"a": 1, "b": 1}
    versions.add(2, _placement(2), ["s0", "s1"])
    assert versions.pending(2) == ["a", "b"]
    assert versions.poll("a", 1) == Poll.SWITCH and versions.poll("a", 2) is None
    assert versions.pending(2) == ["b"]
    assert versions.droppable() == ([], []) and versions.held() == [1, 2]  # b still serves 1
    clock.now += 29.9
    assert versions.poll("b", 2) is None  # b switched
    assert versions.droppable() == ([1], []) and versions.held() == [2]


def test_a_replica_that_stops_polling_stops_holding_its_version(state):
    versions, clock = state
    versions.join("a")
    versions.add(2, _placement(2), ["s0"])
    clock.now += 29.0
    assert versions.droppable() == ([], [])  # a, on version 1, is live
    clock.now += 1.0  # 30 s without a poll: gone
    assert versions.live() == {} and versions.pending(2) == []
    assert versions.droppable() == ([1], [])
    assert versions.poll("a", 1) == Poll.SWITCH  # it comes back: switch, its version is gone


def test_a_version_unknown_here_but_served_is_kept(state):
    """A replica re-joined bringing a version this state never held (placed before a restart):
    the shards must keep it though it is not in ``held``."""
    versions, _ = state
    versions.join("old", serving=7)
    assert versions.droppable() == ([], [7])


def test_loads_sum_over_live_replicas_only(state):
    versions, clock = state
    versions.join("a")
    versions.join("b")
    versions.poll("a", 1, torch.ones(2, 8, dtype=torch.float64))
    clock.now += 20
    versions.poll("b", 1, torch.full((2, 8), 2.0, dtype=torch.float64))
    assert versions.load(2, 8).sum().item() == 16 * 3
    clock.now += 15  # a last polled 35 s ago
    assert versions.load(2, 8).sum().item() == 16 * 2
    versions.poll("b", 1)  # no load this time: the last one stands
    assert versions.load(2, 8).sum().item() == 16 * 2


def test_unknown_replicas_and_a_forgotten_placement_ask_for_a_rejoin(state):
    versions, clock = state
    assert versions.poll("stranger", 1) == Poll.REJOIN
    versions.join("a")
    versions.leave("a")
    assert versions.poll("a", 1) == Poll.REJOIN
    versions.join("a")
    assert versions.unfollowed_for() == 0.0
    clock.now += 30  # a is no longer live
    assert versions.unfollowed_for() == 0.0  # the count starts now
    clock.now += 31
    assert versions.unfollowed_for() == 31.0
    gone = versions.forget_all()
    assert [v.shards for v in gone] == [("s0", "s1")] and versions.current is None and versions.held() == []
    assert versions.poll("a", 1) == Poll.REJOIN and versions.unfollowed_for() == 0.0
    with pytest.raises(LookupError, match="no placement to join"):
        versions.join("a")


def test_bad_arguments_are_refused(state):
    versions, _ = state
    with pytest.raises(ValueError, match="version 1 exists"):
        versions.add(1, _placement(3), ["s0"])
    with pytest.raises(ValueError, match="replica_timeout_s"):
        PlacementVersions(0)
    with pytest.raises(LookupError):
        _ = PlacementVersions(1).target
