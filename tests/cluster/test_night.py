"""The night's plan (``cluster.night``) without a cluster: which nodes are lent, what keeps
serving, and the drain's phases on a fake clock."""

from __future__ import annotations

import pytest

from cluster.night import Drain, Fleet, ReplicaReport, plan_night, shard_only_nodes, unique_units


def _fleet(**kw) -> Fleet:
    replicas = {"r-head": ReplicaReport("LLMServer", "head", 0), "r-a": ReplicaReport("LLMServer", "a", 5),
                "r-b": ReplicaReport("LLMServer", "b", 1), "r-c": ReplicaReport("LLMServer", "c", 1)}
    return Fleet("head", kw.pop("roles", {}), kw.pop("replicas", replicas), **kw)


def _none(nodes):
    return dict.fromkeys(nodes, 0)


def test_the_idlest_nodes_with_the_least_unique_cache_are_lent_and_never_the_head_first():
    plan = plan_night(_fleet(), 2, lambda nodes: {"b": 7, "c": 0, "a": 0, "head": 0})
    assert plan.lend == ["c", "b"] and plan.leaving == ["r-c", "r-b"]  # c: idle and nothing unique
    assert plan.target == {"LLMServer": 2} and plan.nodes == 4


def test_a_lent_node_counts_in_the_fleet_and_is_not_lent_again():
    plan = plan_night(_fleet(roles={"c": "lent"}), 1, _none)
    assert "c" not in plan.lend and plan.nodes == 4


@pytest.mark.parametrize("n", [0, 4])
def test_at_least_one_node_keeps_serving(n):
    with pytest.raises(ValueError, match=f"cannot lend {n} of 4"):
        plan_night(_fleet(), n, _none)


def test_a_pools_last_replica_and_the_ingresss_node_stay():
    replicas = {"r-p": ReplicaReport("LLMServer", "a"), "r-p2": ReplicaReport("LLMServer", "b"),
                "r-d": ReplicaReport("LLMDecode", "c")}
    fleet = Fleet(None, {}, replicas, ("LLMServer", "LLMDecode"), ingress=frozenset({"a"}))
    plan = plan_night(fleet, 1, _none)
    assert plan.lend == ["b"] and plan.target == {"LLMServer": 1, "LLMDecode": 1}
    with pytest.raises(ValueError, match="each pool"):
        plan_night(fleet, 2, _none)


def test_only_the_given_nodes_and_shard_only_nodes():
    assert plan_night(_fleet(), 1, _none, among=["a"]).lend == ["a"]
    assert shard_only_nodes(_fleet(roles={"y": "lent"}), ["a", "x", "y", "x"], None) == ["x"]


def test_unique_units_are_those_no_other_live_node_holds():
    from cachedir.directory.memory import MemoryDirectory

    d = MemoryDirectory("night")
    for node, keys in (("a", [b"1", b"2"]), ("b", [b"2"]), ("c", [b"3"])):
        d.register(node, keys)
        d.heartbeat(node, f"{node}:1", 60)
    assert unique_units(d, ["a", "b", "c"]) == {"a": 1, "b": 0, "c": 1}
    d.register("dead", [b"1", b"4"])  # never beats: its units are no one's
    assert unique_units(d, ["a", "dead"]) == {"a": 1, "dead": 0}


def test_the_drain_waits_then_migrates_then_gives_up():
    now = [100.0]
    drain = Drain(["r-a", "r-b"], deadline_s=30, grace_s=60, clock=lambda: now[0])
    busy = {"r-a": {"time": 102.0, "draining": True, "running": 2}, "r-b": {"time": 102.0, "draining": True}}
    assert drain.state(busy) == "draining"
    now[0] = 131.0
    assert drain.state(busy) == "migrate"
    now[0] = 191.0
    assert drain.state(busy) == "stuck"
    stale = {"r-a": {"time": 100.5, "draining": True, "running": 0}}  # a report from before the drain
    assert drain.state(stale) == "stuck" and not drain.drained(stale)
    assert drain.state({"r-a": {"time": 102.0, "draining": True, "running": 0}}) == "drained"  # r-b gone
