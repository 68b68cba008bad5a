"""The fault matrix on a simulated 3-node Ray cluster serving through HTTP under a request stream
(shared and unique prefixes): Redis killed and restarted empty, a cache agent crashing, a node
removed from the cluster. For every fault each request succeeds (or gets a retryable 503 with
Retry-After), every generated token equals the reference, and no unit the cache acknowledged is
lost unless its node is gone.

Also here: unit (segment) files bit-flipped, truncated and deleted under the stream; a node's disk filling
up (a 192 KiB tmpfs mounted over its cache directory); a "node" in the directory whose gRPC agent
serves garbage or hangs. Elsewhere: a replica killed mid-decode (tests/actors/test_tidal.py), an
expert shard killed (tests/actors/test_ep.py), a slow disk and a writer killed mid-write
(tests/cluster/test_engine_faults.py, tests/cachedir/test_store.py), garbage peers in detail
(tests/cachedir/test_agent.py)."""

from __future__ import annotations

import os
import random
import signal
import time

import httpx
import pytest

from deploy.connect import alive_actors
from model.checkpoint import load_model
from model.generate import generate
from tests.actors.tidal_streams import ClientThreads

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow, pytest.mark.fault]
CHECKPOINT_SEED = 17  # the weights of the `checkpoint` fixture (tests/actors/conftest.py)

MAX_TOKENS = 6
NAMESPACE = "faults-test"


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy text of a prompt as the model alone computes it (memoized)."""
    from model.tokenizer import load_tokenizer

    model, tok, memo = load_model(checkpoint), load_tokenizer(checkpoint), {}

    def text(prompt: tuple[int, ...]) -> str:
        if prompt not in memo:
            memo[prompt] = tok.decode(generate(model, list(prompt), MAX_TOKENS, eos_id=None))
        return memo[prompt]

    return text


@pytest.fixture(scope="module")
def app(three_nodes, redis_server, checkpoint, tmp_path_factory):
    from deploy.app import build_app
    from tests.shared_ray import serving

    home = tmp_path_factory.mktemp("faults")
    # no RAM tier and no prefix sharing in the replicas: every prefix hit reads the unit files
    # (a repeated prompt goes back to its replica, whose pages would otherwise serve it)
    args = {"checkpoint": str(checkpoint), "replicas": 2, "replica_cpus": 1, "max_replicas_per_node": 1,
            "num_pages": 256, "ram_mb": 0, "prefix_sharing": False, "cache_dir": str(home / "cache" / "{node}"),
            "usage_dir": str(home / "usage"), "directory_url": redis_server.url,
            "directory_namespace": NAMESPACE}
    # One HTTP proxy and the ingress on the head: the simulated nodes share 127.0.0.1, so proxies
    # on every node would share the port and a removed node's dying proxy would answer some
    # requests; an ingress on the removed node would take its requests down with it. The fault
    # under test is losing a serving node (its replica and cache agent).
    with serving(build_app(args), 300) as url:
        yield url, three_nodes.cluster, list(three_nodes.cluster.worker_nodes), home


@pytest.fixture(scope="module")
def directory(redis_server):
    from cachedir.directory import open_directory

    return open_directory(redis_server.url, NAMESPACE)


@pytest.fixture(scope="module")
def unit_keys(checkpoint):
    import torch

    from cachedir.hashing import chain_keys
    from cluster.request import UNIT_TOKENS, cache_namespace
    from model.config import load_config
    from model.weights_id import weights_digest

    seed = cache_namespace(load_config(checkpoint), weights_digest(checkpoint), torch.float32).seed
    return lambda prompt: chain_keys(seed, list(prompt), UNIT_TOKENS, max_units=(len(prompt) - 1) // UNIT_TOKENS)


def _prompt(seed: int, units: int = 3, shared: int = 0) -> tuple[int, ...]:
    """``units`` whole units and 4 more tokens; the first ``shared`` units are common to all seeds."""
    common, own = random.Random("shared"), random.Random(seed)
    body = [(common if i < shared * 64 else own).randrange(3, 253) for i in range(64 * units + 4)]
    return (256, *body)


def _complete(client: httpx.Client, url: str, prompt) -> httpx.Response:
    return client.post(f"{url}/v1/completions", json={
        "model": "tiny", "prompt": list(prompt), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})


class Stream(ClientThreads):
    """Two clients sending a mix of repeated, shared-prefix and unique prompts until stopped."""

    def __init__(self, url: str, seed: int) -> None:
        super().__init__()
        self.url, self.seed = url, seed
        self.results: list[tuple[tuple[int, ...], int, str, str | None]] = []  # prompt, status, text, Retry-After

    def _run(self, worker: int) -> None:
        i = 0
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                i += 1
                kind = i % 3
                prompt = (_prompt(self.seed) if kind == 0 else  # repeated: cache hits
                          _prompt(self.seed * 1000 + worker * 100 + i, shared=2) if kind == 1 else
                          _prompt(self.seed * 1000 + worker * 100 + i, units=1))
                try:
                    r = _complete(client, self.url, prompt)
                except httpx.HTTPError as e:
                    self.results.append((prompt, 0, repr(e), None))
                    continue
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                self.results.append((prompt, r.status_code, text, r.headers.get("retry-after")))

    def wait_more(self, n: int, timeout_s: float = 120.0) -> None:
        """Until ``n`` more requests came back (answered during whatever happens meanwhile)."""
        target = len(self.results) + n
        _wait(lambda: len(self.results) >= target, timeout_s, f"{n} more answers", show=lambda: len(self.results))

    def check(self, reference) -> int:
        """Every request succeeded (or got a 503 with Retry-After) with the reference text."""
        failed = [(s, t[:300]) for _, s, t, retry in self.results if s != 200 and not (s == 503 and retry)]
        assert failed == [], failed
        wrong = [p for p, s, t, _ in self.results if s == 200 and t != reference(p)]
        assert wrong == [], (f"{len(wrong)} wrong outputs of {len(self.results)}, e.g. prompt {wrong[0]}: "
                             f"{[t for p, _, t, _ in self.results if p == wrong[0]]} != {reference(wrong[0])!r}")
        ok = sum(s == 200 for _, s, _, _ in self.results)
        assert ok >= 4, self.results
        return ok


def _wait(cond, timeout_s: float, what: str, show=None):
    """``cond()`` once truthy; on timeout the message includes ``show()`` (the state seen last)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}" + (f"; last seen: {show()}" if show else ""))


def _holders(directory, keys) -> list[set[str]]:
    from cachedir.directory.base import DirectoryUnavailable

    try:
        return [{h.node_id for h in hs} for hs in directory.longest_prefix(keys).holders]
    except DirectoryUnavailable:
        return []


def _warm(url, prompt, reference) -> dict:
    with httpx.Client(timeout=300) as client:
        r = _complete(client, url, prompt)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference(prompt)
    return r.json()["usage"]


def test_redis_killed_then_restarted_empty_under_a_stream(app, redis_server, directory, unit_keys, reference):
    url, *_ = app
    warm = _prompt(1)
    _warm(url, warm, reference)
    keys = unit_keys(warm)
    before = _wait(lambda: (h := _holders(directory, keys)) and len(h) == 3 and h, 20, "the units in the directory")
    with Stream(url, seed=1) as stream:
        stream.wait_more(2)
        redis_server.kill()  # lookups and registrations fail: local units only, requests go on
        stream.wait_more(4)
        redis_server.start()  # empty, same address: every node re-registers what it holds
        # nodes re-register independently: wait until every earlier holder is back, not just one
        after = _wait(lambda: (h := _holders(directory, keys)) and len(h) == 3
                      and all(a >= b for a, b in zip(h, before, strict=True)) and h,
                      30, "re-registration by every holder", show=lambda: (_holders(directory, keys), before))
        stream.wait_more(2)
    stream.check(reference)
    assert all(a >= b for a, b in zip(after, before, strict=True))  # nothing acknowledged was lost
    assert _warm(url, warm, reference)["prompt_cache_hit_tokens"] == 3 * 64  # hits are back


def _actor_pid(name_part: str, node_id: str) -> int | None:
    for a in alive_actors(detail=True):
        if a.node_id == node_id and name_part in ((a.class_name or "") + (a.name or "")):
            return a.pid
    return None


def test_a_cache_agent_crash_under_a_stream(app, directory, unit_keys, reference):
    url, *_ = app
    warm = _prompt(2)
    _warm(url, warm, reference)
    keys = unit_keys(warm)
    held = _wait(lambda: (h := _holders(directory, keys)) and len(h) == 3 and set.intersection(*h), 20, "the units",
                 show=lambda: (_holders(directory, keys), {n: _agent_stats(n) for n in _llm_nodes()}))
    holder = next(iter(held))  # a node that holds all three units
    with Stream(url, seed=2) as stream:
        stream.wait_more(2)
        pid = _actor_pid("CacheAgent", holder)
        os.kill(pid, signal.SIGKILL)  # Ray restarts it; it rebuilds its index from its files
        _wait(lambda: _actor_pid("CacheAgent", holder) != pid, 60, "the agent to restart")
        stream.wait_more(2)
    stream.check(reference)
    # the restarted agent found its units on disk and published them again
    _wait(lambda: (h := _holders(directory, keys)) and len(h) == 3 and all(holder in x for x in h), 30,
          "the restarted agent's units in the directory again")
    # every replica hits again, the one beside the restarted agent too (it listens on a new port,
    # which that replica's client finds again: actors.cache_agent.NodeAgentClient)
    usages = [_warm(url, warm, reference) for _ in range(3)]
    assert [u["prompt_cache_hit_tokens"] for u in usages] == [3 * 64] * 3, [u["prompt_cache_accounting"] for u in usages]


def _agent_stats(node_id: str) -> dict:
    import ray

    from actors.cache_agent import NAMESPACE, agent_name

    return ray.get(ray.get_actor(agent_name(node_id), namespace=NAMESPACE).stats.remote(), timeout=60)


def test_unit_files_damaged_under_a_stream(app, reference):
    url, *_, home = app
    warm = _prompt(4)
    _warm(url, warm, reference)
    nodes = _llm_nodes()

    def failed_reads() -> int:  # reads of indexed units that were damaged (corrupt) or gone (a miss)
        return sum(_agent_stats(n)["ssd_corrupt"] + _agent_stats(n)["ssd_misses"] for n in nodes)

    before = failed_reads()
    with Stream(url, seed=4) as stream:
        stream.wait_more(2)
        files = sorted(p for p in (home / "cache").rglob("*") if p.suffix in (".unit", ".seg"))  # either layout
        assert files
        for i, f in enumerate(files):
            try:
                data = bytearray(f.read_bytes())
                if i % 3 == 0:
                    for at in range(len(data) - 10, 0, -1024):  # a bit flip in every record a segment holds
                        data[at] ^= 0xFF
                    f.write_bytes(bytes(data))
                elif i % 3 == 1:
                    f.write_bytes(bytes(data[: len(data) // 2]))  # truncated
                else:
                    f.unlink()  # deleted under the reader
            except FileNotFoundError:
                continue  # evicted or replaced meanwhile
        stream.wait_more(6)  # requests read the damaged files
    stream.check(reference)
    # the repeated prompt's units were read again, whichever damage their file got: caught, counted
    assert failed_reads() > before
    _warm(url, warm, reference)


@pytest.fixture
def full_disk(app):
    """A 192 KiB tmpfs mounted over one replica node's cache directory: its agent's index still
    lists the hidden units (reads miss) and new writes fail with ENOSPC once two units are in."""
    import subprocess

    from actors.cache_agent import node_cache_dir

    url, *_, home = app
    node = sorted(_llm_nodes())[0]
    root = node_cache_dir(str(home / "cache" / "{node}"), node)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(root)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    yield node
    subprocess.run(["umount", "-l", str(root)], check=False)


def test_a_full_disk_under_a_stream(app, full_disk, reference):
    url, *_ = app
    errors_before = _agent_stats(full_disk)["ssd_write_errors"]
    with Stream(url, seed=5) as stream:
        stream.wait_more(2)
        # until the full node has had new units to write (the router decides which node computes)
        _wait(lambda: _agent_stats(full_disk)["ssd_write_errors"] > errors_before, 90,
              "a write on the full disk to fail and be counted", show=lambda: _agent_stats(full_disk))
        stream.wait_more(2)  # and serving goes on after it
    stream.check(reference)


def _bad_peer(kind: str):
    """A 'node' that is not a real cache agent: it serves garbage (a gRPC server whose Fetch
    returns random bytes) or accepts connections and never answers."""
    from tests.cachedir.test_agent import _lying_peer, _tcp_peer

    return _lying_peer() if kind == "garbage" else _tcp_peer(noise=False)


@pytest.mark.parametrize("kind", ["garbage", "hanging"])
def test_a_garbage_or_hanging_peer_in_the_directory(app, directory, unit_keys, reference, kind):
    """The directory says a bad peer holds every unit of the stream's repeated prompt: replicas
    fetch from it, get nothing usable within bounded timeouts, and compute instead."""
    url, *_ = app
    address, close = _bad_peer(kind)
    repeated = _prompt(6 if kind == "garbage" else 7)
    try:
        directory.heartbeat(f"bad-{kind}", address, 60)
        directory.register(f"bad-{kind}", unit_keys(repeated))
        # only the bad peer holds it: computed, same text. The wait it costs is bounded by the
        # client's timeout and the peer is then avoided (counted in tests/cachedir/test_agent.py:
        # one call, no retry, a suspect); after the garbage peer's slow "loads" the router may
        # also decline to load from the hanging one at all
        usage = _warm(url, repeated, reference)
        assert usage["prompt_cache_hit_tokens"] == 0
        with Stream(url, seed=6 if kind == "garbage" else 7) as stream:
            stream.wait_more(6)
        stream.check(reference)
    finally:
        directory.unregister(f"bad-{kind}", unit_keys(repeated))
        close()


def test_a_node_removed_under_a_stream(app, directory, unit_keys, reference):
    """Last in the module: the cluster is one node smaller afterwards (until the shared Ray
    puts a node back)."""
    url, cluster, workers, _ = app
    replica_nodes = {_node_of(w) for w in workers} & _llm_nodes()
    assert replica_nodes, "no replica on a worker node"
    gone = next(w for w in workers if _node_of(w) in replica_nodes)
    gone_id = _node_of(gone)
    with Stream(url, seed=3) as stream:
        stream.wait_more(3)
        cluster.remove_node(gone)
        stream.wait_more(4)  # answered while Serve notices: by the replica left, or continued there
        _wait(lambda: len(nodes := _llm_nodes()) == 2 and gone_id not in nodes, 120, "Serve to replace the replica",
              show=_llm_nodes)
        stream.wait_more(2)
    stream.check(reference)
    warm = _prompt(3)  # its units may have lived on the removed node: lookups forget that node
    _wait(lambda: all(gone_id not in h for h in _holders(directory, unit_keys(warm))), 30, "the node to leave lookups")
    _warm(url, warm, reference)


def _node_of(node) -> str:
    return node.node_id


def _llm_nodes() -> set[str]:
    return {a.node_id for a in alive_actors()
            if "LLMServer" in (a.class_name or "") + (a.name or "")}
