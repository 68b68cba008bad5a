"""Prefix affinity without a directory: requests that share their first tokens go to the same
replica, by rendezvous (highest-random-weight) hashing of those tokens over the replicas, so a
replica joining or leaving moves only its own share of prefixes. It is what SGLang's router and
Ray Serve's prefix-aware router approximate, and the baseline a user would pick instead of the
shared cache directory (``tide bench cluster``'s ``prefix_affinity`` mode).

Bounded load: a replica whose queue is longer than ``max_queue_ratio`` times the shortest one
(plus ``slack``) and more than ``min_gap`` requests longer is passed over for the next in the
prefix's ranking, so a hot prefix does not pile onto one replica. SGLang's and vLLM's routers
balance only past an imbalance of 64 requests and 1.5 times the shortest queue (their
``cache_aware`` defaults: ``SGLANG_QUEUE_RATIO``, ``SGLANG_QUEUE_GAP``); below it they follow the
prefix alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

__all__ = ["AFFINITY_TOKENS", "QUEUE_RATIO", "SGLANG_QUEUE_GAP", "SGLANG_QUEUE_RATIO", "rank_by_prefix"]

AFFINITY_TOKENS = 256  # the first 4 cache units decide where a prompt goes
QUEUE_RATIO = 2.0  # the bounded load: a queue over twice the shortest (+ slack) is passed over
SGLANG_QUEUE_RATIO, SGLANG_QUEUE_GAP = 1.5, 64  # --balance-rel-threshold, --balance-abs-threshold


def _score(prefix: bytes, replica: str) -> int:
    return xxhash.xxh3_64_intdigest(prefix + replica.encode())


def rank_by_prefix(prompt_ids: Sequence[int], replicas: Sequence[str], queued: Sequence[int] | None = None,
                   affinity_tokens: int = AFFINITY_TOKENS, max_queue_ratio: float = QUEUE_RATIO, slack: int = 2,
                   min_gap: int = 0) -> list[int]:
    """Indices of ``replicas`` in the order to try them for a prompt: by rendezvous hash of its
    first ``affinity_tokens`` ids, the overloaded ones (``queued``: requests waiting at each;
    the bounded load of the module docstring) moved to the end. Size 0 -> []."""
    if affinity_tokens < 1:
        raise ValueError(f"affinity_tokens must be >= 1, got {affinity_tokens}")
    prefix = b"".join(int(t).to_bytes(4, "little") for t in prompt_ids[:affinity_tokens])
    order = sorted(range(len(replicas)), key=lambda i: _score(prefix, replicas[i]), reverse=True)
    if not queued:
        return order
    limit = max(min(queued) * max_queue_ratio + slack, min(queued) + min_gap)
    return [i for i in order if queued[i] <= limit] + [i for i in order if queued[i] > limit]
