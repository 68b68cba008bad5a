"""The ingress's request path without Ray: ``Ingress`` (``deploy.ingress.service``) over a
``FakePool``, a ``ReplicaPool`` whose replicas are a Python function of the request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable


class Gone(RuntimeError):
    """A fake replica went away: the request can continue elsewhere."""


class FakePool:
    """``outputs(req)``: an async iterator of the request's outputs (it may raise ``Gone``).
    Records each request, and each stream its reader stopped before its end; ``ready`` answers /health
    after ``delay_s``. ``prefill``: P/D, the outputs up to the handoff, and the KV item after."""

    def __init__(self, outputs: Callable | None = None, ready: bool = True, delay_s: float = 0.0) -> None:
        self.outputs, self._ready, self.delay_s = outputs, ready, delay_s
        self.requests: list = []
        self.cancelled: list = []

    async def generate(self, req) -> AsyncIterator:
        self.requests.append(req)
        try:
            async for item in self.outputs(req):
                yield item
        except (GeneratorExit, asyncio.CancelledError):  # the reader stopped early
            self.cancelled.append(req)
            raise

    async def prefill(self, req):
        last = None
        async for last in self.generate(req):
            if last.handoff is not None:
                return last, ("kv", req.prompt_ids)
        return last, None

    async def ready(self) -> bool:
        await asyncio.sleep(self.delay_s)
        return self._ready

    async def stats(self) -> dict:
        return {}

    @staticmethod
    def continuable(e: BaseException) -> bool:
        return isinstance(e, Gone)

    @staticmethod
    def unavailable(e: BaseException) -> bool:
        return isinstance(e, Gone)


def ingress(pool, limits: dict | None = None, tokens_per_minute: int = 0, clock=None, decode=None,
            directory=None, namespace=None, **cfg):
    """The shipped model's ingress over ``pool`` with ``limits`` (``deploy.protocol.Limits``
    fields) and a tenant token quota on ``clock``; ``directory`` and ``namespace`` plan prompts."""
    import time

    from cluster.cache_identity import CacheIdentity
    from deploy.http_edge import TenantQuotas
    from deploy.ingress.config import IngressConfig
    from deploy.ingress.service import Ingress
    from deploy.limits import Limits
    from model.default import default_checkpoint

    lim = Limits(**({"tenant_tokens_per_minute": tokens_per_minute} | (limits or {})))
    config = IngressConfig(CacheIdentity(str(default_checkpoint())), "tiny", lim, **cfg)
    quotas = TenantQuotas(tokens_per_minute=tokens_per_minute, clock=clock or time.monotonic)
    return Ingress(config, pool, decode, directory=directory, namespace=namespace, quotas=quotas)


def request(seed: int | None = None, prompt=(1, 2, 3), max_tokens: int = 8, **sampling):
    from cluster.request import GenerationRequest
    from model.sampling import SamplingParams

    return GenerationRequest("", tuple(prompt), max_tokens, SamplingParams(seed=seed, **sampling))


def prepared(reqs, n: int = 1, kind: str = "completion", stream: bool = False, **fields):
    from deploy.ingress.prepare import Prepared

    return Prepared(kind, tuple(reqs), n, stream, **fields)


def output(token: int, finished: bool = False, prompt_logprobs=None, prompt_tokens: int = 3):
    from cluster.request import FinishReason, RequestOutput, TokenSources

    return RequestOutput("r", [token], "x", finished, FinishReason.LENGTH if finished else None, prompt_tokens, 1, 0,
                         TokenSources(compute=prompt_tokens), prompt_logprobs=prompt_logprobs)
