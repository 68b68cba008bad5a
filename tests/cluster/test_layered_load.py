"""A prefix loaded layer by layer while the suffix computes (``cachedir/layered.py``,
``cluster/layer_feed.py``): the pass reads each layer only after it arrived, the tokens equal the
model alone, and a unit that changes, shrinks or belongs to another namespace under the read makes
the engine throw the pass away and compute the prompt: a miss, never wrong tokens."""

from __future__ import annotations

import os

import pytest

from cachedir.agent.client import AgentClient
from cachedir.agent.cluster_cache import ClusterCache
from cachedir.agent.node_agent import AgentConfig, NodeAgent
from cachedir.agent.service import ServerConfig
from cachedir.directory.memory import MemoryDirectory
from cachedir.hashing import Namespace, chain_keys
from cachedir.node_cache import CacheConfig
from cachedir.store import StoreConfig
from cluster.engine import Engine, EngineConfig
from cluster.request import GenerationRequest
from model.tokenizer import ByteTokenizer
from tests.cluster.test_engine import _prompt, _ref, _tokens

SECRET = b"layered-load-test-secret-0123456"
PROMPT_UNITS = 3


@pytest.fixture(params=[True, False], ids=["sealed", "plain"])
def node(request, tmp_path, model):
    """A node's agent holding the units of a prompt this node computed, and the namespace."""
    secret = SECRET if request.param else b""
    ns = Namespace(model.cfg.fingerprint(), "test", "float32", "latent", 64, secret=secret)
    directory = MemoryDirectory("layered")
    agent = NodeAgent(AgentConfig("node-a", CacheConfig(StoreConfig(tmp_path / "a", 1 << 30, fsync=False),
                                                        ram_bytes=0),
                                  ServerConfig(host="127.0.0.1"), heartbeat_ttl_s=30, sync_every_s=3600,
                                  replication=None), directory)
    prompt = _prompt(64 * PROMPT_UNITS + 9, 41)
    writer = _cache(agent, directory, secret)
    _run(model, writer, ns, prompt, layered=False)
    writer.flush()
    agent.cache.flush()
    yield agent, directory, ns, prompt
    agent.close()


def _cache(agent, directory, secret) -> ClusterCache:
    return ClusterCache(agent.node_id, AgentClient(agent.address), directory, AgentClient, secret=secret)


def _run(model, cache, ns, prompt, layered=True, n=6):
    tok = ByteTokenizer()
    eng = Engine(model, EngineConfig(num_pages=128, itl_factor=0.0, layered_loads=layered), ns, tok.decode, None,
                 cache)
    eng.add_request(GenerationRequest("r", prompt, n))
    out = eng.run_to_completion()["r"]
    return eng, _tokens(out), out[-1].cached_tokens


def test_a_prefix_handed_over_layer_by_layer_gives_the_models_tokens(model, node, monkeypatch):
    agent, directory, ns, prompt = node
    read = []  # (layer the pass is about to read, layers the load had by then)
    real = Engine._run_chunk

    def spy(self, seq, end, batch, spec):
        feed = seq.feed
        if feed is not None:
            inner = feed._write

            def write(layer):
                inner(layer)
                read.append((layer, feed.load._layers))

            monkeypatch.setattr(feed, "_write", write)
        return real(self, seq, end, batch, spec)

    monkeypatch.setattr(Engine, "_run_chunk", spy)
    cache = _cache(agent, directory, ns.secret)
    eng, tokens, cached = _run(model, cache, ns, prompt)
    assert tokens == _ref(model, prompt, 6)
    assert cached == PROMPT_UNITS * 64 and eng.stats["load_failures"] == 0
    assert cache.counters["direct_units"] == PROMPT_UNITS
    layers = model.cfg.num_hidden_layers
    assert [layer for layer, _ in read] == list(range(layers))  # each layer written just before its turn
    assert all(have > layer for layer, have in read)  # ... and only once the load had it


def _corrupt_after(monkeypatch, what: str, calls: int):
    """The layered reader's ``calls``-th slice read is damaged: a flipped byte, or the record
    cut short (a unit rewritten or evicted under the read)."""
    import cachedir.layered as layered

    real, seen = os.preadv, []

    def preadv(fd, buffers, offset):
        n = real(fd, buffers, offset)
        seen.append(offset)
        if len(seen) == calls:
            if what == "rewritten":
                buffers[0][7] = (buffers[0][7] + 1) % 256
            else:
                return n // 2
        return n

    monkeypatch.setattr(layered.os, "preadv", preadv)


@pytest.mark.parametrize("what", ["rewritten", "evicted"])
def test_a_unit_changed_under_a_layered_read_is_computed_again_never_wrong(model, node, monkeypatch, what):
    agent, directory, ns, prompt = node
    _corrupt_after(monkeypatch, what, calls=PROMPT_UNITS + 2)  # layer 1 of the second unit
    eng, tokens, cached = _run(model, _cache(agent, directory, ns.secret), ns, prompt)
    assert tokens == _ref(model, prompt, 6)
    assert eng.stats["load_failures"] == 1 and cached == 0  # the pass over it was thrown away


def test_another_namespaces_units_are_a_miss(model, node):
    agent, directory, ns, prompt = node
    other = ns.for_tenant("other")
    cache = _cache(agent, directory, ns.secret)
    keys = chain_keys(ns.seed, list(prompt), 64)[:PROMPT_UNITS]  # the first tenant's units, asked for as another's
    toks = [prompt[i * 64 : (i + 1) * 64] for i in range(PROMPT_UNITS)]
    load = cache.load_layered(keys, other.seed, toks)
    assert load.units(30) == [] and load.verified(30)
    _, tokens, cached = _run(model, cache, other, prompt)
    assert tokens == _ref(model, prompt, 6) and cached == 0
