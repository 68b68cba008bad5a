"""``PDRouter``: prefill/decode disaggregation across pools of ``LLMServer`` actors.

A request goes to a prefill replica (fewest requests in flight), which computes the prompt, samples
the first token and hands off: the prompt's latent KV goes into the Ray object store. The decode
load balancer (``cluster.decode_lb``) then picks a decode replica with KV room for the whole
request (prompt + max_tokens), or the request waits until one frees; that replica pulls the KV from
the object store and streams every output token. A request that ends at its first token never
reaches the decode pool. Co-located mode is simply one pool that does both (no router).

Replicas are Ray actor handles of ``LLMServer`` (e.g. ``ray.remote(LLMServer)``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import ray

from actors.pd_handoff import decode_request, read_prefill
from cluster.decode_lb import DecodeBalancer
from cluster.request import GenerationRequest, RequestOutput

__all__ = ["PDRouter"]


class PDRouter:
    def __init__(self, prefill: list, decode: list) -> None:
        if not prefill or not decode:
            raise ValueError(f"P/D needs at least one prefill and one decode replica, got {len(prefill)} and {len(decode)}")
        self.prefill = prefill
        self.decode = {f"decode-{i}": h for i, h in enumerate(decode)}
        kv = ray.get([h.kv_capacity.remote() for h in decode])
        if len({k["page_size"] for k in kv}) != 1:
            raise ValueError(f"decode replicas must share one page size, got {[k['page_size'] for k in kv]}")
        capacities = {rid: k["tokens"] for rid, k in zip(self.decode, kv, strict=True)}
        self.balancer = DecodeBalancer(capacities, kv[0]["page_size"])
        self._in_flight = [0] * len(prefill)
        self._room = asyncio.Condition()
        self.stats = {"handoffs": 0, "queued": 0, "prefill_only": 0}

    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        need = len(req.prompt_ids) + req.max_tokens
        if not self.balancer.fits_anywhere(need):
            raise ValueError(f"request needs {need} KV tokens; the largest decode replica holds fewer")
        i = min(range(len(self.prefill)), key=lambda j: self._in_flight[j])
        self._in_flight[i] += 1
        try:
            refs = self.prefill[i].generate.options(num_returns="streaming").remote(dataclasses.replace(req, handoff=True))
            last, kv = await read_prefill(refs)
        finally:
            self._in_flight[i] -= 1
        if kv is None:
            self.stats["prefill_only"] += 1
            if last is not None:
                yield last
            return
        replica = await self._place(need)
        self.stats["handoffs"] += 1
        try:
            decode_req = decode_request(req, last, kv)
            async for ref in self.decode[replica].generate.options(num_returns="streaming").remote(decode_req):
                yield await ref
        finally:
            async with self._room:
                self.balancer.release(replica, need)
                self._room.notify_all()

    async def _place(self, need: int) -> str:
        async with self._room:
            replica = self.balancer.choose(need)
            if replica is None:
                self.stats["queued"] += 1
            while replica is None:
                await self._room.wait()
                replica = self.balancer.choose(need)
            return replica
