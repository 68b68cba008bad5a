"""The ingress's answer when no replica can finish a request, with the replica handle replaced by
one whose every replica dies (a unit test: a real Serve app cannot be made to lose every try
deterministically)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from tests.deploy.ingress_fakes import ingress, output, request

pytestmark = [pytest.mark.fault]  # no cluster: the replica handles are fakes


class _DyingHandle:
    """``options(stream=True).generate.remote(req)`` streams ``tokens`` then loses its replica."""

    def __init__(self, tokens: int) -> None:
        self.tokens, self.calls, self.cancelled = tokens, 0, 0
        self.generate = SimpleNamespace(remote=lambda req: _Response(self._generate(req), self))

    def options(self, **_):
        return self

    async def _generate(self, req):
        from ray.exceptions import ActorDiedError

        self.calls += 1
        for t in range(self.tokens):
            yield output(t)
        raise ActorDiedError()


class _Response:
    """What a streaming handle call returns: its outputs, and ``cancel()``."""

    def __init__(self, outputs, handle: _DyingHandle) -> None:
        self.outputs, self.handle = outputs, handle

    def __aiter__(self):
        return self.outputs

    def cancel(self) -> None:
        self.handle.cancelled += 1


def test_a_request_every_replica_drops_is_a_503_with_retry_after():
    from deploy.openai_api import MAX_CONTINUATIONS, RETRY_AFTER_S
    from deploy.protocol import APIError

    handle = _DyingHandle(tokens=1)
    body = SimpleNamespace(stream=False, stream_options=None, n=1)
    with pytest.raises(APIError) as e:
        asyncio.run(ingress(handle)._respond([request()], body, "completion"))
    assert e.value.status == 503 and e.value.retry_after_s == RETRY_AFTER_S
    assert handle.calls == MAX_CONTINUATIONS + 1  # it was continued elsewhere before giving up


def test_mid_stream_the_503_is_an_error_event():
    handle = _DyingHandle(tokens=1)
    body = SimpleNamespace(stream=True, stream_options=None, n=1)

    async def collect():
        resp = await ingress(handle)._respond([request()], body, "chat")
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

    from deploy.openai_api import _continuable

    for cause in (ObjectLostError("ab" * 14, None, ""), OwnerDiedError("ab" * 14, None, "")):
        assert _continuable(cause) and _continuable(RayTaskError("generate", "tb", cause).as_instanceof_cause())
    assert not _continuable(RayTaskError("generate", "tb", ValueError("bad request")).as_instanceof_cause())


class _DiesOnce(_DyingHandle):
    """The first call streams two tokens and loses its replica; the next finishes the request."""

    def __init__(self) -> None:
        super().__init__(tokens=2)
        self.requests = []

    async def _generate(self, req):
        from cluster.request import FinishReason, RequestOutput, TokenSources

        self.requests.append(req)
        if len(self.requests) == 1:
            async for o in super()._generate(req):
                yield o
            return
        yield output(2)
        prompt = len(req.prompt_ids)
        yield RequestOutput("r", [3], "y", True, FinishReason.LENGTH, prompt, 2, prompt, TokenSources(ram=prompt))


def test_a_request_whose_replica_dies_is_continued_with_the_client_requests_usage():
    """The continuation starts from the prompt and the tokens streamed; its last output reports
    the client's prompt, every token streamed and the first attempt's cache hit (not the longer
    prompt of the continuation, nor its hit on the tokens it was handed)."""
    handle = _DiesOnce()

    async def run():
        return [o async for o in ingress(handle)._continued(request())]

    outs = asyncio.run(run())
    assert [t for o in outs for t in o.new_token_ids] == [0, 1, 2, 3]
    again = handle.requests[1]
    assert again.prompt_ids == (1, 2, 3, 0, 1) and again.continued_ids == (0, 1) and again.max_tokens == 6
    assert again.continued_chars == 2  # the text streamed before ("x" twice)
    last = outs[-1]
    assert last.finished and (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (3, 4, 0)


class _OneChoiceFails:
    """n = 2: the call with the request's seed fails at once (an error of the request, not
    retried); the other streams slowly until cancelled."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []
        self.generate = SimpleNamespace(remote=self._remote)

    def options(self, **_):
        return self

    def _remote(self, req):
        handle, seed = self, req.sampling.seed

        async def outputs():
            if seed == 0:
                raise ValueError("bad request")
            for t in range(10_000):
                await asyncio.sleep(0.01)
                yield output(t)

        class Response:
            def __aiter__(self):
                return outputs()

            def cancel(self):
                handle.cancelled.append(seed)

        return Response()


def test_when_one_choice_fails_the_others_are_cancelled():
    handle = _OneChoiceFails()
    body = SimpleNamespace(stream=False, stream_options=None, n=2)

    async def run():
        with pytest.raises(ValueError, match="bad request"):
            await ingress(handle)._respond([request(seed=0)], body, "completion")
        for _ in range(10):  # the cancelled choice's task finishes
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert 1 in handle.cancelled  # the slow choice's replica call was cancelled, not left running


class _Pool:
    """A pool whose ``ready.remote()`` answers ``answer`` after ``delay_s`` (or never)."""

    def __init__(self, answer: bool = True, delay_s: float = 0.0) -> None:
        async def ready():
            await asyncio.sleep(delay_s)
            return answer

        self.ready = SimpleNamespace(remote=ready)


@pytest.mark.parametrize("server, decode, status", [
    (_Pool(), None, 200),
    (_Pool(delay_s=3600), None, 503),  # no replica answers (starting, or all gone)
    (_Pool(answer=False), None, 503),  # a replica whose engine thread died
    (_Pool(), _Pool(delay_s=3600), 503),  # P/D: the decode pool cannot serve
    (_Pool(), _Pool(), 200),
])
def test_health_is_503_while_no_replica_of_a_pool_can_serve(server, decode, status):
    ing = ingress(server)
    ing.health_timeout_s = 0.2
    ing.decode = decode
    r = asyncio.run(ing.health())
    got = getattr(r, "status_code", 200)
    assert got == status
    if status == 503:
        assert r.headers["Retry-After"] and json.loads(r.body)["error"]["code"] == "service_unavailable"


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
