"""``ActorPool``: the ingress's ``ReplicaPool`` protocol (``deploy.ingress.dispatch``) over plain
``LLMServer`` actor handles (``ray.remote(LLMServer)``), for P/D and tests without Serve.

A prefill pool sends each request to the replica with the fewest requests in flight. A decode
pool (``kv=True``) places each on a replica with KV room for the whole request (prompt +
max_tokens) through the decode load balancer (``cluster.decode_lb``), or the request waits
until one frees. Under Serve the request routers do this (``deploy.prefill_router``,
``deploy.decode_router``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import ray

from actors.pd_handoff import read_prefill
from cluster.decode_lb import DecodeBalancer
from cluster.request import GenerationRequest, KVLost, RequestMigrated, RequestOutput

__all__ = ["ActorPool", "continuable"]


def continuable(e: BaseException) -> bool:
    """A replica gave the request back or went away: the request can go on elsewhere."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, ObjectLostError, RayActorError

    # KVLost, ObjectLostError: P/D, the prompt's KV (or its ticket) was lost before the decode
    # replica pulled it (its replica or node went away); nothing was streamed, the request starts over
    gone = (RequestMigrated, KVLost, RayActorError, ActorDiedError, ActorUnavailableError, ObjectLostError)
    return isinstance(e, gone) or isinstance(getattr(e, "cause", None), gone)


class ActorPool:
    def __init__(self, handles: list, kv: bool = False) -> None:
        if not handles:
            raise ValueError("a replica pool needs at least one replica")
        self.handles = {f"replica-{i}": h for i, h in enumerate(handles)}
        self.in_flight = dict.fromkeys(self.handles, 0)
        self.balancer: DecodeBalancer | None = None
        self.queued = 0  # requests that waited for KV room
        if kv:
            caps = ray.get([h.kv_capacity.remote() for h in handles])
            if len({c["page_size"] for c in caps}) != 1:
                raise ValueError(f"decode replicas must share one page size, got {[c['page_size'] for c in caps]}")
            self.balancer = DecodeBalancer({r: c["tokens"] for r, c in zip(self.handles, caps, strict=True)},
                                           caps[0]["page_size"])
        self._room = asyncio.Condition()

    async def _place(self, need: int) -> str:
        if self.balancer is None:
            return min(self.in_flight, key=self.in_flight.get)
        if not self.balancer.fits_anywhere(need):
            raise ValueError(f"request needs {need} KV tokens; the largest decode replica holds fewer")
        async with self._room:
            replica = self.balancer.choose(need)
            self.queued += replica is None
            while replica is None:
                await self._room.wait()
                replica = self.balancer.choose(need)
            return replica

    async def _release(self, replica: str, need: int) -> None:
        self.in_flight[replica] -= 1
        if self.balancer is not None:
            async with self._room:
                self.balancer.release(replica, need)
                self._room.notify_all()

    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        need = len(req.prompt_ids) + req.max_tokens
        replica = await self._place(need)
        self.in_flight[replica] += 1
        try:
            async for ref in self.handles[replica].generate.options(num_returns="streaming").remote(req):
                yield await ref
        finally:
            await self._release(replica, need)

    async def prefill(self, req: GenerationRequest) -> tuple[RequestOutput | None, Any]:
        replica = await self._place(0)
        self.in_flight[replica] += 1
        try:
            return await read_prefill(self.handles[replica].generate.options(num_returns="streaming").remote(req))
        finally:
            await self._release(replica, 0)

    async def ready(self) -> bool:
        return any(await asyncio.gather(*(h.ready.remote() for h in self.handles.values())))

    async def stats(self) -> dict:
        return await next(iter(self.handles.values())).stats.remote()

    continuable = staticmethod(continuable)

    @staticmethod
    def unavailable(e: BaseException) -> bool:
        return continuable(e)

