"""The SSD store and RAM tier: atomic writes, verification, eviction, restart, randomized ops."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from cachedir.ram import RamTier
from cachedir.store import StoreConfig, UnitStore
from cachedir.unit import UnitRemoved, UnitStored
from tests.cachedir.conftest import FakeClock
from tests.cachedir.units import NS, make_units

UNIT_FILE_BYTES = len(make_units(list(range(64)))[0].encode())


def _store(tmp_path, units=100, clock=None, **kw):
    cfg = StoreConfig(tmp_path / "ssd", capacity_bytes=units * UNIT_FILE_BYTES, **kw)
    return UnitStore(cfg, now_s=clock or time.time)


def test_put_get_and_events(tmp_path):
    store = _store(tmp_path)
    units = make_units(list(range(256)))
    for u in units:
        assert store.put(u)
        store.check_integrity()
    got = store.get(units[2].key, NS.seed, units[2].token_ids)
    assert got == units[2]
    assert store.get(b"\1" * 16, NS.seed) is None
    assert [type(e) for e in store.drain_events()] == [UnitStored] * 4
    assert store.get_many_async([u.key for u in units], NS.seed, [u.token_ids for u in units]).result() == units
    assert store.stats.hits == 5 and store.stats.misses == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "wrong_tokens", "wrong_namespace", "delete"])
def test_damaged_unit_is_a_miss_removed_and_counted(tmp_path, damage):
    store = _store(tmp_path)
    unit = make_units(list(range(64)))[0]
    store.put(unit)
    path = store.path(unit.key)
    tokens, ns = unit.token_ids, NS.seed
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-7])
    elif damage == "wrong_tokens":
        tokens = tuple(reversed(tokens))
    elif damage == "wrong_namespace":
        ns = NS.for_tenant("other").seed
    else:
        path.unlink()
    assert store.get(unit.key, ns, tokens) is None
    assert unit.key not in store and not path.exists()
    assert store.stats.corrupt == (0 if damage == "delete" else 1)
    store.check_integrity()


def test_restart_rebuilds_the_index_and_drops_garbage(tmp_path):
    store = _store(tmp_path)
    units = make_units(list(range(640)))
    for u in units:
        store.put(u)
    (store.path(units[0].key).parent / ".leftover.tmp").write_bytes(b"partial")
    bad = store.path(units[3].key)
    bad.write_bytes(bad.read_bytes()[:100])
    store.close()
    again = _store(tmp_path)
    assert len(again) == 9 and units[3].key not in again
    assert again.get(units[5].key, NS.seed, units[5].token_ids) == units[5]
    again.check_integrity()


def test_capacity_evicts_lru_and_max_age(tmp_path):
    clock = FakeClock()
    store = _store(tmp_path, units=3, clock=clock, max_age_s=100)
    u = make_units(list(range(64 * 5)))
    for unit in u[:3]:
        store.put(unit)
        clock.advance(1)
    store.get(u[0].key, NS.seed)  # u0 becomes most recent
    store.put(u[3])  # evicts u1
    assert set(store.keys()) == {u[0].key, u[2].key, u[3].key}
    assert UnitRemoved(u[1].key, "ssd") in store.drain_events()
    clock.advance(150)
    store.put(u[4])  # everything else is older than max_age
    assert set(store.keys()) == {u[4].key}
    store.check_integrity()


def test_lfu_keeps_frequently_used_units(tmp_path):
    clock = FakeClock()
    store = _store(tmp_path, units=2, clock=clock, eviction="lfu")
    u = make_units(list(range(64 * 3)))
    store.put(u[0])
    store.put(u[1])
    for _ in range(3):
        clock.advance(1)
        store.get(u[0].key, NS.seed)
    store.get(u[1].key, NS.seed)  # most recent, but used less
    store.put(u[2])
    assert set(store.keys()) == {u[0].key, u[2].key}


def test_disk_full_skips_and_counts(tmp_path, monkeypatch):
    import errno

    store = _store(tmp_path)
    unit = make_units(list(range(64)))[0]

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert store.put(unit) is False
    assert store.stats.write_errors == 1 and unit.key not in store
    store.check_integrity()


_WRITER = """
import sys, time
from cachedir.store import StoreConfig, UnitStore
from tests.cachedir.units import make_units
store = UnitStore(StoreConfig(sys.argv[1], capacity_bytes=1 << 40))
units = make_units(list(range(64 * 100)), layers=8, dim=576)
print("ready", flush=True)
for u in units:
    store.put(u)
"""


def test_writer_killed_mid_write_leaves_no_visible_partial_unit(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "ssd")], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.25)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = UnitStore(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 40))
    units = make_units(list(range(64 * 100)), layers=8, dim=576)
    written = [u for u in units if u.key in store]
    assert 0 < len(written) < len(units), "kill landed outside the write loop"
    for u in written:
        assert store.get(u.key, NS.seed, u.token_ids) == u
    assert not list((tmp_path / "ssd").rglob("*.tmp"))
    store.check_integrity()


def test_randomized_operations_keep_the_store_consistent(tmp_path):
    rng = random.Random(7)
    clock = FakeClock()
    store = _store(tmp_path, units=12, clock=clock, eviction=rng.choice(["lru", "lfu"]), max_age_s=500)
    pool = make_units(list(range(64 * 40)))
    for _ in range(300):
        clock.advance(rng.uniform(0, 20))
        u = rng.choice(pool)
        op = rng.random()
        if op < 0.5:
            store.put(u)
        elif op < 0.85:
            got = store.get(u.key, NS.seed, u.token_ids)
            assert got is None or got == u
        else:
            store.remove(u.key)
        store.check_integrity()


def test_ram_tier_is_bounded_lru():
    ram = RamTier(capacity_bytes=2 * len(make_units(list(range(64)))[0].payload))
    u = make_units(list(range(64 * 3)))
    ram.put(u[0])
    ram.put(u[1])
    assert ram.get(u[0].key, NS.seed) == u[0]
    ram.put(u[2])
    assert u[1].key not in ram and u[0].key in ram
    assert ram.get(u[0].key, NS.for_tenant("t").seed) is None  # other namespace: miss
    assert ram.stats.evictions == 1
    ram.check_integrity()


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_pinned_units_survive_eviction_expiry_and_restarts(tmp_path, eviction):
    clock = FakeClock()
    store = _store(tmp_path, units=3, clock=clock, eviction=eviction, max_age_s=100.0)
    units = make_units(list(range(64 * 6)))
    for u in units[:3]:
        assert store.put(u)
    assert store.pin([units[0].key, b"\0" * 16]) == 1  # an absent key pins nothing
    clock.advance(50)
    for u in units[3:5]:  # two more: the two unpinned units go, the pinned one stays
        assert store.put(u)
    clock.advance(200)  # past max_age: every unpinned unit expires
    assert store.put(units[5])
    assert units[0].key in store and units[3].key not in store and units[5].key in store
    store.check_integrity()
    store.close()
    again = UnitStore(store.cfg, now_s=clock)  # pins are kept on disk
    assert again.pinned() == [units[0].key]
    assert again.put(units[1]) and again.pin([u.key for u in units]) == 3
    assert again.put(units[2]) is False  # full of pinned units: refused
    assert again.get(units[2].key, NS.seed) is None and again.unpin([units[5].key]) == 1
    assert again.put(units[2]) and units[5].key not in again  # the unpinned one made room
    again.check_integrity()
    again.close()
