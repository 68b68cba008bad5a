"""Decode load balancer: which decode replica continues a prefilled request.

Each decode replica has a KV capacity in tokens. Placing a request reserves the KV it can grow to
(prompt + max_tokens, rounded up to whole pages as the engine allocates them) until it finishes, so a replica is never asked to hold more than it has: when
no replica has room, ``choose`` returns None and the caller queues the request. Among replicas
with room it picks the lowest KV occupancy after placing, then the fewest running requests.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DecodeBalancer", "DecodeReplica"]


@dataclass(slots=True)
class DecodeReplica:
    capacity_tokens: int
    reserved_tokens: int = 0
    running: int = 0

    def occupancy_after(self, need: int) -> float:
        return (self.reserved_tokens + need) / self.capacity_tokens


class DecodeBalancer:
    def __init__(self, capacities: dict[str, int], page_size: int = 1) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        self.replicas: dict[str, DecodeReplica] = {}
        for rid, cap in capacities.items():
            self.add(rid, cap)

    def add(self, replica_id: str, capacity_tokens: int) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be > 0, got {capacity_tokens} for {replica_id!r}")
        self.replicas[replica_id] = DecodeReplica(capacity_tokens)

    def remove(self, replica_id: str) -> None:
        """Stop placing on ``replica_id`` (its running requests still release normally)."""
        self.replicas.pop(replica_id, None)

    def reservation(self, tokens: int) -> int:
        """KV tokens a request of ``tokens`` (prompt + max_tokens) holds: whole pages."""
        return -(-tokens // self.page_size) * self.page_size

    def fits_anywhere(self, need_tokens: int) -> bool:
        """Whether any replica could ever hold ``need_tokens`` (else queueing would wait forever)."""
        need_tokens = self.reservation(need_tokens)
        return any(r.capacity_tokens >= need_tokens for r in self.replicas.values())

    def rank(self, need_tokens: int) -> list[str]:
        """The replicas with room for ``need_tokens`` (page-rounded), best first: lowest KV
        occupancy after placing, then fewest running requests. Reserves nothing."""
        need_tokens = self.reservation(need_tokens)
        room = [(rid, r) for rid, r in self.replicas.items() if r.capacity_tokens - r.reserved_tokens >= need_tokens]
        return [rid for rid, _ in sorted(room, key=lambda item: (item[1].occupancy_after(need_tokens), item[1].running,
                                                                  item[0]))]

    def reserve(self, replica_id: str, need_tokens: int) -> None:
        """Hold ``need_tokens`` (page-rounded) on ``replica_id`` until ``release``."""
        r = self.replicas[replica_id]
        r.reserved_tokens += self.reservation(need_tokens)
        r.running += 1

    def choose(self, need_tokens: int) -> str | None:
        """Reserve ``need_tokens`` (page-rounded) on the best replica with room and return its
        id, or None. ``release`` takes the same ``need_tokens``."""
        ranked = self.rank(need_tokens)
        if not ranked:
            return None
        self.reserve(ranked[0], need_tokens)
        return ranked[0]

    def release(self, replica_id: str, need_tokens: int) -> None:
        r = self.replicas.get(replica_id)
        need_tokens = self.reservation(need_tokens)
        if r is None:
            return  # removed meanwhile
        assert r.reserved_tokens >= need_tokens and r.running >= 1, (replica_id, r, need_tokens)
        r.reserved_tokens -= need_tokens
        r.running -= 1

    def check_integrity(self) -> None:
        for rid, r in self.replicas.items():
            assert 0 <= r.reserved_tokens <= r.capacity_tokens, (rid, r)
            assert r.running >= 0 and (r.running > 0 or r.reserved_tokens == 0), (rid, r)
