"""The cache-aware router ranks replicas by the TTFT its plan would have on each; the chosen
replica decides what to load with the same estimate (``cluster.prefill_lb.load_units``). The
router never changes the request it routes."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

from cluster.prefill_lb import CostModel, load_units
from cluster.request import GenerationRequest, PrefixPlan
from cluster.routing_stats import RoutingStats
from deploy.prefill_router import CacheAwareRouter, plan_prefix

KEYS = tuple(bytes([i]) * 16 for i in range(4))


def _replica(rid: str, node: str, cost: CostModel, queued=()):
    stats = RoutingStats(node, time=1e18, queued=tuple(queued), samples=100, cost=cost).to_dict()
    return SimpleNamespace(routing_stats=stats, replica_id=SimpleNamespace(unique_id=rid), node_id=node)


def _route(replicas, req):
    router = object.__new__(CacheAwareRouter)  # Serve builds it with its handle's internals
    router.initialize_state()
    pending = SimpleNamespace(args=[req], metadata=SimpleNamespace(internal_request_id="r1"))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert pending.args[0] is req  # the request goes as it came
    return ranks[0][0].replica_id.unique_id


def test_plan_prefix_counts_each_nodes_run_from_the_start():
    plan = PrefixPlan(KEYS, (("a", "b"), ("a",), ("a", "b")))
    info = plan_prefix(4 * 64 + 1, plan)
    assert info.units == 3 and dict(info.local_run) == {"a": 3, "b": 1}
    assert plan_prefix(10, None).units == 0


def test_the_holders_replica_is_chosen_and_loads_its_nodes_units_and_a_slow_remote_load_is_declined():
    slow_net = CostModel(token_s=1e-3, attn_s=0.0, unit_bytes=1 << 30, remote_bps=1e6, local_bps=1e12)
    plan = PrefixPlan(KEYS, (("n1",), ("n1",), ("n1",)))
    req = GenerationRequest("", tuple(range(4 * 64 + 1)), 1, plan=plan)
    # a replica on the holder's node: it is chosen and loads all three locally
    assert _route([_replica("r-n2", "n2", slow_net), _replica("r-n1", "n1", slow_net)], req) == "r-n1"
    assert load_units("n1", len(req.prompt_ids), plan.holders, slow_net) == 3
    # a replica elsewhere: fetching 3 GiB at 1 MB/s is slower than computing 257 tokens
    assert load_units("n2", len(req.prompt_ids), plan.holders, slow_net) == 0
    fast_net = dataclasses.replace(slow_net, token_s=1e-2, unit_bytes=1 << 10, remote_bps=1e9)
    assert load_units("n2", len(req.prompt_ids), plan.holders, fast_net) == 3  # fetching beats computing


def test_a_busy_holder_loses_to_an_idle_replica_that_fetches():
    fast_net = CostModel(token_s=1e-3, attn_s=0.0, unit_bytes=1 << 10, remote_bps=1e9, local_bps=1e12)
    req = GenerationRequest("", tuple(range(4 * 64 + 1)), 1, plan=PrefixPlan(KEYS, (("n1",),) * 3))
    busy = _replica("r-n1", "n1", fast_net, queued=[(4000, 0)] * 4)
    assert _route([busy, _replica("r-n2", "n2", fast_net)], req) == "r-n2"


def test_requests_sent_after_a_report_count_in_its_queue_and_those_before_it_do_not():
    """A report counts what reached the replica before it was taken; what the router sent after
    it is added, so a burst does not all go where the last report showed an empty queue."""
    cost = CostModel(token_s=1e-3, attn_s=0.0)
    router = object.__new__(CacheAwareRouter)
    router.initialize_state()

    def replica(rid, taken, queued=()):
        stats = RoutingStats(rid, time=taken, queued=tuple(queued), samples=100, cost=cost).to_dict()
        return SimpleNamespace(routing_stats=stats, replica_id=SimpleNamespace(unique_id=rid), node_id=rid)

    def route(replicas, rid, tokens=300):
        req = GenerationRequest(rid, tuple(range(tokens)), 1)
        pending = SimpleNamespace(args=[req], metadata=SimpleNamespace(internal_request_id=rid))
        chosen = asyncio.run(router.choose_replicas(replicas, pending))[0][0]
        router.on_request_routed(pending, chosen.replica_id, None)
        return chosen.replica_id.unique_id

    a, b = replica("a", taken=1.0), replica("b", taken=1.0)  # reports from long ago, both idle
    assert route([a, b], "r1", 3000) == "a"
    assert route([a, b], "r2") == "b"  # r1 was sent after the reports: a is busier
    # fresh reports that show r1 and r2 queued where they went (and b one more from elsewhere):
    # r1 is not counted twice, so a's 3,000 tokens are less than b's 3,500
    later = time.time() + 1.0
    assert route([replica("a", later, queued=[(3000, 0)]), replica("b", later, queued=[(300, 0), (3200, 0)])],
                 "r3") == "a"
