"""The ingress's edge (``deploy.http_edge``) in front of a small FastAPI app, in-process: keys,
content type and size are checked before the body is read, and a good body reaches the route."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request

from deploy.http_edge import EdgeConfig, EdgeMiddleware, find_grant
from deploy.limits import KeyGrant

LIMIT = 1000


def _app() -> tuple[FastAPI, list]:
    app = FastAPI()
    app.add_middleware(EdgeMiddleware)
    app.state.edge = EdgeConfig({"sk-a": KeyGrant("alpha"), "sk-b": KeyGrant("beta")}, LIMIT)
    seen: list = []

    @app.post("/v1/echo")
    async def echo(request: Request):
        body = await request.json()
        seen.append((request.state.grant.tenant, body))
        return {"ok": True}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return {"tide_requests_total": 0}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        seen.append((request.state.grant.tenant, await request.json()))
        return {"tokens": []}

    return app, seen


class _CountingBody(httpx.AsyncByteStream):
    """A chunked request body that records how much of it the server read."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks, self.sent = chunks, 0

    async def __aiter__(self):
        for c in self.chunks:
            self.sent += 1
            yield c


def _call(app, method: str, path: str, root_path: str = "", **kw) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_a_good_request_reaches_the_route_with_its_grant_and_body():
    app, seen = _app()
    r = _call(app, "POST", "/v1/echo", json={"x": 1}, headers={"Authorization": "Bearer sk-b"})
    assert r.status_code == 200 and seen == [("beta", {"x": 1})]
    chunks = [b'{"x": ', b'2}']  # chunked: replayed to the route whole
    r = _call(app, "POST", "/v1/echo", content=_CountingBody(chunks),
              headers={"Authorization": "Bearer sk-a", "Content-Type": "application/json"})
    assert r.status_code == 200 and seen[-1] == ("alpha", {"x": 2})


@pytest.mark.security
def test_a_missing_or_wrong_key_is_refused_before_the_body_is_read():
    app, seen = _app()
    body = _CountingBody([b"{" * 10] * 50)
    for headers in ({}, {"Authorization": "Bearer sk-c"}, {"Authorization": "sk-a"}):
        r = _call(app, "POST", "/v1/echo", content=body, headers={**headers, "Content-Type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert seen == [] and body.sent <= 1  # nothing past the first chunk was pulled from the client
    assert _call(app, "GET", "/health").status_code == 200  # public paths need no key


@pytest.mark.security
def test_metrics_and_docs_need_a_key_unless_made_public():
    from deploy.app import AppArgs
    from deploy.http_edge import PUBLIC_PATHS

    app, _ = _app()
    for path in ("/metrics", "/docs", "/openapi.json"):
        assert _call(app, "GET", path).status_code == 401, path
    assert _call(app, "GET", "/metrics", headers={"Authorization": "Bearer sk-a"}).status_code == 200
    app.state.edge = EdgeConfig(app.state.edge.api_keys, LIMIT, PUBLIC_PATHS | {"/metrics"})
    assert _call(app, "GET", "/metrics").status_code == 200 and _call(app, "GET", "/docs").status_code == 401
    with pytest.raises(ValueError, match="not /v1/chat/completions"):
        AppArgs(public_paths=["/metrics", "/v1/chat/completions"])


@pytest.mark.security
def test_an_oversized_body_is_a_413_by_its_length_or_as_it_arrives():
    app, seen = _app()
    auth = {"Authorization": "Bearer sk-a", "Content-Type": "application/json"}
    r = _call(app, "POST", "/v1/echo", content=b"1" * (LIMIT + 1), headers=auth)
    assert r.status_code == 413 and str(LIMIT) in r.json()["error"]["message"]
    body = _CountingBody([b"1" * 400] * 10)  # no Content-Length: stopped at the chunk that crosses it
    r = _call(app, "POST", "/v1/echo", content=body, headers=auth)
    assert r.status_code == 413 and body.sent == 3 and seen == []


def test_a_body_that_is_not_json_is_a_415_naming_the_type():
    app, seen = _app()
    r = _call(app, "POST", "/v1/echo", content=json.dumps({"x": 1}),
              headers={"Authorization": "Bearer sk-a", "Content-Type": "text/plain"})
    assert r.status_code == 415 and "text/plain" in r.json()["error"]["message"] and seen == []


@pytest.mark.security
def test_before_the_ingress_configures_it_the_edge_fails_closed():
    """An app whose edge has no config yet (the ingress still starting) answers 503 to the API
    and its health check as usual: it never serves without the keys it will check."""
    app, seen = _app()
    del app.state.edge
    r = _call(app, "POST", "/v1/echo", json={"x": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready" and r.headers["retry-after"] == "1"
    assert _call(app, "GET", "/health").status_code == 200
    assert seen == []


def test_find_grant_compares_the_whole_key():
    keys = {"sk-proj-aaaa": KeyGrant("a"), "sk-proj-bbbb": KeyGrant("b")}
    assert find_grant(keys, "Bearer sk-proj-bbbb") == KeyGrant("b")
    assert find_grant(keys, "bearer sk-proj-aaaa") == KeyGrant("a")
    assert find_grant(keys, "Bearer sk-proj-") is None and find_grant(keys, "") is None


@pytest.mark.security
def test_a_tenant_over_its_rate_or_concurrency_gets_a_429_and_others_do_not():
    from deploy.http_edge import PUBLIC_PATHS, TenantQuotas

    now = [0.0]
    app, seen = _app()
    quotas = TenantQuotas(rate_per_s=1.0, burst=2, clock=lambda: now[0])
    app.state.edge = EdgeConfig(app.state.edge.api_keys, LIMIT, PUBLIC_PATHS, quotas)
    post = lambda key: _call(app, "POST", "/v1/echo", json={"x": 1}, headers={"Authorization": f"Bearer {key}"})  # noqa: E731
    assert [post("sk-a").status_code for _ in range(3)] == [200, 200, 429]  # a burst of 2
    refused = post("sk-a")
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and refused.headers["retry-after"] == "1"
    assert post("sk-b").status_code == 200  # another tenant has its own bucket
    now[0] += 1.0  # one token a second
    assert [post("sk-a").status_code for _ in range(2)] == [200, 429]
    assert len(seen) == 4  # a refused request never reached the route
    # at most one request at once: a second one while the first runs is refused, then admitted
    one = TenantQuotas(concurrency=1)
    assert one.admit("alpha") is None and one.admit("alpha") == 1.0 and one.admit("beta") is None
    one.release("alpha")
    assert one.admit("alpha") is None


@pytest.mark.security
@pytest.mark.parametrize("root_path", ["", "/api"])
def test_quotas_cover_every_protected_path_also_under_a_route_prefix(root_path):
    """/tokenize draws from the same bucket as /v1/...; under Serve's route_prefix (the ASGI
    root_path) keys, public paths and quotas apply to the paths below it."""
    from deploy.http_edge import PUBLIC_PATHS, TenantQuotas

    app, seen = _app()
    app.state.edge = EdgeConfig(app.state.edge.api_keys, LIMIT, PUBLIC_PATHS,
                                TenantQuotas(rate_per_s=1.0, burst=2, clock=lambda: 0.0))
    auth = {"Authorization": "Bearer sk-a"}
    call = lambda path, **kw: _call(app, "POST", root_path + path, root_path, json={"x": 1}, **kw)  # noqa: E731
    assert call("/v1/echo").status_code == 401  # no key
    assert [call(p, headers=auth).status_code for p in ("/v1/echo", "/tokenize", "/tokenize")] == [200, 200, 429]
    assert _call(app, "GET", root_path + "/health", root_path).status_code == 200  # public, no key, no quota
    assert len(seen) == 2


def test_limits_take_tenant_quotas_and_refuse_bad_ones():
    from deploy.limits import Limits

    assert Limits(tenant_requests_per_minute=600, tenant_concurrency=4).tenant_concurrency == 4
    with pytest.raises(ValueError, match="tenant_concurrency"):
        Limits(tenant_concurrency=-1)


class _StallingBody(httpx.AsyncByteStream):
    """A body whose sender stops after its first bytes (slowloris, with a valid key)."""

    async def __aiter__(self):
        yield b'{"a": '
        await asyncio.sleep(3600)
        yield b"1}"


@pytest.mark.security
def test_a_body_that_does_not_arrive_in_time_is_a_408():
    import dataclasses

    app, seen = _app()
    app.state.edge = dataclasses.replace(app.state.edge, body_timeout_s=0.2)
    auth = {"Authorization": "Bearer sk-a", "Content-Type": "application/json"}
    r = _call(app, "POST", "/v1/echo", content=_StallingBody(), headers=auth)
    assert r.status_code == 408 and "0.2 s" in r.json()["error"]["message"] and seen == []
    assert _call(app, "POST", "/v1/echo", json={"a": 1}, headers=auth).status_code == 200  # a whole body still passes


@pytest.mark.security
def test_refused_bodies_cost_the_server_no_memory():
    """A 34 MB chunked body without a key, or over the limit with one, is refused while the
    server holds at most a chunk of it (measured: tracemalloc's peak during the request)."""
    import tracemalloc

    app, seen = _app()
    chunk = b"1" * (1 << 20)
    for headers, status in (({"Content-Type": "application/json"}, 401),
                            ({"Authorization": "Bearer sk-a", "Content-Type": "application/json"}, 413)):
        body = _CountingBody([chunk] * 34)
        tracemalloc.start()
        try:
            r = _call(app, "POST", "/v1/echo", content=body, headers=headers)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert r.status_code == status and body.sent <= 1 and peak < 4 << 20, (status, body.sent, peak)
    assert seen == []


def test_an_upload_path_takes_a_multipart_form_within_its_own_limit_and_nothing_else():
    app = FastAPI()
    app.add_middleware(EdgeMiddleware)
    app.state.edge = EdgeConfig(None, LIMIT, uploads={"/v1/files": 4 * LIMIT})
    got: list = []

    @app.post("/v1/files")
    async def upload(request: Request):
        async with request.form() as form:
            got.append(await form["file"].read())
        return {"ok": True}

    @app.post("/v1/echo")
    async def echo(request: Request):
        return await request.json()

    @app.post("/v1/batches/{bid}/cancel")
    async def cancel(bid: str):
        return {"id": bid}

    data = b"x" * (2 * LIMIT)  # over the JSON limit, within the upload's
    r = _call(app, "POST", "/v1/files", files={"file": ("a.jsonl", data)}, data={"purpose": "batch"})
    assert r.status_code == 200 and got == [data]
    too_big = _call(app, "POST", "/v1/files", files={"file": ("a.jsonl", b"x" * (5 * LIMIT))})
    assert too_big.status_code == 413 and len(got) == 1
    as_json = _call(app, "POST", "/v1/files", json={"file": "x"})
    assert as_json.status_code == 415 and "multipart" in as_json.json()["error"]["message"]
    form_elsewhere = _call(app, "POST", "/v1/echo", files={"file": ("a.jsonl", b"{}")})
    assert form_elsewhere.status_code == 415 and "JSON" in form_elsewhere.json()["error"]["message"]
    assert _call(app, "POST", "/v1/batches/b1/cancel").json() == {"id": "b1"}  # no body: nothing to check
