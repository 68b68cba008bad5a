"""P/D disaggregation in the Serve app (``decode_replicas``), through HTTP: a prefill replica hands
each prompt's KV to one of two decode replicas, which the decode router fills by free KV and never
beyond it. Greedy answers equal the model computed alone."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 40
PROMPTS = [f"p{i} " + "tide " * (5 + i % 6) for i in range(8)]  # 1 + 28..53 tokens (bytes)


@pytest.fixture(scope="module")
def base_url(local_ray, tmp_path_factory):
    from deploy.app import build_app
    from tests.shared_ray import serving

    home = tmp_path_factory.mktemp("tide")
    # 16 pages of 16 tokens per replica: a decode replica holds two of these requests at once
    app = build_app({"cache_dir": str(home / "cache"), "usage_dir": str(home / "usage"), "replica_cpus": 0.5,
                     "num_pages": 16, "replicas": 1, "decode_replicas": 2})
    with serving(app, 300) as url:
        yield url, local_ray.home  # the replicas' TIDE_HOME (their default checkpoint)


def _complete(url: str, prompt: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _decode_stats() -> dict[str, dict]:
    """Each decode replica's stats (by its id): ask the pool until both answered."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMDecode", app_name="tideserve")
    seen: dict[str, dict] = {}
    for _ in range(60):
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats["replica_id"]] = stats
        if len(seen) == 2:
            break
    return seen


def test_prefill_hands_off_to_decode_replicas_by_free_kv(base_url):
    from model.checkpoint import load_model
    from model.default import default_checkpoint
    from model.generate import generate
    from model.tokenizer import load_tokenizer

    url, home = base_url
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: _complete(url, p), PROMPTS))
    ckpt = default_checkpoint(home)
    model, tok = load_model(ckpt), load_tokenizer(ckpt)
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        ids = [tok.bos_id] + tok.encode(prompt)
        assert len(ids) + MAX_TOKENS <= 96  # 6 pages: two fit a decode replica, three do not
        assert answer["choices"][0]["text"] == tok.decode(generate(model, ids, MAX_TOKENS, eos_id=None))
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    stats = list(_decode_stats().values())
    assert len(stats) == 2
    # both decode replicas took requests, and neither was asked to hold more KV than it has
    # (an overfilled engine preempts a running request to make room)
    assert all(s["engine"]["decode_tokens"] > 0 for s in stats), stats
    assert sum(s["engine"]["decode_tokens"] for s in stats) >= len(PROMPTS) * (MAX_TOKENS - 1)
    assert all(s["engine"]["preemptions"] == 0 for s in stats), stats
    # one handoff a request, and one more for each request that went on elsewhere (a busy
    # machine can make a decode replica unreachable for a moment: the request starts over)
    continued = _counter(url, "tide:requests_continued_total")
    assert len(PROMPTS) <= _handoffs(url) <= len(PROMPTS) + continued


def _counter(url: str, name: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    return next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name)), 0.0)


def _handoffs(url: str) -> float:
    return _counter(url, "tide:pd_handoffs_total")


def test_a_request_that_ends_at_its_first_token_never_reaches_the_decode_pool(base_url):
    url, _ = base_url
    before = _handoffs(url)
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={"model": "tiny", "prompt": "one token", "max_tokens": 1,
                                                                 "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    assert _handoffs(url) == before


def test_n_choices_each_go_through_a_handoff(base_url):
    """``n`` = 3 sampled choices at once: each is handed off on its own (the routers keep the
    three apart) and equals the request alone with its seed."""
    url, _ = base_url
    body = {"model": "tiny", "prompt": "three ways", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    before = _handoffs(url)
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={**body, "n": 3, "seed": 5})
    assert r.status_code == 200, r.text
    assert _handoffs(url) == before + 3
    alone = [_text(url, {**body, "seed": 5 + i}) for i in range(3)]
    assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == alone


def _text(url: str, body: dict) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_json_mode_logit_bias_and_a_choice_go_through_the_handoff(base_url):
    """The decode replica takes up JSON mode where the prefill replica's first token left it, and
    applies the request's logit_bias too: the object equals the model alone under the same masks;
    a choice among texts likewise."""
    from model.checkpoint import load_model
    from model.default import default_checkpoint
    from model.generate import generate
    from model.grammar import Grammars, GrammarSpec
    from model.sampling import SamplingParams
    from model.tokenizer import load_tokenizer

    url, home = base_url
    bias = {str(ord(" ")): -10, str(ord("}")): 2.5, str(ord(",")): -4}  # this model then closes its object
    before = _handoffs(url)
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "Reply in JSON", "max_tokens": 40, "temperature": 0, "logit_bias": bias,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    assert _handoffs(url) == before + 1
    ckpt = default_checkpoint(home)
    model, tok = load_model(ckpt), load_tokenizer(ckpt)
    params = SamplingParams(logit_bias=tuple((int(t), float(b)) for t, b in bias.items()))
    grammars = Grammars(tok.grammar_vocab(), model.cfg.vocab_size, [tok.eos_id])
    ids = generate(model, [tok.bos_id, *tok.encode("Reply in JSON")], 40, params, eos_id=tok.eos_id,
                   grammar=grammars.state(GrammarSpec("json_object")))
    choice = r.json()["choices"][0]
    assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["text"]), dict)
    # a choice among texts likewise: the decode replica goes on in the choice's grammar
    texts = ["calm", "rough", "stormy sea"]
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "The sea is", "max_tokens": 16, "temperature": 0, "guided_choice": texts})
    assert r.status_code == 200, r.text
    assert _handoffs(url) == before + 2
    alone = generate(model, [tok.bos_id, *tok.encode("The sea is")], 16, eos_id=tok.eos_id,
                     grammar=grammars.state(GrammarSpec("choice", choices=tuple(texts))))
    assert r.json()["choices"][0]["text"] == tok.decode(alone) in texts


def test_an_echoed_prompts_logprobs_come_back_through_the_handoff(base_url):
    """Echo with logprobs: the prefill replica scores the prompt; the client gets those scores
    ahead of the tokens the decode replica streams (stream or not)."""
    from model.checkpoint import load_model
    from model.default import default_checkpoint
    from model.tokenizer import load_tokenizer
    from tests.model.reference import prompt_logprobs_alone

    url, home = base_url
    body = {"model": "tiny", "prompt": "score the tide", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 1}
    before = _handoffs(url)
    whole = httpx.post(f"{url}/v1/completions", timeout=120, json=body)
    assert whole.status_code == 200, whole.text
    assert _handoffs(url) == before + 1
    ckpt = default_checkpoint(home)
    tok = load_tokenizer(ckpt)
    ids = [tok.bos_id, *tok.encode("score the tide")]
    ref = prompt_logprobs_alone(load_model(ckpt), ids)
    lp = whole.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4 and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx([float(ref[i, t]) for i, t in enumerate(ids[1:])],
                                                               abs=1e-4)
    events = httpx.post(f"{url}/v1/completions", timeout=120, json={**body, "stream": True}).text.split("\n\n")
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert sum((s["token_logprobs"] for s in streamed), []) == pytest.approx(lp["token_logprobs"])
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.json()["choices"][0]["text"]
