"""The engine while its cache's disk fails: full (a real 320 KiB tmpfs), slow (loads time out and
the prompt is computed), unit files deleted or truncated while a request reads them. Every output
equals the reference, and every unit the store acknowledged is still readable.

Part of the fault matrix (issue 9); the cluster-level faults are in tests/actors/test_faults.py."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from cachedir.hashing import chain_keys
from cachedir.layout import SegmentFiles, UnitFiles
from cachedir.node_cache import CacheConfig, NodeCache
from cachedir.store import StoreConfig
from cluster.request import GenerationRequest
from tests.cluster.test_engine import _engine, _ns, _prompt, _ref, _tokens

pytestmark = pytest.mark.fault


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of 480 KiB: room for five units of the tiny model (~82 KB each), or one
    segment of a 4-unit run."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=480k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _run(model, cache, prompt, n=8, **cfg):  # noqa: F811 - model is the fixture's value
    eng = _engine(model, cache, **cfg)
    eng.add_request(GenerationRequest("r", prompt, n))
    out = eng.run_to_completion()["r"]
    return eng, _tokens(out), out[-1]


@pytest.mark.parametrize("layout", ["segment", "unit"])
def test_disk_full_skips_persistence_and_serving_continues(model, small_disk, layout):  # noqa: F811
    cache = NodeCache(CacheConfig(StoreConfig(small_disk / "ssd", capacity_bytes=1 << 30, layout=layout), ram_bytes=0))
    prompts = [_prompt(300, 100 + i) for i in range(4)]  # 4 units each: 16 units, the disk holds 5
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
    layout = type(cache.ssd.layout)
    real_read = layout.read
    disk, done = threading.Event(), []

    def slow(self, *a, **k):  # a disk that answers only once the test lets it
        disk.wait(60)
        done.append(True)
        return real_read(self, *a, **k)

    monkeypatch.setattr(layout, "read", slow)
    eng, tokens, last = _run(model, cache, prompt, load_timeout_s=0.3)
    assert tokens == want and last.cached_tokens == 0 and eng.stats["load_failures"] == 1
    assert done == []  # it computed while the read was still waiting: it did not wait for the disk
    monkeypatch.setattr(layout, "read", real_read)
    disk.set()  # the abandoned reads finish in the background; the units are still there
    deadline = time.monotonic() + 60
    while not done and time.monotonic() < deadline:
        time.sleep(0.05)
    _, tokens, last = _run(model, cache, prompt)
    assert tokens == want and last.cached_tokens == 4 * 64


def test_unit_files_deleted_or_truncated_under_a_reader(model, tmp_path, monkeypatch):  # noqa: F811
    cache = NodeCache(CacheConfig(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30, layout="unit"), ram_bytes=0))
    prompt = _prompt(300, 9)
    want = _ref(model, prompt, 8)
    _run(model, cache, prompt)
    cache.flush()
    keys = chain_keys(_ns(model).seed, prompt, 64)
    real_read = UnitFiles.read

    def racing(self, locs, *a):
        # the file goes away (unit 1) or is cut short (unit 2) after the index said it is there
        if locs[0].path == self.path(keys[1]):
            locs[0].path.unlink()
        elif locs[0].path == self.path(keys[2]):
            locs[0].path.write_bytes(locs[0].path.read_bytes()[:1000])
        return real_read(self, locs, *a)

    monkeypatch.setattr(UnitFiles, "read", racing)
    _, tokens, last = _run(model, cache, prompt)
    assert tokens == want and last.cached_tokens == 64  # only the unit before the damage
    assert cache.ssd.stats.corrupt == 1  # the truncated file; the deleted one is a plain miss
    monkeypatch.setattr(UnitFiles, "read", real_read)
    cache.flush()  # the recomputed units were persisted again, whole
    cache.ssd.check_integrity()
    _, tokens, last = _run(model, cache, prompt)
    assert tokens == want and last.cached_tokens == 4 * 64


def test_a_segment_cut_short_under_a_reader(model, tmp_path, monkeypatch):  # noqa: F811
    cache = NodeCache(CacheConfig(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30, layout="segment"), ram_bytes=0))
    prompt = _prompt(300, 11)
    want = _ref(model, prompt, 8)
    _run(model, cache, prompt)
    cache.flush()
    keys = chain_keys(_ns(model).seed, prompt, 64)
    cut = cache.ssd.location(keys[2])
    assert {cache.ssd.location(k).path for k in keys[:4]} == {cut.path}  # the run is one segment
    real_read = SegmentFiles.read

    def racing(self, locs, *a):  # the segment is cut inside unit 2 after the index said it is whole
        with open(cut.path, "r+b") as f:
            f.truncate(cut.offset + 1000)
        return real_read(self, locs, *a)

    monkeypatch.setattr(SegmentFiles, "read", racing)
    _, tokens, last = _run(model, cache, prompt)
    assert tokens == want and last.cached_tokens == 2 * 64  # the units before the cut
    assert cache.ssd.stats.corrupt == 2
    monkeypatch.setattr(SegmentFiles, "read", real_read)
    cache.flush()
    cache.ssd.check_integrity()
    _, tokens, last = _run(model, cache, prompt)
    assert tokens == want and last.cached_tokens == 4 * 64


@pytest.mark.redis
def test_a_directory_primary_killed_between_and_under_requests(model, tmp_path):  # noqa: F811
    """Two nodes with cache agents share a Redis Cluster directory; node B serves prompts whose
    units node A computed (remote hits). A primary of the cluster dies: B's requests go on with
    the reference tokens, as misses while the slot map is broken, and hit remotely again once the
    replica took over and A registered its units again."""
    import os
    import signal

    from cachedir.agent.client import AgentClient
    from cachedir.agent.cluster_cache import ClusterCache
    from cachedir.agent.node_agent import AgentConfig, NodeAgent
    from cachedir.agent.service import ServerConfig
    from cachedir.directory import open_directory
    from deploy.redis_proc import RedisClusterServer

    servers = RedisClusterServer(tmp_path / "redis").start()
    agents, caches = [], []
    try:
        def node(name):
            directory = open_directory(servers.url, "engine-failover", timeout_s=0.3)
            agent = NodeAgent(AgentConfig(name, CacheConfig(StoreConfig(tmp_path / name, 1 << 30, fsync=False),
                                                            ram_bytes=0), ServerConfig(host="127.0.0.1"),
                                          heartbeat_ttl_s=30, sync_every_s=0.2, replication=None), directory)
            cache = ClusterCache(name, AgentClient(agent.address), directory, AgentClient)
            agents.append(agent)
            caches.append(cache)
            return cache

        a, b = node("node-a"), node("node-b")
        remote = [_prompt(64 * 3 + 5, 100 + i) for i in range(8)]  # computed by A; B never computes them
        for p in remote:
            _run(model, a, p, n=4)
        a.flush()
        directory = agents[0].publisher.directory
        deadline = time.monotonic() + 30
        while any(len(directory.longest_prefix(chain_keys(_ns(model).seed, list(p), 64, max_units=3)).holders) < 3
                  for p in remote):
            assert time.monotonic() < deadline, "node A's units never reached the directory"
            time.sleep(0.1)

        def serve(prompt) -> int:
            """B serves ``prompt``: the reference tokens always; returns its cached tokens."""
            _, tokens, last = _run(model, b, prompt, n=4)
            assert tokens == _ref(model, prompt, 4)
            return last.cached_tokens

        assert serve(remote[0]) == 3 * 64  # from A's agent

        victim = servers.primary_of("tide:{engine-failover}:expiry")  # the node table's: every lookup reads it
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        victim.proc = None
        assert [serve(remote[i]) for i in (1, 2)] == [0, 0]  # at once: the lookups fail, B computes
        unseen = iter(remote[3:])
        deadline = time.monotonic() + 60
        while agents[0].publisher.resyncs < 1:  # the new primary: A registers everything again
            assert time.monotonic() < deadline, "node A never registered its units again"
            serve(_prompt(64 + 7, int(time.monotonic() * 1000)))  # meanwhile B serves new prompts
        for prompt in unseen:  # and B finds A's units again
            keys = chain_keys(_ns(model).seed, list(prompt), 64, max_units=3)
            while len(directory.longest_prefix(keys).holders) < 3:  # A registers them (B serves in ms)
                assert time.monotonic() < deadline, "node A's units never came back to the directory"
                time.sleep(0.1)
            if (hit := serve(prompt)) == 3 * 64:
                break
            time.sleep(0.5)  # B's directory client may not have found the new primary yet
        else:
            pytest.fail(f"no remote hit within the prompts never served (last {hit})")
    finally:
        for c in caches:
            c.close()
        for agent in agents:
            agent.close()
        servers.kill()
