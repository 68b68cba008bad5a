from __future__ import annotations

import pytest
import torch

from model.sampling import SamplingParams, TokenLogprob, sample, token_logprobs
from model.tokenizer import ByteTokenizer


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams()] * 2, [None, None]).tolist() == [1, 0]


def test_seeded_sampling_is_reproducible_and_respects_top_k():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_k=3, seed=7)
    draws = [int(sample(logits, [p], [torch.Generator().manual_seed(7)])[0]) for _ in range(5)]
    assert len(set(draws)) == 1
    allowed = set(logits[0].topk(3).indices.tolist())
    gen = torch.Generator().manual_seed(1)
    assert {int(sample(logits, [p], [gen])[0]) for _ in range(200)} <= allowed


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.8)
    gen = torch.Generator().manual_seed(0)
    assert {int(sample(logits, [p], [gen])[0]) for _ in range(300)} == {0, 1}


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0.0}, {"top_k": -2}, {"logprobs": -1}, {"logprobs": 21},
                                {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0.0},
                                {"repetition_penalty": 11.0}, {"min_p": 1.5}, {"prompt_logprobs": 21}])
def test_bad_sampling_values_are_rejected(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_byte_tokenizer_round_trip_and_chat_template():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    ids = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert ids[0] == tok.BOS and ids[-1] == tok.ASSISTANT and tok.USER in ids
    with pytest.raises(ValueError, match="robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_logprobs_are_the_raw_log_softmax_with_the_top_alternatives():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(temperature=0.5, logprobs=0)]
    tokens = [int(logits[0].argmax()), 5, 7]  # row 2 "sampled" an unlikely token
    out = token_logprobs(logits, tokens, params)
    ref = logits.log_softmax(-1)
    assert out[1] is None
    assert out[0].token == tokens[0] and out[0].logprob == pytest.approx(float(ref[0, tokens[0]]))
    assert [i for i, _ in out[0].top] == ref[0].topk(3).indices.tolist()
    assert [v for _, v in out[0].top] == pytest.approx(ref[0].topk(3).values.tolist())
    assert out[0].top[0][0] == tokens[0]  # greedy: the chosen token is the most likely
    # the raw distribution, not the temperature-scaled one; no alternatives asked for
    assert out[2] == TokenLogprob(7, pytest.approx(float(ref[2, 7])), ())
    assert token_logprobs(logits, tokens, [SamplingParams()] * 3) == [None] * 3


def test_byte_tokenizer_token_bytes():
    tok = ByteTokenizer()
    assert [tok.token_bytes(i) for i in tok.encode("é")] == [b"\xc3", b"\xa9"]
    assert tok.token_bytes(tok.EOS) == b""


def test_presence_and_frequency_penalties_lower_the_tokens_already_generated():
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.0]])
    assert sample(logits, [SamplingParams(presence_penalty=0.5)], [None], [[0]]).tolist() == [1]
    assert sample(logits, [SamplingParams(presence_penalty=0.5)], [None], [[]]).tolist() == [0]
    # frequency counts each appearance: token 0 twice (-1.0) falls below token 1 seen once (-0.5)
    assert sample(logits, [SamplingParams(frequency_penalty=0.5)], [None], [[0, 0, 1]]).tolist() == [1]
    assert sample(logits, [SamplingParams(frequency_penalty=0.5)], [None], [[0, 1, 1, 1]]).tolist() == [0]
    # a negative penalty favours repeats; without penalties the history changes nothing
    assert sample(logits, [SamplingParams(presence_penalty=-2.0)], [None], [[2]]).tolist() == [0]  # 1.0 + 2 ties 3.0: the first
    assert sample(logits, [SamplingParams(presence_penalty=-2.0)], [None], [[1]]).tolist() == [1]
    assert sample(logits, [SamplingParams()], [None], [[0, 0, 0]]).tolist() == [0]


def test_logit_bias_moves_tokens_up_and_down():
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    up, ban = SamplingParams(logit_bias=((2, 2.5),)), SamplingParams(logit_bias=((3, -100.0),))
    assert sample(logits, [up, ban], [None, None]).tolist() == [2, 2]
    assert sample(logits, [SamplingParams(), up], [None, None]).tolist() == [0, 2]  # per row
    assert logits[0, 2] == 1.0  # the caller's logits are not changed
    # a banned token is never drawn when sampling either
    gen = torch.Generator().manual_seed(0)
    hot = SamplingParams(temperature=2.0, logit_bias=((0, -100.0), (1, -100.0)))
    assert {int(sample(logits[:1], [hot], [gen])[0]) for _ in range(200)} == {2, 3}
    # bias and penalties add up: +0.05 on token 1 (2.95) beats token 0 only once 0 was seen (2.5)
    both = SamplingParams(presence_penalty=0.5, logit_bias=((1, 0.05),))
    assert sample(logits[:1], [both], [None], [[]]).tolist() == [0]
    assert sample(logits[:1], [both], [None], [[0]]).tolist() == [1]


@pytest.mark.parametrize("bias", [((-1, 1.0),), ((3, 100.5),), ((3, float("nan")),)])
def test_bad_logit_bias_is_rejected(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_byte_tokenizer_renders_tools_calls_and_results():
    from model.tool_calls import parse_tool_calls

    tok = ByteTokenizer()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "snow"}]
    ids = tok.apply_chat_template(msgs, tools)
    assert ids[:2] == [tok.BOS, tok.SYSTEM] and ids[-1] == tok.ASSISTANT
    text = tok.decode(ids)
    assert '"name": "get_weather"' in text and "tool c1: snow" in text
    said = tok.decode(ids[ids.index(tok.ASSISTANT) + 1 : ids.index(tok.EOS)])
    assert [(c.name, c.arguments) for c in parse_tool_calls(said)[1]] == [("get_weather", '{"city": "Oslo"}')]
    assert tok.apply_chat_template(msgs[:1]) == [tok.BOS, tok.USER, *tok.encode("weather?"), tok.ASSISTANT]


def _nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> dict[int, float]:
    """Reference: the renormalised probabilities of the top-p nucleus (one row)."""
    probs = (logits / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    keep, mass = [], 0.0
    for t in order:
        keep.append(t)
        mass += float(probs[t])
        if mass >= top_p:
            break
    total = sum(float(probs[t]) for t in keep)
    return {t: float(probs[t]) / total for t in keep}


@pytest.mark.parametrize("shape", ["peaked", "flat"])  # nucleus inside the candidate window / not
def test_batched_sampling_draws_from_the_nucleus_with_its_probabilities(shape):
    from model.sampling import NUCLEUS_CANDIDATES

    gen = torch.Generator().manual_seed(3)
    vocab = 2 * NUCLEUS_CANDIDATES
    logits = torch.randn(vocab, generator=gen) * (4.0 if shape == "peaked" else 0.05)
    p = SamplingParams(temperature=0.8, top_p=0.9)
    want = _nucleus(logits, 0.8, 0.9)
    assert (len(want) < NUCLEUS_CANDIDATES) == (shape == "peaked")
    draws = sample(logits.repeat(4000, 1), [p] * 4000, [None] * 4000).tolist()
    assert set(draws) <= set(want)
    if shape == "peaked":  # total variation from the nucleus distribution
        freq = {t: draws.count(t) / len(draws) for t in want}
        assert sum(abs(freq[t] - want[t]) for t in want) / 2 < 0.05
    else:  # the fallback sorted the whole vocabulary: tokens ranked past the window come out
        rank = {t: i for i, t in enumerate(logits.argsort(descending=True).tolist())}
        assert max(rank[t] for t in draws) >= NUCLEUS_CANDIDATES


def test_temperature_alone_samples_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    draws = sample(logits.repeat(8000, 1), [SamplingParams(temperature=0.5)] * 8000, [None] * 8000).tolist()
    want = (logits / 0.5).softmax(-1).tolist()
    assert sum(abs(draws.count(t) / 8000 - want[t]) for t in range(4)) / 2 < 0.03


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 3000, generator=gen) * 2
    mine = SamplingParams(temperature=1.0, top_p=0.8, seed=11)
    others = [SamplingParams(temperature=0.7, top_k=50), SamplingParams(temperature=1.3), SamplingParams(),
              SamplingParams(temperature=1.0, top_p=0.999), SamplingParams(temperature=0.9, top_k=2999)]
    for seed in range(20):
        alone = int(sample(logits[:1], [mine], [torch.Generator().manual_seed(seed)])[0])
        batch = sample(logits, [mine, *others], [torch.Generator().manual_seed(seed)] + [None] * 5)
        assert int(batch[0]) == alone


def test_the_two_level_draw_inverts_the_whole_cumulative_sum():
    """``_draw`` finds the block first, then the token in it: with the same uniform it picks the
    token the whole vocabulary's float64 cumulative sum picks, in every block (the shorter last
    one too), and never a token of probability 0."""
    from model.sampling import DRAW_BLOCK, _draw

    vocab = 3 * DRAW_BLOCK + 300  # three whole blocks and a short one
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(64, vocab, generator=gen) ** 4
    probs[:, ::7] = 0.0  # masked tokens, block edges among them
    probs[0] = 0.0
    probs[0, -5:] = 1.0  # all the mass in the short block
    probs[1] = 0.0
    probs[1, DRAW_BLOCK - 1] = probs[1, DRAW_BLOCK] = 1.0  # on either side of a block edge
    seeds = [torch.Generator().manual_seed(100 + r) for r in range(64)]
    got = _draw(probs, seeds)
    u = torch.tensor([[1.0 - float(torch.rand(1, generator=torch.Generator().manual_seed(100 + r),
                                              dtype=torch.float64))] for r in range(64)], dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, u * cdf[:, -1:])[:, 0]
    assert torch.equal(got, want)
    assert (probs[torch.arange(64), got] > 0).all()
    assert got[0] >= vocab - 5 and got[1] in (DRAW_BLOCK - 1, DRAW_BLOCK)


def _cpu_sampler():
    from kernels.cpu_gemv import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the CPU kernels are not built")


SAMPLER_MODES = {
    "temperature": [SamplingParams(temperature=0.7)],
    "top_k": [SamplingParams(temperature=1.0, top_k=40)],
    "top_p_peaked": [SamplingParams(temperature=0.8, top_p=0.9)],
    "top_p_flat": [SamplingParams(temperature=1.0, top_p=0.97)],  # the nucleus is past the candidates
    "top_k_and_p": [SamplingParams(temperature=0.9, top_k=200, top_p=0.8)],
    "mixed": [SamplingParams(temperature=0.7), SamplingParams(temperature=1.2, top_k=5),
              SamplingParams(temperature=0.6, top_p=0.5), SamplingParams(temperature=1.0, top_k=4999, top_p=0.99)],
}


@pytest.mark.parametrize("mode", list(SAMPLER_MODES))
def test_the_cpu_sampler_draws_the_torch_references_tokens(mode):
    """fp32 CPU logits take the C++ sampler; with the same uniforms (seeded rows) it draws the
    tokens the batched torch path draws, over a vocabulary of several draw blocks with masked
    tokens, and never a masked one."""
    from model.sampling import _sample_rows, _sample_rows_torch

    _cpu_sampler()
    rows, vocab = 96, 5000
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, vocab, generator=gen) * (0.05 if mode == "top_p_flat" else 3.0)
    logits[:, ::11] = float("-inf")
    params = (SAMPLER_MODES[mode] * rows)[:rows]
    got = _sample_rows(logits, params, [torch.Generator().manual_seed(r) for r in range(rows)])
    want = _sample_rows_torch(logits, params, [torch.Generator().manual_seed(r) for r in range(rows)])
    assert (got == want).sum() >= rows - 1  # a uniform within rounding of a boundary may differ
    assert torch.isfinite(logits[torch.arange(rows), got]).all()
    if mode == "top_p_flat":
        rank = logits.argsort(dim=-1, descending=True).argsort(dim=-1)
        assert int(rank[torch.arange(rows), got].max()) >= 1024  # drawn from past the candidate window


def test_the_cpu_sampler_at_the_top_of_the_cumulative_sum_and_its_errors():
    from kernels.cpu_gemv import sample_rows

    _cpu_sampler()
    logits = torch.full((2, 3000), float("-inf"))
    logits[0, :2500] = 0.0  # u = 1: the last token with any mass, not a masked one after it
    logits[1, 10] = 5.0
    one = torch.ones(2, dtype=torch.float64)
    args = (torch.tensor([1.0, 0.5]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]))
    assert sample_rows(logits, *args, one).tolist() == [2499, 10]
    with pytest.raises(RuntimeError, match="row 1: .* u 0"):
        sample_rows(logits, *args, torch.tensor([0.5, 0.0], dtype=torch.float64))
    with pytest.raises(RuntimeError, match="row 0: temperature 0"):
        sample_rows(logits, torch.tensor([0.0, 1.0]), *args[1:], one)


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    from model.sampling import penalized

    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5], [2.0, -1.0, 3.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0)
    out = penalized(logits, [p, SamplingParams()], None, [[0, 1, 0], [0, 1]])
    assert out[0].tolist() == [1.0, -2.0, 3.0, 0.5] and out[1].tolist() == logits[1].tolist()
    mask = torch.tensor([True, True, False, False])
    assert torch.equal(penalized(logits[:1], [p], None, [mask]), out[:1])
    # greedy under the penalty: the argmax of the penalized logits (here no longer token 0)
    strong = SamplingParams(repetition_penalty=4.0)
    assert not strong.plain_greedy
    assert int(sample(torch.tensor([[2.0, 1.0, -1.0]]), [strong], [None], seen=[[0]])[0]) == 1


@pytest.mark.parametrize("shape", ["peaked", "flat"])  # kept tokens inside the candidate window / not
def test_min_p_draws_only_tokens_that_likely_with_their_probabilities(shape):
    from model.sampling import NUCLEUS_CANDIDATES

    gen = torch.Generator().manual_seed(4)
    vocab = 2 * NUCLEUS_CANDIDATES
    logits = torch.randn(vocab, generator=gen) * (4.0 if shape == "peaked" else 0.05)
    p = SamplingParams(temperature=0.7, min_p=0.1)
    probs = (logits / 0.7).softmax(-1)
    keep = (probs >= 0.1 * probs.max()).nonzero()[:, 0].tolist()
    assert (len(keep) < NUCLEUS_CANDIDATES) == (shape == "peaked")
    draws = sample(logits.repeat(4000, 1), [p] * 4000, [None] * 4000).tolist()
    assert set(draws) <= set(keep)
    if shape == "peaked":  # total variation from the kept tokens' renormalised distribution
        want = {t: float(probs[t]) / float(probs[keep].sum()) for t in keep}
        assert sum(abs(draws.count(t) / len(draws) - want[t]) for t in keep) / 2 < 0.05
    else:  # kept tokens ranked past the window come out too
        rank = {t: i for i, t in enumerate(logits.argsort(descending=True).tolist())}
        assert max(rank[t] for t in draws) >= NUCLEUS_CANDIDATES
