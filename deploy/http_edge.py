"""The ingress's edge: API key, content type and body size, checked before any body is read or
parsed (a pure ASGI middleware, so an unauthenticated or oversized request costs neither parse
time nor memory).

Each request under a protected path must carry a configured key (``Authorization: Bearer``;
constant-time comparison, keys never logged) or get a 401; a tenant over its quota (requests per
second with a burst, requests at once; ``TenantQuotas``) gets a 429 with ``Retry-After``; a
``POST`` body must be JSON (a multipart form on an upload path: ``uploads``) or get a 415, fit
``max_body_bytes`` (an upload: its path's limit; its Content-Length, or
counted as it arrives when chunked) or get a 413, and arrive whole within ``body_timeout_s`` or
get a 408 (a slow body holds a connection and its tenant's concurrency, not a replica). The caller's ``KeyGrant`` is left in
``scope["state"]["grant"]`` for the route.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from deploy.errors import error_body
from deploy.limits import KeyGrant

__all__ = ["OPTIONAL_PUBLIC_PATHS", "PUBLIC_PATHS", "EdgeConfig", "EdgeMiddleware", "TenantQuotas", "find_grant",
           "route_path"]

# served without a key when keys are configured; /metrics and the API docs (/docs, /redoc,
# /openapi.json) are protected unless an operator adds them (AppArgs.public_paths)
PUBLIC_PATHS = frozenset({"/health", "/version"})
OPTIONAL_PUBLIC_PATHS = frozenset({"/metrics", "/docs", "/openapi.json", "/redoc"})


class TenantQuotas:
    """Per tenant: a bucket of ``rate_per_s`` requests a second holding up to ``burst`` (0: a
    second's worth), at most ``concurrency`` requests at once, and a bucket of
    ``tokens_per_minute`` model tokens holding a minute's worth, from which each request draws
    its cost (``deploy.request_cost``; 0: that quota is off). Per ingress replica."""

    def __init__(self, rate_per_s: float = 0.0, burst: int = 0, concurrency: int = 0,
                 clock: Callable[[], float] = time.monotonic, tokens_per_minute: int = 0) -> None:
        self.rate_per_s, self.concurrency, self.tokens_per_minute = rate_per_s, concurrency, tokens_per_minute
        self.burst = max(burst or math.ceil(rate_per_s), 1)
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (requests, at)
        self._token_buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)
        self._running: dict[str, int] = {}

    @property
    def active(self) -> bool:
        return self.rate_per_s > 0 or self.concurrency > 0

    def charge(self, tenant: str, tokens: int) -> float | None:
        """Draw a request's ``tokens`` from the tenant's bucket: None when drawn (or the quota is
        off), else the seconds until the bucket holds them. A cost over a minute's worth never
        fits: the caller refuses it first."""
        if self.tokens_per_minute <= 0:
            return None
        rate = self.tokens_per_minute / 60
        with self._lock:
            now = self._clock()
            held, at = self._token_buckets.get(tenant, (float(self.tokens_per_minute), now))
            held = min(float(self.tokens_per_minute), held + (now - at) * rate)
            if held < tokens:
                self._token_buckets[tenant] = (held, now)
                return (tokens - held) / rate
            self._token_buckets[tenant] = (held - tokens, now)
            return None

    def admit(self, tenant: str) -> float | None:
        """None: admitted (``release`` it when done); else the seconds until one would be."""
        with self._lock:
            if self.concurrency and self._running.get(tenant, 0) >= self.concurrency:
                return 1.0
            if self.rate_per_s > 0:
                now = self._clock()
                tokens, at = self._buckets.get(tenant, (float(self.burst), now))
                tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
                if tokens < 1.0:
                    self._buckets[tenant] = (tokens, now)
                    return (1.0 - tokens) / self.rate_per_s
                self._buckets[tenant] = (tokens - 1.0, now)
            self._running[tenant] = self._running.get(tenant, 0) + 1
            return None

    def release(self, tenant: str) -> None:
        with self._lock:
            self._running[tenant] -= 1


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """``api_keys``: key -> grant (None: no authentication, every caller is tenant "")."""

    api_keys: dict[str, KeyGrant] | None
    max_body_bytes: int
    public_paths: frozenset[str] = field(default=PUBLIC_PATHS)
    quotas: TenantQuotas | None = None
    body_timeout_s: float = 30.0
    uploads: dict[str, int] = field(default_factory=dict)  # path -> largest body: multipart forms (files)


def find_grant(api_keys: dict[str, KeyGrant], authorization: str) -> KeyGrant | None:
    """The grant of the bearer key in ``authorization``, or None. Every key is compared, each
    in constant time, so the time taken does not tell which key matched or how much of one."""
    token = authorization[7:] if authorization[:7].lower() == "bearer " else ""
    found = None
    for key, grant in api_keys.items():
        if hmac.compare_digest(token.encode(), key.encode()):
            found = grant
    return found


async def _reply(send, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps(error_body(message, type_, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *extra_headers]})
    await send({"type": "http.response.body", "body": body})


def route_path(scope) -> str:
    """The request's path below the app's mount point (Serve's ``route_prefix``, which comes as
    ``root_path``): the path the app's routes, public paths and quotas name."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


async def _read_body(receive, send, limit: int, timeout_s: float) -> bytes | None:
    """The whole body, counted as it arrives (a chunked body has no Content-Length); None when
    it was refused (a 413 or 408 sent) or the client left."""
    chunks, size = [], 0
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
        except TimeoutError:
            await _reply(send, 408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout")
            return None
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            await _reply(send, 413, f"request body exceeds the limit of {limit} bytes")
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class EdgeMiddleware:
    """Wraps the FastAPI app; reads its ``EdgeConfig`` from ``app.state.edge``, which the ingress
    sets once it knows its keys and limits. Until then it fails closed: every HTTP request but
    the public paths is a 503."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cfg: EdgeConfig | None = getattr(getattr(scope.get("app"), "state", None), "edge", None)
        path = route_path(scope)
        if cfg is None:
            if path in PUBLIC_PATHS:
                await self.app(scope, receive, send)
            else:
                await _reply(send, 503, "the API is not configured yet; retry shortly", "server_error", "not_ready",
                             ((b"retry-after", b"1"),))
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        grant = KeyGrant("")
        public = path in cfg.public_paths
        if cfg.api_keys is not None and not public:
            grant = find_grant(cfg.api_keys, headers.get("authorization", ""))
            if grant is None:
                await _reply(send, 401, "missing or invalid API key", "authentication_error", "invalid_api_key")
                return
        scope.setdefault("state", {})["grant"] = grant
        quotas = cfg.quotas if cfg.quotas is not None and cfg.quotas.active and not public else None
        if quotas is not None:
            wait_s = quotas.admit(grant.tenant)
            if wait_s is not None:
                await _reply(send, 429, "rate limit reached for this API key's tenant; retry after the Retry-After seconds",
                             "rate_limit_error", "rate_limit_exceeded",
                             ((b"retry-after", str(max(1, math.ceil(wait_s))).encode()),))
                return
            try:
                await self._checked(scope, receive, send, cfg, headers, path)
            finally:
                quotas.release(grant.tenant)
            return
        await self._checked(scope, receive, send, cfg, headers, path)

    async def _checked(self, scope, receive, send, cfg: EdgeConfig, headers: dict[str, str], path: str) -> None:
        """The content type and size checks, then the app."""
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if headers.get("content-length") == "0" and not ctype:  # no body (a cancel): nothing to check
            await self.app(scope, receive, send)
            return
        upload = scope["method"] == "POST" and path in cfg.uploads
        want, limit = ("multipart/form-data", cfg.uploads[path]) if upload else ("application/json", cfg.max_body_bytes)
        if ctype != want:
            await _reply(send, 415, f"the body must be {'a multipart form' if upload else 'JSON'} (Content-Type: {want}), "
                                    f"not {ctype or 'untyped'}", code="unsupported_media_type")
            return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _reply(send, 413, f"request body of {length} bytes exceeds the limit of {limit}")
            return
        body = await _read_body(receive, send, limit, cfg.body_timeout_s)
        if body is None:
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect

        await self.app(scope, replay, send)
