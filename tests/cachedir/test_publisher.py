"""Publishing store events to the directory, through a Redis outage and an empty restart."""

from __future__ import annotations

import pytest

from cachedir.directory import open_directory
from cachedir.publisher import DirectoryPublisher
from cachedir.store import StoreConfig, UnitStore
from deploy.redis_proc import RedisServer
from tests.cachedir.units import make_units

pytestmark = pytest.mark.redis


def test_events_survive_an_outage_and_a_restart_empty_re_registers(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        d = open_directory(server.url, "pub", timeout_s=0.3)
        store = UnitStore(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30))
        pub = DirectoryPublisher(d, "node-a", "127.0.0.1:9", lambda: {"ssd": store.keys()}, heartbeat_ttl_s=30)
        units = make_units(list(range(64 * 6)))
        keys = [u.key for u in units]
        for u in units[:3]:
            store.put(u)
        pub.record(store.drain_events())
        assert pub.sync()
        assert d.longest_prefix(keys).num_units == 3

        server.kill()  # Redis down: writes go on, events wait
        for u in units[3:]:
            store.put(u)
        store.remove(units[0].key)
        pub.record(store.drain_events())
        assert not pub.sync()
        assert pub.failures == 1 and pub.pending == 4  # one failed try, nothing lost (no retry loop inside sync)

        server.start()  # back, but empty: the epoch changed, so everything is re-registered
        assert pub.sync() and pub.resyncs == 1 and pub.pending == 0
        assert d.longest_prefix(keys).num_units == 0  # unit 0 was removed
        assert d.longest_prefix(keys[1:]).num_units == 5
        assert d.node_keys("node-a") == set(keys[1:])
    finally:
        server.kill()


def _keys(n: int, seed: int) -> list[bytes]:
    import random

    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def test_nodes_reap_dead_nodes_registrations_now_and_then():
    """A node whose heartbeat lapsed is ignored at once; a live node's publisher removes its
    registrations at its next reap (every reap_every_s, on a clock of its own), not before."""
    from cachedir.directory.memory import MemoryDirectory
    from tests.cachedir.conftest import FakeClock

    clock = FakeClock()
    d = MemoryDirectory("reap", now_s=clock)
    gone = DirectoryPublisher(d, "gone", "x", lambda: {"ssd": _keys(50, 1)}, heartbeat_ttl_s=10, reap_every_s=0)
    live = DirectoryPublisher(d, "live", "y", lambda: {"ssd": _keys(5, 2)}, heartbeat_ttl_s=1000,
                              reap_every_s=60, now_s=clock)
    assert gone.sync() and live.sync()
    assert len(d.node_keys("gone")) == 50 and live.reaped == 0
    clock.advance(11)  # gone's heartbeat lapsed: its units are no hit already, still registered
    assert d.longest_prefix(_keys(50, 1)).num_units == 0 and len(d.node_keys("gone")) == 50
    for _ in range(6):  # within a minute, live reaps once
        clock.advance(10)
        assert live.sync()
    assert live.reaped == 1 and d.node_keys("gone") == set()
    assert len(d.node_keys("live")) == 5  # its own stay


def test_a_node_whose_heartbeat_lapsed_registers_everything_again():
    """A node paused past its TTL (and reaped meanwhile) comes back: its heartbeat says it was
    not live, and it registers what it holds again."""
    from cachedir.directory.memory import MemoryDirectory
    from tests.cachedir.conftest import FakeClock

    clock = FakeClock()
    d = MemoryDirectory("revive", now_s=clock)
    keys = _keys(20, 3)
    pub = DirectoryPublisher(d, "a", "x", lambda: {"ssd": keys}, heartbeat_ttl_s=10, reap_every_s=0)
    assert pub.sync() and d.longest_prefix(keys).num_units == 20
    clock.advance(11)
    assert d.collect_dead() == ["a"] and d.node_keys("a") == set()
    assert pub.sync() and d.longest_prefix(keys).num_units == 20 and d.node_keys("a") == set(keys)
