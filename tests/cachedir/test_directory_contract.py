"""One contract suite for every directory backend: in-memory and a real redis-server."""

from __future__ import annotations

import itertools

import pytest

from cachedir.directory import DirectoryUnavailable, Holder, open_directory
from cachedir.directory.memory import MemoryDirectory
from tests.cachedir.conftest import FakeClock
from tests.waiting import until

_ns = itertools.count()


@pytest.fixture(params=["mem", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("redis-cluster", marks=pytest.mark.redis)])
def make_dir(request):
    """Factory: a fresh namespace (or two sharing one store) of the backend under test: in
    memory, one redis-server, a Redis Cluster of three primaries."""
    if request.param == "mem":
        def make(namespace=None, **options):
            return MemoryDirectory(namespace or f"ns{next(_ns)}", **options)
    else:
        server = request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")

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


def test_holders_are_each_keys_live_nodes_in_batches(make_dir, monkeypatch):
    import cachedir.directory.redis_backend as redis_backend

    monkeypatch.setattr(redis_backend, "HOLDER_BATCH", 2)  # 5 keys: three round trips
    d = make_dir()
    d.heartbeat("a", "x", ttl_s=30)
    d.heartbeat("b", "y", ttl_s=30)
    d.register("a", [K(1), K(2), K(5)], "ssd")
    d.register("b", [K(1), K(5)], "ram")
    d.register("c", [K(1), K(3)])  # never beats: not live
    d.unregister("a", [K(2)])  # every holder dropped it
    assert d.holders([K(1), K(2), K(3), K(4), K(5)]) == [
        [Holder("a", "ssd"), Holder("b", "ram")], [], [], [], [Holder("a", "ssd"), Holder("b", "ram")]]
    assert d.holders([]) == []


def test_a_unit_every_holder_dropped_is_told_from_one_never_seen(make_dir):
    """The cache's accounting: the unit after a lookup's run was dropped by the nodes that held
    it (evicted), or never registered; registering it again forgets the drop, and a dead node's
    units collected are not drops."""
    d = make_dir()
    d.heartbeat("a", "x", ttl_s=30)
    d.heartbeat("b", "y", ttl_s=30)
    d.register("a", [K(1), K(2), K(3)])
    d.register("b", [K(2)])
    assert d.longest_prefix([K(1), K(2), K(3)]).dropped_next is False  # all held
    d.unregister("a", [K(2), K(3)])
    m = d.longest_prefix([K(1), K(2), K(3)])
    assert m.num_units == 2 and m.dropped_next is True  # b still holds unit 2; unit 3's only holder dropped it
    d.unregister("b", [K(2)])
    m = d.longest_prefix([K(1), K(2), K(3)])
    assert m.num_units == 1 and m.dropped_next is True  # unit 2: its last holder dropped it
    assert d.longest_prefix([K(1), K(7)]).dropped_next is False  # never registered
    d.register("b", [K(2)])
    d.unregister("a", [K(3)])  # a no longer holds 3: still dropped
    m = d.longest_prefix([K(1), K(2), K(3)])
    assert m.num_units == 2 and m.dropped_next is True
    d.register("a", [K(3)])
    assert d.longest_prefix([K(1), K(2), K(3)]).num_units == 3
    d.heartbeat("dying", "z", ttl_s=0.2)
    d.register("dying", [K(8)])
    until(lambda: "dying" not in d.live_nodes(), 10, "the heartbeat to expire", every_s=0.05)
    assert "dying" in d.collect_dead()
    assert d.longest_prefix([K(8)]).dropped_next is False  # a dead node's units are not drops


def test_units_of_a_dead_node_are_ignored_at_once_and_collected_lazily(make_dir):
    d = make_dir()
    d.heartbeat("a", "x", ttl_s=30)
    d.heartbeat("dying", "y", ttl_s=0.2)
    d.register("a", [K(1)])
    d.register("dying", [K(1), K(2)])
    assert d.longest_prefix([K(1), K(2)]).num_units == 2
    until(lambda: "dying" not in d.live_nodes(), 10, "the heartbeat to expire", every_s=0.05)
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


def _linear(holders: list[str]) -> list[str]:
    """The exact answer: every unit up to the first one nobody holds."""
    out = []
    for h in holders:
        if not h:
            break
        out.append(h)
    return out


def _expand(runs: list[tuple[int, str]]) -> list[str]:
    return [h for count, h in runs for _ in range(count)]


def test_bisect_runs_is_exact_on_prefix_closed_chains_in_log_rounds():
    """Each node holding a prefix of the chain (how units persist): the runs equal a walk over
    every unit, in about log16(n) + 1 rounds of at most 16 (k + 1) reads for k changes of the
    holder set."""
    import math
    import random

    from cachedir.directory.base import FANOUT, bisect_runs

    rng = random.Random(7)
    for _ in range(300):
        n = rng.choice([1, 2, 3, 17, 64, 2000])
        ends = {node: rng.randint(0, n) for node in rng.sample("abcdef", rng.randint(0, 4))}
        holders = [",".join(f"{node}=ssd" for node in sorted(ends) if i < ends[node]) for i in range(n)]
        rounds: list[list[int]] = []

        def probe(idx, rounds=rounds, holders=holders):
            rounds.append(idx)
            return [holders[i] for i in idx]

        runs = bisect_runs(n, probe)
        assert _expand(runs) == _linear(holders)
        reads = [i for r in rounds for i in r]
        assert len(set(reads)) == len(reads)  # each unit read once at most
        changes = len({e for e in ends.values() if 0 < e < n})
        assert len(rounds) <= math.ceil(math.log(max(n, 2), FANOUT)) + 2, (n, ends, len(rounds))
        assert max(len(r) for r in rounds) <= FANOUT * (changes + 1) + 1, (n, ends)


def test_bisect_runs_never_stops_before_a_hole_and_never_claims_a_unit_it_saw_empty():
    import random

    from cachedir.directory.base import bisect_runs

    rng = random.Random(11)
    for _ in range(500):
        n = rng.choice([2, 5, 40, 300])
        holders = [rng.choice(["a=ssd", "a=ssd,b=ram", "b=ram", ""] if rng.random() < 0.2 else ["a=ssd"])
                   for _ in range(n)]
        probed: dict[int, str] = {}

        def probe(idx, probed=probed, holders=holders):
            return [probed.setdefault(i, holders[i]) for i in idx]

        got, exact = _expand(bisect_runs(n, probe, fanout=4)), _linear(holders)
        assert len(got) >= len(exact)
        assert all(got[i] == holders[i] for i in probed if i < len(got))  # what it read, it reports


def test_a_hole_past_the_leading_run_is_a_shorter_hit_never_a_longer_miss(make_dir):
    """Node a holds units 0..1999 but 500 was evicted; b holds 0..999; c only unit 1500: the
    match reaches at least unit 500, and where it reports holders it probed, they are right."""
    d = make_dir()
    for n in "abc":
        d.heartbeat(n, n, ttl_s=30)
    keys = [K(i) for i in range(2000)]
    d.register("a", keys[:500] + keys[501:])
    d.register("b", keys[:1000])
    d.register("c", [keys[1500]])
    m = d.longest_prefix(keys)
    assert m.num_units >= 1000  # b covers the hole at 500
    assert m.holders[0] == [Holder("a", "ssd"), Holder("b", "ssd")]
    assert m.holders[500] in ([Holder("b", "ssd")], [Holder("a", "ssd"), Holder("b", "ssd")])


def test_nested_holders_come_back_exactly(make_dir):
    d = make_dir()
    for n in "abc":
        d.heartbeat(n, n, ttl_s=30)
    keys = [K(i) for i in range(2000)]
    d.register("a", keys)
    d.register("b", keys[:1234], "ram")
    d.register("c", keys[:7])
    m = d.longest_prefix(keys + [K(99_999)])
    assert m.num_units == 2000
    assert m.holders[:7] == [[Holder("a", "ssd"), Holder("b", "ram"), Holder("c", "ssd")]] * 7
    assert m.holders[7:1234] == [[Holder("a", "ssd"), Holder("b", "ram")]] * 1227
    assert m.holders[1234:] == [[Holder("a", "ssd")]] * 766


def test_unknown_scheme_lists_the_supported_ones():
    with pytest.raises(ValueError, match="supported schemes: mem, redis, rediss, redis[+]cluster, rediss[+]cluster"):
        open_directory("etcd://x", "ns")


@pytest.mark.redis
def test_a_redis_lookup_reads_log_n_units_in_log_n_round_trips(redis_server):
    """A 2,000-unit chain held by one node, then with a second holder for its first half: a few
    round trips, and Redis reads a few dozen unit hashes, not 2,000 (INFO commandstats)."""
    import redis

    d = open_directory(redis_server.url, "rt", timeout_s=2.0)
    d.heartbeat("a", "x", ttl_s=30)
    d.heartbeat("b", "y", ttl_s=30)
    keys = [K(i) for i in range(2000)]
    d.register("a", keys)
    r = redis.Redis.from_url(redis_server.url)

    def hgetalls() -> int:
        return r.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0)

    for second, most in ((0, 48), (1000, 96)):
        if second:
            d.register("b", keys[:second], "ram")
        before, reads = d.round_trips(), hgetalls()
        m = d.longest_prefix(keys)
        assert m.num_units == 2000 and {len(h) for h in m.holders[:second]} <= {2}
        assert d.round_trips() - before <= 4 and hgetalls() - reads <= most, (d.round_trips() - before,
                                                                              hgetalls() - reads)


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
