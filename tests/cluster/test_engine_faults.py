"""The engine while its cache's disk fails: full (a real 320 KiB tmpfs), slow (loads time out and
the prompt is computed), unit files deleted or truncated while a request reads them. Every output
equals the reference, and every unit the store acknowledged is still readable.

Part of the fault matrix (issue 9); the cluster-level faults are in tests/actors/test_faults.py."""

from __future__ import annotations

import subprocess
import time

import pytest

from cachedir.hashing import chain_keys
from cachedir.node_cache import CacheConfig, NodeCache
from cachedir.store import StoreConfig, UnitStore
from cluster.request import GenerationRequest
from tests.cluster.test_engine import _engine, _ns, _prompt, _ref, _tokens, model  # noqa: F401 - fixture

pytestmark = pytest.mark.fault


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of 320 KiB: room for three units of the tiny model (~82 KB each)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _run(model, cache, prompt, n=8, **cfg):  # noqa: F811 - model is the fixture's value
    eng = _engine(model, cache, **cfg)
    eng.add_request(GenerationRequest("r", prompt, n))
    out = eng.run_to_completion()["r"]
    return eng, _tokens(out), out[-1]


def test_disk_full_skips_persistence_and_serving_continues(model, small_disk):  # noqa: F811
    cache = NodeCache(CacheConfig(StoreConfig(small_disk / "ssd", capacity_bytes=1 << 30), ram_bytes=0))
    prompts = [_prompt(300, 100 + i) for i in range(4)]  # 4 units each: 16 units, the disk holds 3
    for p in prompts:
        _, tokens, _ = _run(model, cache, p)
        assert tokens == _ref(model, p, 8)
        cache.flush()
    stats = cache.ssd.stats
    assert stats.write_errors > 0 and 0 < stats.writes < 16  # skipped and counted, not raised
    assert not [p for p in small_disk.rglob("*") if p.name.endswith(".tmp")]  # no partial leftovers
    cache.ssd.check_integrity()
    # every acknowledged unit is intact, and its prompt is served from it again
    stored = set(cache.ssd.keys())
    assert stored
    first_with_units = next(p for p in prompts if chain_keys(_ns(model).seed, p, 64)[0] in stored)
    _, tokens, last = _run(model, cache, first_with_units)
    assert tokens == _ref(model, first_with_units, 8) and last.cached_tokens >= 64


def test_a_slow_disk_times_out_to_compute(model, tmp_path, monkeypatch):  # noqa: F811
    cache = NodeCache(CacheConfig(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30), ram_bytes=0))
    prompt = _prompt(300, 7)
    want = _ref(model, prompt, 8)
    _, tokens, _ = _run(model, cache, prompt)
    cache.flush()
    assert tokens == want
    slow_get = UnitStore.get

    def slow(self, *a, **k):
        time.sleep(2.0)  # a disk that takes 2 s per unit read
        return slow_get(self, *a, **k)

    monkeypatch.setattr(UnitStore, "get", slow)
    t0 = time.monotonic()
    eng, tokens, last = _run(model, cache, prompt, load_timeout_s=0.3)
    assert tokens == want and last.cached_tokens == 0 and eng.stats["load_failures"] == 1
    assert time.monotonic() - t0 < 1.9  # did not wait for the disk
    monkeypatch.setattr(UnitStore, "get", slow_get)
    time.sleep(2.5)  # the abandoned reads finish in the background; the units are still there
    _, tokens, last = _run(model, cache, prompt)
    assert tokens == want and last.cached_tokens == 4 * 64


def test_unit_files_deleted_or_truncated_under_a_reader(model, tmp_path, monkeypatch):  # noqa: F811
    cache = NodeCache(CacheConfig(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30), ram_bytes=0))
    prompt = _prompt(300, 9)
    want = _ref(model, prompt, 8)
    _run(model, cache, prompt)
    cache.flush()
    keys = chain_keys(_ns(model).seed, prompt, 64)
    real_get = UnitStore.get

    def racing(self, key, *a, **k):
        # the file goes away (unit 1) or is cut short (unit 2) after the index said it is there
        if key == keys[1]:
            self.path(key).unlink()
        elif key == keys[2]:
            path = self.path(key)
            path.write_bytes(path.read_bytes()[:1000])
        return real_get(self, key, *a, **k)

    monkeypatch.setattr(UnitStore, "get", racing)
    _, tokens, last = _run(model, cache, prompt)
    assert tokens == want and last.cached_tokens == 64  # only the unit before the damage
    assert cache.ssd.stats.corrupt == 1  # the truncated file; the deleted one is a plain miss
    monkeypatch.setattr(UnitStore, "get", real_get)
    cache.flush()  # the recomputed units were persisted again, whole
    cache.ssd.check_integrity()
    _, tokens, last = _run(model, cache, prompt)
    assert tokens == want and last.cached_tokens == 4 * 64
