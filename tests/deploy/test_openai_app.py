"""The Serve app end to end through HTTP with the official ``openai`` client."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from model.grammar import GrammarSpec

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tide_home(tmp_path_factory):
    return tmp_path_factory.mktemp("tide")


@pytest.fixture(scope="module")
def base_url(local_ray, tide_home):
    from deploy.app import build_app
    from tests.shared_ray import serving

    home = tide_home
    # The app serves with expert parallelism: routed experts on two expert-shard actors.
    app = build_app({"cache_dir": str(home / "cache"), "usage_dir": str(home / "usage"), "files_dir": str(home / "files"),
                     "replica_cpus": 1, "num_pages": 512,
                     "expert_shards": 2, "micro_batches": 2,
                     "api_keys": {"sk-alpha": "alpha", "sk-beta": "beta:tiny", "sk-gamma": "gamma:other-model"}, "limits": {"max_tokens": 64, "max_request_tokens": 8192, "max_scored_tokens": 2048}})
    with serving(app, 120) as url:
        yield url


@pytest.fixture()
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="sk-alpha", max_retries=0)


def test_models_and_chat(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=8, temperature=0)
    u = r.usage
    assert r.choices[0].finish_reason in ("stop", "length")
    assert u.completion_tokens <= 8 and u.prompt_tokens > 0
    extra = u.model_extra
    assert extra["prompt_cache_hit_tokens"] + extra["prompt_cache_miss_tokens"] == u.prompt_tokens
    assert u.prompt_tokens_details.cached_tokens == extra["prompt_cache_hit_tokens"]


def test_a_batch_through_the_official_client_answers_each_line_as_interactively(client, base_url):
    """files.create, batches.create, batches.retrieve and files.content unchanged: every line's
    answer equals the same request sent interactively (greedy); another tenant sees none of it."""
    import time

    system = "You answer in one short sentence, in English, politely. " * 4  # lines share a prefix
    bodies = [{"model": "tiny", "messages": [{"role": "system", "content": system if i % 2 else "Be brief."},
                                             {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
               "max_tokens": 8, "temperature": 0} for i in range(10)]
    data = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}) + "\n"
                   for i, b in enumerate(bodies)).encode()
    upload = client.files.create(file=("questions.jsonl", data), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len(data)
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"run": "suite"})
    deadline = time.monotonic() + 180
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    assert batch.status == "completed" and batch.request_counts.completed == 10 and batch.error_file_id is None
    assert batch.metadata == {"run": "suite"} and batch.usage.output_tokens > 0
    lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in lines] == [f"q{i}" for i in range(10)]
    # the lines sharing the system prompt ran after the first of them: they found it cached
    hits = [x["response"]["body"]["usage"]["prompt_cache_hit_tokens"] for x in lines[1::2]]
    assert sum(h >= 64 for h in hits) >= 4, hits
    for line, body in zip(lines, bodies, strict=True):
        alone = client.chat.completions.create(**body)
        assert line["response"]["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
    assert batch.id in [b.id for b in client.batches.list()]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    beta = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-beta", max_retries=0)
    for call in (lambda: beta.batches.retrieve(batch.id), lambda: beta.files.content(upload.id),
                 lambda: beta.files.retrieve(batch.output_file_id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in beta.batches.list()]
    metrics = httpx.get(base_url + "/metrics", headers={"Authorization": "Bearer sk-alpha"}, timeout=30).text
    done = re.search(r'tide:batch_lines_done_total\{model_name="tiny",status="completed"\} (\S+)', metrics)
    assert done is not None and float(done.group(1)) >= 10


def test_repeated_long_prompt_hits_the_cache_with_identical_output(client):
    prompt = "The tide comes in and goes out. " * 12  # > 256 tokens with the byte tokenizer
    a = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    b = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.model_extra["prompt_cache_hit_tokens"] == 0
    assert b.usage.model_extra["prompt_cache_hit_tokens"] >= 256
    # where the hit came from: the replica's pool or the node's RAM, its SSD, another node
    assert a.usage.model_extra["prompt_cache_hit_sources"] == {"ram": 0, "ssd": 0, "remote": 0}
    assert sum(b.usage.model_extra["prompt_cache_hit_sources"].values()) == b.usage.model_extra["prompt_cache_hit_tokens"]
    # the cache's accounting: nothing delivered the first time, every whole unit computed for a reason
    first, again = (r.usage.model_extra["prompt_cache_accounting"] for r in (a, b))
    assert first["cacheable_tokens"] >= 256 and first["delivered_tokens"] == 0
    assert sum(first["missed_tokens"].values()) == first["cacheable_tokens"]
    assert again["delivered_tokens"] == b.usage.model_extra["prompt_cache_hit_tokens"]


def test_streaming_with_usage(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "stream me"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens <= 6
    full = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "stream me"}],
                                          max_tokens=6, temperature=0)
    assert text == full.choices[0].message.content


def test_completion_streaming(client):
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="abc", max_tokens=5, temperature=0, stream=True)]
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0)
    assert "".join(pieces) == full.choices[0].text


def test_n_choices_are_the_requests_with_seeds_in_turn(client):
    """``n`` choices of a seeded request: choice i is the same request alone with seed + i;
    the prompt counts once in usage, the completions add up."""
    kw = {"model": "tiny", "prompt": "the tide turns", "max_tokens": 6, "temperature": 1.0,
          "extra_body": {"ignore_eos": True}}
    r = client.completions.create(**kw, n=3, seed=40)
    alone = [client.completions.create(**kw, seed=40 + i) for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone) == 18
    # streamed chat: the chunks of both choices interleave, each adds up to its whole answer
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "two please"}], "max_tokens": 5,
            "temperature": 1.0, "seed": 7, "n": 2, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**chat)
    texts = {0: "", 1: ""}
    chunks = list(client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [10]


def _greedy_alone(prompt_ids: list[int], n: int) -> tuple[list[int], list]:
    """The model computed alone: ``n`` greedy tokens and the log-softmax before each."""
    from model.checkpoint import load_model
    from model.default import default_checkpoint
    from model.generate import generate
    from tests.model.reference import logprobs_alone

    model = load_model(default_checkpoint())
    ids = generate(model, prompt_ids, n, eos_id=None)
    return ids, logprobs_alone(model, prompt_ids, ids)


def test_completion_logprobs_are_the_models(client):
    from model.tokenizer import ByteTokenizer

    kw = {"model": "tiny", "prompt": "the tide", "max_tokens": 5, "temperature": 0, "logprobs": 2,
          "extra_body": {"ignore_eos": True}}
    lp = client.completions.create(**kw).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    # greedy: each token is its step's most likely one, and its logprob is the model's
    ids, refs = _greedy_alone([ByteTokenizer.BOS, *ByteTokenizer().encode("the tide")], 5)
    assert lp.tokens == [ByteTokenizer().token_bytes(i).decode("utf-8", errors="replace") for i in ids]
    assert lp.token_logprobs == pytest.approx([float(r[i]) for r, i in zip(refs, ids, strict=True)], abs=1e-3)
    assert all(max(top.values()) == pytest.approx(v, abs=1e-6) for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    # streamed: the same tokens, their offsets continue across chunks
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True)]
    assert sum((c.tokens for c in chunks if c), []) == lp.tokens
    assert sum((c.text_offset for c in chunks if c), []) == lp.text_offset
    assert client.completions.create(**{**kw, "logprobs": None}).choices[0].logprobs is None


def test_echo_returns_the_prompt_scored_by_the_model(client):
    """``echo`` with ``logprobs``, as evaluation harnesses score text (lm-eval's loglikelihood):
    each prompt token's logprob is the model's on the whole prompt, the first has none, and
    the completion's own tokens follow; ``max_tokens`` 0 returns the scored prompt alone; a
    streamed echo sends the same."""
    from model.checkpoint import load_model
    from model.default import default_checkpoint
    from model.tokenizer import ByteTokenizer
    from tests.model.reference import prompt_logprobs_alone

    tok = ByteTokenizer()
    prompt = "The tide comes in. " * 16  # several whole units: a cached copy is there, and is not used
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    ids = [tok.BOS, *tok.encode(prompt)]
    ref = prompt_logprobs_alone(load_model(default_checkpoint()), ids)
    kw = {"model": "tiny", "prompt": prompt, "temperature": 0, "echo": True, "logprobs": 2}
    scored = client.completions.create(**kw, max_tokens=0)
    only = scored.choices[0]
    assert only.text == prompt and only.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    assert scored.usage.model_extra["prompt_cache_hit_tokens"] == 0
    lp = only.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([float(ref[i, t]) for i, t in enumerate(ids[1:])], abs=1e-4)
    want = []  # keyed by text: of two alternatives with the same text (special tokens), the likelier one's
    for i in range(len(ids) - 1):
        top: dict[str, float] = {}
        for j in ref[i].topk(2).indices:
            top.setdefault(tok.token_bytes(int(j)).decode("utf-8", errors="replace"), float(ref[i, j]))
        want.append(top)
    assert [list(t) for t in lp.top_logprobs[1:]] == [list(t) for t in want]
    assert [v for t in lp.top_logprobs[1:] for v in t.values()] == pytest.approx([v for t in want for v in t.values()],
                                                                                abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    # with a completion: the prompt's text and scores, then the completion's, offsets running on
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    both = client.completions.create(**kw, max_tokens=3).choices[0]
    assert both.text == prompt + plain.choices[0].text
    assert both.logprobs.token_logprobs == pytest.approx(lp.token_logprobs + plain.choices[0].logprobs.token_logprobs,
                                                         abs=1e-4)
    assert both.logprobs.text_offset == [sum(len(t) for t in both.logprobs.tokens[:i]) for i in range(len(ids) + 3)]
    chunks = [c.choices[0] for c in client.completions.create(**kw, max_tokens=3, stream=True)]
    assert "".join(c.text for c in chunks) == both.text
    assert sum((c.logprobs.token_logprobs for c in chunks), []) == pytest.approx(both.logprobs.token_logprobs, abs=1e-4)
    # echo without logprobs: the text only
    assert client.completions.create(model="tiny", prompt="ab", max_tokens=0, echo=True).choices[0].text == "ab"


def test_vllms_prompt_logprobs_score_the_prompt_of_completions_and_chats(client):
    """prompt_logprobs k: per prompt token (the first has none) its logprob and rank, and the k
    most likely tokens there, as the model alone gives them; per choice for completions (each
    prompt of a batch its own), once for a chat; refused with stream, as vLLM does."""
    from model.checkpoint import load_model
    from model.default import default_checkpoint
    from model.tokenizer import ByteTokenizer
    from tests.model.reference import prompt_logprobs_alone

    tok, model = ByteTokenizer(), load_model(default_checkpoint())

    def check(got: list, ids: list[int]) -> None:
        ref = prompt_logprobs_alone(model, ids)
        assert len(got) == len(ids) and got[0] is None
        for i, (entry, t) in enumerate(zip(got[1:], ids[1:], strict=True)):
            want = {t, *ref[i].topk(2).indices.tolist()}
            assert {int(k) for k in entry} == want
            assert entry[str(t)]["logprob"] == pytest.approx(float(ref[i, t]), abs=1e-4)
            assert entry[str(t)]["rank"] == 1 + int((ref[i] > ref[i, t]).sum())

    r = client.completions.create(model="tiny", prompt=["low tide", "ebb"], max_tokens=2, n=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})  # each prompt scored once, for both choices
    for i, choice in enumerate(r.choices):
        check(choice.model_extra["prompt_logprobs"], [tok.BOS, *tok.encode(["low tide", "ebb"][i // 2])])
    msgs = [{"role": "user", "content": "score me"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, n=2, temperature=0,
                                          extra_body={"prompt_logprobs": 2})
    check(chat.model_extra["prompt_logprobs"], tok.apply_chat_template(msgs))
    with pytest.raises(openai.BadRequestError, match="not supported with stream"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1})


def test_a_batch_of_prompts_gets_each_prompts_choices_in_order(client):
    """A list of prompts (texts or token ids) is a batch: prompt p's n choices are indexes p*n ..
    p*n+n-1, each what that prompt alone gets (seeded choices with seed + j), and the usage
    counts every prompt once."""
    prompts = ["low tide", "high water mark", "ebb"]
    kw = {"model": "tiny", "max_tokens": 5, "temperature": 0.9, "seed": 11, "n": 2}
    batch = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in batch.choices] == list(range(6))
    singles = []
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(prompt=prompt, **kw)
        assert [c.text for c in batch.choices[2 * p : 2 * p + 2]] == [c.text for c in alone.choices], prompt
        singles.append(alone.usage)
    assert batch.usage.prompt_tokens == sum(u.prompt_tokens for u in singles)
    assert batch.usage.completion_tokens == sum(u.completion_tokens for u in singles)
    ids = client.completions.create(model="tiny", prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert [c.text for c in ids.choices] == [
        client.completions.create(model="tiny", prompt=p, max_tokens=2, temperature=0).choices[0].text
        for p in ([1, 2, 3], [4, 5])]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, **kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(6)] == [c.text for c in batch.choices]


def _alone(prompt: str | list[int], n: int, grammar: GrammarSpec | None = None, **params) -> list[int]:
    """The default model's ``n`` tokens after ``prompt`` (a completion prompt's text, or ids),
    computed alone; under ``grammar``'s masks where one is given."""
    from model.checkpoint import load_model
    from model.default import default_checkpoint
    from model.generate import generate
    from model.grammar import Grammars
    from model.sampling import SamplingParams
    from model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    model = load_model(default_checkpoint())
    ids = [tok.BOS, *tok.encode(prompt)] if isinstance(prompt, str) else prompt
    state = Grammars(tok.grammar_vocab(), model.cfg.vocab_size, [tok.EOS]).state(grammar) if grammar else None
    return generate(model, ids, n, SamplingParams(**params), eos_id=tok.EOS if grammar else None, grammar=state)


def test_penalties_equal_the_model_alone(client):
    from model.tokenizer import ByteTokenizer

    for kw in ({"frequency_penalty": 1.5}, {"presence_penalty": 2.0}):
        r = client.completions.create(model="tiny", prompt="penalize me", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}, **kw)
        ids = _alone("penalize me", 12, **kw)
        assert r.choices[0].text == ByteTokenizer().decode(ids), kw
        assert ids != _alone("penalize me", 12), kw  # the penalty mattered


def test_sampling_values_below_float32s_resolution_are_answered_greedily(client):
    """temperature or top_p of 1e-300 (issue 49: 0 in float32, whose sampler check ended every
    stream on the replica) are a 200 with the greedy text."""
    from model.tokenizer import ByteTokenizer

    want = ByteTokenizer().decode(_alone("tiny values", 8))
    for kw in ({"temperature": 1e-300}, {"temperature": 0.8, "top_p": 1e-300}):
        r = client.completions.create(model="tiny", prompt="tiny values", max_tokens=8,
                                      extra_body={"ignore_eos": True}, **kw)
        assert r.choices[0].text == want, kw


def test_vllms_sampling_extensions_equal_the_model_alone(client):
    """repetition_penalty and min_p (vLLM's extra parameters) sample what the model alone does;
    stop_token_ids end the output at that token and min_tokens holds it back."""
    from model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    for extra, sampled in (({"repetition_penalty": 1.6}, {"temperature": 0}),
                           ({"min_p": 0.3}, {"temperature": 1.0, "seed": 3})):
        r = client.completions.create(model="tiny", prompt="say it again", max_tokens=12,
                                      extra_body={"ignore_eos": True, **extra}, **sampled)
        assert r.choices[0].text == tok.decode(_alone("say it again", 12, **sampled, **extra)), extra
    greedy = _alone("say it again", 12)
    assert _alone("say it again", 12, repetition_penalty=1.6) != greedy  # each mattered
    assert _alone("say it again", 12, temperature=1.0, seed=3, min_p=0.3) != _alone("say it again", 12, temperature=1.0,
                                                                                   seed=3)
    at = next(i for i in range(1, 8) if greedy[i] not in greedy[:i])  # a token first seen at position at
    stop = greedy[at]
    r = client.completions.create(model="tiny", prompt="say it again", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert r.usage.completion_tokens == at + 1 and r.choices[0].finish_reason == "stop"
    held = client.completions.create(model="tiny", prompt="say it again", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [stop], "min_tokens": 8})
    assert held.usage.completion_tokens >= 8


def test_vllms_chat_template_and_stop_string_options(client, base_url):
    """continue_final_message goes on from the last (assistant's) message as DeepSeek's prefix
    does; add_generation_prompt false ends the prompt after the last message (as /tokenize
    then counts it); include_stop_str_in_output keeps the stop string in the text."""
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}]
    kw = {"model": "tiny", "max_tokens": 6, "temperature": 0}
    prefixed = client.chat.completions.create(messages=[msgs[0], {**msgs[1], "prefix": True}], **kw)
    continued = client.chat.completions.create(messages=msgs, extra_body={"continue_final_message": True,
                                                                          "add_generation_prompt": False}, **kw)
    assert continued.choices[0].message.content == prefixed.choices[0].message.content
    assert continued.usage.prompt_tokens == prefixed.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt false"):
        client.chat.completions.create(messages=msgs, extra_body={"continue_final_message": True}, **kw)
    bare = client.chat.completions.create(messages=msgs[:1], extra_body={"add_generation_prompt": False}, **kw)
    usual = client.chat.completions.create(messages=msgs[:1], **kw)
    assert bare.usage.prompt_tokens == usual.usage.prompt_tokens - 1  # the byte tokenizer's assistant marker
    counted = httpx.post(base_url + "/tokenize", headers={"Authorization": "Bearer sk-alpha"}, timeout=30, json={
        "model": "tiny", "messages": msgs[:1], "add_generation_prompt": False}).json()
    assert counted["count"] == bare.usage.prompt_tokens
    text = client.completions.create(model="tiny", prompt="stop here", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[2:4]
    cut = client.completions.create(model="tiny", prompt="stop here", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert cut.choices[0].text == text[: text.index(stop) + 2] and cut.choices[0].finish_reason == "stop"


def test_logit_bias_equals_the_model_alone(client):
    from model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    plain = _alone("bias me", 8)
    for bias in ({str(plain[0]): -100}, {str(tok.encode("z")[0]): 100, str(plain[1]): -5}):
        r = client.completions.create(model="tiny", prompt="bias me", max_tokens=8, temperature=0,
                                      logit_bias=bias, extra_body={"ignore_eos": True})
        ids = _alone("bias me", 8, logit_bias=tuple((int(t), float(b)) for t, b in bias.items()))
        assert r.choices[0].text == tok.decode(ids) and ids != plain, bias


# fewer spaces and commas, and a nudge to close: this model's JSON objects then end within 64 tokens
COMPACT = {str(ord(" ")): -10, str(ord("}")): 2.5, str(ord(",")): -4}


def test_json_mode_is_one_json_object_equal_to_the_model_alone(client):
    from model.tokenizer import ByteTokenizer

    r = client.completions.create(model="tiny", prompt="Reply in JSON", max_tokens=64, temperature=0,
                                  logit_bias=COMPACT, extra_body={"response_format": {"type": "json_object"}})
    bias = tuple((int(t), b) for t, b in COMPACT.items())
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].text), dict), r
    ids = _alone("Reply in JSON", 64, GrammarSpec("json_object"), logit_bias=bias)
    assert r.choices[0].text == ByteTokenizer().decode(ids) and r.usage.completion_tokens == len(ids)
    assert ids != _alone("Reply in JSON", 64, logit_bias=bias)  # the masks mattered

    # chat, streamed: the deltas make up the object
    msgs = [{"role": "user", "content": "Reply in JSON"}]
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=64, temperature=0, stream=True,
                                            logit_bias=COMPACT, response_format={"type": "json_object"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict)
    chat_ids = ByteTokenizer().apply_chat_template(msgs)
    assert text == ByteTokenizer().decode(_alone(chat_ids, 64, GrammarSpec("json_object"), logit_bias=bias))


ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}, "n": {"type": "integer"},
                                          "ok": {"type": "boolean"}},
          "required": ["answer", "n"], "additionalProperties": False}


def test_json_schema_output_is_valid_and_equals_the_model_alone(client):
    jsonschema = pytest.importorskip("jsonschema")
    from model.tokenizer import ByteTokenizer

    bias = {str(ord(c)): -10 for c in " \n\t\r"} | {str(ord("}")): 2}  # compact, and this model closes its object
    r = client.completions.create(model="tiny", prompt="Reply in JSON", max_tokens=64, temperature=0, logit_bias=bias,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "answer", "schema": ANSWER}}})
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), ANSWER)
    ids = _alone("Reply in JSON", 64, GrammarSpec("json_schema", json.dumps(ANSWER)), logit_bias=tuple((int(t), float(b)) for t, b in bias.items()))
    assert text == ByteTokenizer().decode(ids)


CALLABLE = [{"type": "function", "function": {"name": "set_level", "parameters": {
                 "type": "object", "properties": {"level": {"type": "integer"}}, "required": ["level"],
                 "additionalProperties": False}}},
             {"type": "function", "function": {"name": "stop_all", "parameters": {
                 "type": "object", "properties": {"now": {"type": "boolean"}}, "required": ["now"],
                 "additionalProperties": False}}}]


def test_tool_choice_required_is_one_call_of_one_of_the_tools(client):
    """tool_choice required: the output is generated under a schema of one call ({NAME: ARGUMENTS},
    each tool's arguments per its parameters) and comes back as that call, the same as the model
    alone under that schema's masks, whole and streamed."""
    jsonschema = pytest.importorskip("jsonschema")
    from deploy.ingress import structured
    from deploy.protocol import ChatCompletionRequest
    from model.tokenizer import ByteTokenizer

    msgs = [{"role": "user", "content": "Call a tool"}]
    bias = {str(ord(c)): -10 for c in " \n\t\r"} | {str(ord("}")): 2}  # compact, and this model closes its object
    kw = {"model": "tiny", "messages": msgs, "tools": CALLABLE, "tool_choice": "required", "max_tokens": 64,
          "temperature": 0, "logit_bias": bias}
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    params = {t["function"]["name"]: t["function"]["parameters"] for t in CALLABLE}
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    spec = structured.required_grammar(ChatCompletionRequest(**kw), 65536)
    chat_ids = ByteTokenizer().apply_chat_template(msgs, CALLABLE)
    alone = ByteTokenizer().decode(_alone(chat_ids, 64, spec,
                                          logit_bias=tuple((int(t), float(b)) for t, b in bias.items())))
    assert json.loads(alone) == {call.function.name: json.loads(call.function.arguments)}
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [(call.function.name,
                                                                               call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # a call cut short by max_tokens: finish_reason length, and no half call as content
    cut = client.chat.completions.create(**{**kw, "max_tokens": 6}).choices[0]
    assert cut.finish_reason == "length" and not cut.message.content and not cut.message.tool_calls, cut
    chunks = list(client.chat.completions.create(**{**kw, "max_tokens": 6}, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_vllms_structured_outputs_choose_among_texts_and_follow_schemas(client):
    """structured_outputs choice (and guided_choice): the output is one of the texts, the same
    as the model alone under the choice's masks; structured_outputs json is response_format's
    json_schema by another name."""
    from model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    choices = ["calm", "rough", "stormy sea"]
    alone = tok.decode(_alone("The sea is", 16, GrammarSpec("choice", choices=tuple(choices))))
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = client.completions.create(model="tiny", prompt="The sea is", max_tokens=16, temperature=0, extra_body=extra)
        assert r.choices[0].text == alone and r.choices[0].text in choices
        assert r.choices[0].finish_reason == "stop"
    sampled = {client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Sea?"}],
                                              max_tokens=16, temperature=1.5, seed=s,
                                              extra_body={"guided_choice": choices}).choices[0].message.content
               for s in range(6)}
    assert sampled <= set(choices)
    bias = {str(ord(c)): -10 for c in " \n\t\r"} | {str(ord("}")): 2}
    kw = {"model": "tiny", "prompt": "Reply in JSON", "max_tokens": 64, "temperature": 0, "logit_bias": bias}
    by_vllm = client.completions.create(**kw, extra_body={"structured_outputs": {"json": ANSWER}})
    by_openai = client.completions.create(**kw, extra_body={"response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}})
    assert by_vllm.choices[0].text == by_openai.choices[0].text
    # a regex and an EBNF grammar: the output matches it whole, the same as the model alone
    for extra, spec, whole in (
            ({"structured_outputs": {"regex": "[a-z]+( [a-z]+)?[.]"}}, GrammarSpec("regex", "[a-z]+( [a-z]+)?[.]"),
             r"[a-z]+( [a-z]+)?[.]"),
            ({"guided_grammar": 'root ::= "tide " ("in" | "out")'}, GrammarSpec("grammar", 'root ::= "tide " ("in" | "out")'),
             "tide (in|out)")):
        r = client.completions.create(model="tiny", prompt="The sea is", max_tokens=24, temperature=0, extra_body=extra)
        assert re.fullmatch(whole, r.choices[0].text) and r.choices[0].finish_reason == "stop", r.choices[0]
        assert r.choices[0].text == tok.decode(_alone("The sea is", 24, spec))


@pytest.mark.parametrize(("schema", "needle"), [
    ({"type": "object", "not": {"required": ["a"]}}, "'not'"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"enum": ["x" * 70000]}, "over the limit")])
def test_a_schema_it_cannot_enforce_is_a_400_naming_what(base_url, schema, needle):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = httpx.post(base_url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-alpha"}, timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": fmt})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_chat_logprobs_with_top_alternatives(client):
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    r = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.bytes) <= 1  # the byte tokenizer: one byte a token (none for a special token)
    assert client.chat.completions.create(**kw).choices[0].logprobs is None


def _token_sources(base_url) -> dict[str, float]:
    assert httpx.get(base_url + "/metrics", timeout=30).status_code == 401  # keys configured: /metrics needs one
    text = httpx.get(base_url + "/metrics", headers={"Authorization": "Bearer sk-alpha"}, timeout=30).text
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["source"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "tide:prompt_tokens_total"}


@pytest.mark.security
def test_tenants_do_not_share_cache_and_nothing_reveals_a_cross_tenant_hit(base_url):
    prompt = "tenant isolation check " * 15
    alpha = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-alpha", max_retries=0)
    beta = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-beta", max_retries=0)
    alpha.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = alpha.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.model_extra["prompt_cache_hit_tokens"] >= 64  # cacheable: alpha hits its own units
    before = _token_sources(base_url)
    r = beta.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    after = _token_sources(base_url)
    # the usage fields say "miss", and beta's request really computed every prompt token: it did
    # the work (and took the time) of a cold request, so its latency cannot reveal alpha's units
    assert r.usage.model_extra["prompt_cache_hit_tokens"] == 0 == r.usage.prompt_tokens_details.cached_tokens
    assert r.usage.model_extra["prompt_cache_miss_tokens"] == r.usage.prompt_tokens
    assert after["compute"] - before.get("compute", 0) == r.usage.prompt_tokens
    assert all(after.get(s, 0) == before.get(s, 0) for s in ("ram", "ssd", "remote"))


@pytest.mark.security
def test_a_key_without_access_to_the_model_gets_403(base_url):
    gamma = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-gamma", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="no access to model 'tiny'"):
        gamma.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert gamma.models.list().data == []  # it sees no model it may not use
    with pytest.raises(openai.NotFoundError, match="model 'tiny' does not exist"):
        gamma.models.retrieve("tiny")
    beta = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-beta", max_retries=0)
    assert [m.id for m in beta.models.list().data] == ["tiny"]
    assert beta.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="model 'org/other' does not exist"):
        beta.models.retrieve("org/other")


@pytest.mark.security
def test_an_oversized_body_is_refused_also_without_content_length(base_url):
    body = json.dumps({"model": "tiny", "prompt": "x" * (5 << 20), "max_tokens": 2}).encode()
    headers = {"Authorization": "Bearer sk-alpha", "Content-Type": "application/json"}
    r = httpx.post(base_url + "/v1/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: Transfer-Encoding: chunked
        for i in range(0, len(body), 1 << 20):
            yield body[i : i + (1 << 20)]

    r = httpx.post(base_url + "/v1/completions", content=chunked(), headers=headers, timeout=60)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    # without a key: refused before the body is read (401, not 413 or a validation error)
    r = httpx.post(base_url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 401


@pytest.mark.security
def test_api_keys_never_reach_the_logs(base_url):
    import ray

    r = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                   headers={"Authorization": "Bearer sk-alpha"}, timeout=60)
    assert r.status_code == 200
    httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "x"},
               headers={"Authorization": "Bearer sk-not-a-key"}, timeout=60)
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    leaked = [p for p in logs.rglob("*") if p.is_file() and (b"sk-alpha" in p.read_bytes() or b"sk-not-a-key" in p.read_bytes())]
    assert leaked == []


@pytest.mark.parametrize("body, status, needle", [
    ({"model": "nope", "prompt": "x", "max_tokens": 2}, 404, "nope"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x" * 5000, "max_tokens": 2}, 400, "context length"),
    ({"model": "tiny", "prompt": [1, 99999], "max_tokens": 2}, 400, "99999"),
    ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "tiny", "prompt": "x", "n": 9}, 400, "n=9"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "seed": 2**64}, 400, "seed"),  # was a 500
    # accepted at their defaults, refused otherwise rather than silently ignored
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "0 with echo"),
    ({"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "a[+"}}, 400, "structured_outputs regex"),
    ({"model": "tiny", "prompt": "x", "guided_grammar": "root ::= nowhere"}, 400, "structured_outputs grammar"),
    ({"model": "tiny", "prompt": "x", "guided_choice": ["a"], "response_format": {"type": "json_object"}}, 400,
     "response_format or structured_outputs"),
    ({"model": "tiny", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": "tiny", "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [99999]}, 400, "stop token id 99999"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens=5 exceeds max_tokens=4"),
    ({"model": "tiny", "prompt": ["x", "y" * 5000]}, 400, "prompt 1 of the batch"),
    ({"model": "tiny", "prompt": ["x"] * 65}, 400, "batch of 65 prompts"),
    ({"model": "tiny", "prompt": ["x", ""]}, 400, "prompt 1 of the batch is empty"),
    ({"model": "tiny", "prompt": [[1], [2, 99999]]}, 400, "99999"),
    ({"model": "tiny", "prompt": "x", "echo": True, "suffix": "y"}, 400, "echo and suffix"),
    ({"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"seven": 5}}, 400, "logit_bias key 'seven'"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias key '99999'"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"7": 101}}, 400, "must be in [-100, 100]"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"1" * 5000: 1}}, 400, "(5000 characters)"),  # was a 500
    ({"model": "tiny", "prompt": "x", "best_of": 2}, 400, "best_of"),
    # a request's cost (issue 49): n 8 of a 1,500-token prompt with 64 tokens each; 2,202 tokens scored
    ({"model": "tiny", "prompt": "x" * 1500, "n": 8, "max_tokens": 64}, 400, "limits.max_request_tokens"),
    ({"model": "tiny", "prompt": ["x" * 1100, "y" * 1100], "echo": True, "logprobs": 1, "max_tokens": 0}, 400,
     "limits.max_scored_tokens"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "no fill-in-the-middle tokens"),  # the byte tokenizer
])
def test_bad_requests_get_openai_errors(base_url, body, status, needle):
    r = httpx.post(base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-alpha"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_tool_parameters_nested_too_deep_are_a_400_on_chat_and_responses(base_url):
    """Issue 49: parameters nested 300 deep (a RecursionError, a 500) are refused by name."""
    params: dict = {"type": "object", "properties": {}}
    inner = params
    for _ in range(300):
        inner["properties"]["a"] = {"type": "object", "properties": {}}
        inner = inner["properties"]["a"]
    tools = [{"type": "function", "function": {"name": "deep", "parameters": params}}]
    auth = {"Authorization": "Bearer sk-alpha"}
    chat = httpx.post(base_url + "/v1/chat/completions", headers=auth, timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "required"})
    flat = [{"type": "function", "name": "deep", "parameters": params}]
    responses = httpx.post(base_url + "/v1/responses", headers=auth, timeout=30, json={
        "model": "tiny", "input": "x", "tools": flat, "tool_choice": "required"})
    for r in (chat, responses):
        assert r.status_code == 400, r.text
        assert "nest more than 128" in r.json()["error"]["message"]


def test_an_over_long_prompt_names_the_field_it_came_in(base_url):
    auth = {"Authorization": "Bearer sk-alpha"}
    r = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 5000, "max_tokens": 2},
                   headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(base_url + "/v1/chat/completions", headers=auth, timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_unknown_paths_wrong_methods_and_content_types_get_openai_errors(base_url):
    auth = {"Authorization": "Bearer sk-alpha"}
    r = httpx.get(base_url + "/v1/engines", headers=auth, timeout=30)
    assert r.status_code == 404 and "/v1/engines" in r.json()["error"]["message"]
    r = httpx.get(base_url + "/v1/chat/completions", headers=auth, timeout=30)
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/v1/completions", content=json.dumps({"model": "tiny", "prompt": "x"}),
                   headers={**auth, "Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], r.text


def test_tokenize_detokenize_and_version(base_url, client):
    auth = {"Authorization": "Bearer sk-alpha"}
    r = httpx.post(base_url + "/tokenize", json={"model": "tiny", "prompt": "hi"}, headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert r.json()["count"] == len(tokens) and r.json()["max_model_len"] > 0
    # the ids a completion of that prompt counts as its prompt
    done = client.completions.create(model="tiny", prompt="hi", max_tokens=1, temperature=0)
    assert done.usage.prompt_tokens == len(tokens)
    back = httpx.post(base_url + "/detokenize", json={"model": "tiny", "tokens": tokens}, headers=auth, timeout=30)
    assert back.status_code == 200 and back.json()["prompt"].endswith("hi")
    chat = httpx.post(base_url + "/tokenize", headers=auth, timeout=30,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).json()
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens
    assert httpx.post(base_url + "/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 401
    bad = httpx.post(base_url + "/detokenize", json={"tokens": [10**9]}, headers=auth, timeout=30)
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    from importlib.metadata import version

    assert httpx.get(base_url + "/version", timeout=30).json() == {"version": version("tideserve")}


def test_chat_parameters_this_server_lacks_are_refused_and_their_defaults_accepted(base_url, client):
    msgs = [{"role": "user", "content": "x"}]
    for extra, needle in (({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"},
                           "tool_choice 'any' is not supported"),
                          ({"tool_choice": "required"}, "tool_choice required needs tools"),
                          ({"response_format": {"type": "xml"}}, "'xml' is not supported")):
        r = httpx.post(base_url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-alpha"}, timeout=30,
                       json={"model": "tiny", "messages": msgs, **extra})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, presence_penalty=0,
                                       frequency_penalty=0, response_format={"type": "text"})
    assert r.usage.completion_tokens <= 2


def test_documented_openai_fields_are_accepted_through_the_official_client(base_url, client):
    """What OpenAI's clients send (the Agents SDK's ``include``, ``store``, ``metadata``...)
    reaches a 200 through the real ingress; a capability this server lacks is a 400 naming it."""
    msgs = [{"role": "user", "content": "x"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, store=True, metadata={"k": "v"},
                                       prompt_cache_key="conv-1", safety_identifier="u1", verbosity="low",
                                       reasoning_effort="low", service_tier="auto", user="u1", modalities=["text"],
                                       parallel_tool_calls=False, audio=None)
    assert r.usage.completion_tokens <= 2
    r = client.responses.create(model="tiny", input="x", max_output_tokens=2, include=["reasoning.encrypted_content"],
                                store=False, metadata={"k": "v"}, truncation="auto", prompt_cache_key="conv-1",
                                safety_identifier="u1", max_tool_calls=3, top_logprobs=0)
    assert r.metadata == {"k": "v"} and r.usage.output_tokens <= 2
    for route, body, field in (("/v1/chat/completions", {"messages": msgs, "audio": {"voice": "alloy", "format": "wav"},
                                                         "modalities": ["text", "audio"]}, "audio"),
                               ("/v1/responses", {"input": "x", "conversation": "conv_1"}, "conversation")):
        r = httpx.post(base_url + route, headers={"Authorization": "Bearer sk-alpha"}, timeout=30,
                       json={"model": "tiny", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_stored_responses_chain_list_their_input_and_delete(base_url, client):
    """store (the default): a Response can be retrieved, its input items listed, and a request
    naming it as previous_response_id goes on from its conversation, as the same chat sent
    whole would (and finds that conversation's units in the prompt cache); another tenant sees
    none of it; a deleted or unstored one is a 404."""
    first_text = "The tide comes in twice a day and goes out twice a day. " * 3
    first = client.responses.create(model="tiny", input=first_text, max_output_tokens=8, temperature=0)
    assert first.store and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model="tiny", input="Say it again.", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    whole = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": first_text}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Say it again."}])
    assert second.output_text == whole.choices[0].message.content
    assert second.usage.input_tokens_details.cached_tokens > 0  # the stored conversation's units
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["Say it again."] and not items.has_more
    # streamed, and chained from a streamed one
    events = list(client.responses.create(model="tiny", input="Once more.", previous_response_id=second.id,
                                          max_output_tokens=8, temperature=0, stream=True))
    third = events[-1].response  # its last event (incomplete: max_output_tokens) holds the whole Response
    assert client.responses.retrieve(third.id).output_text == third.output_text
    other = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-beta", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=2)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert client.responses.retrieve(second.id).id == second.id  # its own record holds the conversation
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_top_logprobs_without_logprobs_is_refused(base_url):
    r = httpx.post(base_url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-alpha"}, timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]


def test_malformed_json_and_missing_key(base_url):
    r = httpx.post(base_url + "/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": "Bearer sk-alpha", "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
    assert r.status_code == 401
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def _gauge_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's series whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics(base_url, client, tide_home):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=2, temperature=0)
    client.completions.create(model="tiny", prompt="the cache gauge counts what is on disk. " * 5, max_tokens=2,
                              temperature=0)  # 200 bytes: 3 units are persisted
    import time

    deadline = time.monotonic() + 60
    while True:  # units are written after the request finishes, and counted once the agent indexed them
        text = httpx.get(base_url + "/metrics", headers={"Authorization": "Bearer sk-alpha"}, timeout=30).text
        units = _gauge_sum(text, "tide:cache_units", tier="ssd")
        on_disk = sum(p.stat().st_size for p in (tide_home / "cache").rglob("*")
                      if p.is_file() and p.suffix in (".seg", ".unit"))
        if units >= 3 and _gauge_sum(text, "tide:cache_bytes", tier="ssd") == on_disk or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert units >= 3 and on_disk > 0
    assert _gauge_sum(text, "tide:cache_bytes", tier="ssd") == on_disk  # the agents' bytes are the files' bytes
    assert _gauge_sum(text, "tide:prompt_tokens_total", source="compute") > 0
    assert _gauge_sum(text, "tide:generation_tokens_total") >= 4
    assert _gauge_sum(text, "tide:request_success_total", status="ok") >= 2
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds"):
        assert _gauge_sum(text, f"tide:{histogram}_count") >= 2, histogram
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert samples and all(s.labels.get("model_name") == "tiny" for s in samples)  # on every series
    # one series per replica, from each replica's heartbeat
    from ray import serve

    replicas = serve.status().applications["tideserve"].deployments["LLMServer"].replica_states["RUNNING"]
    for name in ("tide:num_requests_running", "tide:num_requests_waiting", "tide:kv_cache_usage_perc"):
        series = [s for s in samples if s.name == name]
        assert len(series) == replicas and {s.labels["deployment"] for s in series} == {"LLMServer"}, series
        assert len({s.labels["replica"] for s in series}) == replicas
    assert all(0.0 <= s.value <= 1.0 for s in samples if s.name == "tide:kv_cache_usage_perc")
    # the app serves with two expert shards: its placement is a series too
    assert _gauge_sum(text, "tide:ep_shards") == 2 and _gauge_sum(text, "tide:ep_placement_version") > 0
    import torch

    if not torch.cuda.is_available():
        assert _gauge_sum(text, "tide:gpus") == 0  # absent GPUs are reported as absent
    json.dumps(text)


def test_the_dashboards_queries_return_data_from_a_real_prometheus(base_url, client, tmp_path):
    """A real Prometheus scrapes /metrics (with a key, as the PodMonitor does) while requests run;
    every query of the shipped Grafana dashboard returns data."""
    import shutil
    import subprocess
    import time
    from urllib.parse import urlparse

    import yaml

    from tests.conftest import require

    exe = shutil.which("prometheus")
    require(exe is not None, "prometheus is not installed (Debian package prometheus)")
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "tideserve.json").read_text())
    target = urlparse(base_url)
    from deploy.redis_proc import free_port

    port = free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "tideserve", "metrics_path": "/metrics",
                            "authorization": {"credentials": "sk-alpha"},
                            "static_configs": [{"targets": [f"{target.hostname}:{target.port}"]}]}]}))
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([exe, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)

    def query(expr: str) -> list:
        try:
            resp = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=10)
        except httpx.HTTPError:
            return []
        if resp.status_code == 503:  # Prometheus says "Service Unavailable" until it is ready
            return []
        r = resp.json()
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]

    try:
        deadline = time.monotonic() + 60
        while not [x for x in query('up{job="tideserve"}') if x["value"][1] == "1"]:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.5)
        for i in range(6):  # a short load, spread over a few scrapes
            client.completions.create(model="tiny", prompt=f"dashboard {i} " * 12, max_tokens=4, temperature=0)
            time.sleep(0.5)
        exprs = [t["expr"].replace("$__rate_interval", "1m").replace("$model_name", ".*")
                 for panel in dashboard["panels"] for t in panel["targets"]]
        deadline = time.monotonic() + 60
        while (empty := [e for e in exprs if not query(e)]) and time.monotonic() < deadline:
            time.sleep(1)
        assert empty == []
        # the dashboard's model variable, label_values(tide:generation_tokens_total, model_name),
        # as Grafana asks it: over the dashboard's time range (an instant query has nothing
        # while a scrape that timed out on a busy machine has marked the series stale)
        values = httpx.get(f"http://127.0.0.1:{port}/api/v1/label/model_name/values", timeout=10,
                           params={"match[]": "tide:generation_tokens_total", "start": time.time() - 3600}).json()
        assert values["status"] == "success" and values["data"] == ["tiny"], values
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_finished_requests_are_logged_for_tide_stats(client, tide_home):
    import time

    from cluster.daily_report import UsageRecord, read_jsonl

    r = client.completions.create(model="tiny", prompt="usage " * 30, max_tokens=5, temperature=0)
    deadline = time.monotonic() + 10
    while True:
        records = read_jsonl(sorted((tide_home / "usage").glob("*.jsonl")), UsageRecord)
        match = [u for u in records if u.prompt_tokens == r.usage.prompt_tokens
                 and u.completion_tokens == r.usage.completion_tokens]
        if match or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert match, records
    assert match[-1].cached_tokens == r.usage.model_extra["prompt_cache_hit_tokens"]


def test_the_app_serves_with_expert_parallelism(client):
    from ray import serve

    client.completions.create(model="tiny", prompt="experts " * 10, max_tokens=4, temperature=0)
    stats = serve.get_deployment_handle("LLMServer", app_name="tideserve").ep_stats.remote().result()
    assert stats["num_shards"] == 2 and stats["rounds"] > 0 and stats["retries"] == 0
