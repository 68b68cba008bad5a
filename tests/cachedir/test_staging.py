"""Staging buffers: a buffer is reused only once nothing refers to it, and the store's reads go
through them without ever changing a unit a caller still holds."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from cachedir.node_cache import CacheConfig, NodeCache
from cachedir.staging import StagingBuffers
from cachedir.store import StoreConfig, UnitStore
from tests.cachedir.units import NS, make_units

MIB = 1 << 20


def test_a_buffer_is_reused_only_when_nothing_refers_to_it():
    pool = StagingBuffers(8 * MIB)
    a = pool.take(3 * MIB)
    assert len(a) == 3 * MIB and not a.readonly
    a[:4] = b"abcd"
    b = pool.take(3 * MIB)  # `a` is in use: another buffer
    assert (pool.allocated, pool.reused) == (2, 0)
    b[:4] = b"wxyz"
    assert bytes(a[:4]) == b"abcd"
    del a
    c = pool.take(3 * MIB - 1000)  # same size class (3 MiB): the freed one
    assert (pool.allocated, pool.reused) == (2, 1) and bytes(c[:4]) == b"abcd"
    assert pool.in_use() == 2


@pytest.mark.parametrize("derive", ["slice", "numpy", "torch"])
def test_anything_made_from_a_buffer_keeps_it_in_use(derive):
    pool = StagingBuffers(4 * MIB)
    view = pool.take(MIB)
    view[:8] = b"12345678"
    kept = {
        "slice": lambda v: v[2:6],
        "numpy": lambda v: np.frombuffer(v, dtype=np.uint8),
        "torch": lambda v: torch.frombuffer(v, dtype=torch.uint8),
    }[derive](view)
    del view
    other = pool.take(MIB)
    other[:8] = b"--------"
    assert pool.allocated == 2 and pool.reused == 0
    assert bytes(memoryview(np.asarray(kept)).cast("B")[:4]) in (b"3456", b"1234")
    del kept, other
    pool.take(MIB)
    assert pool.reused == 1


def test_over_budget_a_read_gets_its_own_buffer_and_free_buffers_of_other_sizes_make_room():
    pool = StagingBuffers(4 * MIB)
    held = pool.take(3 * MIB)
    extra = pool.take(2 * MIB)  # 3 + 2 > 4: not pooled
    assert pool.unpooled == 1 and pool.pooled_bytes == 3 * MIB and len(extra) == 2 * MIB
    del held
    pool.take(2 * MIB)  # the free 3 MiB buffer is dropped to make room
    assert pool.pooled_bytes == 2 * MIB and pool.allocated == 2
    with pytest.raises(ValueError, match="staging capacity"):
        StagingBuffers(-1)


def _store(tmp_path: Path, **kw) -> UnitStore:
    return UnitStore(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30, io_threads=2, **kw))


def _run(store: UnitStore, units):
    return store.get_many_async([u.key for u in units], NS.seed, [u.token_ids for u in units]).result()


@pytest.mark.parametrize("layout", ["unit", "segment"])
def test_units_held_by_a_caller_never_change_while_reads_reuse_the_buffers(tmp_path, layout):
    store = _store(tmp_path, layout=layout, staging_bytes=12 * MIB)  # more than `held` takes
    first, second = make_units(list(range(64 * 8)), seed=1), make_units(list(range(1, 64 * 8 + 1)), seed=2)
    for f in store.put_many_async(first) + store.put_many_async(second):
        assert f.result()
    held = _run(store, first)
    for _ in range(5):
        assert _run(store, second) == second  # the pool's free buffers, again and again
    assert store.staging.reused > 0
    assert [bytes(u.payload) for u in held] == [u.payload for u in first]
    store.close()


def test_a_released_read_frees_its_buffers_without_the_garbage_collector(tmp_path):
    # The group futures of a read and its completion callback refer to each other; if that
    # cycle held the units, their buffers would stay in use until a collection.
    store = _store(tmp_path)
    units = make_units(list(range(64 * 8)))
    for f in store.put_many_async(units):
        assert f.result()
    gc.disable()
    try:
        got = _run(store, units)
        assert store.staging.in_use() > 0
        del got
        assert store.staging.in_use() == 0
    finally:
        gc.enable()
        store.close()


def test_the_ram_tier_keeps_its_own_copy_of_a_unit_read_from_ssd(tmp_path):
    cache = NodeCache(CacheConfig(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30), ram_bytes=1 << 30))
    units = make_units(list(range(64 * 4)))
    for f in cache.ssd.put_many_async(units):
        assert f.result()
    loaded = cache.load_async([u.key for u in units], NS.seed, [u.token_ids for u in units]).result()
    assert [r.tier for r in loaded] == ["ssd"] * 4
    del loaded
    assert cache.ssd.staging.in_use() == 0  # promoted units do not pin the read buffer
    again = cache.load_async([u.key for u in units], NS.seed, [u.token_ids for u in units]).result()
    assert [r.tier for r in again] == ["ram"] * 4 and [r.unit for r in again] == units
    assert all(isinstance(r.unit.payload, bytes) for r in again)
    cache.close()


def test_segment_reads_share_a_descriptor_that_goes_with_the_segment(tmp_path):
    store = _store(tmp_path)
    units = make_units(list(range(64 * 4)))
    for f in store.put_many_async(units):
        assert f.result()
    path = store.location(units[0].key).path

    def open_on_it() -> int:
        return sum(os.readlink(f"/proc/self/fd/{fd}").startswith(str(path))
                   for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))

    for _ in range(3):
        assert _run(store, units) == units
    assert open_on_it() == 1
    for u in units:
        store.remove(u.key)
    assert not path.exists() and open_on_it() == 0  # its disk space is given back
    store.close()
