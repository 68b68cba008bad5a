"""How a prompt's KV travels from a prefill replica to a decode replica (P/D disaggregation).

A prefill replica's stream (``LLMServer.generate`` with ``handoff``) ends with two items: the
output that finishes the prefill, carrying ``handoff`` (the first token, where the prompt's KV
came from, the sampler's state), then a ``cluster.kv_transfer.KVTicket`` for the prompt's KV,
which the replica holds in its outbox. The caller (the ingress's pool:
``deploy.ingress.serve_pool`` or ``actors.replica_pool``) fetches the first and only takes the
*reference* of the second (``read_prefill``); the decode replica gets that reference inside its
``prefilled`` request, reads the ticket and pulls the tensor straight from the prefill
replica's outbox over TCP (``resolve``): the KV never enters Ray's object store, only its ticket
(a few hundred bytes) does.

When the prefill replica is gone before the pull (killed, lent to training, its outbox full),
the pull raises ``KVLost``: nothing was streamed yet, so the ingress starts the request over on
another replica (``actors.replica_pool.continuable``).

What crosses is typed: a prefill replica's handoff output is a ``RequestOutput`` whose
``handoff`` is a ``Prefilled`` without its tensor (``kv`` None), and the decode request is the
client's ``GenerationRequest`` with ``prefilled`` set to that ``Prefilled`` holding the ticket
item's reference (``deploy.ingress.dispatch.decode_request``); the decode replica swaps the
reference for the tensor (``resolve``).
"""

from __future__ import annotations

import asyncio
import dataclasses

import ray

from cluster.request import GenerationRequest, RequestOutput

__all__ = ["read_prefill", "resolve"]


async def read_prefill(refs: ray.ObjectRefGenerator) -> tuple[RequestOutput | None, ray.ObjectRef | None]:
    """Read a prefill stream: its last output, and when that output hands the request off, the
    reference of the KV item that follows it (``None`` when the request ended on the prefill
    replica, e.g. at its first token). Errors of the stream are raised."""
    last = None
    async for ref in refs:
        last = await ref
        if last.handoff is not None:
            return last, await refs.__anext__()  # the KV's ticket: its reference only
    return last, None


async def resolve(req: GenerationRequest) -> GenerationRequest:
    """A decode replica's view of a ``decode_request``: the KV tensor pulled from the prefill
    replica's outbox in place of its ticket's reference; ``KVLost`` when it cannot be."""
    # imported here: it needs torch, which the replicas have and the ingress (read_prefill) need not
    from cluster.kv_transfer import KVTicket, fetch_kv

    p = req.prefilled
    if p is None or not isinstance(p.kv, ray.ObjectRef):
        return req
    kv = await p.kv
    if isinstance(kv, KVTicket):
        kv = await asyncio.to_thread(fetch_kv, kv)
    return dataclasses.replace(req, prefilled=dataclasses.replace(p, kv=kv))
