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
