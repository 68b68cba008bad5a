"""The cache-aware router fills in the request's prefix plan: what the chosen replica loads."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from cluster.prefill_lb import CostModel
from cluster.request import GenerationRequest, PrefixPlan
from deploy.prefill_router import CacheAwareRouter, plan_prefix

KEYS = tuple(bytes([i]) * 16 for i in range(4))


def _replica(rid: str, node: str, cost: CostModel):
    stats = {"node": node, "queued": [], "running": 0, "time": 1e18, "samples": 100,
             "cost": {k: getattr(cost, k) for k in cost.__dataclass_fields__}}
    return SimpleNamespace(routing_stats=stats, replica_id=SimpleNamespace(unique_id=rid), node_id=node)


def _route(replicas, req):
    router = object.__new__(CacheAwareRouter)
    router.initialize_state()
    pending = SimpleNamespace(args=[req], metadata=SimpleNamespace(internal_request_id="r1"))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert pending.args[0].prompt_ids == req.prompt_ids  # the request sent is the one routed, planned
    return ranks[0][0].replica_id.unique_id, pending.args[0].plan


def test_plan_prefix_counts_each_nodes_run_from_the_start():
    plan = PrefixPlan(KEYS, (("a", "b"), ("a",), ("a", "b")))
    info = plan_prefix(4 * 64 + 1, plan)
    assert info.units == 3 and dict(info.local_run) == {"a": 3, "b": 1}
    assert plan_prefix(10, None).units == 0


def test_the_chosen_replica_loads_its_nodes_units_and_a_slow_remote_load_is_declined():
    slow_net = CostModel(token_s=1e-3, attn_s=0.0, unit_bytes=1 << 30, remote_bps=1e6, local_bps=1e12)
    req = GenerationRequest("", tuple(range(4 * 64 + 1)), 1, plan=PrefixPlan(KEYS, (("n1",), ("n1",), ("n1",))))
    # a replica on the holder's node: it loads all three locally
    chosen, plan = _route([_replica("r-n1", "n1", slow_net), _replica("r-n2", "n2", slow_net)], req)
    assert chosen == "r-n1" and plan.load_units == 3
    # only replicas elsewhere: fetching 3 GiB at 1 MB/s is slower than computing 257 tokens
    chosen, plan = _route([_replica("r-n2", "n2", slow_net), _replica("r-n3", "n3", slow_net)], req)
    assert plan.load_units == 0 and plan.unit_keys == KEYS  # declined: the replica computes them
    fast_net = CostModel(token_s=1e-2, attn_s=0.0, unit_bytes=1 << 10, remote_bps=1e9, local_bps=1e12)
    _, plan = _route([_replica("r-n2", "n2", fast_net)], req)
    assert plan.load_units == 3  # fetching beats computing
