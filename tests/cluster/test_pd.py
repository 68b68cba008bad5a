"""P/D disaggregation in the engine: a prefill engine hands the prompt's KV and first token to a
decode engine, which continues token-identically to one engine doing both."""

from __future__ import annotations

import random

import pytest
import torch

from cachedir.hashing import Namespace
from cluster.engine import Engine, EngineConfig
from cluster.request import FinishReason, GenerationRequest, Prefilled, TokenSources
from model.grammar import GrammarSpec
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer


def _engine(model, **kw):
    ns = Namespace(model.cfg.fingerprint(), "test", "float32", "latent", 64)
    tok = ByteTokenizer()
    return Engine(model, EngineConfig(**{"num_pages": 128, "itl_factor": 0.0, **kw}), ns, tok.decode, None, grammar_vocab=tok.grammar_vocab)


def _prompt(n, seed):
    g = random.Random(seed)
    return tuple(g.randrange(0, 256) for _ in range(n))


def _run(engine, reqs):
    for r in reqs:
        engine.add_request(r)
    out = engine.run_to_completion()
    engine.check_integrity()
    return out


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(0.9, 0.95, 20, seed=11),
                                      SamplingParams(0.9, 0.95, 20, seed=12, logprobs=3)])
def test_prefill_then_decode_equals_one_engine(model, sampling):
    prompts = {f"r{i}": _prompt(30 + 37 * i, i) for i in range(4)}
    whole = _run(_engine(model), [GenerationRequest(rid, p, 12, sampling) for rid, p in prompts.items()])

    prefill = _run(_engine(model), [GenerationRequest(rid, p, 12, sampling, handoff=True) for rid, p in prompts.items()])
    handoffs = {rid: outs[-1] for rid, outs in prefill.items()}
    for rid, last in handoffs.items():
        assert last.finish_reason == FinishReason.HANDOFF
        assert last.handoff.kv.shape == (model.cfg.num_hidden_layers, len(prompts[rid]), model.cfg.latent_dim)
    decode = _engine(model, max_num_seqs=2, num_pages=40)  # queues: not all fit at once
    out = _run(decode, [GenerationRequest(rid, prompts[rid], 12, sampling, prefilled=handoffs[rid].handoff)
                        for rid in prompts])
    for rid in prompts:
        got = [t for o in out[rid] for t in o.new_token_ids]
        want = [t for o in whole[rid] for t in o.new_token_ids]
        assert got == want, rid
        assert out[rid][-1].finish_reason == whole[rid][-1].finish_reason == FinishReason.LENGTH
        assert "".join(o.text for o in out[rid]) == "".join(o.text for o in whole[rid])
        if sampling.logprobs is not None:  # the first token's, computed on the prefill side, came along
            got_lp = [lp for o in out[rid] for lp in o.new_logprobs]
            want_lp = [lp for o in whole[rid] for lp in o.new_logprobs]
            assert [lp.token for lp in got_lp] == want
            assert [[i for i, _ in lp.top] for lp in got_lp] == [[i for i, _ in lp.top] for lp in want_lp]
            assert [lp.logprob for lp in got_lp] == pytest.approx([lp.logprob for lp in want_lp], abs=1e-5)


def test_json_mode_through_a_handoff_and_a_continuation_equals_one_engine(model):
    """The decode replica, and a replica that continues a request another gave back, take up
    JSON mode where it was (the grammar's state follows the tokens already generated)."""
    sampling = SamplingParams(logit_bias=tuple((ord(c), 5.0) for c in '"}],1'))
    prompt = _prompt(30, 71)  # this model closes its object after 26 tokens
    whole = [t for o in _run(_engine(model), [GenerationRequest("j", prompt, 40, sampling, grammar=GrammarSpec("json_object"))])["j"]
             for t in o.new_token_ids]
    assert 10 < len(whole) < 40  # closed before max_tokens
    pre = _run(_engine(model), [GenerationRequest("j", prompt, 40, sampling, handoff=True, grammar=GrammarSpec("json_object"))])
    out = _run(_engine(model), [GenerationRequest("j", prompt, 40, sampling, prefilled=pre["j"][-1].handoff,
                                                  grammar=GrammarSpec("json_object"))])
    assert [t for o in out["j"] for t in o.new_token_ids] == whole and out["j"][-1].finish_reason == FinishReason.STOP
    k = 9  # another replica gave the request back after k tokens
    cont = _run(_engine(model), [GenerationRequest("j", prompt + tuple(whole[:k]), 40 - k, sampling,
                                                   continued_ids=tuple(whole[:k]), grammar=GrammarSpec("json_object"))])
    assert [t for o in cont["j"] for t in o.new_token_ids] == whole[k:] and cont["j"][-1].finish_reason == FinishReason.STOP


def test_a_request_that_ends_at_its_first_token_is_not_handed_off(model):
    out = _run(_engine(model), [GenerationRequest("one", _prompt(10, 1), 1, handoff=True)])
    assert out["one"][-1].finish_reason == FinishReason.LENGTH and out["one"][-1].handoff is None


def test_prefilled_kv_of_the_wrong_shape_is_refused(model):
    bad = Prefilled(torch.zeros(2, 5, 3), 7, TokenSources())
    with pytest.raises(ValueError, match=r"prefilled KV has shape \(2, 5, 3\)"):
        _engine(model).add_request(GenerationRequest("x", _prompt(5, 0), 4, prefilled=bad))
    with pytest.raises(ValueError, match="not both"):
        GenerationRequest("y", (1, 2), 4, handoff=True, prefilled=bad)
