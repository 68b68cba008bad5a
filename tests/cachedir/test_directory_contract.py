"""One contract suite for every directory backend: in-memory and a real redis-server."""

from __future__ import annotations

import itertools
import time

import pytest

from cachedir.directory import DirectoryUnavailable, Holder, open_directory
from cachedir.directory.memory import MemoryDirectory
from tests.cachedir.conftest import FakeClock

_ns = itertools.count()


@pytest.fixture(params=["mem", pytest.param("redis", marks=pytest.mark.redis)])
def make_dir(request):
    """Factory: a fresh namespace (or two sharing one store) of the backend under test."""
    if request.param == "mem":
        def make(namespace=None, **options):
            return MemoryDirectory(namespace or f"ns{next(_ns)}", **options)
    else:
        server = request.getfixturevalue("redis_server")

        def make(namespace=None, **options):
            return open_directory(server.url, namespace or f"ns{next(_ns)}", timeout_s=2.0, **options)
    return make


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_longest_prefix_walks_from_the_first_unit(make_dir):
    d = make_dir()
    d.heartbeat("a", "10.0.0.1:7000", ttl_s=30)
    d.heartbeat("b", "10.0.0.2:7000", ttl_s=30)
    d.register("a", [K(1), K(2), K(3)], "ssd")
    d.register("b", [K(1)], "ram")
    m = d.longest_prefix([K(1), K(2), K(3), K(4), K(5)])
    assert m.num_units == 3
    assert m.holders[0] == [Holder("a", "ssd"), Holder("b", "ram")]
    assert m.holders[2] == [Holder("a", "ssd")]
    assert d.longest_prefix([K(9), K(1)]).num_units == 0  # a gap at unit 0 stops the walk
    assert d.longest_prefix([]).num_units == 0


def test_register_is_idempotent_and_unregister_removes(make_dir):
    d = make_dir()
    d.heartbeat("a", "x", ttl_s=30)
    d.register("a", [K(1), K(2)])
    d.register("a", [K(1), K(2)])
    assert d.node_keys("a") == {K(1), K(2)}
    d.unregister("a", [K(2)])
    assert d.longest_prefix([K(1), K(2)]).num_units == 1
    assert d.node_keys("a") == {K(1)}
    with pytest.raises(ValueError, match="tier 'disk'"):
        d.register("a", [K(3)], "disk")


def test_units_of_a_dead_node_are_ignored_at_once_and_collected_lazily(make_dir):
    d = make_dir()
    d.heartbeat("a", "x", ttl_s=30)
    d.heartbeat("dying", "y", ttl_s=0.2)
    d.register("a", [K(1)])
    d.register("dying", [K(1), K(2)])
    assert d.longest_prefix([K(1), K(2)]).num_units == 2
    time.sleep(0.35)
    m = d.longest_prefix([K(1), K(2)])
    assert m.num_units == 1 and m.holders[0] == [Holder("a", "ssd")]
    assert set(d.live_nodes()) == {"a"}
    assert d.collect_dead() == ["dying"]
    assert d.node_keys("dying") == set()
    assert d.collect_dead() == []


def test_namespaces_share_a_store_without_seeing_each_other(make_dir):
    a, b = make_dir("model-a"), make_dir("model-b")
    for d in (a, b):
        d.heartbeat("n", "x", ttl_s=30)
    a.register("n", [K(1)])
    assert a.longest_prefix([K(1)]).num_units == 1
    assert b.longest_prefix([K(1)]).num_units == 0


def test_the_hot_set_is_bounded_and_keeps_the_hottest(make_dir):
    d = make_dir(max_hot=16)
    d.heartbeat("a", "x", ttl_s=30)
    d.register("a", [K(i) for i in range(200)])
    for i in range(200):  # K(i) is hit i % 7 + 1 times: the 7-hit units are the hottest
        d.record_hits([K(i)] * (i % 7 + 1), now_s=1000.0)
    hot = d.hot_units(limit=1000, max_replicas=2, now_s=1000.0)
    assert 0 < len(hot) <= 16  # 28 units have 7 hits: only some of them are left
    assert all(h.hits == pytest.approx(7.0) for h in hot)
    with pytest.raises(ValueError, match="max_hot"):
        make_dir(max_hot=0)


def test_hot_units_rank_by_decayed_hits_and_skip_fully_replicated(make_dir):
    d = make_dir()
    for n in ("a", "b"):
        d.heartbeat(n, n, ttl_s=30)
    d.register("a", [K(1), K(2), K(3)])
    d.register("b", [K(3)])
    now = 1_000_000.0
    d.record_hits([K(1)] * 1, now)
    d.record_hits([K(2)] * 3, now)
    d.record_hits([K(3)] * 5, now)
    hot = d.hot_units(limit=10, max_replicas=2, now_s=now)
    assert [h.key for h in hot] == [K(2), K(1)]  # K(3) already has 2 replicas
    assert hot[0].hits == pytest.approx(3.0) and hot[0].replicas == 1 and hot[0].holders == ["a"]
    # one half-life later the counts have halved, and new hits outweigh old ones
    later = now + d.half_life_s
    assert d.hot_units(10, 2, later)[0].hits == pytest.approx(1.5)
    d.record_hits([K(1)] * 2, later)
    assert [h.key for h in d.hot_units(10, 2, later)] == [K(1), K(2)]


def test_epoch_is_stable_within_a_store_lifetime(make_dir):
    d = make_dir()
    assert d.epoch() == d.epoch()


def test_2000_unit_lookup(make_dir):
    d = make_dir()
    d.heartbeat("a", "x", ttl_s=30)
    keys = [K(i) for i in range(2000)]
    d.register("a", keys)
    assert d.longest_prefix(keys).num_units == 2000


def test_unknown_scheme_lists_the_supported_ones():
    with pytest.raises(ValueError, match="supported schemes: mem, redis, rediss"):
        open_directory("etcd://x", "ns")


@pytest.mark.redis
def test_redis_lookup_is_one_round_trip(redis_server):
    d = open_directory(redis_server.url, "rt", timeout_s=2.0)
    d.heartbeat("a", "x", ttl_s=30)
    keys = [K(i) for i in range(2000)]
    d.register("a", keys)
    d.longest_prefix(keys[:1])  # loads the script
    before = d.round_trips()
    assert d.longest_prefix(keys).num_units == 2000
    assert d.round_trips() - before == 1


@pytest.mark.redis
def test_redis_down_is_unavailable_at_once_and_restart_changes_the_epoch(tmp_path, monkeypatch):
    import redis

    from deploy.redis_proc import RedisServer

    server = RedisServer(tmp_path).start()
    d = open_directory(server.url, "down", timeout_s=0.2)
    d.heartbeat("a", "x", ttl_s=30)
    d.register("a", [K(1)])
    epoch = d.epoch()
    server.kill()
    attempts = []
    connect = redis.Connection.connect
    monkeypatch.setattr(redis.Connection, "connect", lambda self, *a, **k: attempts.append(1) or connect(self, *a, **k))
    with pytest.raises(DirectoryUnavailable):
        d.longest_prefix([K(1)])
    assert 1 <= len(attempts) <= 2  # a dead Redis costs a reconnect (each bounded by timeout_s), no retry loop
    monkeypatch.undo()
    server.start()  # same port, empty
    assert d.longest_prefix([K(1)]).num_units == 0
    assert d.epoch() != epoch
    server.kill()


@pytest.mark.redis
def test_redis_password(tmp_path):
    from deploy.redis_proc import RedisServer

    server = RedisServer(tmp_path, password="s3cret").start()
    try:
        ok = open_directory(server.url, "auth", timeout_s=1.0)
        ok.heartbeat("a", "x", ttl_s=5)
        bad = open_directory(server.url.replace("s3cret", "wrong"), "auth", timeout_s=1.0)
        with pytest.raises(DirectoryUnavailable):
            bad.live_nodes()
        assert "a" in ok.live_nodes()
    finally:
        server.kill()


def test_memory_clock_is_injectable():
    clock = FakeClock()
    d = MemoryDirectory("clock", now_s=clock)
    d.heartbeat("a", "x", ttl_s=10)
    d.register("a", [K(1)])
    clock.advance(11)
    assert d.longest_prefix([K(1)]).num_units == 0


@pytest.mark.redis
def test_redis_over_tls(tmp_path):
    """rediss:// with the server's CA: works; without trusting the CA: unavailable, not a hang."""
    from deploy.redis_proc import RedisServer
    from tests.certs import make_certs

    ca, cert, key = make_certs(tmp_path)
    server = RedisServer(tmp_path / "redis", tls=(ca, cert, key)).start()
    try:
        assert server.url.startswith("rediss://")
        d = open_directory(server.url, "tls", timeout_s=2.0, ssl_ca_certs=str(ca))
        d.heartbeat("a", "x", ttl_s=30)
        d.register("a", [K(1)])
        assert d.longest_prefix([K(1)]).num_units == 1
        untrusted = open_directory(server.url, "tls", timeout_s=1.0)
        with pytest.raises(DirectoryUnavailable):
            untrusted.live_nodes()
    finally:
        server.kill()
