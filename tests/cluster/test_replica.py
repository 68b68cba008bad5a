"""``cluster.replica.Replica`` without Ray: a plan's load is decided on the replica with its own
measured costs, the usage log records finished requests, the routing stats round-trip as
Serve carries them, and a unit store's new units reach the directory."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from cachedir.hashing import chain_keys
from cluster.prefill_lb import CostModel
from cluster.replica import Replica
from cluster.request import GenerationRequest, PrefixPlan
from cluster.routing_stats import RoutingStats
from model.tokenizer import ByteTokenizer
from tests.cluster.test_engine import _cache, _engine, _ns, _prompt, _ref, _tokens
from tests.waiting import until


@pytest.fixture
def replica(model, tmp_path):
    from cachedir.directory.memory import MemoryDirectory

    directory = MemoryDirectory("replica-test")
    rep = Replica(_engine(model, _cache(tmp_path / "store", ram=0), prefix_sharing=False), "node-a", ByteTokenizer(),
                  usage_dir=str(tmp_path / "usage"), open_directory=lambda: directory)
    yield rep, directory
    rep.loop.stop()
    rep.engine.cache.close()


def _run(rep: Replica, req: GenerationRequest) -> list:
    async def go():
        return [o async for o in rep.generate(req)]

    return asyncio.run(go())


def test_a_planned_load_is_decided_on_the_replica_and_its_tokens_equal_computing(replica, model):
    rep, directory = replica
    prompt = _prompt(64 * 3 + 5, 3)
    want = _ref(model, prompt, 4)
    outs = _run(rep, GenerationRequest("warm", prompt, 4))
    assert _tokens(outs) == want
    rep.engine.cache.flush()
    keys = tuple(chain_keys(_ns(model).seed, prompt, 64))
    plan = PrefixPlan(keys, (("node-a",),) * 3, namespace=_ns(model).id)
    outs = _run(rep, GenerationRequest("hit", prompt, 4, plan=plan))
    assert _tokens(outs) == want and outs[-1].cached_tokens == 3 * 64  # its own node's units: loaded
    # another node's units over a network too slow to pay: computed, same tokens
    rep._cost = dataclasses.replace(rep._cost, unit_bytes=1 << 30)
    rep._bandwidth["remote"].bps = 1e3
    far = dataclasses.replace(plan, holders=(("node-b",),) * 3, addresses=(("node-b", "10.0.0.9:1"),))
    outs = _run(rep, GenerationRequest("far", prompt, 4, plan=far))
    assert _tokens(outs) == want and outs[-1].sources.declined == 3 * 64
    until(lambda: len(rep.usage.path.read_text().splitlines()) == 3, 10, "a usage record per request")


def test_routing_stats_round_trip_as_serve_carries_them(replica):
    rep, _ = replica
    st = rep.routing_stats("ray-node-1")
    assert st.node == "ray-node-1" and not st.draining and st.kv_tokens == 256 * rep.engine.cfg.page_size
    again = RoutingStats.of(json.loads(json.dumps(st.to_dict())))
    assert again == st and isinstance(again.cost, CostModel)
    rep.role = "draining"
    assert rep.routing_stats().draining
    assert RoutingStats.of(None) == RoutingStats() and RoutingStats().cost is None


def test_the_stores_new_units_reach_the_directory(replica, model):
    rep, directory = replica
    prompt = _prompt(64 * 2 + 3, 9)
    _run(rep, GenerationRequest("r", prompt, 2))
    keys = chain_keys(_ns(model).seed, prompt, 64)
    until(lambda: directory.longest_prefix(keys[:2]).num_units == 2, 30, "the units to be published")
    assert rep.stats()["directory"]["failures"] == 0


def test_a_batch_lines_usage_is_logged_as_batch_with_the_tokens_of_an_interactive_one(replica, model):
    rep, _ = replica
    prompt = _prompt(40, 5)
    interactive = _run(rep, GenerationRequest("now", prompt, 4))
    background = _run(rep, GenerationRequest("later", prompt, 4, background=True))
    assert _tokens(background) == _tokens(interactive) and background[-1].background and not interactive[-1].background
    until(lambda: len(rep.usage.path.read_text().splitlines()) == 2, 10, "a usage record per request")
    records = [json.loads(x) for x in rep.usage.path.read_text().splitlines()]
    assert [r["batch"] for r in records] == [False, True]


def test_stats_give_the_replicas_memory_beside_its_bound(replica, model):
    """The bound adds the model's weights, its pool, the cache's in-memory caps (RAM tier and read
    buffers), the grammar cache, the scored-logits cap, a step's logits and their copies, and the
    runtime's allowance; it grows with the engine's caps."""
    import resource

    from cluster.engine_config import EngineConfig
    from cluster.memory_bound import RUNTIME_MB, memory_bound
    from model.quant import weight_bytes

    rep, _ = replica
    mem = rep.stats()["memory"]
    bound, eng = mem["bound"], rep.engine
    assert bound["weights_mb"] >= round(weight_bytes(model) / 2**20, 1) > 0  # the weights, and its tables
    assert bound["kv_pool_mb"] == round(eng.kv.pool.nbytes() / 2**20, 1)
    assert bound["cache_mb"] == round(eng.cache.memory_bytes() / 2**20, 1) == 256  # the store's read buffers (no RAM tier)
    assert bound["runtime_mb"] == RUNTIME_MB and bound["scored_logits_mb"] == eng.cfg.scored_logits_mib
    assert bound["total_mb"] == pytest.approx(sum(v for k, v in bound.items() if k != "total_mb"), abs=0.5)
    assert 0 < mem["rss_mb"] <= mem["peak_rss_mb"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 + 1
    base = memory_bound(1, 1, 129280, EngineConfig())
    more = memory_bound(1, 1, 129280, EngineConfig(max_num_seqs=32, speculative_tokens=1, scored_logits_mib=512))
    assert more.step_logits_mb == 4 * base.step_logits_mb and more.scored_logits_mb == 2 * base.scored_logits_mb


@pytest.mark.parametrize("family", ["tiny", "tiny-v3.2", "tiny-v4"])
def test_a_models_tensors_are_counted_once_in_every_family(family):
    from cluster.memory_bound import tensor_bytes
    from model.checkpoint import build_model, random_state_dict
    from model.config import named_config

    cfg = named_config(family)
    state = random_state_dict(cfg, seed=1, std=0.02)
    model = build_model(cfg, state)
    stored = sum(t.numel() * t.element_size() for t in state.values())
    assert stored <= tensor_bytes(model) <= 1.25 * stored  # every weight, no view counted twice
