"""The SSD store and RAM tier: atomic writes, verification, eviction, restart, randomized ops.
The store's tests run on both layouts (a file per unit, segment files); segment specifics
(batched writes, coalesced reads, tombstones, compaction) at the end."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from cachedir.ram import RamTier
from cachedir.store import StoreConfig, UnitStore
from cachedir.unit import UnitRemoved, UnitStored
from tests.cachedir.conftest import FakeClock
from tests.cachedir.units import NS, flip_byte, make_units

UNIT_FILE_BYTES = len(make_units(list(range(64)))[0].encode())


@pytest.fixture(params=["unit", "segment"])
def layout(request) -> str:
    return request.param


def _read(store: UnitStore, units) -> list:
    """``units`` read back as one run (None for each miss)."""
    return store.get_many_async([u.key for u in units], NS.seed, [u.token_ids for u in units]).result()


def _store(tmp_path, layout, units=100, clock=None, **kw):
    cfg = StoreConfig(tmp_path / "ssd", capacity_bytes=units * UNIT_FILE_BYTES, layout=layout, **kw)
    return UnitStore(cfg, now_s=clock or time.time)


def _rewrite(store: UnitStore, key: bytes, change) -> None:
    """Replace the bytes of ``key``'s file from its record's start with ``change(record bytes)``."""
    loc = store.location(key)
    data = loc.path.read_bytes()
    loc.path.write_bytes(data[: loc.offset] + change(data[loc.offset : loc.offset + loc.length]))


@pytest.mark.security
def test_unit_files_and_pins_are_private(tmp_path, layout):
    """Unit records carry tenants' prompt token ids: files 0600, directories 0700."""
    store = _store(tmp_path, layout)
    units = make_units(list(range(256)))
    for u in units:
        store.put(u)
    store.pin([units[0].key])
    store.close()
    paths = [p for p in (tmp_path / "ssd").rglob("*")]
    assert any(p.is_file() for p in paths)
    assert all(p.stat().st_mode & 0o077 == 0 for p in [tmp_path / "ssd", *paths]), \
        [(str(p), oct(p.stat().st_mode)) for p in paths if p.stat().st_mode & 0o077]


def test_put_get_and_events(tmp_path, layout):
    store = _store(tmp_path, layout)
    units = make_units(list(range(256)))
    for u in units:
        assert store.put(u)
        store.check_integrity()
    got = store.get(units[2].key, NS.seed, units[2].token_ids)
    assert got == units[2]
    assert store.get(b"\1" * 16, NS.seed) is None
    assert [type(e) for e in store.drain_events()] == [UnitStored] * 4
    assert _read(store, units) == units
    assert store.stats.hits == 5 and store.stats.misses == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "wrong_tokens", "wrong_namespace", "delete"])
def test_damaged_unit_is_a_miss_removed_and_counted(tmp_path, layout, damage):
    store = _store(tmp_path, layout)
    unit = make_units(list(range(64)))[0]
    store.put(unit)
    path = store.path(unit.key)
    tokens, ns = unit.token_ids, NS.seed
    if damage == "flip":
        _rewrite(store, unit.key, lambda r: r[: len(r) // 2] + bytes([r[len(r) // 2] ^ 0x10]) + r[len(r) // 2 + 1 :])
    elif damage == "truncate":
        _rewrite(store, unit.key, lambda r: r[:-7])
    elif damage == "wrong_tokens":
        tokens = tuple(reversed(tokens))
    elif damage == "wrong_namespace":
        ns = NS.for_tenant("other").seed
    else:
        path.unlink()
    assert store.get(unit.key, ns, tokens) is None
    assert unit.key not in store and not path.exists()
    assert store.stats.corrupt == (0 if damage == "delete" else 1)
    assert store.gone([unit.key]) == ["damaged"]
    store.check_integrity()


def test_restart_rebuilds_the_index_and_drops_garbage(tmp_path, layout):
    store = _store(tmp_path, layout)
    units = make_units(list(range(640)))
    for u in units:
        store.put(u)
    (store.path(units[0].key).parent / ".leftover.tmp").write_bytes(b"partial")
    _rewrite(store, units[3].key, lambda r: r[:100])
    store.close()
    again = _store(tmp_path, layout)
    assert len(again) == 9 and units[3].key not in again
    assert again.get(units[5].key, NS.seed, units[5].token_ids) == units[5]
    again.check_integrity()


@pytest.mark.parametrize("before, after", [("unit", "segment"), ("segment", "unit")])
def test_a_store_opened_with_the_other_layout_takes_its_units_over(tmp_path, before, after, monkeypatch):
    old = _store(tmp_path, before, segment_bytes=4 * UNIT_FILE_BYTES)
    units = make_units(list(range(64 * 10)))
    for f in old.put_many_async(units[:6]) + old.put_many_async(units[6:]):
        assert f.result()
    old.pin([units[1].key])
    flip_byte(old, units[4].key)  # damaged: not carried over
    old.close()
    old_read = type(old.layout).read
    disk = threading.Event()
    monkeypatch.setattr(type(old.layout), "read", lambda *a: disk.wait(60) and old_read(*a))  # a disk that waits
    store = _store(tmp_path, after, segment_bytes=4 * UNIT_FILE_BYTES)
    assert len(store) < 9  # opened while the old units are still unread: the takeover goes on in the background
    disk.set()
    store.wait_for_takeover()
    assert len(store) == 9 and store.stats.corrupt == 1 and store.pinned() == [units[1].key]
    assert _read(store, units) \
        == [None if i == 4 else u for i, u in enumerate(units)]
    assert store.stats.bytes == 9 * UNIT_FILE_BYTES  # within the capacity accounting
    leftovers = [p for p in (tmp_path / "ssd").rglob("*")
                 if p.is_file() and p.suffix == (".unit" if before == "unit" else ".seg")]
    assert leftovers == []
    store.check_integrity()
    store.close()
    again = _store(tmp_path, after)
    again.wait_for_takeover()
    assert len(again) == 9 and again.stats.writes == 0  # nothing was left to take over
    again.check_integrity()


def test_a_takeover_cut_short_by_close_goes_on_at_the_next_start(tmp_path, monkeypatch):
    from cachedir.layout import UnitFiles

    old = _store(tmp_path, "unit")
    units = make_units(list(range(64 * 10)))
    assert all(old.put_many(units))
    old.close()
    real_read = UnitFiles.read
    monkeypatch.setattr(UnitFiles, "read", lambda *a: time.sleep(0.2) or real_read(*a))
    store = _store(tmp_path, "segment", segment_bytes=2 * UNIT_FILE_BYTES)
    deadline = time.monotonic() + 30
    while len(store) == 0 and time.monotonic() < deadline:  # the first batch is over
        time.sleep(0.01)
    store.close()  # stops the takeover after the unit under way
    assert 0 < len(store) < 10
    monkeypatch.setattr(UnitFiles, "read", real_read)
    again = _store(tmp_path, "segment")
    again.wait_for_takeover()
    assert len(again) == 10
    assert _read(again, units) == units
    again.check_integrity()
    again.close()


def test_capacity_evicts_lru_and_max_age(tmp_path, layout):
    clock = FakeClock()
    store = _store(tmp_path, layout, units=3, clock=clock, max_age_s=100)
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
    # what was dropped and why (tide cache explain): evicted, removed by hand, or never here
    store.remove(u[4].key)
    assert store.gone([u[1].key, u[0].key, u[4].key, bytes(16)]) == ["evicted", "evicted", "removed", ""]
    store.put(u[1])  # stored again: no longer gone
    assert store.gone([u[1].key]) == [""]


def test_lfu_keeps_frequently_used_units(tmp_path, layout):
    clock = FakeClock()
    store = _store(tmp_path, layout, units=2, clock=clock, eviction="lfu")
    u = make_units(list(range(64 * 3)))
    store.put(u[0])
    store.put(u[1])
    for _ in range(3):
        clock.advance(1)
        store.get(u[0].key, NS.seed)
    store.get(u[1].key, NS.seed)  # most recent, but used less
    store.put(u[2])
    assert set(store.keys()) == {u[0].key, u[2].key}


def test_disk_full_skips_and_counts(tmp_path, layout, monkeypatch):
    import errno

    store = _store(tmp_path, layout)
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
store = UnitStore(StoreConfig(sys.argv[1], capacity_bytes=1 << 40, layout=sys.argv[2]))
units = make_units(list(range(64 * 100)), layers=8, dim=576)
print("ready", flush=True)
for i, u in enumerate(units):
    store.put(u)
    print(i, flush=True)
"""


def test_writer_killed_mid_write_leaves_no_visible_partial_unit(tmp_path, layout):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "ssd"), layout], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    for _ in range(5):  # a few units are in; 95 (~110 MB) to go: the kill lands in the loop
        assert proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = UnitStore(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 40, layout=layout))
    units = make_units(list(range(64 * 100)), layers=8, dim=576)
    written = [u for u in units if u.key in store]
    assert 0 < len(written) < len(units), "kill landed outside the write loop"
    for u in written:
        assert store.get(u.key, NS.seed, u.token_ids) == u
    assert not list((tmp_path / "ssd").rglob("*.tmp"))
    store.check_integrity()


def test_randomized_operations_keep_the_store_consistent(tmp_path, layout):
    rng = random.Random(7)
    clock = FakeClock()
    store = _store(tmp_path, layout, units=12, clock=clock, eviction=rng.choice(["lru", "lfu"]), max_age_s=500)
    pool = make_units(list(range(64 * 40)))
    for _ in range(300):
        clock.advance(rng.uniform(0, 20))
        u = rng.choice(pool)
        op = rng.random()
        if op < 0.3:
            store.put(u)
        elif op < 0.5:  # one write batch (one segment)
            batch = rng.sample(pool, rng.randint(2, 6))
            results = store.put_many(batch)  # a unit of the batch may evict an earlier one
            assert all(ok for b, ok in zip(batch, results, strict=True) if b.key in store)
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
def test_pinned_units_survive_eviction_expiry_and_restarts(tmp_path, layout, eviction):
    clock = FakeClock()
    store = _store(tmp_path, layout, units=3, clock=clock, eviction=eviction, max_age_s=100.0)
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


def test_a_restart_with_less_room_keeps_the_pinned_units(tmp_path, layout):
    """Opened again with room for two units of four, the store evicts while it scans: a pinned
    unit (here the first written, so the first scanned in segment order) is never among them."""
    store = _store(tmp_path, layout, units=4)
    units = make_units(list(range(64 * 4)))
    for u in units:
        assert store.put(u)
    assert store.pin([units[0].key]) == 1
    store.close()
    again = _store(tmp_path, layout, units=2)
    assert units[0].key in again and again.pinned() == [units[0].key] and len(again) == 2
    again.check_integrity()
    again.close()


def _segment_store(tmp_path, units=100, **kw) -> UnitStore:
    return _store(tmp_path, "segment", units=units, **kw)


def _segment_files(tmp_path) -> list:
    return sorted((tmp_path / "ssd" / "segments").glob("*.seg"))


def test_queued_writes_share_segments_and_a_run_is_one_read(tmp_path, monkeypatch):
    from cachedir.layout import SegmentFiles

    store = _segment_store(tmp_path, io_threads=2)
    units = make_units(list(range(64 * 40)))
    assert all(f.result(timeout=30) for f in [store.put_async(u) for u in units])
    segments = {store.location(u.key).path for u in units}
    assert len(_segment_files(tmp_path)) == len(segments) < len(units)
    reads = []
    real_read = SegmentFiles.read
    monkeypatch.setattr(SegmentFiles, "read", lambda self, locs, *a: reads.append(len(locs)) or real_read(self, locs, *a))
    got = _read(store, units)
    assert got == units
    assert len(reads) == len(segments) and sum(reads) == len(units)  # one read per segment
    run = make_units(list(range(5000, 5000 + 64 * 6)))
    assert all(f.result(timeout=30) for f in store.put_many_async(run))
    assert len({store.location(u.key).path for u in run}) == 1  # a run persisted together: one segment
    store.check_integrity()


def test_a_read_verifies_its_units_outside_the_store_lock(tmp_path, layout, monkeypatch):
    """Checksumming a run of units (MiBs) must not stall the request path's puts and lookups."""
    import cachedir.store

    store = _store(tmp_path, layout)
    units = make_units(list(range(64 * 4)))
    assert all(store.put(u) for u in units[:3])
    verifying, go_on = threading.Event(), threading.Event()
    real_decode = cachedir.store.decode

    def slow_decode(*args):
        verifying.set()
        assert go_on.wait(10)
        return real_decode(*args)

    monkeypatch.setattr(cachedir.store, "decode", slow_decode)
    read = store.get_many_async([u.key for u in units[:3]], NS.seed, [u.token_ids for u in units[:3]])
    assert verifying.wait(10)
    put = threading.Thread(target=store.put, args=(units[3],))
    put.start()
    put.join(5)
    locked_out = put.is_alive()
    go_on.set()
    put.join()
    assert not locked_out, "a put waited for another read's verification"
    assert read.result(timeout=10) == units[:3]
    assert store.location(units[3].key) is not None
    store.check_integrity()


def test_evictions_and_removals_are_synced_outside_the_store_lock(tmp_path, layout, monkeypatch):
    """A deletion's fsync (a tombstone, an unlinked file's directory) takes milliseconds: none
    runs while the store's lock is held (puts and lookups wait for it); they run once it is
    released."""
    import cachedir.layout

    store = _store(tmp_path, layout, units=2)
    units = make_units(list(range(64 * 6)))
    store.put(units[0])
    store.put(units[1])
    deleting, synced_in_delete, synced_after = [False], [], []
    real_fsync, real_sync_dir, real_delete = os.fsync, cachedir.layout.sync_dir, store.layout.delete
    real_sync_deleted = store.layout.sync_deleted

    def recording(real):
        def sync(arg):
            if deleting[0]:
                synced_in_delete.append(arg)
            real(arg)
        return sync

    def delete(loc):
        deleting[0] = True
        try:
            return real_delete(loc)
        finally:
            deleting[0] = False

    def sync_deleted():
        synced_after.append(store._lock._lock._is_owned())
        real_sync_deleted()

    monkeypatch.setattr(cachedir.layout.os, "fsync", recording(real_fsync))
    monkeypatch.setattr(cachedir.layout, "sync_dir", recording(real_sync_dir))
    monkeypatch.setattr(store.layout, "delete", delete)
    monkeypatch.setattr(store.layout, "sync_deleted", sync_deleted)
    for u in units[2:5]:
        store.put(u)  # each evicts the oldest
    store.remove(units[4].key)
    assert synced_in_delete == [] and synced_after and not any(synced_after), (synced_in_delete, synced_after)
    store.check_integrity()
    assert set(store.keys()) == {units[3].key}


def _resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (``mincore`` over a private mapping of the file)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(m)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) == 0
        finally:
            del anchor
    return sum(v & 1 for v in vec)


def test_dropping_every_units_page_cache_leaves_none_of_their_segment_cached(tmp_path):
    """What `tide bench unit-io` and `tide bench ttft` call cold: the pages a unit shares with
    its neighbours go too (the kernel keeps partial pages of an fadvise range)."""
    with open("/proc/mounts") as f:
        mounts = [line.split() for line in f]
    fs = max((m for m in mounts if str(tmp_path).startswith(m[1])), key=lambda m: len(m[1]))[2]
    if fs == "tmpfs":
        pytest.skip("tmpfs keeps its files in the page cache")
    store = _segment_store(tmp_path)
    units = make_units(list(range(64 * 20)))
    assert all(f.result(timeout=30) for f in store.put_many_async(units))
    assert _read(store, units) == units
    (segment,) = {store.location(u.key).path for u in units}
    assert _resident_pages(segment) > 0
    for u in units:
        store.drop_page_cache(u.key)
    assert _resident_pages(segment) == 0


def test_a_damaged_record_costs_only_its_unit(tmp_path):
    store = _segment_store(tmp_path)
    units = make_units(list(range(64 * 8)))
    assert store.put_many(units) == [True] * 8
    _rewrite_middle = store.location(units[3].key)
    data = bytearray(_rewrite_middle.path.read_bytes())
    data[_rewrite_middle.offset + _rewrite_middle.length - 5] ^= 0x01  # a payload bit of unit 3
    _rewrite_middle.path.write_bytes(bytes(data))
    got = _read(store, units)
    assert got[:3] == units[:3] and got[3] is None and got[4:] == units[4:]
    assert store.stats.corrupt == 1 and units[3].key not in store
    store.check_integrity()
    store.close()
    again = _segment_store(tmp_path)  # the bad record was tombstoned: not back after a restart
    assert set(again.keys()) == {u.key for u in units} - {units[3].key}
    again.check_integrity()


def test_a_segment_cut_short_keeps_the_records_before_the_cut(tmp_path):
    store = _segment_store(tmp_path)
    units = make_units(list(range(64 * 8)))
    store.put_many(units)
    cut = store.location(units[5].key)
    store.close()
    os.truncate(cut.path, cut.offset + cut.length // 2)
    again = _segment_store(tmp_path)
    assert set(again.keys()) == {u.key for u in units[:5]} and again.stats.corrupt == 1
    assert again.get(units[4].key, NS.seed, units[4].token_ids) == units[4]
    again.check_integrity()


def test_removed_units_stay_removed_and_sparse_segments_are_compacted(tmp_path):
    store = _segment_store(tmp_path)
    units = make_units(list(range(64 * 8)))
    store.put_many(units)
    old = store.location(units[0].key).path
    store.remove(units[1].key)
    store.close()
    again = _segment_store(tmp_path)  # tombstoned: a restart does not bring it back
    assert units[1].key not in again and len(again) == 7
    for u in units[2:5]:  # 4 of 8 left: half live, not yet worth a rewrite
        again.remove(u.key)
    assert old.exists()
    again.remove(units[5].key)  # 3 of 8: compacted in the background (rewritten to a new segment)
    deadline = time.monotonic() + 10
    while old.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not old.exists()
    kept = [units[0], *units[6:]]
    assert _read(again, kept) == kept
    again.check_integrity()
    again.close()
    assert set(_segment_store(tmp_path).keys()) == {u.key for u in kept}


def test_a_read_racing_a_compaction_finds_the_units_where_they_went(tmp_path, monkeypatch):
    """A compaction that moves a run while it is being read (its old segment tombstoned and
    gone) is neither a miss nor damage: the units are read again where they went."""
    store = _segment_store(tmp_path)
    units = make_units(list(range(64 * 4)))
    store.put_many(units)
    old = store.location(units[0].key).path
    real_read = store.layout.read
    compacted = []

    def read_after_a_compaction(locs, *a):
        if not compacted:
            compacted.append(True)
            store._rewrite_live([old])  # between the read's lookup and its read
        return real_read(locs, *a)

    monkeypatch.setattr(store.layout, "read", read_after_a_compaction)
    assert _read(store, units) == units
    assert not old.exists() and store.location(units[0].key).path != old
    assert (store.stats.corrupt, store.stats.misses, store.stats.hits) == (0, 0, len(units))
    store.check_integrity()


def test_a_tombstone_that_cannot_be_written_rewrites_its_segment(tmp_path, monkeypatch):
    """A removed unit must not come back after a restart: where its tombstone cannot be
    written, its segment is compacted without it."""
    store = _segment_store(tmp_path)
    units = make_units(list(range(64 * 8)))
    store.put_many(units)
    old = store.location(units[0].key).path
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(5, "I/O error")))
    store.remove(units[3].key)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    store.flush()
    assert not old.exists()
    store.close()
    again = _segment_store(tmp_path)
    assert units[3].key not in again and len(again) == 7


def test_an_empty_segment_is_deleted_with_its_last_unit(tmp_path):
    store = _segment_store(tmp_path)
    units = make_units(list(range(64 * 3)))
    store.put_many(units)
    path = store.location(units[0].key).path
    for u in units:
        store.remove(u.key)
    assert not path.exists() and len(store) == 0
    store.check_integrity()


def test_a_restart_that_evicts_compacts_once_the_scan_is_done(tmp_path, monkeypatch):
    """Evictions while the index is rebuilt (a smaller capacity) make a segment sparse before the
    scan has finished; its compaction starts once the scan is done (beside it, it raced the
    rebuild's bookkeeping), and the store stays consistent."""
    from cachedir.layout import SegmentFiles

    store = _segment_store(tmp_path)
    first, second, third = (make_units(list(range(s, s + 64 * 8))) for s in (0, 9000, 19000))
    for run in (first, second, third):
        store.put_many(run)
    store.close()
    real_records = SegmentFiles._records

    def slow_third(self, path, size, repair):  # the compaction runs while the scan is here
        if path.name.startswith("0000000000000002"):
            time.sleep(1.0)
        return real_records(self, path, size, repair)

    monkeypatch.setattr(SegmentFiles, "_records", slow_third)
    started_during_scan = []
    real_compact = UnitStore._compact_async
    monkeypatch.setattr(UnitStore, "_compact_async",
                        lambda self, paths: started_during_scan.append(self._rebuilding) or real_compact(self, paths))
    again = _segment_store(tmp_path, units=11)  # the second run evicts five of the first: sparse
    again.flush()  # the compaction
    assert started_during_scan and not any(started_during_scan)
    left = [u for u in first + second + third if u.key in again]
    assert len(left) == 11
    assert _read(again, left) == left
    again.check_integrity()


def test_small_segments_are_merged_and_nothing_is_lost(tmp_path):
    """Single puts (and replica pushes) write a segment each; small ones are merged, so their
    number stays bounded, and a restart finds every unit in the merged segments."""
    store = _segment_store(tmp_path, units=200, merge_min=4)
    units = make_units(list(range(64 * 30)))
    for u in units:
        assert store.put(u)
        store.check_integrity()
    store.flush()  # the merges under way
    assert len(_segment_files(tmp_path)) <= 4 < len(units)
    assert _read(store, units) == units
    store.check_integrity()
    store.close()
    again = _segment_store(tmp_path, units=200)
    assert set(again.keys()) == {u.key for u in units}
    again.check_integrity()


def test_merge_and_compaction_thresholds_come_from_the_config(tmp_path):
    merge_none = _segment_store(tmp_path / "a", merge_below=1e-9)  # no segment is small enough
    for u in make_units(list(range(64 * 20))):
        merge_none.put(u)
    merge_none.flush()
    assert len(_segment_files(tmp_path / "a")) == 20
    merge_none.close()
    assert (merge_none.layout.compact_below, merge_none.layout.merge_min) == (0.5, 16)
    store = _segment_store(tmp_path / "b", compact_below=0.25, merge_min=3)
    assert (store.layout.compact_below, store.layout.merge_min) == (0.25, 3)
    store.close()


@pytest.mark.parametrize("kw, message", [({"compact_below": 1.0}, "compact_below"), ({"compact_below": 0}, "compact_below"),
                                         ({"merge_below": 0}, "merge_below"), ({"merge_min": 1}, "merge_min")])
def test_bad_segment_thresholds_are_refused(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        StoreConfig(tmp_path, capacity_bytes=1 << 20, **kw)


def test_a_unit_removed_during_a_merge_stays_removed(tmp_path, monkeypatch):
    from cachedir.layout import SegmentFiles

    store = _segment_store(tmp_path, merge_min=4)
    units = make_units(list(range(64 * 4)))
    staging, go_on = threading.Event(), threading.Event()
    real_stage = SegmentFiles.stage

    def held_merge(self, items):
        if len(items) == 4:  # the merge's write (every put is one unit)
            staging.set()
            assert go_on.wait(10)
        return real_stage(self, items)

    monkeypatch.setattr(SegmentFiles, "stage", held_merge)
    for u in units:
        store.put(u)
    assert staging.wait(10)
    assert store.remove(units[2].key)
    go_on.set()
    store.flush()
    kept = [u for i, u in enumerate(units) if i != 2]
    assert len(_segment_files(tmp_path)) == 1 and units[2].key not in store
    assert _read(store, kept) == kept
    store.check_integrity()
    store.close()
    assert set(_segment_store(tmp_path).keys()) == {u.key for u in kept}


def test_a_merge_that_meets_a_damaged_unit_removes_and_counts_it(tmp_path):
    store = _segment_store(tmp_path, merge_min=4)
    units = make_units(list(range(64 * 4)))
    for u in units[:3]:
        store.put(u)
    flip_byte(store, units[1].key)
    store.put(units[3])  # the fourth small segment: the merge
    store.flush()
    kept = [u for i, u in enumerate(units) if i != 1]
    assert units[1].key not in store and store.stats.corrupt == 1
    assert len(_segment_files(tmp_path)) == 1
    assert _read(store, kept) == kept
    store.check_integrity()


def _record_fsyncs(monkeypatch) -> list[str]:
    """Every path fsynced from here on, in order (a directory's too)."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_what_is_acknowledged_or_removed_is_synced_to_its_directory(tmp_path, layout, monkeypatch):
    """A rename, an unlink or a tombstone survives a power loss only once the file and its
    directory are fsynced: a stored unit's directory entry, a removed unit's (evicted units came
    back after a power loss), a tombstone, and the pins file."""
    store = _store(tmp_path, layout)
    units = make_units(list(range(64 * 6)))
    synced = _record_fsyncs(monkeypatch)
    store.put(units[0])
    path = store.location(units[0].key).path
    data = [i for i, f in enumerate(synced) if f.startswith(str(path.parent / f".{path.name}."))]  # its temporary
    assert data and str(path.parent) in synced[data[0] + 1 :]  # the data, then (renamed) its name
    for u in units[1:]:
        store.put(u)
    synced.clear()
    where = store.location(units[1].key).path
    shared = any(store.location(u.key).path == where for u in units[2:])
    store.remove(units[1].key)
    store.flush()
    # a unit file's unlink, a segment's last record's (the segment goes), or a record's tombstone
    assert str(where if layout == "segment" and shared else where.parent) in synced
    synced.clear()
    store.pin([units[3].key])
    assert synced[-2:] == [str(tmp_path / "ssd" / "pinned.tmp"), str(tmp_path / "ssd")]
    store.close()


def test_new_directories_are_synced_into_their_parents(tmp_path, layout, monkeypatch):
    """A directory the store makes (its root, a unit file's two levels, the segments' folder)
    is an entry in its parent: without syncing the parent a power loss takes it, and the
    acknowledged units in it, away."""
    synced = _record_fsyncs(monkeypatch)
    store = _store(tmp_path, layout)
    assert str(tmp_path) in synced  # ssd/ made in tmp_path
    unit = make_units(list(range(64)))[0]
    store.put(unit)
    path = store.location(unit.key).path
    for made in ([path.parent.parent, path.parent] if layout == "unit" else [path.parent]):
        assert str(made.parent) in synced, made
    store.close()


@pytest.mark.security
def test_files_and_directories_of_an_older_looser_store_are_made_private(tmp_path, layout):
    store = _store(tmp_path, layout)
    units = make_units(list(range(64 * 3)))
    for u in units:
        store.put(u)
    store.pin([units[0].key])
    store.close()
    root = tmp_path / "ssd"
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    again = _store(tmp_path, layout)
    assert all(p.stat().st_mode & 0o077 == 0 for p in [root, *root.rglob("*")])
    assert _read(again, units) == units
    again.close()


def test_one_store_per_directory(tmp_path, layout):
    from cachedir.store import StoreLocked

    store = _store(tmp_path, layout)
    with pytest.raises(StoreLocked, match=f"in use by another store \\(pid {os.getpid()}\\)"):
        _store(tmp_path, layout)
    code = ("import sys; from cachedir.store import StoreConfig, StoreLocked, UnitStore\n"
            f"try: UnitStore(StoreConfig({str(tmp_path / 'ssd')!r}, 1 << 20))\n"
            "except StoreLocked as e: print(e); sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and f"pid {os.getpid()}" in r.stdout  # another process too
    store.close()
    _store(tmp_path, layout).close()  # free again once closed


def test_the_write_queue_is_bounded_by_bytes(tmp_path, monkeypatch):
    """A disk slower than the units arriving drops units (each a later miss) instead of
    growing the queue without bound."""
    units = make_units(list(range(64 * 6)))
    size = len(units[0].payload)
    store = _store(tmp_path, "segment", io_threads=1, queue_bytes=2 * size)
    entered, release = threading.Event(), threading.Event()
    real = store.put_many

    def slow(batch):
        entered.set()
        release.wait(30)
        return real(batch)

    monkeypatch.setattr(store, "put_many", slow)
    first = store.put_many_async(units[:1])
    assert entered.wait(30)  # the I/O thread holds unit 0; the queue is empty again
    rest = store.put_many_async(units[1:])
    assert [f.done() and not f.result() for f in rest] == [False, False, True, True, True]
    assert store.stats.queue_full == 3
    release.set()
    assert first[0].result(30) and all(f.result(30) for f in rest[:2])
    assert len(store) == 3
    store.close()
