"""A byte-bounded set of keys with an eviction policy: the accounting core of every tier.

The SSD store and the RAM tier keep their bytes elsewhere (files, dicts) and ask this index what
to evict; the trace simulator uses it alone, so a replay exercises the same code as serving.
"""

from __future__ import annotations

from cachedir.eviction import EvictionPolicy, make_policy

__all__ = ["CapacityIndex"]


class CapacityIndex:
    def __init__(
        self, capacity_bytes: int, policy: str | EvictionPolicy = "lru", max_age_s: float | None = None
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.max_age_s = max_age_s
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self._sizes: dict[bytes, int] = {}
        self.bytes = 0
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self):
        return self._sizes.keys()

    def size(self, key: bytes) -> int:
        return self._sizes[key]

    def touch(self, key: bytes, now_s: float) -> None:
        self.policy.touch(key, now_s)

    def add(self, key: bytes, nbytes: int, now_s: float) -> list[bytes]:
        """Admit ``key`` (touch it if present), evicting as needed; returns the evicted keys.
        A key larger than the whole capacity is not admitted (and evicts nothing)."""
        if key in self._sizes:
            self.policy.touch(key, now_s)
            return []
        if nbytes > self.capacity_bytes:
            return []
        evicted = self.expire(now_s)
        while self.bytes + nbytes > self.capacity_bytes:
            victim = self.policy.victim()
            assert victim is not None, "over capacity with an empty policy"
            self.remove(victim)
            self.evictions += 1
            evicted.append(victim)
        self._sizes[key] = nbytes
        self.bytes += nbytes
        self.policy.insert(key, now_s)
        return evicted

    def expire(self, now_s: float) -> list[bytes]:
        """Drop keys unused for longer than ``max_age_s``; returns them."""
        if self.max_age_s is None:
            return []
        old = self.policy.expired(now_s, self.max_age_s)
        for key in old:
            self.remove(key)
            self.evictions += 1
        return old

    def remove(self, key: bytes) -> bool:
        nbytes = self._sizes.pop(key, None)
        if nbytes is None:
            return False
        self.bytes -= nbytes
        self.policy.remove(key)
        return True

    def check_integrity(self) -> None:
        assert self.bytes == sum(self._sizes.values()), (self.bytes, sum(self._sizes.values()))
        assert 0 <= self.bytes <= self.capacity_bytes, (self.bytes, self.capacity_bytes)
        assert len(self.policy) == len(self._sizes), (len(self.policy), len(self._sizes))
