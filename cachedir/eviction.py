"""Eviction policies for a byte-bounded unit store.

A policy only orders keys; the store owns sizes and files. ``insert``/``touch``/``remove`` keep
the policy in step with the store; ``victim`` names the key to evict next (None when empty);
``expired`` lists keys idle longer than the maximum age. All methods are O(log n) or amortised
O(1) so a trace of millions of operations replays quickly.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Protocol

__all__ = ["EvictionPolicy", "LFUDecay", "LRU", "make_policy"]


class EvictionPolicy(Protocol):
    def insert(self, key: bytes, now_s: float) -> None: ...

    def touch(self, key: bytes, now_s: float) -> None: ...

    def remove(self, key: bytes) -> None: ...

    def victim(self) -> bytes | None: ...

    def expired(self, now_s: float, max_age_s: float) -> list[bytes]:
        """Keys not used for more than ``max_age_s`` (oldest first)."""
        ...

    def __len__(self) -> int: ...


class _Recency:
    """Last-use order, shared by every policy for the maximum-age rule."""

    def __init__(self) -> None:
        self._last: OrderedDict[bytes, float] = OrderedDict()

    def use(self, key: bytes, now_s: float) -> None:
        self._last[key] = now_s
        self._last.move_to_end(key)

    def drop(self, key: bytes) -> None:
        self._last.pop(key, None)

    def oldest(self) -> bytes | None:
        return next(iter(self._last), None)

    def expired(self, now_s: float, max_age_s: float) -> list[bytes]:
        out = []
        for key, t in self._last.items():
            if now_s - t <= max_age_s:
                break
            out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._last)


class LRU(_Recency):
    """Least recently used first."""

    def insert(self, key: bytes, now_s: float) -> None:
        self.use(key, now_s)

    touch = insert

    def remove(self, key: bytes) -> None:
        self.drop(key)

    def victim(self) -> bytes | None:
        return self.oldest()


class LFUDecay:
    """Least frequently used first, counts halving every ``half_life_s`` of disuse.

    A decayed count ``c * 2^-(t - t0)/h`` orders the same at every later time as
    ``log2(c) + t0/h``, so each key carries one fixed priority and a lazy min-heap finds the
    victim without rescoring the whole store.
    """

    def __init__(self, half_life_s: float = 3600.0) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self._state: dict[bytes, tuple[float, float]] = {}  # key -> (count at t0, t0)
        self._heap: list[tuple[float, bytes]] = []
        self._recency = _Recency()

    def _priority(self, count: float, t0: float) -> float:
        return math.log2(count) + t0 / self.half_life_s

    def insert(self, key: bytes, now_s: float) -> None:
        self._state[key] = (1.0, now_s)
        heapq.heappush(self._heap, (self._priority(1.0, now_s), key))
        self._recency.use(key, now_s)

    def touch(self, key: bytes, now_s: float) -> None:
        count, t0 = self._state[key]
        count = count * 2.0 ** (-(now_s - t0) / self.half_life_s) + 1.0
        self._state[key] = (count, now_s)
        heapq.heappush(self._heap, (self._priority(count, now_s), key))
        self._recency.use(key, now_s)
        if len(self._heap) > 4 * len(self._state) + 64:
            self._heap = [(self._priority(c, t), k) for k, (c, t) in self._state.items()]
            heapq.heapify(self._heap)

    def remove(self, key: bytes) -> None:
        self._state.pop(key, None)
        self._recency.drop(key)

    def victim(self) -> bytes | None:
        while self._heap:
            prio, key = self._heap[0]
            state = self._state.get(key)
            if state is not None and self._priority(*state) == prio:
                return key
            heapq.heappop(self._heap)  # stale entry
        return None

    def expired(self, now_s: float, max_age_s: float) -> list[bytes]:
        return self._recency.expired(now_s, max_age_s)

    def __len__(self) -> int:
        return len(self._state)


def make_policy(name: str, half_life_s: float = 3600.0) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFUDecay(half_life_s)
    raise ValueError(f"unknown eviction policy {name!r}; supported: lfu, lru")
