"""The engine serves DeepSeek's current families (V3.2's indexer keys beside the latent, V4's window
and compressed-entry pools) as it serves V3: batching, chunked prefill, prefix sharing, cache units
from RAM and SSD, preemption and the P/D handoff all give the model's own tokens."""

from __future__ import annotations

import pytest

from cluster.engine import Engine
from cluster.request import FinishReason, GenerationRequest
from model.checkpoint import build_model, random_state_dict
from model.config import named_config
from tests.cluster.test_engine import _cache, _engine, _prompt, _ref, _tokens


@pytest.fixture(scope="module", params=["tiny-v3.2", "tiny-v4"])
def model(request):
    cfg = named_config(request.param)
    return build_model(cfg, random_state_dict(cfg, seed=5, std=0.1))


def _run(eng: Engine, reqs: list[GenerationRequest]) -> dict:
    for r in reqs:
        eng.add_request(r)
    outs: dict = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        eng.check_integrity()
    return outs


def test_chunked_batched_and_shared_prefixes_give_the_models_tokens(model):
    """Prompts past the indexer's top-k and the compression windows, prefilled in chunks of 100
    (boundaries inside windows) beside decoding rows; half share a 150-token system prompt."""
    eng = _engine(model, max_num_seqs=4, max_prefill_tokens=100)
    system = _prompt(150, 0)
    prompts = {f"r{i}": (system + _prompt(20 + 7 * i, i + 1)) if i % 2 else _prompt(90 + 13 * i, i + 1)
               for i in range(6)}
    outs = _run(eng, [GenerationRequest(rid, p, max_tokens=40) for rid, p in prompts.items()])
    for rid, p in prompts.items():
        assert _tokens(outs[rid]) == _ref(model, p, 40), rid
    assert any(outs[f"r{i}"][-1].cached_tokens == 128 for i in (3, 5))  # two units shared in the pool
    assert eng.stats["mixed_steps"] > 0


def test_units_from_ram_and_ssd_give_the_computed_tokens(model, tmp_path):
    prompt = _prompt(300, 42)
    ref = _ref(model, prompt, 10)
    cache = _cache(tmp_path)
    first = _engine(model, cache)
    assert _tokens(_run(first, [GenerationRequest("a", prompt, 10)])["a"]) == ref
    cache.flush()
    second = _engine(model, cache)  # a new replica on the node: the units come from RAM
    out = _run(second, [GenerationRequest("b", prompt, 10)])["b"]
    assert _tokens(out) == ref and out[-1].sources.ram == 256
    cache.close()
    third = _engine(model, _cache(tmp_path, ram=0))  # only the SSD
    out = _run(third, [GenerationRequest("c", prompt, 10)])["c"]
    assert _tokens(out) == ref and out[-1].sources.ssd == 256


def test_a_prompt_of_whole_units_loads_all_but_its_last_token(model, tmp_path):
    prompt = _prompt(256, 77)
    ref = _ref(model, prompt, 6)
    cache = _cache(tmp_path)
    _run(_engine(model, cache), [GenerationRequest("a", prompt, 6)])
    cache.flush()
    out = _run(_engine(model, cache), [GenerationRequest("b", prompt, 6)])["b"]
    assert _tokens(out) == ref and out[-1].cached_tokens == 255


def test_preemption_under_a_small_pool_loses_nothing(model):
    eng = _engine(model, num_pages=40, max_num_seqs=6)
    prompts = {f"p{i}": _prompt(70 + 11 * i, 100 + i) for i in range(6)}
    outs = _run(eng, [GenerationRequest(rid, p, max_tokens=40) for rid, p in prompts.items()])
    assert eng.stats["preemptions"] > 0
    for rid, p in prompts.items():
        assert _tokens(outs[rid]) == _ref(model, p, 40), rid


def test_a_prompt_handed_from_prefill_to_decode_goes_on_as_one_engine(model):
    prompts = {f"r{i}": _prompt(30 + 67 * i, i) for i in range(3)}
    prefill = _run(_engine(model), [GenerationRequest(rid, p, 12, handoff=True) for rid, p in prompts.items()])
    decode = _engine(model, max_num_seqs=2, num_pages=60)
    reqs = []
    for rid, outs in prefill.items():
        assert outs[-1].finish_reason == FinishReason.HANDOFF
        reqs.append(GenerationRequest(rid, prompts[rid], 12, prefilled=outs[-1].handoff))
    out = _run(decode, reqs)
    for rid, p in prompts.items():
        assert _tokens(out[rid]) == _ref(model, p, 12), rid


def test_a_v4_prefix_goes_on_only_after_a_unit_with_a_resume_record(model, tmp_path):
    """V4's units carry compressed entries only; the window state to go on after one comes in a
    resume record, persisted where a prompt (or an output) ended. A prompt that shares only the
    first three units of a cached one has no such record after them: it computes all (V3.2's
    units are whole per-token rows and load as V3's)."""
    cache = _cache(tmp_path)
    first = _prompt(300, 5)
    _run(_engine(model, cache), [GenerationRequest("a", first, 4)])
    cache.flush()
    second = first[:200] + _prompt(60, 6)  # units 0-2 are the first prompt's
    eng = _engine(model, cache)
    out = _run(eng, [GenerationRequest("b", second, 6)])["b"]
    assert _tokens(out) == _ref(model, second, 6)
    resumable = eng.kv.resumable
    assert resumable == (model.cfg.model_type == "deepseek_v4")
    assert out[-1].cached_tokens == (0 if resumable else 192)
    cache.flush()
    again = _run(_engine(model, cache), [GenerationRequest("c", second + _prompt(10, 7), 6)])["c"]
    assert _tokens(again) == _ref(model, second + _prompt(10, 7), 6)
    assert again[-1].cached_tokens == 256  # where the second prompt ended, a record now is


def test_a_long_v4_sequence_holds_its_entries_and_a_window_of_fixed_size(model):
    """V4's window rows live in pages of their own, given back once behind the window: through a
    chunked prefill and a long decode a sequence never holds more than its window's pages (and a
    chunk's), and its tokens are the model's (V3.2 keeps every row: it has no window pages)."""
    eng = _engine(model, max_num_seqs=2, max_prefill_tokens=128)
    if not hasattr(eng.kv, "window"):
        assert model.cfg.model_type == "deepseek_v32"
        return
    prompt = _prompt(600, 21)
    eng.add_request(GenerationRequest("long", prompt, max_tokens=120))
    seq, outs, held = eng._by_id["long"], [], []
    while eng.has_work():
        outs += eng.step()
        eng.check_integrity()
        held.append(sum(p >= 0 for p in seq.window_pages))
    assert _tokens(outs) == _ref(model, prompt, 120)
    z = eng.kv.page_size
    assert max(held) <= -(-(eng.kv.keep + 128) // z) + 2  # a chunk's rows and the window behind it
    assert max(held[-100:]) <= -(-eng.kv.keep // z) + 2  # decoding: the window alone
    assert eng.kv.num_window_pages < eng.kv.num_pages  # the pool's rows are sized for windows, not tokens


def test_units_from_another_nodes_agent_give_the_computed_tokens(model, tmp_path):
    """Two nodes' cache agents (real gRPC, one directory): a replica on node B loads the prompt's
    units (and V4's resume record) that node A computed, from A's agent."""
    from cachedir.agent.client import AgentClient
    from cachedir.agent.cluster_cache import ClusterCache
    from cachedir.agent.node_agent import AgentConfig, NodeAgent
    from cachedir.agent.service import ServerConfig
    from cachedir.directory.memory import MemoryDirectory
    from cachedir.node_cache import CacheConfig
    from cachedir.store import StoreConfig

    directory = MemoryDirectory("families")
    agents = [NodeAgent(AgentConfig(name, CacheConfig(StoreConfig(tmp_path / name, 1 << 30, fsync=False), ram_bytes=0),
                                    ServerConfig(host="127.0.0.1"), heartbeat_ttl_s=60, sync_every_s=3600,
                                    replication=None), directory) for name in ("node-a", "node-b")]
    caches = [ClusterCache(a.node_id, AgentClient(a.address), directory, AgentClient) for a in agents]
    try:
        prompt = _prompt(300, 8)
        ref = _ref(model, prompt, 10)
        assert _tokens(_run(_engine(model, caches[0]), [GenerationRequest("a", prompt, 10)])["a"]) == ref
        caches[0].flush()
        agents[0].cache.flush()
        agents[0].sync_once()
        out = _run(_engine(model, caches[1]), [GenerationRequest("b", prompt, 10)])["b"]
        assert _tokens(out) == ref and out[-1].sources.remote == 256
    finally:
        for c in caches:
            c.close()
        for a in agents:
            a.close()
