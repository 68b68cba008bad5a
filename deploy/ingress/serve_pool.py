"""The ``ReplicaPool`` over a Ray Serve deployment handle: everything of the ingress that knows
Serve's handles, its request context and Ray's errors."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from actors.pd_handoff import read_prefill
from actors.replica_pool import continuable
from cluster.request import GenerationRequest, RequestOutput

__all__ = ["ServePool", "continuable", "unavailable"]


def unavailable(e: BaseException) -> bool:
    """No replica could serve the request right now (all gone, or each try was lost)."""
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    return continuable(e) or isinstance(e, (BackPressureError, DeploymentUnavailableError))


def _own_request_id() -> None:
    """Give this asyncio task's Serve request context an internal request id of its own. The
    replica calls made while serving an HTTP request inherit its id, and Ray 2.60's request
    routers index the calls waiting for a replica by that id: two waiting at once (the choices of
    ``n`` > 1) collide, and one is never given a replica. (asyncio gives each task a copy of the
    context, so this changes only the calling task's.)"""
    from ray.serve import context

    ctx = context._get_serve_request_context()
    context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=uuid.uuid4().hex))


class ServePool:
    """The replicas of one Serve deployment (``LLMServer`` or the decode pool ``LLMDecode``)."""

    def __init__(self, handle, health_timeout_s: float = 5.0) -> None:
        self.handle, self.health_timeout_s = handle, health_timeout_s

    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        _own_request_id()
        response = self.handle.options(stream=True).generate.remote(req)
        done = False
        try:
            async for item in response:
                yield item
            done = True
        finally:
            if not done:  # the reader stopped early: the replica frees the request's KV
                response.cancel()

    async def prefill(self, req: GenerationRequest) -> tuple[RequestOutput | None, Any]:
        _own_request_id()
        response = self.handle.options(stream=True).generate.remote(req)
        try:
            return await read_prefill(await response._to_object_ref_gen())
        except BaseException:
            response.cancel()
            raise

    async def ready(self) -> bool:
        import asyncio

        try:
            return await asyncio.wait_for(self.handle.ready.remote(), timeout=self.health_timeout_s)
        except Exception:  # noqa: BLE001 - no replica answered in time: not ready
            return False

    async def stats(self) -> dict:
        return await self.handle.stats.remote()

    continuable = staticmethod(continuable)
    unavailable = staticmethod(unavailable)
