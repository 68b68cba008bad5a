"""The cache agent's gRPC service, client, cluster cache and replication, in-process (two or
three ``NodeAgent``s on one machine sharing a directory). The same code on a real 3-node Ray
cluster: tests/actors/test_cache_agents.py."""

from __future__ import annotations

import json
import time

import grpc
import numpy as np
import pytest

from cachedir.agent import agent_pb2, agent_pb2_grpc
from cachedir.agent.auth import Signer
from cachedir.agent.client import AgentClient, AgentError
from cachedir.agent.cluster_cache import ClusterCache
from cachedir.agent.node_agent import AgentConfig, NodeAgent
from cachedir.agent.service import MAX_UNIT_BYTES, ServerConfig
from cachedir.directory.base import DirectoryUnavailable
from cachedir.directory.memory import MemoryDirectory
from cachedir.node_cache import CacheConfig
from cachedir.replication import ReplicationConfig
from cachedir.store import StoreConfig
from tests.cachedir.units import NS, flip_byte, make_units

TOKENS = list(range(1000, 1000 + 64 * 4))


def _agent(tmp_path, name, directory=None, token=None, replication=None, **server) -> NodeAgent:
    cfg = AgentConfig(
        name, CacheConfig(StoreConfig(tmp_path / name, 1 << 30, fsync=False), ram_bytes=0),
        ServerConfig(host="127.0.0.1", token=token, **server), heartbeat_ttl_s=2.0, sync_every_s=3600,
        replication=replication,
    )
    return NodeAgent(cfg, directory)


@pytest.fixture
def pair(tmp_path):
    d = MemoryDirectory("agents")
    a, b = _agent(tmp_path, "node-a", d), _agent(tmp_path, "node-b", d)
    yield d, a, b
    a.close()
    b.close()


def _store(agent: NodeAgent, units) -> None:
    agent.cache.persist(units)
    agent.cache.flush()
    agent.sync_once()


def _cluster_cache(agent: NodeAgent, directory) -> ClusterCache:
    return ClusterCache(agent.node_id, AgentClient(agent.address), directory, AgentClient)


def test_fetch_has_push_and_stats_round_trip(pair):
    _, a, b = pair
    units = make_units(TOKENS)
    _store(a, units)
    with AgentClient(a.address) as c:
        assert c.has([u.key for u in units] + [b"\0" * 16]) == ["ssd"] * 4 + [""]
        got = c.fetch([units[1].key, b"\0" * 16, units[3].key], requester="node-b")
        assert got[0] == ("ssd", units[1].encode()) and got[1] is None and got[2][1] == units[3].encode()
        assert c.stats()["fetch_remote_units"] == 2
    with AgentClient(b.address) as c:
        assert c.push(u.encode() for u in units[:2]) == (2, 0)
        corrupt = bytearray(units[2].encode())
        corrupt[-1] ^= 1
        assert c.push([bytes(corrupt)]) == (0, 1)  # fails its checksum: refused, not stored
    b.cache.flush()
    assert b.cache.has([u.key for u in units]) == ["ssd", "ssd", "", ""]


def test_a_push_is_answered_once_its_units_are_stored(pair, monkeypatch):
    """A slow disk: the pusher learns of an accepted unit only when it is readable and on SSD."""
    _, _, b = pair
    units = make_units(TOKENS)
    put_many = type(b.cache.ssd).put_many

    def slow_put_many(store, batch):
        time.sleep(0.5)
        return put_many(store, batch)

    monkeypatch.setattr(type(b.cache.ssd), "put_many", slow_put_many)
    with AgentClient(b.address) as c:
        assert c.push(u.encode() for u in units[:2]) == (2, 0)
        assert b.cache.has([u.key for u in units[:2]]) == ["ssd", "ssd"]
        assert [f is not None for f in c.fetch([u.key for u in units[:2]])] == [True, True]
        assert c.stats()["push_accepted"] == 2


def test_large_units_stream_in_chunks(tmp_path):
    """A DeepSeek-V3-sized unit (several 1 MiB chunks) arrives whole and verified."""
    a = _agent(tmp_path, "big")
    try:
        (unit,) = make_units(TOKENS[:64], layers=61, dim=576)  # fp32: 8.6 MiB
        _store(a, [unit])
        with AgentClient(a.address) as c:
            tier, data = c.fetch([unit.key])[0]
        assert data == unit.encode() and len(data) > 8 << 20
    finally:
        a.close()


@pytest.mark.security
def test_a_fetch_holds_one_group_of_units_at_a_time_and_a_client_refuses_oversized_ones(tmp_path):
    """The agent reads a many-key fetch FETCH_GROUP units at a time, streaming each group before
    it reads the next; a client refuses a unit declaring more than its model's units can be."""
    from cachedir.agent.service import FETCH_GROUP, AgentBackend, _Servicer

    units = make_units(list(range(64 * (FETCH_GROUP + 4))))
    by_key = {u.key: ("ssd", u.encode()) for u in units}
    reads: list[int] = []
    backend = AgentBackend(read=lambda keys, _: reads.append(len(keys)) or [by_key[k] for k in keys],
                           has=None, accept=None, stats=None)
    stream = _Servicer(backend).Fetch(agent_pb2.FetchRequest(keys=[u.key for u in units]), context=None)
    first = next(stream)
    assert first.index == 0 and reads == [FETCH_GROUP]  # streaming before the rest is read
    rest = list(stream)
    assert reads == [FETCH_GROUP, 4] and {c.index for c in [first, *rest]} == set(range(len(units)))
    a = _agent(tmp_path, "bounded")
    try:
        _store(a, units[:2])
        size = len(units[0].encode())
        with AgentClient(a.address) as c:
            assert [f[1] for f in c.fetch([u.key for u in units[:2]], max_unit_bytes=size)] == [
                u.encode() for u in units[:2]]
            with pytest.raises(AgentError, match="declares"):
                c.fetch([units[0].key], max_unit_bytes=size - 1)
    finally:
        a.close()


def test_bad_token_and_malformed_requests_get_clear_statuses(tmp_path):
    a = _agent(tmp_path, "secured", token="s3cret")
    try:
        for token in (None, "wrong"):
            with AgentClient(a.address, token=token) as c, pytest.raises(AgentError) as e:
                c.has([b"\0" * 16])
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and "token" in str(e.value)
            with AgentClient(a.address, token=token) as c, pytest.raises(AgentError) as e:
                c.fetch([b"\0" * 16])
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with AgentClient(a.address, token="s3cret") as c:
            assert c.has([b"\0" * 16]) == [""]
            with pytest.raises(AgentError) as e:
                c.fetch([b"short"])
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "16" in str(e.value)
            with pytest.raises(AgentError) as e:
                c.has([b"\0" * 16] * 5000)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "4096" in str(e.value)
        # a raw stream without the unit's size, and one that ends inside a unit
        channel = grpc.insecure_channel(a.address)
        stub = agent_pb2_grpc.CacheAgentStub(channel)
        signer = Signer("s3cret", "test")
        push = "/tideserve.cache.CacheAgent/Push"
        with pytest.raises(grpc.RpcError) as e:
            stub.Push(iter([agent_pb2.UnitChunk(index=0, data=b"x", last=True)]),
                      metadata=signer.sign(push, a.address)[0], timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "size" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Push(iter([agent_pb2.UnitChunk(index=0, data=b"x", size=10)]),
                      metadata=signer.sign(push, a.address)[0], timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "last chunk" in e.value.details()
        channel.close()
        assert json.loads(json.dumps(a.stats()))["push_accepted"] == 0
    finally:
        a.close()


def test_tls(tmp_path):
    from tests.certs import make_certs

    ca, cert, key = make_certs(tmp_path)
    a = _agent(tmp_path, "tls", tls_cert_chain=cert.read_bytes(), tls_private_key=key.read_bytes())
    try:
        with AgentClient(a.address, root_certificates=ca.read_bytes()) as c:
            assert c.has([b"\0" * 16]) == [""]
            assert c.reserve([b"\0" * 16]) == (b"", 0)  # no bulk port beside TLS: units go through TLS
        with AgentClient(a.address, timeout_s=2) as plain, pytest.raises(AgentError):
            plain.has([b"\0" * 16])
    finally:
        a.close()


def test_mutual_tls_admits_only_nodes_with_a_certificate_of_the_cluster_ca(tmp_path):
    from tests.certs import make_certs

    (tmp_path / "other").mkdir()
    ca, cert, key = make_certs(tmp_path)
    _, other_cert, other_key = make_certs(tmp_path / "other")  # a certificate of another CA
    a = _agent(tmp_path, "mtls", tls_cert_chain=cert.read_bytes(), tls_private_key=key.read_bytes(),
               tls_client_ca=ca.read_bytes())
    try:
        node_cert = (key.read_bytes(), cert.read_bytes())
        with AgentClient(a.address, root_certificates=ca.read_bytes(), client_certificate=node_cert) as c:
            assert c.has([b"\0" * 16]) == [""]
        for client_cert in (None, (other_key.read_bytes(), other_cert.read_bytes())):
            with AgentClient(a.address, root_certificates=ca.read_bytes(), client_certificate=client_cert,
                             timeout_s=2) as c, pytest.raises(AgentError):
                c.has([b"\0" * 16])
        with pytest.raises(ValueError, match="mutual TLS"):
            _agent(tmp_path, "half", tls_client_ca=ca.read_bytes())
    finally:
        a.close()


def test_cluster_cache_loads_remote_units_verified(pair):
    d, a, b = pair
    units = make_units(TOKENS)
    _store(a, units[:3])
    _store(b, units[:1])
    b.sync_once()
    cache = _cluster_cache(b, d)
    keys = [u.key for u in units]
    assert cache.lookup(keys) == ["ssd", "remote", "remote"]  # unit 3 is nowhere
    toks = [u.token_ids for u in units[:3]]
    loaded = cache.load_async(keys[:3], NS.seed, toks).result(timeout=10)
    assert [x.tier for x in loaded] == ["ssd", "remote", "remote"]
    assert [bytes(x.unit.payload) for x in loaded] == [bytes(u.payload) for u in units[:3]]
    assert cache.stats()["remote_units"] == 2 and cache.stats()["remote_bytes"] > 0
    # the engine asked for other tokens than the units hold: a miss, never the wrong KV
    cache.lookup(keys[:3])
    wrong = [toks[0], toks[1], tuple(t + 1 for t in toks[2])]
    assert cache.load_async(keys[:3], NS.seed, wrong).result(timeout=10)[2] is None
    assert cache.stats()["verify_failures"] == 1
    # every lookup that found units counted as hits in the directory (they drive replication)
    cache.flush()
    assert any(h.key == keys[1] for h in d.hot_units(10, 5, time.time()))
    cache.close()


class _CountingDirectory:
    """A directory that counts its prefix lookups (a prefix plan must make none)."""

    def __init__(self, inner) -> None:
        self.inner, self.lookups = inner, 0

    def longest_prefix(self, keys):
        self.lookups += 1
        return self.inner.longest_prefix(keys)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_prefix_plan_loads_from_its_holders_without_a_lookup(pair):
    """With the holders the ingress got from the directory, a replica asks neither its agent nor
    the directory which nodes hold the units; a holder that no longer has one is a miss there."""
    d, a, b = pair
    units = make_units(TOKENS)
    _store(a, units[:3])
    _store(b, units[:1])
    counting = _CountingDirectory(d)
    cache = _cluster_cache(b, counting)
    keys = [u.key for u in units]
    holders = [[h.node_id for h in hs] for hs in d.longest_prefix(keys).holders]
    assert cache.lookup(keys[:3], holders) == ["local", "remote", "remote"] and counting.lookups == 0
    toks = [u.token_ids for u in units[:3]]
    loaded = cache.load_async(keys[:3], NS.seed, toks).result(timeout=10)
    assert [x.tier for x in loaded] == ["ssd", "remote", "remote"] and counting.lookups == 0
    stale = [["node-b"], ["node-b"]]  # the plan says this node holds unit 1: it does not any more
    assert cache.lookup(keys[:2], stale) == ["local", "local"]
    got = cache.load_async(keys[:2], NS.seed, toks[:2]).result(timeout=10)
    assert got[0] is not None and got[1] is None  # a miss, computed by the engine
    assert cache.lookup(keys[:3], [["node-c"], ["node-a"]]) == []  # a holder that is not live
    cache.close()


def test_cluster_cache_spreads_a_run_over_holders_and_retries_another(tmp_path):
    d = MemoryDirectory("spread")
    agents = [_agent(tmp_path, f"n{i}", d) for i in range(3)]
    try:
        units = make_units(TOKENS)
        for ag in agents[:2]:
            _store(ag, units)
        cache = _cluster_cache(agents[2], d)
        keys = [u.key for u in units]
        assert cache.lookup(keys) == ["remote"] * 4
        loaded = cache.load_async(keys, NS.seed, [u.token_ids for u in units]).result(timeout=10)
        assert all(x is not None for x in loaded)
        served = [ag.stats()["bulk_units"] for ag in agents[:2]]
        assert served == [2, 2]  # both holders served half of the run, in parallel (over their bulk ports)
        assert cache.stats()["bulk_units"] == 4 and sum(ag.stats()["fetch_remote_units"] for ag in agents) == 0
        # one holder's copy of unit 0 is damaged: the unit comes from the other holder
        flip_byte(agents[0].cache.ssd, keys[0])
        flip_byte(agents[1].cache.ssd, keys[0])
        flip_byte(agents[0].cache.ssd, keys[1])
        cache.lookup(keys)
        loaded = cache.load_async(keys, NS.seed, [u.token_ids for u in units]).result(timeout=10)
        assert loaded[0] is None and loaded[1] is not None and loaded[1].tier == "remote"
        assert cache.stats()["retried_units"] >= 1
        cache.close()
    finally:
        for ag in agents:
            ag.close()


def test_dead_agent_and_dead_directory_degrade_to_misses(pair, monkeypatch):
    d, a, b = pair
    units = make_units(TOKENS)
    _store(a, units)
    cache = _cluster_cache(b, d)
    keys = [u.key for u in units]
    assert cache.lookup(keys) == ["remote"] * 4
    a.server.stop(grace=0).wait()  # the agent dies between lookup and load
    loaded = cache.load_async(keys, NS.seed, [u.token_ids for u in units]).result(timeout=30)
    assert loaded == [None] * 4 and cache.stats()["agent_errors"] >= 1

    def down(*a, **k):
        raise DirectoryUnavailable("redis is down")

    monkeypatch.setattr(d, "longest_prefix", down)
    _store(b, units[:2])
    assert cache.lookup(keys) == ["ssd", "ssd"]  # local units only
    assert cache.stats()["directory_errors"] == 1
    cache.close()


def test_a_holder_whose_agent_restarted_elsewhere_is_fetched_from_at_once(tmp_path):
    """A dead holder is avoided (suspected) while its agent stays where it failed; restarted
    (Ray restarts a killed agent, on a new port, with its units from disk) it is trusted again,
    and a fetch that meets the old address follows the node to the new one."""
    d = MemoryDirectory("restart")
    a, b = _agent(tmp_path, "node-a", d), _agent(tmp_path, "node-b", d)
    units = make_units(TOKENS)
    keys, toks = [u.key for u in units], [u.token_ids for u in units]
    _store(a, units)
    cache = ClusterCache(b.node_id, AgentClient(b.address), d, AgentClient, live_ttl_s=0.0)
    try:
        assert cache.lookup(keys) == ["remote"] * 4
        a.close()  # killed between lookup and load, still listed live at its old address
        assert cache.load_async(keys, NS.seed, toks).result(timeout=30) == [None] * 4
        assert cache.stats()["suspected_holders"] == 1 and cache.lookup(keys) == []  # avoided
        a = _agent(tmp_path, "node-a", d)  # restarted: a new port, its units found on disk
        a.sync_once()
        assert cache.lookup(keys) == ["remote"] * 4  # the new agent is not the one that failed
        loaded = cache.load_async(keys, NS.seed, toks).result(timeout=30)
        assert [x.tier for x in loaded] == ["remote"] * 4 and cache.stats()["suspected_holders"] == 1
        # restarted again after this replica read the directory (its copy of the addresses is old)
        cache._live_ttl_s = 3600.0
        assert cache.lookup(keys) == ["remote"] * 4
        a.close()
        a = _agent(tmp_path, "node-a", d)
        a.sync_once()
        loaded = cache.load_async(keys, NS.seed, toks).result(timeout=30)
        assert [x.tier for x in loaded] == ["remote"] * 4 and cache.stats()["suspected_holders"] == 1
    finally:
        cache.close()
        a.close()
        b.close()


def test_heartbeat_ttl_hides_a_stopped_agents_units(tmp_path):
    from tests.cachedir.conftest import FakeClock

    clock = FakeClock()
    d = MemoryDirectory("ttl", now_s=clock)
    a = _agent(tmp_path, "a", d)
    b = _agent(tmp_path, "b", d)
    units = make_units(TOKENS)
    _store(a, units)
    cache = _cluster_cache(b, d)
    assert cache.lookup([u.key for u in units]) == ["remote"] * 4
    a.close()  # no more heartbeats
    clock.advance(60)  # past the TTL
    b.sync_once()  # b heartbeats at the new time; a does not
    cache._live = (-1e18, {})
    assert cache.lookup([u.key for u in units]) == []
    cache.close()
    b.close()


def test_hot_units_get_a_replica_preferring_the_node_that_fetched_them(tmp_path):
    d = MemoryDirectory("repl")
    # settle_s=0: the eviction below is seen at once (test_a_push_under_way_counts_as_a_copy covers it)
    rep = ReplicationConfig(replicas=2, min_hits=2.0, cooldown_s=60.0, retry_after_s=0.0, settle_s=0.0)
    agents = [_agent(tmp_path, f"r{i}", d, replication=rep) for i in range(3)]
    try:
        for ag in agents:
            ag.sync_once()
        units = make_units(TOKENS)
        _store(agents[0], units[:1])
        cache = _cluster_cache(agents[2], d)
        key = units[0].key
        for _ in range(3):  # r2 hits the unit remotely three times
            assert cache.lookup([key]) == ["remote"]
            assert cache.load_async([key], NS.seed, [units[0].token_ids]).result(timeout=10)[0] is not None
        cache.flush()  # the hits are recorded in the background
        agents[0].sync_once()  # the holder's replication tick pushes it
        agents[0].replicator.wait(10)
        agents[2].cache.flush()
        agents[2].sync_once()  # the receiver registers its copy
        holders = {h.node_id for h in d.longest_prefix([key]).holders[0]}
        assert holders == {"r0", "r2"}  # to the node that fetched it, not r1
        assert agents[0].stats()["replication_pushed"] == 1
        # R reached: no more copies
        agents[0].sync_once()
        assert agents[0].replicator.stats["pushed"] == 1
        # r2 evicts its copy; the unit is hot and under R again, but r2 refuses it (cooldown)
        assert agents[2].evict([key]) == 1
        d.record_hits([key], time.time())
        agents[0].sync_once()
        agents[0].replicator.wait(10)
        assert agents[2].stats()["push_refused"] == 1
        assert {h.node_id for h in d.longest_prefix([key]).holders[0]} == {"r0"}
        cache.close()
    finally:
        for ag in agents:
            ag.close()


def test_a_push_under_way_counts_as_a_copy(tmp_path):
    """Until its receiver registers a pushed copy (at its next sync), the next ticks must not push
    the unit to yet another node: R copies, not one per tick."""
    d = MemoryDirectory("settle")
    rep = ReplicationConfig(replicas=2, min_hits=0.5, retry_after_s=0.0)
    agents = [_agent(tmp_path, f"s{i}", d, replication=rep) for i in range(3)]
    try:
        for ag in agents:
            ag.sync_once()
        units = make_units(TOKENS[:64])
        _store(agents[0], units)
        key = units[0].key
        d.record_hits([key], time.time())
        assert agents[0].replicator.tick() == 1
        agents[0].replicator.wait(10)
        assert agents[0].replicator.tick() == 0  # the receiver has not registered its copy yet
        for ag in agents[1:]:
            ag.cache.flush()
            ag.sync_once()
        assert agents[0].replicator.tick() == 0
        assert len(d.longest_prefix([key]).holders[0]) == 2
        assert sum(ag.stats()["push_accepted"] for ag in agents[1:]) == 1
    finally:
        for ag in agents:
            ag.close()


def test_replication_respects_the_byte_budget(tmp_path):
    d = MemoryDirectory("budget")
    rep = ReplicationConfig(replicas=2, min_hits=0.5, bytes_per_s=1.0, retry_after_s=0.0)
    agents = [_agent(tmp_path, f"b{i}", d, replication=rep) for i in range(2)]
    try:
        for ag in agents:
            ag.sync_once()
        units = make_units(TOKENS[:64 * 3])
        _store(agents[0], units)
        d.record_hits([u.key for u in units], time.time())
        agents[0].replicator._bucket.level = len(units[0].encode())  # room for exactly one unit
        agents[0].replicator._bucket.burst = len(units[0].encode())
        assert agents[0].replicator.tick() == 1  # max_inflight (2) would allow two
        assert agents[0].replicator.tick() == 0  # the bucket refills at 1 byte/s
    finally:
        for ag in agents:
            ag.close()


def test_generated_modules_match_the_proto(tmp_path):
    """agent_pb2*.py are what scripts/gen_proto.sh makes from agent.proto today."""
    import shutil
    from pathlib import Path

    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "cachedir" / "agent").mkdir(parents=True)
    shutil.copy(root / "cachedir/agent/agent.proto", tmp_path / "cachedir/agent/agent.proto")
    assert protoc.main(["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                        str(tmp_path / "cachedir/agent/agent.proto")]) == 0
    for name in ("agent_pb2.py", "agent_pb2_grpc.py"):
        assert (tmp_path / "cachedir/agent" / name).read_text() == (root / "cachedir/agent" / name).read_text(), (
            f"cachedir/agent/{name} is stale: run scripts/gen_proto.sh")


class _LyingServicer(agent_pb2_grpc.CacheAgentServicer):
    """A peer that speaks the protocol but serves garbage: random bytes for the first unit, a
    valid unit of another key for the second, nothing for the rest."""

    def __init__(self, other: bytes) -> None:
        self.other = other

    def Fetch(self, request, context):  # noqa: N802 - the gRPC method name
        for i, key in enumerate(request.keys):
            data = {0: bytes(range(256)) * 40, 1: self.other}.get(i)
            if data is None:
                yield agent_pb2.UnitChunk(index=i, missing=True, last=True)
            else:
                yield agent_pb2.UnitChunk(index=i, key=key, data=data, last=True, tier="ssd", size=len(data))


def _lying_peer():
    from concurrent import futures

    other = make_units(list(range(5000, 5064)))[0].encode()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    agent_pb2_grpc.add_CacheAgentServicer_to_server(_LyingServicer(other), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return f"127.0.0.1:{port}", lambda: server.stop(grace=0)


def _tcp_peer(noise: bool):
    """A TCP peer that is not a gRPC server: it never answers (``noise=False``) or answers with
    random bytes."""
    import os
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    conns = []

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conns.append(conn)
            if noise:
                try:
                    conn.sendall(os.urandom(4096))
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()

    def close():
        sock.close()
        for c in conns:
            c.close()

    return f"127.0.0.1:{sock.getsockname()[1]}", close


@pytest.mark.parametrize("peer", ["lying", "hanging", "noise"])
def test_garbage_or_hanging_peers_cost_a_bounded_wait_and_never_a_wrong_unit(tmp_path, peer):
    address, close = _lying_peer() if peer == "lying" else _tcp_peer(noise=peer == "noise")
    d = MemoryDirectory("evil")
    units = make_units(TOKENS)
    keys = [u.key for u in units]
    d.heartbeat("evil", address, 60)
    d.register("evil", keys)
    me = _agent(tmp_path, "me", d)
    honest = _agent(tmp_path, "honest", d)
    cache = ClusterCache(me.node_id, AgentClient(me.address), d, lambda a: AgentClient(a, timeout_s=1.0))
    try:
        # the bad peer is the only holder: every unit is a miss, within the client timeout
        assert cache.lookup(keys) == ["remote"] * 4
        loaded = cache.load_async(keys, NS.seed, [u.token_ids for u in units]).result(timeout=30)
        assert loaded == [None] * 4
        counters = cache.stats()
        # one call to the bad peer (bounded by the client's timeout), no second try of it
        if peer == "lying":
            assert counters["verify_failures"] == 2 and counters["agent_errors"] == 0
        else:
            assert counters["agent_errors"] == 1 and counters["retried_units"] == 0
        # the failed peer is avoided for a while: the next lookup does not offer its units at all
        assert counters["suspected_holders"] == 1 and cache.lookup(keys) == []
        # with an honest second holder every unit arrives, verified, from it
        _store(honest, units)
        cache._live = (-1e18, {})  # forget the live-node list cached by the first lookup
        assert cache.lookup(keys) == ["remote"] * 4
        loaded = cache.load_async(keys, NS.seed, [u.token_ids for u in units]).result(timeout=30)
        assert [x.unit.encode() for x in loaded] == [u.encode() for u in units]
    finally:
        cache.close()
        me.close()
        honest.close()
        close()


class _FloodingServicer(agent_pb2_grpc.CacheAgentServicer):
    """A peer that declares an oversized unit (``huge``) or a small one and then streams chunks
    without end, never sending the last (``endless``)."""

    def __init__(self, mode: str) -> None:
        self.mode, self.sent = mode, 0

    def Fetch(self, request, context):  # noqa: N802 - the gRPC method name
        if self.mode == "huge":
            yield agent_pb2.UnitChunk(index=0, key=request.keys[0], data=b"x", size=MAX_UNIT_BYTES + 1, tier="ssd")
            return
        while context.is_active() and self.sent < 4096:
            self.sent += 1
            yield agent_pb2.UnitChunk(index=0, key=request.keys[0], data=b"x" * 65536, size=100_000, tier="ssd")


@pytest.mark.parametrize("mode", ["huge", "endless"])
def test_a_peer_cannot_make_the_client_buffer_more_than_a_declared_unit(mode):
    from concurrent import futures

    servicer = _FloodingServicer(mode)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    agent_pb2_grpc.add_CacheAgentServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = AgentClient(f"127.0.0.1:{port}", timeout_s=30.0)
    try:
        with pytest.raises(AgentError, match="declares" if mode == "huge" else "more than its 100000 bytes"):
            client.fetch([b"k" * 32])
        # the client stopped reading at the second 64 KiB chunk, not at the 4096th (256 MiB)
        assert servicer.sent < 64
    finally:
        client.close()
        server.stop(grace=0)


def test_a_unit_forged_by_a_token_holder_is_a_miss_and_the_real_one_replaces_it(tmp_path):
    """Anyone with the agent token can push a self-consistent unit (right namespace, key and
    tokens; zero KV). A cache with the cluster's secret rejects it, and the unit the replica
    recomputes and persists replaces the forged copy (first writer does not win)."""
    from tests.cachedir.test_hashing_unitfile import SECRET_NS, _forge

    d = MemoryDirectory("forge")
    me = _agent(tmp_path, "me", d, token="agent-token")
    units = make_units(TOKENS, SECRET_NS)
    keys, tokens = [u.key for u in units], [u.token_ids for u in units]
    insider = AgentClient(me.address, "agent-token")
    assert insider.push([_forge(u, bytes(len(u.payload))) for u in units]) == (4, 0)
    client = lambda a: AgentClient(a, "agent-token")  # noqa: E731
    unkeyed = ClusterCache(me.node_id, AgentClient(me.address, "agent-token"), d, client)
    cache = ClusterCache(me.node_id, AgentClient(me.address, "agent-token"), d, client, secret=SECRET_NS.secret)
    try:
        # without the secret the forgery passes every check: that is what the MAC is for
        assert [bytes(x.unit.payload) for x in unkeyed.load_async(keys, SECRET_NS.seed, tokens).result(30)] == [
            bytes(len(u.payload)) for u in units]
        assert cache.lookup(keys) == ["ssd"] * 4
        assert cache.load_async(keys, SECRET_NS.seed, tokens).result(30) == [None] * 4
        assert cache.stats()["verify_failures"] == 4 and not cache.holds(keys[0])
        # the engine recomputes and persists: its units replace the forged ones
        assert all(f.result(30) for f in cache.persist(units))
        loaded = cache.load_async(keys, SECRET_NS.seed, tokens).result(30)
        assert [bytes(x.unit.payload) for x in loaded] == [bytes(u.payload) for u in units]
        assert [x.unit.token_ids for x in loaded] == tokens
        # the agent's files hold neither the prompt's token ids nor its KV: units it was given
        # under the cluster's key are sealed (the KV encrypted: its first layer would give the prompt away)
        me.cache.flush()
        on_disk = b"".join(p.read_bytes() for p in (tmp_path / "me").rglob("*") if p.is_file())
        assert len(on_disk) > sum(len(u.payload) for u in units)
        assert not any(bytes(u.payload)[:4096] in on_disk for u in units)
        assert not any(np.asarray(t, dtype="<u4").tobytes() in on_disk for t in tokens)
        # a second forged push does not displace them (no replace flag), and a replaced key is
        # pushed with the flag only once
        insider.push([_forge(units[0], bytes(len(units[0].payload)))])
        assert cache.load_async(keys[:1], SECRET_NS.seed, tokens[:1]).result(30)[0] is not None
    finally:
        cache.close()
        unkeyed.close()
        insider.close()
        me.close()


def test_the_client_pool_keeps_at_most_its_limit_open():
    from cachedir.agent.client import ClientPool

    made, closed = [], []

    class _Client:
        def __init__(self, address):
            self.address = address
            made.append(address)

        def close(self):
            closed.append(self.address)

    pool = ClientPool(_Client, limit=2)
    a = pool("a:1")
    assert pool("a:1") is a and made == ["a:1"]
    pool("b:1")
    pool("a:1")  # a is now the most recent: b goes first
    pool("c:1")
    assert closed == ["b:1"] and len(pool) == 2
    pool.close()
    assert sorted(closed) == ["a:1", "b:1", "c:1"] and len(pool) == 0


@pytest.mark.parametrize("layout", ["segment", "unit"])
def test_this_nodes_units_are_read_from_its_store_files_not_through_grpc(tmp_path, layout):
    """A replica's own node's units come straight from the store's files, where the agent says
    they are (sealed ones opened with the cluster's key), and count as read for eviction; the
    agent sends no unit over gRPC."""
    from cachedir.hashing import Namespace

    secret_ns = Namespace(NS.model_fingerprint, NS.weights_revision, NS.kv_dtype, NS.kv_layout, 64, secret=b"k" * 32)
    d = MemoryDirectory("agents")
    cfg = AgentConfig("node-a", CacheConfig(StoreConfig(tmp_path / "a", 1 << 30, fsync=False, layout=layout),
                                            ram_bytes=0), ServerConfig(host="127.0.0.1"), sync_every_s=3600)
    a = NodeAgent(cfg, d)
    cache = ClusterCache(a.node_id, AgentClient(a.address), d, AgentClient, secret=secret_ns.secret)
    try:
        units = make_units(TOKENS, secret_ns)
        assert all(f.result(30) for f in cache.persist(units))
        a.cache.flush()
        keys, toks = [u.key for u in units], [u.token_ids for u in units]
        where = AgentClient(a.address).locate(keys + [b"\0" * 16])
        assert [w[0] for w in where[:4]] == ["ssd"] * 4 and where[4] is None
        assert all(w[1].path.is_file() and w[1].length > len(units[0].payload) for w in where[:4])
        fetched = a.stats()["fetch_units"]
        assert cache.lookup(keys) == ["ssd"] * 4
        loaded = cache.load_async(keys, secret_ns.seed, toks).result(30)
        assert [bytes(x.unit.payload) for x in loaded] == [bytes(u.payload) for u in units]
        assert [x.tier for x in loaded] == ["ssd"] * 4
        stats = cache.stats()
        assert stats["direct_units"] == 4 and stats["direct_misses"] == 0 and stats["local_bytes"] > 0
        assert a.stats()["fetch_units"] == fetched and a.stats()["located_units"] >= 8
        # another tenant's reader (another namespace and key) reads the same files: a miss
        other = secret_ns.for_tenant("other")
        assert cache.load_async(keys[:1], other.seed, toks[:1]).result(30) == [None]
    finally:
        cache.close()
        a.close()


def test_a_unit_moved_rewritten_or_unreadable_under_a_direct_read_is_never_wrong_kv(pair, monkeypatch):
    """What a direct read finds where the agent said may no longer be the unit: another unit
    (compaction moved it), garbage (the space reused), or a file this process cannot open. It
    fails verification or the read, and the unit comes through the agent instead (a hit where
    the agent still holds it, a miss where it does not)."""
    import cachedir.agent.cluster_cache as cc

    d, a, _ = pair
    units = make_units(TOKENS)
    _store(a, units)
    keys, toks = [u.key for u in units], [u.token_ids for u in units]
    cache = _cluster_cache(a, d)
    try:
        real = cache.local.locate
        # moved: the agent's answer is stale (unit 0 now "is" where unit 1 is)
        monkeypatch.setattr(cache.local, "locate", lambda ks: [real([ks[-1]])[0]] + real(ks[1:]) if len(ks) > 1
                            else real(ks))
        cache.lookup(keys)
        loaded = cache.load_async(keys, NS.seed, toks).result(30)
        assert [bytes(x.unit.payload) for x in loaded] == [bytes(u.payload) for u in units]
        assert cache.stats()["direct_misses"] == 1 and a.stats()["fetch_units"] == 1  # unit 0 through the agent
        monkeypatch.setattr(cache.local, "locate", real)
        # unreadable here (another mount, another user): every unit through the agent
        def denied(locs, take):
            raise PermissionError("not from this process")

        monkeypatch.setattr(cc, "read_run", denied)
        loaded = cache.load_async(keys, NS.seed, toks).result(30)
        assert [bytes(x.unit.payload) for x in loaded] == [bytes(u.payload) for u in units]
        monkeypatch.undo()
        # rewritten in place (the space reused): damaged for the agent too, so a miss
        (_, loc) = a.cache.locate(keys[:1])[0]
        with open(loc.path, "r+b") as f:
            f.seek(loc.offset + loc.length - 100)
            f.write(b"\xff" * 100)
        a.cache.ssd.drop_page_cache(keys[0])
        assert cache.load_async(keys[:1], NS.seed, toks[:1]).result(30) == [None]
    finally:
        cache.close()


def test_other_nodes_units_come_over_the_bulk_port_and_only_with_a_fresh_ticket(pair, monkeypatch):
    """A remote load takes the holder's bulk TCP port (a ticket from its signed Reserve, good for
    one connection); a stranger's ticket, a used one and a peer that fails or floods the bulk
    connection get nothing from it, and the units then come over gRPC, verified as ever."""
    import os
    import socket

    import cachedir.agent.client as client_mod
    from cachedir.agent.bulk import TICKET_BYTES

    d, a, b = pair
    units = make_units(TOKENS)
    _store(a, units)
    keys, toks = [u.key for u in units], [u.token_ids for u in units]
    cache = _cluster_cache(b, d)
    try:
        assert cache.lookup(keys) == ["remote"] * 4
        loaded = cache.load_async(keys, NS.seed, toks).result(30)
        assert [bytes(x.unit.payload) for x in loaded] == [bytes(u.payload) for u in units]
        assert cache.stats()["bulk_units"] == 4 and a.stats()["bulk_units"] == 4 and a.stats()["fetch_units"] == 0
        # a ticket is for its one connection; a made-up one is refused without a byte
        ticket, port = AgentClient(a.address).reserve(keys[:1])
        for t, served in ((os.urandom(TICKET_BYTES), False), (ticket, True), (ticket, False)):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(t)
                got = conn.recv(1 << 20)
                assert (len(got) >= 8) if served else got == b""  # the unit's length, then its bytes
        assert a.stats()["bulk_refused"] == 2

        # the bulk connection fails, or a peer floods it: the units come over gRPC instead
        def broken(*args):
            raise OSError("connection reset")

        real = client_mod.fetch_bulk  # a flood: more than a unit's bytes declared
        for fault in (broken, lambda h, p, t, n, limit, take, timeout: real(h, p, t, n, 10, take, timeout)):
            monkeypatch.setattr(client_mod, "fetch_bulk", fault)
            before = a.stats()["fetch_remote_units"]
            loaded = cache.load_async(keys, NS.seed, toks).result(30)
            assert [bytes(x.unit.payload) for x in loaded] == [bytes(u.payload) for u in units]
            assert a.stats()["fetch_remote_units"] == before + 4
    finally:
        cache.close()

