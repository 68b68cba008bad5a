"""In-memory directory (``mem://``): one process, same contract as Redis; for tests and
single-node runs."""

from __future__ import annotations

import heapq
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from cachedir.directory.base import (
    GONE_TTL_S,
    MAX_HOT,
    Directory,
    Holder,
    HotUnit,
    PrefixMatch,
    add_log2,
    bisect_runs,
)

__all__ = ["MemoryDirectory"]


class MemoryDirectory(Directory):
    def __init__(
        self, namespace: str, half_life_s: float = 600.0, now_s: Callable[[], float] = time.time,
        max_hot: int = MAX_HOT,
    ) -> None:
        super().__init__(namespace, half_life_s, max_hot)
        self._now = now_s
        self._lock = threading.Lock()
        self._holders: dict[bytes, dict[str, str]] = {}
        self._by_node: dict[str, set[bytes]] = {}
        self._alive: dict[str, tuple[str, float]] = {}  # node -> (address, expires)
        self._hot: dict[bytes, float] = {}  # key -> log2 of time-scaled hit mass
        self._gone: dict[bytes, float] = {}  # key every holder dropped -> until when it is remembered
        self._epoch = uuid.uuid4().hex

    def _is_live(self, node_id: str) -> bool:
        entry = self._alive.get(node_id)
        return entry is not None and entry[1] > self._now()

    def register(self, node_id: str, keys: Sequence[bytes], tier: str = "ssd") -> None:
        self._check_tier(tier)
        with self._lock:
            mine = self._by_node.setdefault(node_id, set())
            for k in keys:
                self._holders.setdefault(k, {})[node_id] = tier
                self._gone.pop(k, None)
                mine.add(k)

    def unregister(self, node_id: str, keys: Sequence[bytes]) -> None:
        self._drop(node_id, keys, remember=True)

    def _drop(self, node_id: str, keys: Sequence[bytes], remember: bool) -> None:
        with self._lock:
            mine = self._by_node.get(node_id, set())
            now = self._now()
            for k in keys:
                holders = self._holders.get(k)
                if holders is not None:
                    holders.pop(node_id, None)
                    if not holders:
                        del self._holders[k]
                        if remember:
                            self._gone[k] = now + GONE_TTL_S
                mine.discard(k)
            if remember and len(self._gone) > 2 * len(self._holders) + 1024:  # forget the expired ones
                self._gone = {k: t for k, t in self._gone.items() if t > now}

    def longest_prefix(self, keys: Sequence[bytes]) -> PrefixMatch:
        def probe(indices: list[int]) -> list[str]:
            return [",".join(sorted(f"{n}={t}" for n, t in self._holders.get(keys[i], {}).items() if self._is_live(n)))
                    for i in indices]

        with self._lock:
            runs = bisect_runs(len(keys), probe)
            out: list[list[Holder]] = []
            for count, holders in runs:
                same = [Holder(*item.split("=", 1)) for item in holders.split(",")]
                out.extend([same] * count)
            dropped = len(out) < len(keys) and self._gone.get(keys[len(out)], 0.0) > self._now() \
                and not any(self._is_live(n) for n in self._holders.get(keys[len(out)], {}))
        return PrefixMatch(out, dropped)

    def heartbeat(self, node_id: str, address: str, ttl_s: float) -> bool:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        with self._lock:
            revived = not self._is_live(node_id)
            self._alive[node_id] = (address, self._now() + ttl_s)
            self._by_node.setdefault(node_id, set())
            return revived

    def live_nodes(self) -> dict[str, str]:
        with self._lock:
            return {n: a for n, (a, _) in self._alive.items() if self._is_live(n)}

    def node_keys(self, node_id: str) -> set[bytes]:
        with self._lock:
            return set(self._by_node.get(node_id, set()))

    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        with self._lock:
            return [[Holder(n, t) for n, t in sorted(self._holders.get(k, {}).items()) if self._is_live(n)] for k in keys]

    def collect_dead(self) -> list[str]:
        with self._lock:
            dead = [n for n in self._by_node if not self._is_live(n)]
        for n in dead:
            self._drop(n, list(self.node_keys(n)), remember=False)
            with self._lock:
                self._by_node.pop(n, None)
                self._alive.pop(n, None)
        return dead

    def record_hits(self, keys: Sequence[bytes], now_s: float) -> None:
        mass = now_s / self.half_life_s  # log2 of 2^(t/h): later hits weigh more
        with self._lock:
            for k in keys:
                self._hot[k] = add_log2(self._hot.get(k, -math.inf), mass)
            if len(self._hot) > self.max_hot:  # down to 7/8 of it: one trim per many calls
                keep = heapq.nlargest(max(1, self.max_hot * 7 // 8), self._hot.items(), key=lambda kv: kv[1])
                self._hot = dict(keep)

    def hot_units(self, limit: int, max_replicas: int, now_s: float) -> list[HotUnit]:
        with self._lock:
            ranked = sorted(self._hot.items(), key=lambda kv: kv[1], reverse=True)
            out = []
            for k, score in ranked:
                live = sorted(n for n in self._holders.get(k, {}) if self._is_live(n))
                if 0 < len(live) < max_replicas:
                    out.append(HotUnit(k, 2.0 ** (score - now_s / self.half_life_s), len(live), live))
                    if len(out) == limit:
                        break
            return out

    def epoch(self) -> str:
        return self._epoch

    def reset(self) -> None:
        """Forget everything, as a restarted empty store would (tests)."""
        with self._lock:
            self._holders.clear()
            self._by_node.clear()
            self._alive.clear()
            self._hot.clear()
            self._epoch = uuid.uuid4().hex
