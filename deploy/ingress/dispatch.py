"""From prepared requests to the replicas' outputs, Ray-free, behind a ``ReplicaPool``.

Each prompt is planned once (``deploy.ingress.planner``), then its ``n`` choices fan out as
engine requests of their own (a seeded request's choice j samples with seed + j; a scored prompt
is scored by choice 0 alone and its scores handed to the others). A request whose replica gives
it back (its node is lent to training) or dies mid-stream continues on another from its prompt
plus the tokens already streamed, keeping its plan. With a decode pool (P/D), a prefill replica
computes the prompt and the first token and hands the prompt's KV off; a decode replica streams
the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from cluster.request import GenerationRequest, RequestOutput
from deploy.errors import APIError
from deploy.ingress.planner import Planner
from deploy.metrics import IngressMetrics

__all__ = ["MAX_CONTINUATIONS", "RETRY_AFTER_S", "Dispatcher", "ReplicaPool", "unavailable_error"]

log = logging.getLogger(__name__)

MAX_CONTINUATIONS = 2
RETRY_AFTER_S = 2  # what a 503 tells the client to wait: about one replica restart or handoff


class ReplicaPool(Protocol):
    """A pool of model replicas (``deploy.ingress.serve_pool.ServePool`` over Serve; tests use
    fakes)."""

    def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs from one replica; closing the stream early cancels the call."""

    async def prefill(self, req: GenerationRequest) -> tuple[RequestOutput | None, Any]:
        """P/D: a ``handoff`` request's last output and, when it hands off, the prompt's KV item."""

    async def ready(self) -> bool:
        """Whether a replica answers within its timeout."""

    def continuable(self, e: BaseException) -> bool:
        """The replica gave the request back or went away: it can go on elsewhere."""

    def unavailable(self, e: BaseException) -> bool:
        """No replica could serve it right now: the client should retry (a 503)."""


def unavailable_error() -> APIError:
    return APIError(503, "no serving replica is available right now; retry the request", "server_error",
                    code="service_unavailable", retry_after_s=RETRY_AFTER_S)


def decode_request(req: GenerationRequest, handed_off: RequestOutput, kv: Any) -> GenerationRequest:
    """The decode pool's request: ``req`` continued from the prefill's handoff, whose KV is the
    item ``kv``. The plan stays behind (the prompt's KV comes whole)."""
    return dataclasses.replace(req, handoff=False, plan=None, prefilled=dataclasses.replace(handed_off.handoff, kv=kv))


class Dispatcher:
    def __init__(self, pool: ReplicaPool, planner: Planner, metrics: IngressMetrics,
                 decode: ReplicaPool | None = None) -> None:
        self.pool, self.planner, self.metrics, self.decode = pool, planner, metrics, decode

    async def choices(self, reqs: tuple[GenerationRequest, ...], n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of ``n`` choices of each request, as ``(index, output)`` in the order they
        come (request p's choice j has index p * n + j); the first failure ends them all (a 503
        when no replica could serve)."""
        try:
            planned = await asyncio.gather(*(self.planner.planned(r) for r in reqs))
            if n == 1 and len(planned) == 1:
                async for item in self._measured(planned[0]):
                    yield 0, item
                return
            async for i, item in self._fanned_out(planned, n):
                yield i, item
        except Exception as e:
            if self.pool.unavailable(e):
                raise unavailable_error() from None
            raise

    async def _fanned_out(self, reqs: list[GenerationRequest], n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()
        loop = asyncio.get_running_loop()
        scores = [loop.create_future() if r.sampling.prompt_logprobs is not None and n > 1 else None
                  for r in reqs]  # prompt p's scores, from its choice 0

        async def pump(i: int) -> None:
            req, scored = reqs[i // n], scores[i // n]
            sampling = req.sampling
            if sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + i % n)
            waits = scored is not None and i % n > 0  # for choice 0's scores, at its first output
            if waits:
                sampling = dataclasses.replace(sampling, prompt_logprobs=None)
            try:
                async for item in self._measured(dataclasses.replace(req, sampling=sampling)):
                    if scored is not None and not i % n and not scored.done():
                        scored.set_result(item.prompt_logprobs)
                    if waits:
                        item, waits = item._replace(prompt_logprobs=await scored), False
                    await queue.put((i, item))
                await queue.put((i, done))
            except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i)) for i in range(n * len(reqs))]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is done:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _measured(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """``_continued``'s outputs, counted into the ingress's metrics."""
        start = time.monotonic()
        first = last_t = None
        m = self.metrics
        m.in_flight.inc()
        status = "error"
        try:
            async for item in self._continued(req):
                now = time.monotonic()
                if item.new_token_ids:
                    if first is None:
                        first = now
                        m.ttft.observe(now - start)
                    elif last_t is not None:
                        m.itl.observe((now - last_t) / len(item.new_token_ids))
                    last_t = now
                if item.finished:
                    m.count_prompt(item.prompt_tokens, item.sources)
                    m.generation_tokens.inc(item.completion_tokens)
                    m.queue_time.observe(item.queued_s)
                    status = "ok"
                yield item
        finally:
            m.in_flight.dec()
            m.requests(status).inc()
            if status == "ok":
                m.e2e.observe(time.monotonic() - start)

    async def _continued(self, client_req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """The replica's outputs; after a replica gave the request back or died, the request goes
        on elsewhere from its prompt plus the tokens streamed (greedy output is unchanged), with
        its plan; usage still describes the client's request."""
        prompt_len = len(client_req.prompt_ids)
        emitted: list[int] = []
        chars = 0  # characters of text streamed
        cached: int | None = None
        req = client_req
        for attempt in range(MAX_CONTINUATIONS + 1):
            try:
                async for item in self._attempt(req):
                    if cached is None:
                        cached = item.cached_tokens
                    if item.prompt_logprobs is not None:  # sent: a continuation need not score the prompt again
                        client_req = dataclasses.replace(
                            client_req, sampling=dataclasses.replace(client_req.sampling, prompt_logprobs=None))
                    emitted += item.new_token_ids
                    chars += len(item.text)
                    if item.finished and attempt:
                        item = item._replace(prompt_tokens=prompt_len, completion_tokens=len(emitted),
                                             cached_tokens=min(cached, prompt_len))
                    yield item
                return
            except Exception as e:
                remaining = client_req.max_tokens - len(emitted)
                if not self.pool.continuable(e) or attempt == MAX_CONTINUATIONS or remaining <= 0:
                    raise
                log.warning("continuing a request elsewhere after %d tokens: %s", len(emitted), type(e).__name__)
                self.metrics.continued.inc()
                done = tuple(emitted)
                req = dataclasses.replace(client_req, plan=self.planner.continued(client_req, done),
                                          prompt_ids=client_req.prompt_ids + done, max_tokens=remaining,
                                          continued_ids=done, continued_chars=chars)

    async def _attempt(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """One try. Co-located, one replica streams every output. P/D: a prefill replica hands
        the prompt's KV off and a decode replica pulls it and streams every token; a request that
        ends at its first token never reaches the decode pool."""
        if self.decode is None:
            async for item in self.pool.generate(req):
                yield item
            return
        last, kv = await self.pool.prefill(dataclasses.replace(req, handoff=True))
        if last is None:
            return
        if kv is None:
            yield last
            return
        self.metrics.handoffs.inc()
        scored = last.prompt_logprobs  # the prompt was scored on the prefill replica
        async for item in self.decode.generate(decode_request(req, last, kv)):
            if scored is not None:
                item, scored = item._replace(prompt_logprobs=scored), None
            yield item
