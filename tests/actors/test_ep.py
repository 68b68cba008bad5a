"""Expert parallelism on a simulated 3-node Ray cluster: EP output equals single-process output
token for token, through a rebalance and through a killed expert shard."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cluster.request import GenerationRequest
from model.checkpoint import load_model
from model.generate import generate
from tests.waiting import until

pytestmark = [pytest.mark.ray, pytest.mark.slow]
CHECKPOINT_SEED = 7  # the weights of the `checkpoint` fixture (tests/actors/conftest.py)

PROMPTS = [[256, 5, 17, 99, 3], [256, 40, 41, 42, 43, 44, 45, 46, 47], [256, 7] * 20, [256, 300, 2]]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_model(checkpoint)
    return [generate(model, p, MAX_TOKENS, eos_id=None) for p in PROMPTS]


@pytest.fixture(scope="module")
def cluster(three_nodes):
    return three_nodes.cluster


def _shards_and_control(checkpoint, nodes: int, slots: int, **control_args):
    from actors.ep_control import ep_control_actor
    from actors.ep_group import expert_shard_actor

    shards = [expert_shard_actor(num_cpus=0, resources={f"node{i}": 0.01}).remote() for i in range(nodes)]
    control = ep_control_actor(num_cpus=0, resources={"node0": 0.01}).remote(
        str(checkpoint), shards, slots, nodes, **control_args)
    return shards, control


def _replica(checkpoint, tmp_path_factory, control, node: int = 0, num_pages: int = 256, micro_batches: int = 1,
             ep_timeout_s: float = 30.0, warmup: bool | None = None):
    import ray

    from actors.llm_server import LLMServer
    from actors.replica_config import EPSection, ReplicaConfig, StoreSection
    from cluster.engine import EngineConfig

    engine = EngineConfig(num_pages=num_pages, max_num_seqs=8, micro_batches=micro_batches, itl_factor=0.0)
    return ray.remote(num_cpus=0, resources={f"node{node}": 0.01})(LLMServer).remote(ReplicaConfig(
        str(checkpoint), StoreSection(str(tmp_path_factory.mktemp("cache"))), warmup=warmup, engine=engine,
        enable_cache=False, ep=EPSection(control, ep_timeout_s)))


@pytest.fixture(scope="module")
def ep_server(cluster, checkpoint, tmp_path_factory):
    import ray

    shards, control = _shards_and_control(checkpoint, 3, 18)  # 16 experts + 2 redundant copies
    server = _replica(checkpoint, tmp_path_factory, control,
                      micro_batches=2,  # decode rounds overlap: the kill and the rebalance hit rounds in flight
                      warmup=True)  # as on a GPU: one prefill and one decode through the shards before serving
    ray.get(server.check_health.remote(), timeout=300)
    return server, shards, control


def _generate_all(server) -> list[list[int]]:
    """Submit every prompt at once (one batch) and collect the greedy tokens."""
    import ray

    streams = [
        server.generate.options(num_returns="streaming").remote(
            GenerationRequest("", tuple(p), MAX_TOKENS, ignore_eos=True))
        for p in PROMPTS
    ]
    out = []
    for stream in streams:
        tokens: list[int] = []
        for ref in stream:
            tokens += ray.get(ref, timeout=300).new_token_ids
        out.append(tokens)
    return out


def test_ep_over_three_nodes_equals_single_process(ep_server, reference):
    import ray

    server, shards, _ = ep_server
    nodes = {ray.get(s.info.remote())["node_id"] for s in shards}
    assert len(nodes) == 3  # one shard per node
    assert _generate_all(server) == reference
    stats = ray.get(server.ep_stats.remote())
    assert stats["rounds"] > 0 and stats["retries"] == 0
    counts = torch.tensor(stats["phy2log"]).flatten().bincount()
    assert (counts >= 1).all() and counts.max() > 3  # every expert placed, some with redundant copies


def _rounds(server) -> int:
    import ray

    return ray.get(server.ep_stats.remote())["rounds"]


def _while_streaming(server, action) -> list[list[int]]:
    result: list = []
    before = _rounds(server)
    worker = threading.Thread(target=lambda: result.append(_generate_all(server)))
    worker.start()
    until(lambda: _rounds(server) > before or not worker.is_alive(), 120, "the stream's first expert round")
    assert worker.is_alive(), "the stream ended before the action: make it longer"
    action()
    worker.join(timeout=600)
    assert result, "requests did not finish"
    return result[0]


def test_idle_longer_than_the_round_timeout_needs_no_recovery(cluster, checkpoint, tmp_path_factory, reference):
    """Shards wait in a collective between requests; idling past the replica's round timeout
    must not break the group."""
    import ray

    shards, control = _shards_and_control(checkpoint, 2, 16)
    server = _replica(checkpoint, tmp_path_factory, control, num_pages=64, ep_timeout_s=2.0)
    ray.get(server.check_health.remote(), timeout=300)
    time.sleep(4.0)  # twice the replica's round timeout
    assert _generate_all(server)[:1] == reference[:1]
    assert ray.get(server.ep_stats.remote())["retries"] == 0
    for actor in [server, control, *shards]:
        ray.kill(actor)


def test_rebalance_during_a_stream_loses_nothing(ep_server, reference):
    import ray

    server, shards, control = ep_server
    before, held = ray.get(server.ep_stats.remote()), ray.get(control.info.remote())
    # move every expert: a placement shifted by one shard
    shifted = torch.tensor(before["phy2log"]).roll(6, dims=1).tolist()
    moved = {}
    out = _while_streaming(server, lambda: moved.update(ray.get(control.rebalance.remote(shifted))))
    assert out == reference
    assert moved["moved_slots"] > 0 and moved["pending"] == []
    after, info = ray.get(server.ep_stats.remote()), ray.get(control.info.remote())
    assert after["version"] == before["version"] + 1 and after["phy2log"] == shifted
    assert info["experts_from_peers"] > held["experts_from_peers"]  # moved between shards
    assert info["experts_from_checkpoint"] == held["experts_from_checkpoint"]
    assert all(ray.get(s.info.remote())["versions"] == [after["version"]] for s in shards)  # the old one dropped
    # and a plan from the load the replica measured (it reports it to the control)
    assert float(ray.get(control.load.remote()).sum()) > 0
    assert ray.get(control.rebalance.remote())["version"] >= after["version"]
    assert _generate_all(server) == reference


def test_two_attention_replicas_follow_one_placement(ep_server, checkpoint, tmp_path_factory, reference):
    """DeepSeek's shape: data-parallel attention replicas over the same expert shards. A rebalance
    while both stream moves both to the new placement (the control drops the old weights only
    once both serve the new one); both answer as the model computed alone."""
    import ray

    server, shards, control = ep_server
    other = _replica(checkpoint, tmp_path_factory, control, 1, micro_batches=2)
    ray.get(other.check_health.remote(), timeout=300)
    before = ray.get(control.info.remote())
    assert len(before["replicas"]) == 2 and set(before["replicas"].values()) == {before["version"]}
    shifted = torch.tensor(before["phy2log"]).roll(-6, dims=1).tolist()
    results: dict[str, list] = {}
    workers = [threading.Thread(target=lambda k=k, r=r: results.__setitem__(k, _generate_all(r)))
               for k, r in (("first", server), ("second", other))]
    before = {r: _rounds(r) for r in (server, other)}
    for w in workers:
        w.start()
    until(lambda: all(_rounds(r) > n for r, n in before.items()) or not all(w.is_alive() for w in workers), 120,
          "both streams' first expert round")
    assert all(w.is_alive() for w in workers), "the streams ended before the rebalance: make them longer"
    moved = ray.get(control.rebalance.remote(shifted))
    for w in workers:
        w.join(timeout=600)
    assert results == {"first": reference, "second": reference}
    assert moved["moved_slots"] > 0 and moved["pending"] == []
    assert set(ray.get(control.info.remote())["replicas"].values()) == {moved["version"]}
    for replica in (server, other):
        stats = ray.get(replica.ep_stats.remote())
        assert stats["version"] == moved["version"] and stats["phy2log"] == shifted and stats["retries"] == 0
    assert all(ray.get(s.info.remote())["versions"] == [moved["version"]] for s in shards)
    ray.get(control.leave.remote(ray.get(other.ep_stats.remote())["replica_id"]))  # as a stopping replica does
    ray.kill(other)


def test_a_killed_shard_is_recovered(ep_server, reference):
    import ray

    server, shards, _ = ep_server
    reforms = ray.get(server.ep_stats.remote())["reforms"]
    out = _while_streaming(server, lambda: ray.kill(shards[1], no_restart=False))
    assert out == reference
    stats = ray.get(server.ep_stats.remote())
    assert stats["reforms"] > reforms
    assert _generate_all(server) == reference


def test_prefill_decode_split_with_ep_equals_single_process(ep_server, checkpoint, reference, tmp_path_factory):
    """A prefill replica on node 0 and decode replicas on nodes 1 and 2, all over the same three
    expert shards (each replica its own gloo group); the KV moves through the object store."""
    import asyncio

    import ray

    from actors.replica_pool import ActorPool
    from deploy.ingress.dispatch import Dispatcher
    from deploy.ingress.planner import Planner
    from deploy.metrics import IngressMetrics

    _, _, control = ep_server

    def replica(node: int, num_pages: int):
        return _replica(checkpoint, tmp_path_factory, control, node, num_pages=num_pages)

    prefill, decode = [replica(0, 64)], [replica(1, 6), replica(2, 6)]  # 96 KV tokens each
    ray.get([r.check_health.remote() for r in prefill + decode], timeout=300)
    metrics = IngressMetrics("tiny")

    async def run_all():
        # the pools' conditions belong to this event loop
        decode_pool = ActorPool(decode, kv=True)
        router = Dispatcher(ActorPool(prefill), Planner(None, None), metrics, decode=decode_pool)

        async def one(prompt):
            req = GenerationRequest("", tuple(prompt), MAX_TOKENS, ignore_eos=True)
            return [t async for _, item in router.choices((req,), 1) for t in item.new_token_ids]

        return await asyncio.gather(*(one(p) for p in PROMPTS)), decode_pool

    got, decode_pool = asyncio.run(run_all())
    assert got == reference
    assert metrics.handoffs._value.get() == len(PROMPTS)
    assert decode_pool.queued >= 1  # 4 requests of 48-80 KV tokens do not all fit at once
    served = [ray.get(d.stats.remote())["engine"]["decode_tokens"] for d in decode]
    assert all(n > 0 for n in served)  # both decode replicas took requests
    decode_pool.balancer.check_integrity()
    assert all(r.reserved_tokens == 0 for r in decode_pool.balancer.replicas.values())


def test_scale_down_and_up_during_a_stream(ep_server, reference):
    """Re-plan onto two shards (node 2's shard leaves) mid-stream, then back onto three; weights
    move between shards through the object store and the group is re-formed each time."""
    import ray

    server, shards, control = ep_server
    before = ray.get(control.info.remote())
    result = {}
    out = _while_streaming(server, lambda: result.update(ray.get(control.resize.remote(shards[:2], 2))))
    assert out == reference
    assert result["shards"] == 2 and result["slots"] >= 16
    assert ray.get(server.ep_stats.remote())["num_shards"] == 2
    assert ray.get(control.info.remote())["experts_from_peers"] > before["experts_from_peers"]
    assert ray.get(shards[2].info.remote())["versions"] == []  # the lent shard dropped its weights
    out = _while_streaming(server, lambda: ray.get(control.resize.remote(shards, 3)))
    assert out == reference
    assert ray.get(server.ep_stats.remote())["num_shards"] == 3


def test_a_new_checkpoint_rolls_over_on_the_same_shards(ep_server, tmp_path_factory, reference):
    """A redeploy with new weights (``tide scale day --reload``) runs a second control on the same
    shards while replicas roll over: each replica gets its own checkpoint's experts, and the old
    control frees its weights once no replica follows it."""
    import ray

    from model.checkpoint import random_state_dict, save_checkpoint
    from model.config import named_config

    server, shards, control = ep_server
    cfg = named_config("tiny")
    retrained = save_checkpoint(tmp_path_factory.mktemp("retrained"), cfg, random_state_dict(cfg, seed=99, std=0.06))
    expected = [generate(load_model(retrained), p, MAX_TOKENS, eos_id=None) for p in PROMPTS]
    assert expected != reference
    from actors.ep_control import ep_control_actor

    new_control = ep_control_actor(num_cpus=0, resources={"node0": 0.01}).remote(
        str(retrained), shards, 18, 3, replica_timeout_s=2.0, name="retrained")
    new = _replica(retrained, tmp_path_factory, new_control, 1)
    ray.get(new.check_health.remote(), timeout=300)
    assert _generate_all(new) == expected
    assert _generate_all(server) == reference  # the old replica, same shards, its own weights
    assert all(ray.get(s.info.remote())["owners"] == sorted([ray.get(control.info.remote())["name"], "retrained"])
               for s in shards)
    # the new control's replica goes away: its weights leave the shards
    ray.get(new_control.leave.remote(ray.get(new.ep_stats.remote())["replica_id"]))
    ray.kill(new)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any("retrained" in ray.get(s.info.remote())["owners"] for s in shards):
        time.sleep(0.5)
    assert all("retrained" not in ray.get(s.info.remote())["owners"] for s in shards)
    assert _generate_all(server) == reference
    ray.kill(new_control)


def test_a_restarted_control_takes_the_placement_the_replicas_serve(ep_server, reference):
    """The control keeps its state in memory: when it dies, Ray restarts it empty and the replicas
    re-join with the placement they serve. Serving never depends on it between changes."""
    import ray

    server, shards, control = ep_server
    version = ray.get(server.ep_stats.remote())["version"]
    out = _while_streaming(server, lambda: ray.kill(control, no_restart=False))
    assert out == reference
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = ray.get(control.info.remote())
        if info["version"] == version and len(info["replicas"]) >= 1:
            break
        time.sleep(0.5)
    assert info["version"] == version, info
    assert ray.get(control.rebalance.remote())["version"] >= version  # and it can change placement again
    assert _generate_all(server) == reference

