"""Speculative decoding with MTP drafts: whatever the drafts, the engine's outputs are those of
decoding a token at a time (greedy, seeded sampling, constraints, stops, logprobs, penalties),
and rejected drafts leave nothing behind in pages, shared prefixes, cache units or handoffs."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from cachedir.hashing import Namespace, chain_keys
from cachedir.node_cache import CacheConfig, NodeCache
from cachedir.store import StoreConfig
from cluster.engine import Engine, EngineConfig
from cluster.request import FinishReason, GenerationRequest
from model.checkpoint import build_model, random_state_dict
from model.config import named_config
from model.generate import generate
from model.grammar import GrammarSpec
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def model():
    cfg = dataclasses.replace(named_config("tiny"), num_nextn_predict_layers=1)
    return build_model(cfg, random_state_dict(cfg, seed=7, std=0.1))


def _engine(model, cache=None, **kw):
    tok = ByteTokenizer()
    ns = Namespace(model.cfg.fingerprint(), "test", "float32", "latent+mtp", 64)
    return Engine(model, EngineConfig(**{"num_pages": 256, "itl_factor": 0.0, "speculative_tokens": 1, **kw}), ns,
                  tok.decode, None, cache,
                  grammar_vocab=tok.grammar_vocab)


def _prompt(n, seed):
    g = random.Random(seed)
    return tuple(g.randrange(0, 256) for _ in range(n))


def _run(engine, reqs, check=True):
    for r in reqs:
        engine.add_request(r)
    outs = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        if check:
            engine.check_integrity()
    return outs


def _tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def _oracle(engine, monkeypatch, want: dict[str, list[int]], k: int, wrong_every: int = 0):
    """Drafts from the known outputs ``want`` (each draft right, or with ``wrong_every`` a wrong
    one after the first every so often) instead of the MTP layers' proposals."""

    def chain(seqs, logits, normed):
        for s in seqs:
            n = len(s.output_ids)
            drafts = list(want[s.req.request_id][n : n + k])
            if wrong_every and n % wrong_every == 0 and len(drafts) > 1:
                drafts[1] = (drafts[1] + 1) % 256
            s.drafts = drafts

    monkeypatch.setattr(engine.spec, "_chain", chain)


def test_greedy_output_with_the_models_own_drafts_equals_decoding_without(model):
    """Chunked prompts, decode rows riding in prefill passes, prefix sharing: the same tokens as
    the model decoding alone, with the MTP layers drafting (a random draft layer: mostly
    rejected)."""
    system = _prompt(150, 0)
    prompts = {f"r{i}": system + _prompt(20 + 9 * i, i + 1) if i % 2 else _prompt(40 + 31 * i, i + 1) for i in range(6)}
    eng = _engine(model, max_num_seqs=4, max_prefill_tokens=100)
    outs = _run(eng, [GenerationRequest(rid, p, 14) for rid, p in prompts.items()])
    for rid, p in prompts.items():
        assert _tokens(outs[rid]) == generate(model, list(p), 14), rid
    stats = eng.spec.stats
    assert stats.drafted[0] > 30 and eng.stats["mixed_steps"] > 0
    assert eng.stats["decode_tokens"] == sum(len(_tokens(o)) - 1 for o in outs.values())


def test_greedy_rows_take_their_drafts_from_the_verify_call_and_sampled_rows_beside_them_too(model, monkeypatch):
    """With the C++ steps the MTP layer drafts in the verify pass's call: a greedy request alone
    runs no separate MTP pass after its prompt's; greedy and seeded sampled requests in one batch
    (the sampled ones' drafts computed again from their sampled tokens) give the tokens they give
    without drafts."""
    calls = []
    eng = _engine(model)
    real = eng.spec._draft
    monkeypatch.setattr(eng.spec, "_draft", lambda *a: calls.append(a[0]) or real(*a))
    outs = _run(eng, [GenerationRequest("g", _prompt(40, 3), 20)])
    assert _tokens(outs["g"]) == generate(model, list(_prompt(40, 3)), 20)
    assert len(calls) == 1 and eng.spec.stats.drafted[0] > 0  # the prompt's first draft only
    reqs = lambda: [GenerationRequest(f"r{i}", _prompt(30 + 20 * i, i), 24,  # noqa: E731
                                      SamplingParams() if i % 2 else SamplingParams(0.9, seed=i)) for i in range(4)]
    want = {rid: _tokens(o) for rid, o in _run(_engine(model, speculative_tokens=0), reqs()).items()}
    for k in (1, 2):
        got = _run(_engine(model, speculative_tokens=k), reqs())
        assert {rid: _tokens(o) for rid, o in got.items()} == want, k


@pytest.mark.parametrize(("k", "wrong_every"), [(1, 0), (3, 0), (3, 3), (2, 2)])
def test_accepted_drafts_commit_several_tokens_a_step_and_change_nothing(model, monkeypatch, k, wrong_every):
    prompts = {f"r{i}": _prompt(30 + 70 * i, i) for i in range(3)}
    want = {rid: generate(model, list(p), 30) for rid, p in prompts.items()}
    eng = _engine(model, speculative_tokens=k)
    _oracle(eng, monkeypatch, want, k, wrong_every)
    steps = 0
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, 30))
    outs = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        eng.check_integrity()
        steps += 1
    assert {rid: _tokens(o) for rid, o in outs.items()} == want
    stats = eng.spec.stats
    assert len(stats.drafted) == k and stats.accepted[0] == stats.drafted[0] > 0  # the first draft is always right
    if wrong_every:
        assert 0 < stats.accepted[1] < stats.drafted[1]
    else:
        assert stats.accepted == stats.drafted
    assert steps < 30 * 2 // (k + 1) + 6  # several tokens a step
    # one output per request and step: its tokens in order, whatever was accepted at once
    assert all(len(o.new_token_ids) >= 1 for outs_ in outs.values() for o in outs_)


SAMPLINGS = {
    "seeded penalized with logprobs": (SamplingParams(0.9, 0.95, 30, seed=3, presence_penalty=0.5,
                                                      frequency_penalty=0.3, logprobs=3), {}),
    "repetition": (SamplingParams(0.7, seed=4, repetition_penalty=1.3), {}),
    "greedy min_tokens and stop token": (SamplingParams(), {"min_tokens": 6, "stop_token_ids": (65, 66, 97, 101)}),
    "stop string": (SamplingParams(0.8, seed=9), {"stop": ("e", "th")}),
    "json": (SamplingParams(0.8, seed=5), {"grammar": GrammarSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))}),
    "choice": (SamplingParams(), {"grammar": GrammarSpec("choice", choices=("north", "south", "east wind"))}),
}


@pytest.mark.parametrize("case", list(SAMPLINGS))
def test_sampling_constraints_stops_and_logprobs_are_those_without_drafts(model, monkeypatch, case):
    """Right drafts (the outputs without drafting) and wrong ones: the same tokens, text, finish
    reason and logprobs as decoding a token at a time with the same seed."""
    sampling, extra = SAMPLINGS[case]
    prompts = {f"r{i}": _prompt(20 + 50 * i, 10 + i) for i in range(3)}
    reqs = lambda: [GenerationRequest(rid, p, 24, sampling, **extra) for rid, p in prompts.items()]  # noqa: E731
    alone = _run(_engine(model, speculative_tokens=0), reqs())
    want = {rid: _tokens(o) for rid, o in alone.items()}
    for wrong in (0, 2):
        eng = _engine(model, speculative_tokens=2)
        _oracle(eng, monkeypatch, want, 2, wrong)
        got = _run(eng, reqs())
        for rid in prompts:
            assert _tokens(got[rid]) == want[rid], (case, wrong, rid)
            assert "".join(o.text for o in got[rid]) == "".join(o.text for o in alone[rid])
            assert got[rid][-1].finish_reason == alone[rid][-1].finish_reason
            if sampling.logprobs is not None:
                lps = [lp for o in got[rid] for lp in o.new_logprobs]
                ref = [lp for o in alone[rid] for lp in o.new_logprobs]
                assert [[i for i, _ in lp.top] for lp in lps] == [[i for i, _ in lp.top] for lp in ref]
                assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in ref], abs=1e-4)
        if any(len(w) > 1 for w in want.values()):
            assert eng.spec.stats.accepted[0] > 0


def test_cache_units_and_handoffs_carry_the_draft_layers_latents(model, monkeypatch, tmp_path):
    """Units persist the MTP layer's latents beside the model's (committed positions only); a
    prompt loaded from them, and a prompt handed to a decode engine, decode the same tokens."""
    cache = NodeCache(CacheConfig(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30), ram_bytes=64 << 20))
    prompt = _prompt(200, 1)
    want = generate(model, list(prompt), 20)
    first = _engine(model, cache, prefix_sharing=False)
    _oracle(first, monkeypatch, {"a": want}, 1)
    assert _tokens(_run(first, [GenerationRequest("a", prompt, 20)])["a"]) == want
    cache.flush()
    layers = model.cfg.num_hidden_layers + 1
    assert first.kv.pool.row_layers == layers
    # the first unit as stored: the model's latents and the MTP layer's, as a pass computes them
    keys = chain_keys(first.namespace.seed, list(prompt), 64)
    stored = cache.load_async(keys[:1], first.namespace.seed, [prompt[:64]]).result(timeout=10)[0].unit
    rows = torch.frombuffer(bytearray(stored.payload), dtype=torch.float32).view(stored.num_layers, 64, -1)
    pool, table = model.new_pool(16, 16), torch.arange(16)
    _, hidden = model.prefill(torch.tensor(prompt), pool, table, hidden=True)
    model.draft_chunk(0, hidden[:-1], torch.tensor(prompt[1:]), pool, table, 0)
    assert stored.num_layers == layers
    torch.testing.assert_close(rows, pool.read_pages(list(range(4))), atol=1e-5, rtol=1e-4)
    second = _engine(model, cache, prefix_sharing=False)
    out = _run(second, [GenerationRequest("b", prompt + (7,), 12)])["b"]
    assert out[-1].cached_tokens == 192
    assert _tokens(out) == generate(model, list(prompt) + [7], 12)

    # P/D: the handoff's KV holds the MTP layer too; the decode engine drafts from its first step
    pre = _run(_engine(model), [GenerationRequest("h", prompt, 20, handoff=True)])["h"][-1]
    assert pre.finish_reason == FinishReason.HANDOFF
    assert pre.handoff.kv.shape == (layers, len(prompt), model.cfg.latent_dim)
    dec = _engine(model)
    _oracle(dec, monkeypatch, {"h": want}, 1)
    out = _run(dec, [GenerationRequest("h", prompt, 20, prefilled=pre.handoff)])["h"]
    assert _tokens(out) == want
    assert dec.spec.stats.accepted[0] > 5


def test_a_batch_above_the_limit_decodes_without_drafts(model):
    eng = _engine(model, speculative_max_batch=2, max_num_seqs=4)
    _run(eng, [GenerationRequest(f"r{i}", _prompt(20, i), 6) for i in range(4)])
    assert eng.spec.stats.drafted == [0]
    eng = _engine(model, speculative_max_batch=4, max_num_seqs=4)
    _run(eng, [GenerationRequest(f"r{i}", _prompt(20, i), 6) for i in range(4)])
    assert eng.spec.stats.drafted[0] > 0


def test_an_engine_without_mtp_layers_or_with_drafting_off_never_drafts():
    cfg = named_config("tiny")
    plain = build_model(cfg, random_state_dict(cfg, seed=1))
    eng = _engine(plain)
    assert not eng.spec.enabled and eng.kv.pool.row_layers == cfg.num_hidden_layers
    _run(eng, [GenerationRequest("a", _prompt(20, 1), 5)])
    assert eng.spec.stats.drafted == []


@pytest.mark.gpu
def test_on_cuda_drafting_steps_replay_graphs_and_give_the_eager_engines_tokens():
    """A CUDA model with an MTP layer: the verify and MTP steps are captured per bucket as the
    decode step is; the tokens equal an ``enforce_eager`` engine's, and a plain decode's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = dataclasses.replace(named_config("tiny"), num_nextn_predict_layers=1)
    m = build_model(cfg, {k: v.cuda() for k, v in random_state_dict(cfg, seed=7, std=0.1).items()})
    prompts = {f"r{i}": _prompt(10 + 23 * i, i) for i in range(6)}
    runs = {}
    for eager, drafts in ((False, 2), (True, 2), (True, 0)):
        eng = _engine(m, max_num_seqs=6, max_prefill_tokens=64, enforce_eager=eager, speculative_tokens=drafts)
        assert (eng.fixed_verify is None) == (eager or not drafts)
        if eng.fixed_verify is not None:
            assert eng.fixed_verify.captured == [1, 2, 4, 8, 16, 18] and eng.spec.fixed_draft.captured
        outs = _run(eng, [GenerationRequest(rid, p, 4 + 5 * i) for i, (rid, p) in enumerate(prompts.items())], False)
        runs[(eager, drafts)] = {rid: _tokens(o) for rid, o in outs.items()}
    assert runs[(False, 2)] == runs[(True, 2)] == runs[(True, 0)]


def test_a_v32_model_drafts_with_its_mtp_layers_indexer(monkeypatch):
    """DeepSeek-V3.2's MTP layer attends sparsely like its others (its indexer keys in the pool
    beside the model's): past index_topk tokens, right drafts and the model's own give the tokens
    of decoding without."""
    cfg = dataclasses.replace(named_config("tiny-v3.2"), num_nextn_predict_layers=1)
    model = build_model(cfg, random_state_dict(cfg, seed=3, std=0.1))
    prompts = {"long": _prompt(150, 1), "short": _prompt(30, 2)}
    want = {rid: generate(model, list(p), 16) for rid, p in prompts.items()}
    assert _engine(model).kv.pool.index_k.shape[0] == cfg.num_hidden_layers + 1
    got = _run(_engine(model), [GenerationRequest(rid, p, 16) for rid, p in prompts.items()])
    assert {rid: _tokens(o) for rid, o in got.items()} == want
    eng = _engine(model, speculative_tokens=2)
    _oracle(eng, monkeypatch, want, 2, wrong_every=3)
    got = _run(eng, [GenerationRequest(rid, p, 16) for rid, p in prompts.items()])
    assert {rid: _tokens(o) for rid, o in got.items()} == want and eng.spec.stats.accepted[0] > 0


def test_a_v4_model_drafts_with_its_mtp_layer_through_window_pages_units_and_handoffs(monkeypatch, tmp_path):
    """DeepSeek-V4's MTP layer (a sliding-window block on the model's streams): its own drafts
    and right or wrong ones give the tokens of decoding without, past the window and compressed
    windows closed by verify rows; its window rows travel in resume records and handoffs."""
    cfg = dataclasses.replace(named_config("tiny-v4"), num_nextn_predict_layers=1)
    model = build_model(cfg, random_state_dict(cfg, seed=3, std=0.1))
    prompts = {"long": _prompt(150, 1), "short": _prompt(30, 2)}
    want = {rid: generate(model, list(p), 16) for rid, p in prompts.items()}
    for k in (1, 2):
        eng = _engine(model, speculative_tokens=k)
        assert eng.kv.pool.planes["swa"].shape[0] == cfg.num_hidden_layers + 1
        got = _run(eng, [GenerationRequest(rid, p, 16) for rid, p in prompts.items()])
        assert {rid: _tokens(o) for rid, o in got.items()} == want and eng.spec.stats.drafted[0] > 0
    eng = _engine(model, speculative_tokens=2)
    _oracle(eng, monkeypatch, want, 2, wrong_every=2)
    got = _run(eng, [GenerationRequest(rid, p, 16) for rid, p in prompts.items()])
    assert {rid: _tokens(o) for rid, o in got.items()} == want
    assert eng.spec.stats.accepted[0] > 0 and eng.spec.stats.accepted[1] < eng.spec.stats.drafted[1]

    cache = NodeCache(CacheConfig(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30), ram_bytes=64 << 20))
    prompt = prompts["long"]
    first = _engine(model, cache, prefix_sharing=False)
    _oracle(first, monkeypatch, want, 1)
    assert _tokens(_run(first, [GenerationRequest("long", prompt, 16)])["long"]) == want["long"]
    cache.flush()
    second = _engine(model, cache, prefix_sharing=False)
    _oracle(second, monkeypatch, {"b": generate(model, list(prompt) + [7], 12)}, 1)
    out = _run(second, [GenerationRequest("b", prompt + (7,), 12)])["b"]
    assert out[-1].cached_tokens >= 64
    assert _tokens(out) == generate(model, list(prompt) + [7], 12) and second.spec.stats.accepted[0] >= 5

    pre = _run(_engine(model), [GenerationRequest("long", prompt, 16, handoff=True)])["long"][-1]
    assert pre.finish_reason == FinishReason.HANDOFF
    dec = _engine(model)
    _oracle(dec, monkeypatch, want, 1)
    out = _run(dec, [GenerationRequest("long", prompt, 16, prefilled=pre.handoff)])["long"]
    assert _tokens(out) == want["long"] and dec.spec.stats.accepted[0] > 5
