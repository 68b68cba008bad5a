"""The engine: continuous batching, prefix sharing, the disk cache, preemption — all token-identical
to a single sequence computed alone."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import pytest
import torch

from cachedir.hashing import Namespace
from cachedir.node_cache import CacheConfig, NodeCache
from cachedir.store import StoreConfig
from cluster.engine import Engine, EngineConfig
from cluster.engine_config import PassPace
from cluster.request import FinishReason, GenerationRequest
from model.fixed_decode import FixedShapeDecode, buckets_up_to
from model.generate import generate
from model.grammar import Grammars, GrammarSpec, GrammarState
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from tests.cachedir.units import flip_byte
from tests.model.reference import logprobs_alone, prompt_logprobs_alone


def _ns(model):
    return Namespace(model.cfg.fingerprint(), "test", "float32", "latent", 64)


def _engine(model, cache=None, **kw):
    tok = ByteTokenizer()
    # fixed prefill chunks (itl_factor 0): these tests count chunks and passes
    return Engine(model, EngineConfig(**{"num_pages": 256, "itl_factor": 0.0, **kw}), _ns(model), tok.decode, None, cache,
                  grammar_vocab=tok.grammar_vocab)


def _cache(tmp_path, ram=64 << 20):
    return NodeCache(CacheConfig(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30), ram_bytes=ram))


def _prompt(n, seed):
    g = random.Random(seed)
    return tuple(g.randrange(0, 256) for _ in range(n))


def _tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def _ref(model, prompt, n):
    return generate(model, list(prompt), n)


def test_concurrent_requests_with_shared_and_unique_prefixes_match_the_reference(model):
    eng = _engine(model, max_num_seqs=4, max_prefill_tokens=100)  # chunked prefill, queueing
    system = _prompt(150, 0)
    prompts = {f"r{i}": (system + _prompt(20 + i * 7, i + 1)) if i % 2 else _prompt(90 + i * 13, i + 1)
               for i in range(7)}
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, max_tokens=12))
    outs = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        eng.check_integrity()
    for rid, p in prompts.items():
        assert _tokens(outs[rid]) == _ref(model, p, 12), rid
        assert outs[rid][-1].finish_reason == FinishReason.LENGTH
    # the odd requests shared the 150-token system prompt: 2 whole units reused in-pool
    assert any(outs[f"r{i}"][-1].cached_tokens == 128 for i in (3, 5))
    assert eng.stats["mixed_steps"] > 0  # decode tokens rode in prefill chunks' passes
    # the counters a replica's hit rate comes from (tide bench cluster's per-replica load)
    assert eng.stats["finished"] == 7 and eng.stats["finished_prompt_tokens"] == sum(map(len, prompts.values()))
    assert eng.stats["finished_cached_tokens"] == sum(o[-1].cached_tokens for o in outs.values()) >= 128
    assert eng.stats["finished_local_tokens"] == eng.stats["finished_cached_tokens"]  # no other node here


def test_decode_rides_in_the_prefill_pass_with_one_or_two_micro_batches(model):
    """A step that prefills a chunk while others decode is one forward pass; with two
    micro-batches the chunk and the decode batch are its pipelined halves. The tokens are the
    same."""
    calls = []

    class Counting:
        def __getattr__(self, name):
            attr = getattr(model, name)
            if name in ("prefill", "decode", "mixed"):
                return lambda *a, **k: calls.append((name, k.get("micro_batches", 1))) or attr(*a, **k)
            return attr

    prompts = {"a": _prompt(70, 1), "b": _prompt(300, 2)}
    for micro_batches, passes in ((1, {("mixed", 1)}), (2, {("mixed", 2)})):
        eng = _engine(Counting(), max_prefill_tokens=64, micro_batches=micro_batches)
        eng.add_request(GenerationRequest("a", prompts["a"], max_tokens=12))
        outs = {"a": eng.step() + eng.step()}  # a is prefilled: it decodes from now on
        eng.add_request(GenerationRequest("b", prompts["b"], max_tokens=4))
        chunk_steps = 0
        while eng.has_work():
            calls.clear()
            step = eng.step()
            if "b" in eng._by_id and eng.waiting:  # b's prompt is still being prefilled while a decodes
                assert set(calls) == passes, (micro_batches, calls)
                chunk_steps += 1
            for o in step:
                outs.setdefault(o.request_id, []).append(o)
        assert chunk_steps == 4  # 300 tokens in 64-token chunks: 4 steps before the last
        for rid, p in prompts.items():
            assert _tokens(outs[rid]) == _ref(model, p, 12 if rid == "a" else 4), (micro_batches, rid)
        eng.check_integrity()


def test_prefix_from_ssd_and_ram_is_token_identical(model, tmp_path):
    prompt = _prompt(300, 42)
    ref = _ref(model, prompt, 10)
    cache = _cache(tmp_path)
    first = _engine(model, cache)
    first.add_request(GenerationRequest("a", prompt, 10))
    assert _tokens(first.run_to_completion()["a"]) == ref
    cache.flush()
    assert len(cache.ssd) >= 4
    # a new replica (empty pool) on the same node: units come from RAM
    second = _engine(model, cache)
    second.add_request(GenerationRequest("b", prompt, 10))
    out = second.run_to_completion()["b"]
    assert _tokens(out) == ref and out[-1].sources.ram == 256 and out[-1].sources.compute == 44
    # no RAM tier: from SSD (the same directory, after the first store let go of it)
    cache.close()
    ssd_only = NodeCache(CacheConfig(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30), ram_bytes=0))
    third = _engine(model, ssd_only)
    third.add_request(GenerationRequest("c", prompt, 10))
    out = third.run_to_completion()["c"]
    assert _tokens(out) == ref and out[-1].sources.ssd == 256


def test_without_prefix_sharing_a_repeat_reads_the_prompt_cache(model, tmp_path):
    """``prefix_sharing=False``: the replica keeps no finished prompt's pages, so the same prompt
    again loads its units from the store (here SSD only) instead of this replica's pool."""
    prompt = _prompt(200, 9)
    ref = _ref(model, prompt, 6)
    for sharing, source in ((True, "ram"), (False, "ssd")):
        cache = _cache(tmp_path / str(sharing), ram=0)
        eng = _engine(model, cache, prefix_sharing=sharing)
        for rid in ("a", "b"):
            eng.add_request(GenerationRequest(rid, prompt, 6))
            out = eng.run_to_completion()[rid]
            cache.flush()
            assert _tokens(out) == ref
        sources = out[-1].sources
        assert getattr(sources, source) == 192 and sources.cached == 192, (sharing, sources)
        eng.check_integrity()


def test_a_paced_engine_gives_every_pass_its_emulated_time_and_the_same_tokens(model):
    """Under ``pace`` a pass lasts at least its emulated device's time (lower bounds only: the
    sleep guarantees them whatever the machine's load), the scheduler learns the emulated times,
    and no token changes."""
    pace = PassPace(pass_ms=2.0, token_ms=0.5, row_ms=15.0)
    eng = _engine(model, pace=pace)
    prompt = _prompt(70, 3)
    eng.add_request(GenerationRequest("a", prompt, max_tokens=3))
    outs, steps = [], []
    while eng.has_work():
        t0 = time.perf_counter()
        outs += eng.step()
        steps.append(time.perf_counter() - t0)
    assert _tokens(outs) == _ref(model, prompt, 3)
    assert steps[0] >= pace.seconds(70, 0) and all(s >= pace.seconds(0, 1) for s in steps[1:]), steps
    assert [n for n, _, _ in eng.prefill_samples] == [70] and eng.prefill_samples[0][2] >= 0.037
    assert eng.scheduler.decode_s(1) >= 0.017


def test_logprobs_of_batched_greedy_and_seeded_requests(model):
    eng = _engine(model, max_num_seqs=4)
    prompts = {"greedy": _prompt(70, 21), "seeded": _prompt(40, 22), "plain": _prompt(30, 23)}
    params = {"greedy": SamplingParams(logprobs=2),
              "seeded": SamplingParams(temperature=1.0, seed=4, logprobs=0), "plain": SamplingParams()}
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, 5, params[rid]))
    outs = eng.run_to_completion()
    assert all(o.new_logprobs is None for o in outs["plain"])
    for rid in ("greedy", "seeded"):
        toks = _tokens(outs[rid])
        lps = [lp for o in outs[rid] for lp in o.new_logprobs]
        assert [lp.token for lp in lps] == toks
        for lp, ref in zip(lps, logprobs_alone(model, prompts[rid], toks), strict=True):
            assert lp.logprob == pytest.approx(float(ref[lp.token]), abs=1e-4)
            assert [i for i, _ in lp.top] == ref.topk(params[rid].logprobs).indices.tolist()
        if rid == "greedy":
            assert all(lp.top[0][0] == lp.token for lp in lps)


def _check_prompt_logprobs(model, prompt, scored, k):
    assert len(scored) == len(prompt) and scored[0] is None
    ref = prompt_logprobs_alone(model, prompt)
    for i, lp in enumerate(scored[1:]):
        assert lp.token == prompt[i + 1]
        assert lp.logprob == pytest.approx(float(ref[i, lp.token]), abs=1e-4), i
        assert [t for t, _ in lp.top] == ref[i].topk(k).indices.tolist()
        assert lp.rank == 1 + int((ref[i] > ref[i, lp.token]).sum())


def test_prompt_logprobs_score_every_prompt_token_in_chunks_beside_decodes(model):
    """A request asking for its prompt's logprobs gets one per prompt token with its first output,
    equal to the model's on the whole prompt, though the prompt went in chunks while others
    decoded and a cached copy of its prefix was there to reuse (it is computed whole); its
    tokens and the others' are the model's own."""
    eng = _engine(model, max_num_seqs=4, max_prefill_tokens=48)
    shared = _prompt(150, 60)
    eng.add_request(GenerationRequest("first", shared[:140], 4))
    eng.run_to_completion()  # its whole units stay in the pool, shareable
    prompts = {"scored": shared, "beside": _prompt(30, 61), "later": _prompt(100, 62)}
    eng.add_request(GenerationRequest("beside", prompts["beside"], 20))
    outs = {"beside": eng.step()}  # it decodes while the scored prompt goes in chunks
    eng.add_request(GenerationRequest("scored", shared, 6, SamplingParams(prompt_logprobs=3)))
    eng.add_request(GenerationRequest("later", prompts["later"], 6))
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        eng.check_integrity()
    for rid, p in prompts.items():
        assert _tokens(outs[rid]) == _ref(model, p, 20 if rid == "beside" else 6), rid
    scored = [o.prompt_logprobs for o in outs["scored"] if o.prompt_logprobs is not None]
    assert len(scored) == 1 and outs["scored"][0].prompt_logprobs is scored[0]  # once, with the first token
    _check_prompt_logprobs(model, shared, scored[0], 3)
    assert outs["scored"][-1].cached_tokens == 0 and outs["later"][-1].cached_tokens == 0
    assert all(o.prompt_logprobs is None for rid in ("beside", "later") for o in outs[rid])
    assert eng.stats["mixed_steps"] > 0


def test_a_scored_prompts_logits_stay_within_their_bound(model):
    """scored_logits_mib bounds a scored chunk's logits: at the tiny model's 512-token vocabulary
    1 MiB holds 256 positions (and the log-softmax beside them), so a 600-token prompt goes in
    chunks of at most 256 though the prefill budget is larger, and scores as the model does.
    At DeepSeek's 129,280 tokens the default 256 MiB holds 259."""
    from cluster.scheduler import scored_chunk

    assert scored_chunk(256, 129280) == 259 and scored_chunk(1, 10**9) == 1 and scored_chunk(4096, 512) == 512
    eng = _engine(model, max_prefill_tokens=1024, scored_logits_mib=1)
    rows: list[int] = []
    prefill = eng.model.prefill

    def counted(ids, *args, all_logits=False, **kw):
        if all_logits:
            rows.append(len(ids))
        return prefill(ids, *args, all_logits=all_logits, **kw)

    eng.model.prefill = counted
    try:
        prompt = _prompt(600, 63)
        eng.add_request(GenerationRequest("scored", prompt, 2, SamplingParams(prompt_logprobs=1)))
        outs = eng.run_to_completion()
    finally:
        del eng.model.prefill
    assert rows == [256, 256, 88]
    _check_prompt_logprobs(model, prompt, outs["scored"][0].prompt_logprobs, 1)


def test_prompt_logprobs_survive_a_preemption_without_repeats(model):
    eng = _engine(model, max_num_seqs=3, num_pages=12)  # preempts
    prompts = {rid: _prompt(40 + 9 * i, 70 + i) for i, rid in enumerate(("a", "b", "c", "d"))}
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, 24, SamplingParams(prompt_logprobs=0)))
    outs = eng.run_to_completion()
    assert eng.stats["preemptions"] >= 1
    for rid, p in prompts.items():
        assert _tokens(outs[rid]) == _ref(model, p, 24), rid
        _check_prompt_logprobs(model, p, outs[rid][0].prompt_logprobs, 0)


SAMPLED_BATCHES = {
    # presence and frequency penalties count each request's own output
    "penalties": ({"freq": SamplingParams(frequency_penalty=1.5), "pres": SamplingParams(presence_penalty=2.0),
                   "both": SamplingParams(0.8, seed=3, presence_penalty=-0.5, frequency_penalty=0.7),
                   "plain": SamplingParams()}, "freq"),
    # the repetition penalty counts each request's own prompt and output, min-p its own draws
    "repetition_min_p": ({"repeat": SamplingParams(repetition_penalty=1.8),
                          "mild": SamplingParams(repetition_penalty=0.7), "minp": SamplingParams(0.9, seed=8, min_p=0.2),
                          "both": SamplingParams(1.1, seed=9, min_p=0.05, repetition_penalty=1.3),
                          "plain": SamplingParams()}, "repeat"),
}


@pytest.mark.parametrize("case", SAMPLED_BATCHES)
def test_sampling_options_in_a_batch_equal_the_model_alone(model, case):
    """Each request's sampling options apply to its own rows, also across a preemption (a small
    pool), in a batch with requests without them."""
    params, changed = SAMPLED_BATCHES[case]
    eng = _engine(model, max_num_seqs=3, num_pages=12)  # preempts
    prompts = {rid: _prompt(40 + 9 * i, 30 + i) for i, rid in enumerate(params)}
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, 24, params[rid]))
    outs = eng.run_to_completion()
    for rid, p in prompts.items():
        assert _tokens(outs[rid]) == generate(model, list(p), 24, params[rid]), rid
    assert _tokens(outs[changed]) != _ref(model, prompts[changed], 24)  # the option changed the answer
    assert eng.stats["preemptions"] >= 1


def test_penalty_counts_stay_on_the_logits_device_and_no_step_moves_a_vocabulary_row(model):
    """Penalized requests keep their counts and seen-masks on the model's device in the
    sampler's form, updated in place: no step copies or converts a [V] row per request (on a GPU
    that was a host-to-device copy of every penalized row, 1 MB each at a 129k vocabulary)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab = model.cfg.vocab_size
    moved: list[str] = []

    class RowCopies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # a [V] row made anew in another dtype or on another device (writing a row of the
            # logits in place is not a move)
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if func is torch.ops.aten._to_copy.default or (func is torch.ops.aten.copy_.default and (
                    args[0].dtype != src.dtype or args[0].device != src.device)):
                if src.dim() == 1 and src.numel() == vocab:
                    moved.append(f"{func}: {src.dtype} {src.device}")
            return func(*args, **(kwargs or {}))

    params = {"freq": SamplingParams(frequency_penalty=1.5), "both": SamplingParams(0.8, seed=3, presence_penalty=0.5,
                                                                                      repetition_penalty=1.2)}
    eng = _engine(model)
    prompts = {rid: _prompt(30 + 7 * i, 50 + i) for i, rid in enumerate(params)}
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, 12, params[rid]))
    outs: dict = {}
    for o in eng.step():  # admitted: counts made once
        outs.setdefault(o.request_id, []).append(o)
    for seq in eng.running:
        assert seq.token_counts.device == model.device and seq.token_counts.dtype == torch.float32
        assert seq.seen is None or seq.seen.device == model.device
    with RowCopies():
        while eng.has_work():
            for o in eng.step():
                outs.setdefault(o.request_id, []).append(o)
    assert moved == []
    for rid, p in prompts.items():
        assert _tokens(outs[rid]) == generate(model, list(p), 12, params[rid]), rid


def test_stop_token_ids_end_the_output_and_min_tokens_holds_every_stop_back(model):
    prompt = _prompt(40, 95)
    ref = _ref(model, prompt, 12)
    stop = ref[2]
    assert stop not in ref[:2]
    tok = ByteTokenizer()
    eng = _engine(model)
    eng.add_request(GenerationRequest("stops", prompt, 12, stop_token_ids=(stop, 1)))
    eng.add_request(GenerationRequest("held", prompt, 12, stop_token_ids=(stop,), min_tokens=6))
    other = _prompt(40, 98)  # its first token is a whole character, "("
    first = _ref(model, other, 1)
    eng.add_request(GenerationRequest("string", other, 12, stop=(tok.decode(first),)))
    eng.add_request(GenerationRequest("string_held", other, 12, stop=(tok.decode(first),), min_tokens=3))
    outs = eng.run_to_completion()
    stops = outs["stops"]
    assert _tokens(stops) == ref[:3] and stops[-1].finish_reason == FinishReason.STOP
    assert "".join(o.text for o in stops) == tok.decode(ref[:2])  # the stop token has no text
    held = _tokens(outs["held"])
    assert held[:2] == ref[:2] and stop not in held[:5] and len(held) >= 6
    assert outs["held"][-1].finish_reason == (FinishReason.STOP if held[-1] == stop else FinishReason.LENGTH)
    assert _tokens(outs["string"]) == first and "".join(o.text for o in outs["string"]) == ""
    assert len(_tokens(outs["string_held"])) >= 3
    with pytest.raises(ValueError, match="min_tokens"):
        GenerationRequest("bad", prompt, 4, min_tokens=5)


def test_logit_biased_requests_in_a_batch_equal_the_model_alone(model):
    """Each request's logit_bias applies to its own rows only, at every step, also after a
    preemption; a banned greedy choice changes the answer."""
    eng = _engine(model, max_num_seqs=3, num_pages=12)  # preempts
    prompts = {rid: _prompt(40 + 9 * i, 50 + i) for i, rid in enumerate(("ban", "force", "sampled", "plain"))}
    first = _ref(model, prompts["ban"], 1)[0]
    params = {"ban": SamplingParams(logit_bias=((first, -100.0),)), "force": SamplingParams(logit_bias=((7, 100.0),)),
              "sampled": SamplingParams(0.9, seed=5, logit_bias=((first, 3.0), (9, -2.0))), "plain": SamplingParams()}
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, 16, params[rid]))
    outs = eng.run_to_completion()
    for rid, p in prompts.items():
        assert _tokens(outs[rid]) == generate(model, list(p), 16, params[rid]), rid
    assert first not in _tokens(outs["ban"]) and _tokens(outs["force"]) == [7] * 16
    assert _tokens(outs["plain"]) == _ref(model, prompts["plain"], 16)
    assert eng.stats["preemptions"] >= 1


def _closing(bias: float) -> tuple[tuple[int, float], ...]:
    """Tilts the random model towards closing what it opens, so JSON objects end within 48 tokens."""
    return tuple((ord(c), bias) for c in '"}],1')


def _grammar(model, spec: GrammarSpec, constrain_after: int | None = None) -> GrammarState:
    """A fresh grammar state for the reference path (``model.generate``), over the byte
    tokenizer's vocabulary with its EOS (the engine's here has none: ``_engine`` passes None)."""
    grammars = Grammars(ByteTokenizer().grammar_vocab(), model.cfg.vocab_size, [])
    return GrammarState(grammars.matcher(spec), grammars, constrain_after)


def test_json_mode_requests_in_a_batch_are_json_and_equal_the_model_alone(model):
    """Every JSON-mode output is one JSON object that ends the request (also after a
    preemption and when sampled), equal to the model alone under the same masks; the request
    next to them is unconstrained."""
    tok = ByteTokenizer()
    eng = _engine(model, max_num_seqs=3, num_pages=10)  # preempts
    params = {"greedy": SamplingParams(logit_bias=_closing(5.0)),
              "sampled": SamplingParams(1.0, seed=3, logit_bias=_closing(5.0)),
              "plain": SamplingParams(), "long": SamplingParams(logit_bias=((ord('"'), 2.0),))}
    prompts = {"greedy": _prompt(30, 71), "sampled": _prompt(37, 71), "plain": _prompt(44, 72), "long": _prompt(51, 73)}
    json_object = GrammarSpec("json_object")
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, 48, params[rid], grammar=None if rid == "plain" else json_object))
    outs = eng.run_to_completion()
    for rid, p in prompts.items():
        want = generate(model, list(p), 48, params[rid], grammar=None if rid == "plain" else _grammar(model, json_object))
        assert _tokens(outs[rid]) == want, rid
    for rid in ("greedy", "sampled", "long"):
        text = "".join(o.text for o in outs[rid])
        assert text == tok.decode(_tokens(outs[rid])), rid  # the closing token's text too
        if rid == "long":  # ran out of tokens: an unfinished object, every token of it allowed
            assert outs[rid][-1].finish_reason == FinishReason.LENGTH
            state = _grammar(model, json_object)
            for t in _tokens(outs[rid]):
                state.feed(t)
        else:  # the object closed and ended the request
            assert outs[rid][-1].finish_reason == FinishReason.STOP and isinstance(json.loads(text), dict), rid
    assert _tokens(outs["plain"]) == _ref(model, prompts["plain"], 48)
    assert eng.stats["preemptions"] >= 1


def test_a_late_mask_makes_only_its_own_row_wait_and_changes_no_token(model, monkeypatch):
    """One request's masks take 40 ms each on the mask thread (a pathological grammar), with a
    1 ms wait: it sits steps out while the others decode every step (a seeded one's random draws
    untouched), and every output equals the model alone."""
    import threading

    real_mask = GrammarState.mask

    def slow_mask(self):
        if getattr(self, "slow", False) and not self.ready and threading.current_thread().name.startswith("grammar-masks"):
            import time

            time.sleep(0.04)
        return real_mask(self)

    monkeypatch.setattr(GrammarState, "mask", slow_mask)
    eng = _engine(model, mask_wait_ms=1.0)
    json_object = GrammarSpec("json_object")
    params = {"slow": SamplingParams(logit_bias=_closing(5.0)), "fast": SamplingParams(logit_bias=_closing(5.0)),
              "seeded": SamplingParams(0.9, seed=11), "plain": SamplingParams()}
    grammar = {"slow": json_object, "fast": json_object}
    prompts = {rid: _prompt(20 + 5 * i, 90 + i) for i, rid in enumerate(params)}
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, 24, params[rid], grammar=grammar.get(rid)))
    outs: dict = {}
    waited = 0  # steps in which the others got a token and the slow one did not
    while eng.has_work():
        slow = next((s for s in eng.running if s.req.request_id == "slow"), None)
        if slow is not None and isinstance(slow.grammar, GrammarState):
            slow.grammar.slow = True
        step = eng.step()
        for o in step:
            outs.setdefault(o.request_id, []).append(o)
        got = {o.request_id for o in step if o.new_token_ids}
        waited += slow is not None and slow.finished is None and "slow" not in got and "plain" in got
    assert waited >= 1 and eng.stats["masks_late"] >= 1, (waited, eng.stats)
    for rid, p in prompts.items():
        want = generate(model, list(p), 24, params[rid], grammar=_grammar(model, json_object) if rid in grammar else None)
        assert _tokens(outs[rid]) == want, rid


def test_schema_and_json_object_requests_share_a_batch_each_under_its_grammar(model):
    tok = ByteTokenizer()
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "array", "items": {"type": "boolean"}}},
              "required": ["a", "b"], "additionalProperties": False}
    specs = {"schema": GrammarSpec("json_schema", json.dumps(schema)), "object": GrammarSpec("json_object")}
    eng = _engine(model, max_num_seqs=4)
    params = SamplingParams(logit_bias=_closing(4.0))
    prompts = {"schema": _prompt(30, 77), "object": _prompt(30, 77)}
    for rid in prompts:
        eng.add_request(GenerationRequest(rid, prompts[rid], 40, params, grammar=specs[rid]))
    outs = eng.run_to_completion()
    for rid in prompts:
        assert _tokens(outs[rid]) == generate(model, list(prompts[rid]), 40, params, grammar=_grammar(model, specs[rid])), rid
    text = tok.decode(_tokens(outs["schema"]))
    assert outs["schema"][-1].finish_reason == FinishReason.STOP, text
    value = json.loads(text)
    assert set(value) == {"a", "b"} and value["a"] in ("x", "yz") and all(isinstance(v, bool) for v in value["b"])
    assert _tokens(outs["schema"]) != _tokens(outs["object"])


def test_choices_regexes_and_grammars_share_a_batch_and_end_at_their_text(model):
    import re

    tok = ByteTokenizer()
    specs = {"choice": GrammarSpec("choice", choices=("north", "south", "east wind")),
             "sampled": GrammarSpec("choice", choices=("north", "south", "east wind")),
             "regex": GrammarSpec("regex", "[a-c]{2,4}-[0-9]"), "ebnf": GrammarSpec("grammar", 'root ::= "<" [xy]+ ">"')}
    judge = {"choice": lambda t: t in specs["choice"].choices, "sampled": lambda t: t in specs["choice"].choices,
             "regex": lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]", t), "ebnf": lambda t: re.fullmatch(r"<[xy]+>", t)}
    eng = _engine(model, max_num_seqs=5)
    prompts = {rid: _prompt(30, 80 + i) for i, rid in enumerate((*specs, "plain"))}
    params = {rid: SamplingParams(1.5, seed=2) if rid == "sampled" else SamplingParams() for rid in prompts}
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, 20, params[rid], grammar=specs.get(rid)))
    outs = eng.run_to_completion()
    for rid, spec in specs.items():
        assert _tokens(outs[rid]) == generate(model, list(prompts[rid]), 20, params[rid], grammar=_grammar(model, spec)), rid
        assert judge[rid](tok.decode(_tokens(outs[rid]))) and outs[rid][-1].finish_reason == FinishReason.STOP, rid
    assert _tokens(outs["plain"]) == _ref(model, prompts["plain"], 20)
    with pytest.raises(ValueError, match="choice grammar goes with choices"):
        GrammarSpec("choice")


def test_structured_output_needs_the_vocabulary_and_a_valid_continuation(model):
    """Without the tokenizer's vocabulary the engine refuses a grammar; continued tokens that
    the grammar refuses fail that request alone, with the grammar's word for why."""
    eng = Engine(model, EngineConfig(num_pages=64), _ns(model), ByteTokenizer().decode, None)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request(GenerationRequest("a", (1, 2, 3), 4, grammar=GrammarSpec("json_object")))
    with pytest.raises(ValueError, match="grammar kind"):
        GrammarSpec("yaml")
    eng = _engine(model)
    eng.add_request(GenerationRequest("c", (1, 2, 3), 4, continued_ids=tuple(b"[1"), grammar=GrammarSpec("json_object")))
    eng.add_request(GenerationRequest("ok", (1, 2, 3), 4))
    outs = eng.run_to_completion()
    assert outs["c"][-1].finish_reason == FinishReason.ERROR and "does not continue" in outs["c"][-1].error
    assert _tokens(outs["ok"]) == _ref(model, (1, 2, 3), 4)


def test_a_prompt_waits_for_its_grammar_before_its_last_token_and_others_go_on(model, monkeypatch):
    """A grammar compiles off the engine thread: while it does, its prompt stops short of its
    last token (whose logits need the masks) and the other requests are computed."""
    import threading

    from model import grammar as grammar_module

    release = threading.Event()
    real = grammar_module.GrammarSpec.compile

    def slow(self, compiler):
        assert release.wait(30)
        return real(self, compiler)

    monkeypatch.setattr(grammar_module.GrammarSpec, "compile", slow)
    eng = _engine(model, max_num_seqs=4)
    spec = GrammarSpec("choice", choices=("north", "south"))
    eng.add_request(GenerationRequest("slow", _prompt(30, 90), 8, grammar=spec))
    eng.add_request(GenerationRequest("free", _prompt(20, 91), 6))
    outs: dict[str, list] = {}
    for _ in range(12):
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["free"][-1].finished and "slow" not in outs  # the free one finished; the slow one waits
    slow_seq = eng._by_id["slow"]
    assert slow_seq.num_computed == 29  # all but its last prompt token
    release.set()
    for rid, items in eng.run_to_completion().items():
        outs.setdefault(rid, []).extend(items)
    assert _tokens(outs["slow"]) == generate(model, list(_prompt(30, 90)), 8, grammar=_grammar(model, spec))


def test_corrupted_units_still_give_the_same_tokens(model, tmp_path):
    prompt = _prompt(260, 7)
    ref = _ref(model, prompt, 8)
    cache = _cache(tmp_path, ram=0)
    eng = _engine(model, cache)
    eng.add_request(GenerationRequest("a", prompt, 8))
    eng.run_to_completion()
    cache.flush()
    for key in cache.ssd.keys():
        flip_byte(cache.ssd, key, from_end=50)
    cache.close()  # one store per directory: the fresh one takes it over
    fresh = _engine(model, NodeCache(CacheConfig(StoreConfig(tmp_path / "ssd", capacity_bytes=1 << 30), ram_bytes=0)))
    fresh.add_request(GenerationRequest("b", prompt, 8))
    out = fresh.run_to_completion()["b"]
    assert _tokens(out) == ref and out[-1].cached_tokens == 0


def test_preemption_under_a_small_pool_loses_nothing(model):
    eng = _engine(model, num_pages=40, max_num_seqs=6)
    prompts = {f"p{i}": _prompt(70 + 11 * i, 100 + i) for i in range(6)}
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, max_tokens=40))
    outs = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        eng.check_integrity()
    assert eng.stats["preemptions"] > 0
    for rid, p in prompts.items():
        assert _tokens(outs[rid]) == _ref(model, p, 40), rid


def test_stop_strings_eos_seed_and_abort(model):
    tok = ByteTokenizer()
    eng = _engine(model)
    prompt = _prompt(40, 9)
    ref = _ref(model, prompt, 20)
    text = tok.decode(ref)
    stop = next((text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].isprintable()), None)
    if stop:
        eng.add_request(GenerationRequest("s", prompt, 20, stop=(stop,)))
        outs = eng.run_to_completion()["s"]
        assert "".join(o.text for o in outs) == text[: text.find(stop)]
        assert outs[-1].finish_reason == FinishReason.STOP
    eos_engine = Engine(model, EngineConfig(num_pages=64), _ns(model), tok.decode, ref[3], None)
    eos_engine.add_request(GenerationRequest("e", prompt, 20))
    out = eos_engine.run_to_completion()["e"]
    assert _tokens(out) == ref[:4] and out[-1].finish_reason == FinishReason.STOP
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=3)
    runs = []
    for i in range(2):
        eng.add_request(GenerationRequest(f"seed{i}", prompt, 10, sampling=sp))
        runs.append(_tokens(eng.run_to_completion()[f"seed{i}"]))
    assert runs[0] == runs[1]
    eng.add_request(GenerationRequest("x", prompt, 50))
    eng.step()
    eng.abort("x")
    out = eng.run_to_completion()["x"]
    assert out[-1].finish_reason == FinishReason.ABORT
    eng.check_integrity()


def test_bad_requests_are_rejected(model):
    eng = _engine(model)
    with pytest.raises(ValueError, match="context length"):
        eng.add_request(GenerationRequest("big", (1,) * 4000, max_tokens=200))
    with pytest.raises(ValueError, match="empty"):
        GenerationRequest("e", (), 5)
    with pytest.raises(ValueError, match="admission"):
        EngineConfig(admission="deepseek")
    with pytest.raises(ValueError, match="itl_floor_ms"):
        EngineConfig(itl_factor=2.0, itl_floor_ms=-1)
    torch.manual_seed(0)


def test_prompt_of_whole_units_recomputes_only_its_last_token(model, tmp_path):
    prompt = _prompt(256, 77)  # exactly 4 units
    ref = _ref(model, prompt, 6)
    cache = _cache(tmp_path)
    first = _engine(model, cache)
    first.add_request(GenerationRequest("a", prompt, 6))
    first.run_to_completion()
    cache.flush()
    second = _engine(model, cache)
    second.add_request(GenerationRequest("b", prompt, 6))
    out = second.run_to_completion()["b"]
    assert _tokens(out) == ref
    assert out[-1].cached_tokens == 255 and out[-1].sources.compute == 1
    second.check_integrity()


def test_streamed_text_equals_the_decoded_tokens_also_across_a_continuation(model):
    """Byte-level tokens split characters: the streamed pieces must still add up to the decoded
    output, also when a request moves to another engine mid-stream (the ingress's continuation)."""
    tok = ByteTokenizer()
    eng = _engine(model, max_num_seqs=8)
    prompts = {f"r{i}": _prompt(40 + i, 300 + i) for i in range(24)}
    for rid, p in prompts.items():
        eng.add_request(GenerationRequest(rid, p, max_tokens=16, ignore_eos=True))
    outs = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    texts = {rid: tok.decode(_tokens(o)) for rid, o in outs.items()}
    assert {rid: "".join(x.text for x in o) for rid, o in outs.items()} == texts
    multibyte = [t for t in texts.values() if any(ord(c) > 127 and c != "\ufffd" for c in t)]
    assert multibyte, "no output had a multi-byte character: the test would not test anything"
    # continue each request after 5 tokens on a fresh engine, as the ingress does
    for rid, o in outs.items():
        head = []
        for x in o:
            head.append(x)
            if sum(len(y.new_token_ids) for y in head) >= 5:
                break
        done_ids = _tokens(head)
        sent = "".join(x.text for x in head)
        other = _engine(model)
        other.add_request(GenerationRequest("c", prompts[rid] + tuple(done_ids), 16 - len(done_ids), ignore_eos=True,
                                            continued_ids=tuple(done_ids), continued_chars=len(sent)))
        rest = other.run_to_completion()["c"]
        assert done_ids + _tokens(rest) == _tokens(o)
        assert sent + "".join(x.text for x in rest) == texts[rid], rid


def test_the_text_of_each_step_decodes_a_few_tokens_not_the_whole_output():
    """Incremental detokenization: however long the output grows, a step decodes a bounded
    window per sequence, and the streamed text equals the whole output decoded at once."""
    from cachedir.hashing import Namespace
    from deploy.bench.engine_bench import NullModel

    decoded = []
    tok = ByteTokenizer()

    def detok(ids):
        decoded.append(len(ids))
        return tok.decode(ids)

    model = NullModel(4096, token=ord("a"))
    engine = Engine(model, EngineConfig(num_pages=512, max_num_seqs=4), Namespace(model.cfg.fingerprint(), "t", "float32",
                    "latent", 64), detok, eos_id=None)
    for i in range(4):
        engine.add_request(GenerationRequest(f"r{i}", tuple(range(1, 200)), 1500, stop=("zz",)))
    outputs = {}
    per_step = []
    while engine.has_work():
        decoded.clear()
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o)
        per_step.append(sum(decoded))
    from cluster.output import WINDOW

    # late steps decode no more than early ones: a window of tokens per sequence, once, and now
    # and then again the window's new start (a few tokens)
    assert max(per_step[-100:]) <= max(per_step[1:100]) <= 4 * (WINDOW + 2)
    for outs in outputs.values():
        assert "".join(o.text for o in outs) == "a" * 1500
    engine.check_integrity()


class _Clocked:
    """``model`` on a fake clock, a pass costing by its shape: a decode pass ``decode_s`` plus
    ``row_s`` per row, a prefill token ``token_s`` plus ``attn_s`` per (token x attended token)
    (a mixed pass the sum); ``chunks`` records (new, start) of every prefill chunk."""

    def __init__(self, model, decode_s: float, row_s: float = 0.0, token_s: float = 0.001,
                 attn_s: float = 0.0) -> None:
        self.inner, self.cfg, self.now = model, model.cfg, 0.0
        self.decode_s, self.row_s, self.token_s, self.attn_s = decode_s, row_s, token_s, attn_s
        self.chunks: list[tuple[int, int]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _chunk_s(self, n: int, start: int) -> float:
        self.chunks.append((n, start))
        return self.token_s * n + self.attn_s * n * (start + n)

    def prefill(self, token_ids, pool, block_table, start=0, **k):
        self.now += self._chunk_s(token_ids.shape[0], start)
        return self.inner.prefill(token_ids, pool, block_table, start=start, **k)

    def decode(self, tokens, *a, **k):
        self.now += self.decode_s + self.row_s * tokens.shape[0]
        return self.inner.decode(tokens, *a, **k)

    def verify_draft(self, tokens, *a, **k):  # a decode pass (its MTP layer's pass rides in it)
        self.now += self.decode_s + self.row_s * tokens.shape[0]
        return self.inner.verify_draft(tokens, *a, **k)

    def mixed(self, chunk_ids, chunk_table, chunk_start, tokens, *a, **k):  # the two passes' cost
        self.now += self.decode_s + self.row_s * tokens.shape[0] + self._chunk_s(chunk_ids.shape[0], chunk_start)
        return self.inner.mixed(chunk_ids, chunk_table, chunk_start, tokens, *a, **k)


def _timed_null(attn_s: float = 0.0, row_s: float = 0.0) -> _Clocked:
    """The null model on a fake clock: a decode step 50 ms plus ``row_s`` a row, a prefill token
    1 ms plus ``attn_s`` per (token x attended token)."""
    from deploy.bench.engine_bench import NullModel

    return _Clocked(NullModel(8192, token=ord("a")), decode_s=0.05, row_s=row_s, attn_s=attn_s)


def _timed_engine(model: _Clocked, num_pages: int, max_num_seqs: int, decoding: bool = False,
                  itl_floor_ms: float = 0.0) -> Engine:
    """An engine with itl_factor 2 on ``model``'s fake clock; ``decoding``: with a request
    "first" (64-token prompt, 400 tokens) decoding and its decode step timed."""
    from cachedir.hashing import Namespace

    cfg = EngineConfig(num_pages=num_pages, max_num_seqs=max_num_seqs, max_prefill_tokens=512, itl_factor=2.0,
                       itl_floor_ms=itl_floor_ms)
    engine = Engine(model, cfg, Namespace(model.cfg.fingerprint(), "t", "float32", "latent", 64),
                    ByteTokenizer().decode, eos_id=None, clock=lambda: model.now)
    if decoding:
        engine.add_request(GenerationRequest("first", tuple(range(1, 65)), 400))
        while engine.waiting:
            engine.step()
        engine.step()  # a decode alone: timed
    return engine


def test_while_requests_decode_a_long_prompt_is_prefilled_in_chunks_sized_to_bound_their_latency():
    """itl_factor 2: with a decode step at 50 ms and a prefill token at 1 ms, a step prefills
    (2 - 1) x 50 / 1 = 50 prompt tokens while others decode (their tokens in the same pass), so
    each of them still gets a token every step taking at most ~2 decode steps; alone, a prompt
    goes in max_prefill_tokens chunks. The first step after the first prompt is a decode alone,
    which times the decode."""
    model = _timed_null()
    engine = _timed_engine(model, 512, 4)
    engine.add_request(GenerationRequest("first", tuple(range(1, 1025)), 200))
    engine.step()
    assert [n for n, _, _ in engine.prefill_samples] == [512]  # nothing decodes yet: a whole chunk
    while engine.waiting:
        engine.step()
    engine.add_request(GenerationRequest("long", tuple(range(1, 2001)), 4))
    t0, tokens = model.now, 0
    while engine.waiting:
        out = engine.step()
        tokens += sum(len(o.new_token_ids) for o in out if o.request_id == "first")
    chunks = [n for n, start, _ in engine.prefill_samples if start >= 0][2:]
    assert chunks and set(chunks[:-1]) <= {49, 50}, chunks  # (50 less rounding); the last is what was left
    steps = tokens
    assert steps == len(chunks) + 1 and (model.now - t0) / steps <= 2 * 0.05 + 1e-9  # a token a step, <= 2 decode steps each
    engine.run_to_completion()
    engine.check_integrity()


def _prefill_long_prompt(engine: Engine, model: _Clocked, tokens: int) -> list[float]:
    """Queue a ``tokens`` prompt "long" and step until it is prefilled: each step's time on the
    fake clock (``model.chunks`` then holds the chunks of those steps alone)."""
    engine.add_request(GenerationRequest("long", tuple(1 + i % 250 for i in range(tokens)), 1))
    model.chunks.clear()
    steps = []
    while engine.waiting:
        t0 = model.now
        engine.step()
        steps.append(model.now - t0)
    return steps


@pytest.mark.parametrize("floor_ms, chunk", [(0.0, 10), (10.0, 90)])
def test_beside_a_millisecond_decode_step_chunks_fill_the_itl_floor(floor_ms, chunk):
    """A decode step of 1 ms and a prompt token of 0.1 ms: itl_factor 2 alone leaves 1 ms a pass
    for the chunk (10 tokens), the 10 ms floor 9 ms (90 tokens); every step stays within the
    longer of the two, and the prompt needs a ninth of the steps."""
    from deploy.bench.engine_bench import NullModel

    model = _Clocked(NullModel(8192, token=ord("a")), decode_s=0.001, token_s=1e-4)
    engine = _timed_engine(model, 512, 4, decoding=True, itl_floor_ms=floor_ms)
    steps = _prefill_long_prompt(engine, model, 2000)
    sizes = [n for n, _ in model.chunks[2:-1]]  # past the first two, whose sizes the fit starts from
    assert sizes and all(abs(n - chunk) <= 1 for n in sizes), sizes
    assert max(steps) <= max(2 * 0.001, floor_ms / 1e3) + 1e-9
    engine.run_to_completion()
    engine.check_integrity()


def test_prefill_chunks_shrink_as_the_prompt_context_grows_and_steps_stay_within_the_bound():
    """A chunk's queries attend over its whole prefix, so a prompt token costs more the later it
    is: the chunk size is fitted to ``token_s * new + attn_s * new * (start + new)`` and shrinks
    along the prompt, keeping every step of the running request within itl_factor (2) decode
    steps, where a size fitted per token alone would overrun late in the prompt."""
    model = _timed_null(attn_s=4e-7)
    engine = _timed_engine(model, 1024, 4, decoding=True)
    steps = _prefill_long_prompt(engine, model, 6000)
    chunks = model.chunks[1:-1]  # the long prompt's but its last (what was left)
    assert chunks[0][0] > 40 and chunks[-1][0] < 15, chunks  # ~49 tokens at the start, ~14 at 5.9K
    assert all(a[0] >= b[0] for a, b in zip(chunks[:-1], chunks[1:], strict=True)), chunks
    assert max(steps[3:]) <= 2 * 0.05 * 1.01, max(steps)  # once two chunks separate the terms
    engine.run_to_completion()
    engine.check_integrity()


def test_chunks_are_sized_by_the_batch_that_runs_as_a_burst_of_prompts_joins_it():
    """A burst of prompts arrives while one request decodes, and each joins the decode batch
    when it is prefilled: when the batch has grown past LIKE_ROWS of the one whose step was
    timed, a step decodes alone and is timed, so the chunks riding in the bigger batch's passes
    are sized by its step. Sized by the one-row step, every mixed pass would overrun the budget
    by the rows that joined, and the chunks would shrink to a few tokens each."""
    model = _timed_null(row_s=0.02)  # 70 ms for one row, 190 ms for seven
    engine = _timed_engine(model, 1024, 8, decoding=True)
    for i in range(6):
        engine.add_request(GenerationRequest(f"p{i}", tuple(1 + (i + j) % 250 for j in range(300)), 100))
    model.chunks.clear()
    steps = 0
    while engine.waiting:
        engine.step()
        steps += 1
    assert len(engine.running) == 7 and steps <= 40, steps  # 1,800 prompt tokens, 70-190 a step
    firsts = [k for k, (_, start) in enumerate(model.chunks) if start == 0]  # where each prompt's chunks begin
    assert max(b - a for a, b in zip(firsts, [*firsts[1:], len(model.chunks)], strict=True)) <= 6, model.chunks
    engine.run_to_completion()
    engine.check_integrity()


def test_a_prefix_plan_is_loaded_as_planned_and_a_declined_load_is_computed(model, tmp_path, monkeypatch):
    """The ingress hashed the prompt and the router decided what to load: the engine hashes the
    prompt no more, loads the planned units, and computes the ones whose load was declined,
    with the same tokens either way."""
    import cluster.engine as engine_module
    from cachedir.hashing import chain_keys
    from cluster.request import PrefixPlan

    prompt = _prompt(64 * 3 + 10, 11)
    warm = _engine(model, _cache(tmp_path, ram=0))
    warm.add_request(GenerationRequest("w", prompt, max_tokens=4))
    warm.run_to_completion()
    warm.cache.flush()  # the prompt's 3 units are on disk
    warm.cache.close()
    keys = tuple(chain_keys(_ns(model).seed, prompt, 64))
    hashed = []
    real = engine_module.chain_keys
    monkeypatch.setattr(engine_module, "chain_keys",
                        lambda seed, ids, *a, **k: hashed.append(len(ids)) or real(seed, ids, *a, **k))
    want = _ref(model, prompt, 6)
    # (units the router loads, cached tokens, computed because declined, ... because stale)
    for load_units, cached, declined, stale, where in ((None, 3 * 64, 0, 0, tmp_path), (3, 3 * 64, 0, 0, tmp_path),
                                                       (1, 64, 2 * 64, 0, tmp_path), (0, 0, 3 * 64, 0, tmp_path),
                                                       (3, 0, 0, 3 * 64, tmp_path / "empty")):
        eng = _engine(model, _cache(where, ram=0))  # "empty": the directory listed units this node lost
        plan = PrefixPlan(keys, holders=(("node",),) * 3, load_units=load_units, namespace=_ns(model).id)
        hashed.clear()
        eng.add_request(GenerationRequest("r", prompt, max_tokens=6, plan=plan))
        outs = eng.run_to_completion()["r"]
        assert _tokens(outs) == want, load_units
        src = outs[-1].sources
        assert outs[-1].cached_tokens == cached and src.compute == len(prompt) - cached
        assert (src.declined, src.stale) == (declined, stale), (load_units, src)
        assert (src.listed, src.planned) == (3 * 64, 64 * (3 if load_units is None else load_units))
        assert hashed == [0]  # only the output's units (none whole here), never the prompt again
        eng.check_integrity()
        eng.cache.close()
    # the directory listed only the first unit: the other two were computed, never seen or (the
    # directory remembers the second as dropped by its holders) evicted
    for dropped, evicted in ((False, 0), (True, 2 * 64)):
        eng = _engine(model, _cache(tmp_path, ram=0))
        plan = PrefixPlan(keys, holders=(("node",),), dropped_next=dropped, namespace=_ns(model).id)
        eng.add_request(GenerationRequest("r", prompt, max_tokens=6, plan=plan))
        src = eng.run_to_completion()["r"][-1].sources
        assert (src.ssd, src.declined, src.stale, src.evicted) == (64, 0, 0, evicted)
        assert src.compute == len(prompt) - 64
        eng.cache.close()


def test_a_plan_made_in_another_namespace_is_refused_loudly(model):
    """The ingress and the replica derive the namespace from one ``CacheIdentity``; should they
    still disagree (another secret, dtype or weights), the replica refuses the plan instead of
    missing on every unit in silence. A tenant's plan is in the tenant's namespace."""
    from cachedir.hashing import chain_keys
    from cluster.request import PlanMismatch, PrefixPlan

    prompt = _prompt(64 * 2 + 5, 12)
    ns = _ns(model)
    other = dataclasses.replace(ns, secret=b"another cluster's secret")
    eng = _engine(model)
    for tenant, space in (("", other), ("acme", ns)):
        plan = PrefixPlan(tuple(chain_keys(space.seed, prompt, 64)), namespace=space.id)
        with pytest.raises(PlanMismatch, match="cache namespace"):
            eng.add_request(GenerationRequest("r", prompt, max_tokens=2, tenant=tenant, plan=plan))
    tenant_ns = ns.for_tenant("acme")
    plan = PrefixPlan(tuple(chain_keys(tenant_ns.seed, prompt, 64)), namespace=tenant_ns.id)
    eng.add_request(GenerationRequest("r", prompt, max_tokens=2, tenant="acme", plan=plan))
    assert len(eng.run_to_completion()["r"]) >= 1


def test_json_mode_after_a_thought_constrains_only_the_answer(model):
    """R1: the output is a thought until ``constrain_after`` (</think>); the JSON masks apply
    from the token after it, equal to the model alone under the same rule, also when the
    request is continued on another replica after the thought ended."""
    json_object = GrammarSpec("json_object")
    prompt = _prompt(40, 91)
    params = SamplingParams(logit_bias=_closing(4.0))
    free = generate(model, list(prompt), 12, params)
    close = free[3]  # the "thought" ends at the 4th token the model says unconstrained
    want = generate(model, list(prompt), 40, params, grammar=_grammar(model, json_object, close))
    assert want[: want.index(close) + 1] == generate(model, list(prompt), want.index(close) + 1, params)
    after = bytes(t for t in want[want.index(close) + 1 :] if t < 256).decode()
    assert after.startswith("{") and isinstance(json.loads(after), dict)  # the answer is the JSON object
    eng = _engine(model)
    eng.add_request(GenerationRequest("r", prompt, 40, params, grammar=json_object, constrain_after=close))
    assert _tokens(eng.run_to_completion()["r"]) == want
    k = want.index(close) + 2  # continued after the thought ended and the object began
    eng.add_request(GenerationRequest("c", prompt + tuple(want[:k]), 40 - k, params, grammar=json_object,
                                      constrain_after=close, continued_ids=tuple(want[:k])))
    assert _tokens(eng.run_to_completion()["c"]) == want[k:]


def test_queue_time_ends_when_a_step_takes_the_request_up(model):
    """One seat: the second request waits for the first to finish, and its queue time covers
    that wait (arrival to its first step); only finished outputs carry it."""
    eng = _engine(model, max_num_seqs=1)
    eng.add_request(GenerationRequest("a", _prompt(40, 1), max_tokens=6))
    eng.add_request(GenerationRequest("b", _prompt(40, 2), max_tokens=6))
    outs: dict[str, list] = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    a, b = outs["a"][-1], outs["b"][-1]
    assert all(o.queued_s == 0.0 for o in outs["a"][:-1] + outs["b"][:-1])
    assert 0.0 <= a.queued_s < b.queued_s
    assert b.queued_s >= a.decode_s  # b waited at least as long as a decoded


@pytest.mark.gpu
def test_on_cuda_decode_steps_replay_graphs_and_give_the_eager_engines_tokens():
    """A CUDA model's engine captures a graph per batch bucket; its tokens equal an
    ``enforce_eager`` engine's for requests that join and leave (every bucket, padded rows)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from model.checkpoint import build_model, random_state_dict
    from model.config import named_config

    cfg = named_config("tiny")
    m = build_model(cfg, {k: v.cuda() for k, v in random_state_dict(cfg, seed=5, std=0.1).items()})
    runs = {}
    for eager in (False, True):
        eng = _engine(m, max_num_seqs=6, max_prefill_tokens=64, enforce_eager=eager)
        assert (eng.fixed_decode is None) == eager
        if not eager:
            assert eng.fixed_decode.captured == [1, 2, 4, 6]
        for i in range(6):
            eng.add_request(GenerationRequest(f"r{i}", _prompt(10 + 23 * i, i), max_tokens=4 + 5 * i))
        outs = {}
        while eng.has_work():
            for o in eng.step():
                outs.setdefault(o.request_id, []).append(o)
        runs[eager] = {rid: _tokens(o) for rid, o in outs.items()}
    assert runs[False] == runs[True]


def _alone(model, req: GenerationRequest) -> list:
    """``req``'s outputs in an engine of its own."""
    solo = _engine(model)
    solo.add_request(req)
    return solo.run_to_completion()[req.request_id]


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_random_arrivals_aborts_and_preemption_beside_sized_chunks_lose_no_token(model, mtp_model, tmp_path, seed,
                                                                                monkeypatch):
    """Everything at once, as traffic brings it: requests arrive at random steps, share two
    system prompts or repeat a whole prompt (pages shared in the pool, units from the node's
    cache), greedy beside seeded sampling, a pool too small for all of them (preemption and
    recomputation), chunks sized by itl_factor with decode tokens riding in their passes (one
    or two micro-batches), penalties and logit biases, stop strings, and two requests aborted
    midway; with seeds 2 and 3 decode passes of their own run the fixed-shape step a CUDA engine
    captures as graphs (padded to a bucket, the block tables as wide as the pool). With seeds 4
    and 5 a model with an MTP layer drafts (two drafts a step; with 5 the verify and MTP steps
    of fixed shape). Every request that ran to its end has the tokens, text and finish reason
    it has in an engine of its own (a plain greedy one the model's ``generate``); an aborted one
    a prefix of them; the pages add up every step."""
    rng = random.Random(seed)
    model = mtp_model if seed >= 4 else model
    clocked = _Clocked(model, decode_s=0.02, row_s=0.002)
    tok = ByteTokenizer()
    cfg = EngineConfig(num_pages=32 if seed < 4 else 20, max_num_seqs=5, max_prefill_tokens=64, itl_factor=2.0,
                       micro_batches=2 if seed == 1 else 1, speculative_tokens=(0, 2, 1)[max(0, seed - 3)])
    if seed in (2, 3, 5):  # as on CUDA, but eager: the steps a graph would replay
        monkeypatch.setattr(Engine, "_fixed_decode", lambda e, rows, **kind: FixedShapeDecode(
            e.model, e.kv.pool, e.kv.scratch_page, e.kv.max_pages, buckets_up_to(rows), **kind))
    eng = Engine(clocked, cfg, _ns(model), tok.decode, None, _cache(tmp_path), grammar_vocab=tok.grammar_vocab,
                 clock=lambda: clocked.now)
    systems = [_prompt(rng.randint(128, 200), 1000 + seed), _prompt(rng.randint(128, 160), 2000 + seed)]
    requests, prompts = [], []
    for i in range(10):
        kind = ("unique", "system", "system", "repeat")[i % 4]
        if kind == "unique":
            prompt = _prompt(rng.randint(20, 140), 100 * seed + i)
        elif kind == "system":
            prompt = rng.choice(systems) + _prompt(rng.randint(1, 40), 100 * seed + i)
        else:
            prompt = rng.choice(prompts)
        prompts.append(prompt)
        sampling = rng.choice([
            SamplingParams(), SamplingParams(),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=rng.choice([0, 20]), seed=rng.randrange(1000)),
            SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, logit_bias=((rng.randrange(256), 5.0),))])
        req = GenerationRequest(f"r{i}", prompt, rng.randint(16, 64), sampling)
        text = "".join(o.text for o in _alone(model, req)) if rng.random() < 0.3 else ""
        if len(text) > 2:  # a stop string: a character of its output from the third on
            req = dataclasses.replace(req, stop=(text[rng.randrange(2, len(text))],))
        requests.append((rng.randint(0, 10), req))
    by_id = {req.request_id: (at, req) for at, req in requests}
    aborts = {rid: by_id[rid][0] + rng.randint(1, 12) for rid in rng.sample(sorted(by_id), 2)}  # step of each abort
    requests.sort(key=lambda r: r[0])
    outs: dict[str, list] = {}
    step = 0
    while requests or eng.has_work():
        while requests and requests[0][0] <= step:
            eng.add_request(requests.pop(0)[1])
        for rid, at in aborts.items():
            if at == step:
                eng.abort(rid)
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        eng.check_integrity()
        step += 1
    assert eng.stats["mixed_steps"] > 0 and eng.stats["preemptions"] > 0, eng.stats
    assert (eng.fixed_decode is not None) == (seed in (2, 3, 5))
    assert (eng.fixed_verify is not None) == (seed == 5)
    assert (eng.spec.stats.drafted[0] > 0) == (seed >= 4) if seed >= 4 else not eng.spec.enabled
    assert any(o.cached_tokens for out in outs.values() for o in out)  # a shared system prompt or a repeat
    for rid, (_, req) in by_id.items():
        alone = _alone(model, req)
        if req.sampling.plain_greedy and not req.stop:
            assert _tokens(alone) == _ref(model, req.prompt_ids, req.max_tokens)
        got, reason = _tokens(outs[rid]), outs[rid][-1].finish_reason
        if reason == FinishReason.ABORT:
            assert rid in aborts and got == _tokens(alone)[: len(got)], rid
        else:
            assert (got, reason) == (_tokens(alone), alone[-1].finish_reason), rid
            assert "".join(o.text for o in outs[rid]) == "".join(o.text for o in alone), rid












