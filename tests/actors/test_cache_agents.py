"""Cache agents on a simulated 3-node Ray cluster, each node with its own cache directory and
all sharing one real redis-server directory: a prefix computed on node A is served on node B from
A's units (token-identical), a repeatedly hit unit gets a second replica, and a killed agent's
units leave lookups within the heartbeat TTL while requests keep succeeding."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from model.checkpoint import load_model
from model.generate import generate
from tests.waiting import until

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]
CHECKPOINT_SEED = 11  # the weights of the `checkpoint` fixture (tests/actors/conftest.py)

TTL_S = 2.0
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(three_nodes, redis_server, tmp_path_factory):
    from actors.replica_config import AgentSection, DirectorySection, StoreSection

    agent_cfg = AgentSection(
        StoreSection(str(tmp_path_factory.mktemp("cache") / "{node}"), ssd_bytes=1 << 30, ram_bytes=0),
        DirectorySection(redis_server.url, "agents-test"), token="test-token-0123456789", heartbeat_ttl_s=TTL_S,
        sync_every_s=0.25, replicas=2,
        check_s=3600,  # the test decides when a killed agent comes back
    )
    return three_nodes.cluster, agent_cfg


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> str:
    """The cluster's cache secret: units are authenticated under it, so every hit below passed
    its MAC (and every server and app here hashes keys under it)."""
    import os

    path = tmp_path_factory.mktemp("secret") / "cache.secret"
    path.write_text("agents-test-cache-secret-0123456789")
    os.chmod(path, 0o600)
    return str(path)


@pytest.fixture(scope="module")
def servers(cluster, checkpoint, secret_file):
    import ray

    from actors.llm_server import LLMServer
    from actors.replica_config import ReplicaConfig
    from cluster.engine import EngineConfig

    _, agent_cfg = cluster
    out = [
        ray.remote(num_cpus=0, resources={f"node{i}": 0.01})(LLMServer).remote(ReplicaConfig(
            str(checkpoint), agent_cfg.store, engine=EngineConfig(num_pages=256, max_num_seqs=8, itl_factor=0.0), agents=agent_cfg,
            cache_secret_file=secret_file))
        for i in range(2)
    ]
    ray.get([s.check_health.remote() for s in out], timeout=300)
    return out


@pytest.fixture(scope="module")
def directory(redis_server):
    from cachedir.directory import open_directory

    return open_directory(redis_server.url, "agents-test")


def _run(server, prompt) -> dict:
    """Greedy tokens and the last output (with the usage and token sources)."""
    import ray

    from cluster.request import GenerationRequest

    tokens, last = [], None
    req = GenerationRequest("", tuple(prompt), MAX_TOKENS, ignore_eos=True)
    for ref in server.generate.options(num_returns="streaming").remote(req):
        last = ray.get(ref, timeout=300)
        tokens += last.new_token_ids
    return {"tokens": tokens, "cached_tokens": last.cached_tokens, "sources": dataclasses.asdict(last.sources)}


def _holders(directory, server, prompt) -> list[set[str]]:
    import ray

    keys = [bytes.fromhex(k) for k in ray.get(server.unit_keys.remote(prompt))]
    return [{h.node_id for h in hs} for hs in directory.longest_prefix(keys).holders]


def _prompt(seed: int) -> list[int]:
    return [256] + [(seed * 131 + i * 7) % 250 + 3 for i in range(64 * 3 + 4)]  # 3 whole units


def test_one_agent_per_node_also_on_nodes_added_later(cluster, servers, directory):
    import ray

    from actors.cache_agent import ensure_cache_agents

    c, agent_cfg = cluster
    first = ensure_cache_agents(agent_cfg)
    again = ensure_cache_agents(agent_cfg)
    assert len(first) == 3 and {k: h._actor_id for k, h in first.items()} == {k: h._actor_id for k, h in again.items()}
    infos = ray.get([h.info.remote() for h in first.values()])
    assert {i["node_id"] for i in infos} == set(first)  # each agent runs on its own node
    a, b = servers
    prompt = _prompt(7)
    _run(a, prompt)
    until(lambda: len(_holders(directory, a, prompt)) == 3, 10, "A's units in the directory")
    assert _run(b, prompt)["sources"]["remote"] > 0  # B hit A's units: they are hot now
    node = c.add_node(num_cpus=0)
    try:
        c.wait_for_nodes()
        # a node joining (or back in the morning): its agent fetches the hot units before it answers
        grown = ensure_cache_agents(dataclasses.replace(agent_cfg, warm_bytes=1 << 30))
        assert len(grown) == 4 and set(first) < set(grown)
        (new,) = set(grown) - set(first)
        info = ray.get(grown[new].info.remote())
        assert info["warmed"]["warmed"] >= 3 and info["warmed"]["failed"] == 0, info
        assert all(new in hs for hs in _holders(directory, a, prompt))  # found there at once
    finally:
        c.remove_node(node)


def test_prefix_from_node_a_is_served_on_node_b(servers, checkpoint, directory):
    a, b = servers
    prompt = _prompt(1)
    want = generate(load_model(checkpoint), prompt, MAX_TOKENS, eos_id=None)
    on_a = _run(a, prompt)
    assert on_a["tokens"] == want and on_a["sources"]["compute"] == len(prompt)
    until(lambda: len(_holders(directory, a, prompt)) == 3, 10, "A's units in the directory")
    on_b = _run(b, prompt)
    assert on_b["tokens"] == want  # token-identical, from A's units
    assert on_b["sources"]["remote"] == 3 * 64 and on_b["cached_tokens"] == 3 * 64
    import ray

    assert ray.get(b.stats.remote())["cache"]["verify_failures"] == 0  # A's MACs checked out on B


def test_a_hot_unit_gets_a_second_replica(servers, directory):
    a, b = servers
    prompt = _prompt(2)
    _run(a, prompt)
    until(lambda: len(_holders(directory, a, prompt)) == 3, 10, "A's units in the directory")
    assert all(len(h) == 1 for h in _holders(directory, a, prompt))
    for _ in range(5):  # five more requests find the units: hot (min_hits is 2, hits decay)
        _run(b, prompt)
    try:
        replicated = until(lambda: (h := _holders(directory, a, prompt)) and all(len(x) == 2 for x in h) and h,
                           60, "a second replica of every unit")  # a failed push is retried after 30 s
    except AssertionError as e:
        import ray

        from actors.cache_agent import NAMESPACE, agent_name

        stats = [ray.get(ray.get_actor(agent_name(n["NodeID"]), namespace=NAMESPACE).stats.remote())
                 for n in ray.nodes() if n["Alive"]]
        keep = ("node_id", "fetch_remote_units", "push_accepted", "push_refused", "replication_pushed",
                "replication_refused", "replication_failed")
        raise AssertionError(f"{e}; holders {_holders(directory, a, prompt)}; agents "
                             f"{[{k: s.get(k) for k in keep} for s in stats]}") from None
    assert all(len(x) == 2 for x in replicated)


def test_killed_agent_units_leave_lookups_and_requests_still_succeed(cluster, servers, checkpoint, directory):
    import ray

    from actors.cache_agent import agent_name, ensure_cache_agents

    _, agent_cfg = cluster
    a, b = servers
    prompt = _prompt(3)
    want = generate(load_model(checkpoint), prompt, MAX_TOKENS, eos_id=None)
    _run(a, prompt)
    until(lambda: len(_holders(directory, a, prompt)) == 3, 10, "A's units in the directory")
    a_node = ray.get(a.stats.remote())["node_id"]
    ray.kill(ray.get_actor(agent_name(a_node), namespace="tideserve"), no_restart=True)
    until(lambda: not _holders(directory, a, prompt), TTL_S + 3, "A's units to leave lookups")
    on_b = _run(b, prompt)  # nothing to fetch: computed, same tokens
    assert on_b["tokens"] == want and on_b["sources"]["remote"] == 0
    on_a = _run(a, prompt)  # A's own agent is gone: A still serves (its pool may share pages)
    assert on_a["tokens"] == want
    # the agent comes back (Ray restart or the periodic check); its units are on disk: found again
    ensure_cache_agents(agent_cfg)
    until(lambda: len(_holders(directory, a, prompt)) == 3, 10, "A's units after the agent restarted")


class _PrefixLookups:
    """Counts the directory's prefix lookups Redis serves, by watching MONITOR: each lookup's
    first round, and nothing else, reads unit hashes and then the nodes' heartbeat expiries in
    one pipeline (listing live nodes or hot units reads the expiries after other keys)."""

    def __init__(self, redis_url: str) -> None:
        import uuid

        import redis

        self._redis = redis.Redis.from_url(redis_url)
        self.count = 0
        self._ready = threading.Event()
        # MONITOR lists commands in the order Redis ran them: once it lists an ECHO of a marker,
        # it has listed every command that ran before
        self._marker = f"lookups-{uuid.uuid4().hex}"
        self._marks = {f"{self._marker}-{m}": threading.Event() for m in ("start", "end")}
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        last: dict[tuple, str] = {}  # client -> its previous command
        with self._redis.monitor() as m:
            self._ready.set()
            for cmd in m.listen():
                client, command = (cmd.get("client_address"), cmd.get("client_port")), cmd["command"]
                if self._marker in command:
                    for mark, seen in self._marks.items():
                        if mark in command:
                            seen.set()
                    if self._marks[f"{self._marker}-end"].is_set():
                        return
                    continue
                before = last.get(client, "")
                if command.startswith("HGETALL") and command.endswith(":expiry") and before.startswith("HGETALL") \
                        and ":u:" in before:
                    self.count += 1
                last[client] = command

    def _mark(self, name: str) -> None:
        mark = f"{self._marker}-{name}"
        self._redis.echo(mark)
        assert self._marks[mark].wait(10), f"MONITOR did not list {name!r} within 10 s"

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10), "MONITOR did not start"
        self._mark("start")
        return self

    def __exit__(self, *exc):
        self._mark("end")  # every command before this one has been counted
        self._thread.join(10)


@pytest.mark.parametrize("router", ["cache-aware", "round-robin"])
def test_serve_routes_a_cached_prefix_to_the_node_that_holds_it(
    cluster, servers, checkpoint, redis_server, directory, router, monkeypatch, secret_file
):
    """Two Serve replicas on two nodes: after one request computed a prompt, the cache-aware
    router sends the next request with that prefix to the same node (its units load locally);
    round-robin sends it to the other node (the units come over gRPC)."""
    import socket

    import httpx
    from ray import serve

    from deploy.app import build_app
    from deploy.redis_proc import wait_healthy

    _, agent_cfg = cluster
    token_file = Path(agent_cfg.store.cache_dir.replace("{node}", "token")).with_suffix(".token")
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.write_text(agent_cfg.token)
    token_file.chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    app = build_app({
        "checkpoint": str(checkpoint), "replicas": 2, "replica_cpus": 0.5, "max_replicas_per_node": 1,
        "num_pages": 256, "cache_dir": agent_cfg.store.cache_dir, "directory_url": redis_server.url,
        "directory_namespace": "agents-test", "router": router, "agent_token_file": str(token_file),
        "cache_secret_file": secret_file,
    })
    serve.run(app, name=f"route-{router}", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 180)
        seed = 10 if router == "cache-aware" else 20
        for i in range(4):
            prompt = _prompt(seed + i)
            usage = []
            for _ in range(2):
                with _PrefixLookups(redis_server.url) as lookups:
                    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
                # one directory lookup per request: the ingress's plan (cache-aware; the replica
                # loads it without asking again), or the replica's own (round-robin: no plan)
                assert lookups.count == 1, lookups.count
                usage.append(r.json()["usage"])
                until(lambda p=prompt: len(_holders(directory, servers[0], p)) == 3, 10, "the units in the directory")
            assert usage[0]["prompt_cache_hit_tokens"] == 0 and usage[1]["prompt_cache_hit_tokens"] == 3 * 64
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        remote = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("tide:prompt_tokens_total{") and 'source="remote"' in line]
        if router == "cache-aware":
            assert remote == [0.0]  # every repeat ran where its units were
        else:
            assert remote == [4 * 3 * 64]  # every repeat ran on the other node
    finally:
        serve.delete(f"route-{router}")
        serve.shutdown()
