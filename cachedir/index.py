"""A byte-bounded set of keys with an eviction policy: the accounting core of every tier.

The SSD store and the RAM tier keep their bytes elsewhere (files, dicts) and ask this index what
to evict; the trace simulator uses it alone, so a replay exercises the same code as serving.

Pinned keys (``tide cache pin``: a shared system prompt that must survive any load) count
against the capacity but are never evicted or expired; a new key that only pinned keys stand
in the way of is not admitted.
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
        self._pinned: set[bytes] = set()
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
        """A use of ``key``; a key not held is ignored (the policy must only ever order held
        keys: an eviction loop would otherwise pick a victim it cannot remove)."""
        if key in self._sizes and key not in self._pinned:
            self.policy.touch(key, now_s)

    @property
    def pinned(self) -> frozenset[bytes]:
        return frozenset(self._pinned)

    def pin(self, key: bytes) -> bool:
        """Exempt a held key from eviction; False when it is not held."""
        if key not in self._sizes:
            return False
        if key not in self._pinned:
            self.policy.remove(key)
            self._pinned.add(key)
        return True

    def unpin(self, key: bytes, now_s: float) -> bool:
        if key not in self._pinned:
            return False
        self._pinned.discard(key)
        self.policy.insert(key, now_s)
        return True

    def add(self, key: bytes, nbytes: int, now_s: float) -> list[bytes]:
        """Admit ``key`` (touch it if present), evicting as needed; returns the evicted keys.
        A key larger than the whole capacity is not admitted (and evicts nothing)."""
        if key in self._sizes:
            self.touch(key, now_s)
            return []
        if nbytes > self.capacity_bytes:
            return []
        evicted = self.expire(now_s)
        while self.bytes + nbytes > self.capacity_bytes:
            victim = self.policy.victim()
            if victim is None:  # only pinned keys are left: no room for this one
                return evicted
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
        if key in self._pinned:
            self._pinned.discard(key)
        else:
            self.policy.remove(key)
        return True

    def check_integrity(self) -> None:
        assert self.bytes == sum(self._sizes.values()), (self.bytes, sum(self._sizes.values()))
        assert 0 <= self.bytes <= self.capacity_bytes, (self.bytes, self.capacity_bytes)
        assert len(self.policy) + len(self._pinned) == len(self._sizes), (len(self.policy), len(self._sizes))
        assert self._pinned <= self._sizes.keys()
