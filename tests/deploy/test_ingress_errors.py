"""The ingress's answer when no replica can finish a request, on a fake pool whose replicas die
(a unit test: a real Serve app cannot be made to lose every try deterministically)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.deploy.ingress_fakes import FakePool, Gone, ingress, output, prepared, request

pytestmark = [pytest.mark.fault]  # no cluster: the replicas are fakes


def _dying(tokens: int):
    """Replicas that stream ``tokens`` outputs, then go away."""
    async def outputs(req):
        for t in range(tokens):
            yield output(t)
        raise Gone()

    return FakePool(outputs)


def test_a_request_every_replica_drops_is_a_503_with_retry_after():
    from deploy.errors import APIError
    from deploy.ingress.dispatch import MAX_CONTINUATIONS, RETRY_AFTER_S

    pool = _dying(tokens=1)
    with pytest.raises(APIError) as e:
        asyncio.run(ingress(pool).answer(prepared([request()])).whole())
    assert e.value.status == 503 and e.value.retry_after_s == RETRY_AFTER_S
    assert len(pool.requests) == MAX_CONTINUATIONS + 1  # it was continued elsewhere before giving up


def test_mid_stream_the_503_is_an_error_event():
    async def collect():
        resp = await ingress(_dying(tokens=1)).respond(prepared([request()], kind="chat", stream=True))
        return [c if isinstance(c, str) else c.decode() async for c in resp.body_iterator]

    events = [c.removeprefix("data: ").strip() for c in asyncio.run(collect())]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "service_unavailable" and "retry" in err["message"]
    assert all("choices" in json.loads(c) for c in events[:-2])  # the tokens streamed before


def test_a_lost_handoff_kv_is_continued_and_a_user_error_is_not():
    """P/D: a decode replica that could not pull the prompt's KV (its node went away) raised
    ``RayTaskError(ObjectLostError)``; nothing was streamed from it, so the request starts over.
    An error of the request itself is not retried."""
    from ray.exceptions import ObjectLostError, OwnerDiedError, RayTaskError

    from deploy.ingress.serve_pool import continuable

    for cause in (ObjectLostError("ab" * 14, None, ""), OwnerDiedError("ab" * 14, None, "")):
        assert continuable(cause) and continuable(RayTaskError("generate", "tb", cause).as_instanceof_cause())
    assert not continuable(RayTaskError("generate", "tb", ValueError("bad request")).as_instanceof_cause())


def test_a_request_whose_replica_dies_is_continued_with_the_client_requests_usage():
    """The continuation starts from the prompt and the tokens streamed; its last output reports
    the client's prompt, every token streamed and the first attempt's cache hit (not the longer
    prompt of the continuation, nor its hit on the tokens it was handed)."""
    from cluster.request import FinishReason, RequestOutput, TokenSources

    async def outputs(req):
        if len(pool.requests) == 1:
            yield output(0)
            yield output(1)
            raise Gone()
        yield output(2)
        prompt = len(req.prompt_ids)
        yield RequestOutput("r", [3], "y", True, FinishReason.LENGTH, prompt, 2, prompt, TokenSources(ram=prompt))

    pool = FakePool(outputs)

    async def run():
        return [o async for _, o in ingress(pool).dispatch.choices((request(),), 1)]

    outs = asyncio.run(run())
    assert [t for o in outs for t in o.new_token_ids] == [0, 1, 2, 3]
    again = pool.requests[1]
    assert again.prompt_ids == (1, 2, 3, 0, 1) and again.continued_ids == (0, 1) and again.max_tokens == 6
    assert again.continued_chars == 2  # the text streamed before ("x" twice)
    last = outs[-1]
    assert last.finished and (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (3, 4, 0)


def test_when_one_choice_fails_the_others_are_cancelled():
    """n = 2: the call with the request's seed fails at once (an error of the request, not
    retried); the other streams slowly until cancelled."""
    async def outputs(req):
        if req.sampling.seed == 0:
            raise ValueError("bad request")
        for t in range(10_000):
            await asyncio.sleep(0.01)
            yield output(t)

    pool = FakePool(outputs)

    async def run():
        with pytest.raises(ValueError, match="bad request"):
            await ingress(pool).answer(prepared([request(seed=0)], n=2)).whole()
        for _ in range(10):  # the cancelled choice's task finishes
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert [r.sampling.seed for r in pool.cancelled] == [1]  # the slow choice's call was cancelled, not left running


@pytest.mark.parametrize("server, decode, status", [
    (FakePool(), None, 200),
    (FakePool(delay_s=3600), None, 503),  # no replica answers (starting, or all gone)
    (FakePool(ready=False), None, 503),  # a replica whose engine thread died
    (FakePool(), FakePool(delay_s=3600), 503),  # P/D: the decode pool cannot serve
    (FakePool(), FakePool(), 200),
])
def test_health_is_503_while_no_replica_of_a_pool_can_serve(server, decode, status):
    from deploy.ingress.ops import health

    async def run():
        try:
            return await asyncio.wait_for(health(ingress(server, decode=decode)), 0.2)
        except TimeoutError:  # ServePool's own timeout, here the test's
            return 503, {"error": {"code": "service_unavailable"}}, {"Retry-After": "2"}

    got, body, headers = asyncio.run(run())
    assert got == status
    if status == 503:
        assert headers["Retry-After"] and body["error"]["code"] == "service_unavailable"


def test_a_pool_that_does_not_answer_in_time_is_not_ready():
    from types import SimpleNamespace

    from deploy.ingress.serve_pool import ServePool

    async def never():
        await asyncio.sleep(3600)

    handle = SimpleNamespace(ready=SimpleNamespace(remote=never))
    assert asyncio.run(ServePool(handle, health_timeout_s=0.1).ready()) is False


def test_an_error_no_route_handles_is_openais_json_500_and_a_failed_request_says_why():
    """Issue 49: no plain-text 500. A request that failed alone on its replica (its sampling
    raised: ``RequestFailed``, as Ray hands it over) says why; any other error is a bare 500."""
    from ray.exceptions import RayTaskError

    from cluster.request import RequestFailed
    from deploy.openai_api import _server_error

    failed = RayTaskError("generate", "traceback text", RequestFailed("RuntimeError: sampler check failed"))
    for error, message in ((failed.as_instanceof_cause(), "the request failed: RuntimeError: sampler check failed"),
                           (KeyError("internal detail"), "the request failed")):
        r = asyncio.run(_server_error(None, error))
        body = json.loads(r.body)
        assert r.status_code == 500 and r.media_type == "application/json"
        assert body["error"]["message"] == message and body["error"]["type"] == "server_error"
