"""How a prompt's KV travels from a prefill replica to a decode replica (P/D disaggregation).

A prefill replica's stream (``LLMServer.generate`` with ``handoff``) ends with two items: the
output that finishes the prefill, carrying ``handoff`` (the first token, where the prompt's KV
came from, the sampler's state), then the prompt's KV tensor itself as its own stream item. The
caller (the ingress's pool: ``deploy.ingress.serve_pool`` or ``actors.replica_pool``) fetches the first and only takes the *reference* of the
second (``read_prefill``); the decode replica gets that reference inside its ``prefilled``
request and pulls the tensor straight from the prefill replica's node (``resolve``).

Why the KV is a stream item and not an ``ObjectRef`` put by the prefill replica inside the
output: a stream's items are owned by the caller, so the KV lives as long as the caller holds it,
even if the prefill replica dies or is lent to training meanwhile. A reference put by the replica
and nested in a yielded item is owned by the replica, and Ray 2.60's streaming generators can
lose the caller's borrow of such nested references (ray-project/ray#58080): the decode replica
then failed with ``ReferenceCountingAssertionError`` now and then.

What crosses is typed: a prefill replica's handoff output is a ``RequestOutput`` whose
``handoff`` is a ``Prefilled`` without its tensor (``kv`` None), and the decode request is the
client's ``GenerationRequest`` with ``prefilled`` set to that ``Prefilled`` holding the KV item's
reference (``deploy.ingress.dispatch.decode_request``); the decode replica swaps the reference for the tensor
(``resolve``).
"""

from __future__ import annotations

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
            return last, await refs.__anext__()  # the KV: its reference only, the tensor stays put
    return last, None


async def resolve(req: GenerationRequest) -> GenerationRequest:
    """A decode replica's view of a ``decode_request``: the KV tensor fetched from the prefill
    replica's node in place of its reference."""
    p = req.prefilled
    if p is None or not isinstance(p.kv, ray.ObjectRef):
        return req
    return dataclasses.replace(req, prefilled=dataclasses.replace(p, kv=await p.kv))
