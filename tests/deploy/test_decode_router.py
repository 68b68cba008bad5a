"""``DecodeRouter`` (the decode pool's Serve request router) driven directly: capacities come
from the replicas' routing stats, a request reserves its KV on the replica it is routed to until
it completes, and a request that fits nowhere right now waits (backs off). End to end through
Serve: ``test_pd_app.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from cluster.request import GenerationRequest
from cluster.routing_stats import RoutingStats
from deploy.decode_router import DecodeRouter


def _replica(rid: str, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid),
                           routing_stats=RoutingStats(kv_tokens=tokens, page_size=16).to_dict())


def _request(rid: str, prompt: int, max_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(args=[GenerationRequest(rid, (1,) * prompt, max_tokens)],
                           metadata=SimpleNamespace(internal_request_id=rid),
                           routing_context=SimpleNamespace(should_backoff=False))


def _router() -> DecodeRouter:
    router = DecodeRouter.__new__(DecodeRouter)  # Serve builds it with its handle's internals
    router.initialize_state()
    return router


def _route(router, replicas, req, take: int = 0) -> str | None:
    ranks = asyncio.run(router.choose_replicas(replicas, req))
    flat = [r for rank in ranks for r in rank]
    if not flat:
        return None
    chosen = flat[take]
    router.on_request_routed(req, chosen.replica_id, None)
    return chosen.replica_id.unique_id


def test_reserves_until_completion_and_waits_when_full():
    replicas = [_replica("a", 256), _replica("b", 256)]
    router = _router()
    placed = [_route(router, replicas, _request(f"r{i}", 80, 40)) for i in range(4)]  # 128 tokens each
    assert sorted(placed) == ["a", "a", "b", "b"]  # balanced by occupancy
    full = _request("r4", 80, 40)
    assert _route(router, replicas, full) is None and full.routing_context.should_backoff
    router.on_request_completed(SimpleNamespace(unique_id=placed[0]), "r0")
    assert _route(router, replicas, full) == placed[0]  # room again
    assert {rid: s["reserved_tokens"] for rid, s in router.stats().items()} == {"a": 256, "b": 256}


def test_a_later_choice_moves_the_reservation():
    replicas = [_replica("a", 256), _replica("b", 512)]
    router = _router()
    assert _route(router, replicas, _request("r0", 60, 4), take=1) == "a"  # Serve took the second rank
    assert router.stats()["a"]["reserved_tokens"] == 64 and router.stats()["b"]["reserved_tokens"] == 0


def test_too_big_for_any_replica_goes_on_for_the_engine_to_refuse():
    replicas = [_replica("a", 256)]
    req = _request("r0", 300, 10)
    ranks = asyncio.run(_router().choose_replicas(replicas, req))
    assert ranks == [replicas] and not req.routing_context.should_backoff


def test_replicas_without_reported_capacity_get_serves_default_order():
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id="a"), routing_stats={})]
    assert asyncio.run(_router().choose_replicas(replicas, _request("r0", 10, 10))) == [replicas]
