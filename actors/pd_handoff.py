"""How a prompt's KV travels from a prefill replica to a decode replica (P/D disaggregation).

A prefill replica's stream (``LLMServer.generate`` with ``handoff``) ends with two items: the
output that finishes the prefill, carrying ``handoff`` (the first token, where the prompt's KV
came from, the sampler's state), then the prompt's KV tensor itself as its own stream item. The
caller (the ingress, or ``PDRouter``) fetches the first and only takes the *reference* of the
second (``read_prefill``); the decode replica gets that reference inside its ``prefilled``
request and pulls the tensor straight from the prefill replica's node (``prefilled``).

Why the KV is a stream item and not an ``ObjectRef`` put by the prefill replica inside the
output: a stream's items are owned by the caller, so the KV lives as long as the caller holds it,
even if the prefill replica dies or is lent to training meanwhile. A reference put by the replica
and nested in a yielded item is owned by the replica, and Ray 2.60's streaming generators can
lose the caller's borrow of such nested references (ray-project/ray#58080): the decode replica
then failed with ``ReferenceCountingAssertionError`` now and then.

Also here: a token's logprobs as replicas send them in their outputs and in ``handoff`` (the
first token's, computed on the prefill side).
"""

from __future__ import annotations

import ray

from cluster.request import Prefilled, TokenSources
from model.sampling import TokenLogprob

__all__ = ["logprob_from_dict", "logprob_to_dict", "prefilled", "read_prefill"]


async def read_prefill(refs: ray.ObjectRefGenerator) -> tuple[dict | None, ray.ObjectRef | None]:
    """Read a prefill stream: its last output, and when that output hands the request off, the
    reference of the KV item that follows it (``None`` when the request ended on the prefill
    replica, e.g. at its first token). Errors of the stream are raised."""
    last = None
    async for ref in refs:
        last = await ref
        if "handoff" in last:
            return last, await refs.__anext__()  # the KV: its reference only, the tensor stays put
    return last, None


async def prefilled(handoff: dict) -> Prefilled:
    """A decode replica's view of a ``handoff`` dict with its ``kv`` reference: the tensor is
    fetched from the prefill replica's node."""
    kv = await handoff["kv"]
    first_lp = handoff.get("first_logprob")
    return Prefilled(kv, int(handoff["first_token"]), TokenSources(**handoff["sources"]),
                     handoff.get("generator_state"), logprob_from_dict(first_lp) if first_lp else None)


def logprob_to_dict(lp: TokenLogprob | None) -> dict | None:
    """A token's logprobs as replicas send them: ``{"token", "logprob", "top": [[id, logprob], ...]}``."""
    return None if lp is None else {"token": lp.token, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}


def logprob_from_dict(d: dict) -> TokenLogprob:
    return TokenLogprob(int(d["token"]), float(d["logprob"]), tuple((int(i), float(v)) for i, v in d["top"]))
