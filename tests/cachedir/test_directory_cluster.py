"""The Redis directory on a real local Redis Cluster (three primaries, a replica each): lookups and
registrations spread over the primaries, a lookup's rounds reach every primary at once, a password
is needed, and a primary killed under lookups and registrations costs misses until its replica
takes over, after which every node's units are registered again. The contract suite
(``test_directory_contract.py``) also runs on a cluster."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import redis

from cachedir.directory import DirectoryUnavailable, Holder, open_directory
from cachedir.publisher import DirectoryPublisher
from cachedir.unit import UnitStored
from deploy.redis_proc import RedisClusterServer

pytestmark = pytest.mark.redis


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _random_keys(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def _calls(cluster: RedisClusterServer, command: str) -> dict[int, int]:
    """Calls of ``command`` on each primary (its port) so far."""
    out = {}
    for s in cluster.primary_servers():
        stats = redis.Redis(port=s.port).info("commandstats")
        out[s.port] = stats.get(f"cmdstat_{command}", {}).get("calls", 0)
    return out


def test_a_lookup_reads_every_primary_at_once_in_log_n_rounds(redis_cluster):
    d = open_directory(redis_cluster.url, "rt", timeout_s=2.0)
    d.heartbeat("a", "x", ttl_s=30)
    keys = _random_keys(2000, seed=1)
    d.register("a", keys)
    before, trips = _calls(redis_cluster, "hgetall"), d.round_trips()
    m = d.longest_prefix(keys)
    after = _calls(redis_cluster, "hgetall")
    assert m.num_units == 2000 and m.holders[0] == [Holder("a", "ssd")]
    reads = {port: after[port] - before[port] for port in after}
    assert d.round_trips() - trips <= 4  # a round is one round trip, whatever primaries it reaches
    assert all(r >= 3 for r in reads.values()) and sum(reads.values()) <= 48, reads


def test_registrations_spread_over_the_primaries(redis_cluster):
    """Four nodes register 3,000 units each: every primary holds a fair share of the keys (the
    unit hashes, and each node's 32 unit sets)."""
    d = open_directory(redis_cluster.url, "spread", timeout_s=2.0)
    for n in range(4):
        d.heartbeat(f"node{n}", "x", ttl_s=30)
        d.register(f"node{n}", _random_keys(3000, seed=n))
    sizes = [redis.Redis(port=s.port).dbsize() for s in redis_cluster.primary_servers()]
    assert max(sizes) / (sum(sizes) / len(sizes)) < 1.15, sizes


def test_a_cluster_needs_its_password(tmp_path):
    cluster = RedisClusterServer(tmp_path, password="s3cret").start()
    try:
        ok = open_directory(cluster.url, "auth", timeout_s=1.0)
        ok.heartbeat("a", "x", ttl_s=5)
        assert "a" in ok.live_nodes()
        with pytest.raises(DirectoryUnavailable):
            open_directory(cluster.url.replace("s3cret", "wrong"), "auth", timeout_s=1.0).live_nodes()
        with pytest.raises(DirectoryUnavailable):
            open_directory(cluster.url.replace(":s3cret@", ""), "auth", timeout_s=1.0).live_nodes()
    finally:
        cluster.kill()


def test_a_cluster_over_tls(tmp_path):
    """rediss+cluster:// with the servers' CA: works (clients, replication and the bus on TLS);
    without trusting the CA: unavailable, not a hang."""
    from tests.certs import make_certs

    ca, cert, key = make_certs(tmp_path)
    cluster = RedisClusterServer(tmp_path / "redis", tls=(ca, cert, key)).start()
    try:
        assert cluster.url.startswith("rediss+cluster://")
        d = open_directory(cluster.url, "tls", timeout_s=2.0, ssl_ca_certs=str(ca))
        d.heartbeat("a", "x", ttl_s=30)
        keys = _random_keys(50, seed=3)
        d.register("a", keys)
        assert d.longest_prefix(keys).num_units == 50
        with pytest.raises(DirectoryUnavailable):
            open_directory(cluster.url, "tls", timeout_s=1.0).live_nodes()
    finally:
        cluster.kill()


def test_a_cluster_that_is_down_is_unavailable_not_an_error_at_open(tmp_path):
    from deploy.redis_proc import free_port

    d = open_directory(f"redis+cluster://127.0.0.1:{free_port()}", "down", timeout_s=0.2)
    with pytest.raises(DirectoryUnavailable):
        d.longest_prefix([K(1)])
    with pytest.raises(ValueError, match="host:port"):
        open_directory("redis+cluster://127.0.0.1", "bad")


def test_a_primary_killed_under_lookups_and_registrations(tmp_path):
    """The primary of the node table's slot dies (heartbeats, epochs and some units go with it):
    calls raise DirectoryUnavailable, never anything else and never a wrong holder, until its
    replica is promoted; then the publishers see a new epoch and register their units again, and
    every unit is found."""
    cluster = RedisClusterServer(tmp_path).start()
    try:
        d = open_directory(cluster.url, "failover", timeout_s=0.3)
        nodes = {f"node{i}": _random_keys(400, seed=10 + i) for i in range(2)}
        pubs = {n: DirectoryPublisher(d, n, f"127.0.0.1:{9000 + i}", lambda keys=keys: {"ssd": keys},
                                      heartbeat_ttl_s=30, reap_every_s=0)
                for i, (n, keys) in enumerate(nodes.items())}
        for pub in pubs.values():
            assert pub.sync()
        for keys in nodes.values():
            assert d.longest_prefix(keys).num_units == 400
        victim = cluster.primary_of("tide:{failover}:expiry")
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        victim.proc = None

        outcomes = {"miss": 0, "hit": 0}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for pub in pubs.values():
                pub.record([UnitStored(k, 1, "ssd") for k in _random_keys(5, seed=int(time.monotonic() * 1e6))])
                pub.sync()  # False while the directory is unavailable; never raises
            try:
                for n, keys in nodes.items():
                    m = d.longest_prefix(keys)
                    assert all(h == [Holder(n, "ssd")] for h in m.holders)  # never another node's
                outcomes["hit"] += 1
                if all(d.longest_prefix(k).num_units == 400 for k in nodes.values()) and all(
                        p.resyncs >= 1 and p.pending == 0 for p in pubs.values()):
                    break
            except DirectoryUnavailable:
                outcomes["miss"] += 1
            time.sleep(0.1)
        else:
            pytest.fail(f"not recovered within 60 s: {outcomes}, resyncs {[p.resyncs for p in pubs.values()]}")
        assert outcomes["miss"] >= 1  # the failover was seen, as misses
        assert {n: d.node_keys(n) >= set(keys) for n, keys in nodes.items()} == dict.fromkeys(nodes, True)
    finally:
        cluster.kill()

