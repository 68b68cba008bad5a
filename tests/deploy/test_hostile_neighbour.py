"""The hostile neighbour: one tenant sends each kind of request the security review found could
hurt others (``deploy.bench.neighbour_bench.HOSTILE_REQUESTS``: sampling extremes, oversized
numbers and keys, deep nesting, grammars and choices past their budget or matching nothing,
batches past their cost) while another tenant's streams run on the same replica of a `tide up`
cluster (``tests/conftest.py``'s ``tide_up``, serving the default model). Each hostile
request gets a 4xx or a bounded answer; the neighbour's tokens equal the model's alone. Its
inter-token latency beside them is measured by ``tide bench neighbour`` (timings are never
tested)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from deploy.bench.neighbour_bench import (
    HOSTILE_KEY,
    HOSTILE_REQUESTS,
    NEIGHBOUR_KEY,
    PROMPTS,
    hostile,
    neighbour_stream,
)

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.security, pytest.mark.slow]

TOKENS = 48


@pytest.fixture(scope="module")
def url(tide_up):
    from tests.conftest import TIDE_UP_KEYS

    assert {HOSTILE_KEY, NEIGHBOUR_KEY} <= set(TIDE_UP_KEYS)
    return tide_up


@pytest.fixture(scope="module")
def alone() -> list[str]:
    """Each neighbour prompt's greedy completion by the model alone."""
    from model.checkpoint import load_model
    from model.default import default_checkpoint
    from model.generate import generate
    from model.tokenizer import ByteTokenizer

    tok, model = ByteTokenizer(), load_model(default_checkpoint())
    return [tok.decode(generate(model, [tok.BOS, *tok.encode(p)], TOKENS)) for p in PROMPTS]


def test_every_hostile_request_is_bounded_and_the_neighbour_is_unharmed(url, alone):
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            streams = [asyncio.create_task(neighbour_stream(client, p, TOKENS)) for p in PROMPTS]
            await asyncio.sleep(0.05)  # the neighbour's streams are under way
            answers = await asyncio.gather(*(hostile(client, route, body) for route, body, _ in HOSTILE_REQUESTS))
            return [text for text, _ in await asyncio.gather(*streams)], answers

    texts, answers = asyncio.run(main())
    for (_, body, want), r in zip(HOSTILE_REQUESTS, answers, strict=True):
        shown = json.dumps(body)[:120]
        assert r.headers["content-type"].startswith("application/json"), (shown, r.text[:200])  # never plain text
        if want == 200:
            assert r.status_code == 200, (shown, r.text[:300])
            prompts = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
            choices = r.json()["choices"]
            assert len(choices) == prompts * body.get("n", 1), shown
            assert r.json()["usage"]["completion_tokens"] <= len(choices) * body["max_tokens"], shown
        else:
            assert 400 <= r.status_code < 500 and r.json()["error"]["message"], (shown, r.status_code, r.text[:300])
    assert texts == alone  # every neighbour token as the model alone makes it
