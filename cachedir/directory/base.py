"""The cache directory: which live nodes hold which units, and how hot each unit is.

Contract shared by every backend (``tests/cachedir/test_directory_contract.py`` runs it on each):

* ``register``/``unregister`` are batched and idempotent; a key is a 16-byte unit key.
* ``longest_prefix(keys)`` walks ``keys`` from the first and stops at the first unit no *live*
  node holds; it returns, per matched unit, the live holders and their tiers. One round trip to
  the backing store whatever the length (2,000 keys = a 128K-token prompt). Size 0 -> no match.
* A node is live while its heartbeat (TTL) lasts. Units of a dead node are ignored at once and
  removed lazily by ``collect_dead``.
* ``record_hits`` adds to per-unit hit counters that halve every ``half_life_s``; ``hot_units``
  returns the hottest units with fewer than ``max_replicas`` live holders.
* Backends raise ``DirectoryUnavailable`` when their store cannot be reached in time; callers on
  a request path treat that as "no hit".
* ``epoch`` identifies the store's lifetime: it changes when the store restarts empty, telling
  nodes to re-register their units.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Directory", "DirectoryUnavailable", "Holder", "HotUnit", "PrefixMatch", "TIERS"]

TIERS = ("ram", "ssd")


class DirectoryUnavailable(RuntimeError):
    """The directory's backing store did not answer in time."""


@dataclass(frozen=True, slots=True)
class Holder:
    node_id: str
    tier: str


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    holders: list[list[Holder]]  # one list per matched unit, in order

    @property
    def num_units(self) -> int:
        return len(self.holders)


@dataclass(frozen=True, slots=True)
class HotUnit:
    key: bytes
    hits: float  # decayed hit count now
    replicas: int
    holders: list[str]


def add_log2(a: float, b: float) -> float:
    """log2(2^a + 2^b) without overflow."""
    hi, lo = (a, b) if a >= b else (b, a)
    if lo == -math.inf:
        return hi
    return hi + math.log2(1.0 + 2.0 ** (lo - hi))


MAX_HOT = 1 << 18  # hot units tracked per namespace (the coldest beyond it are forgotten)


class Directory(ABC):
    def __init__(self, namespace: str, half_life_s: float = 600.0, max_hot: int = MAX_HOT) -> None:
        if not namespace or ":" in namespace:
            raise ValueError(f"namespace must be a non-empty string without ':', got {namespace!r}")
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        if max_hot < 1:
            raise ValueError(f"max_hot must be >= 1, got {max_hot}")
        self.namespace = namespace
        self.half_life_s = half_life_s
        self.max_hot = max_hot

    @abstractmethod
    def register(self, node_id: str, keys: Sequence[bytes], tier: str = "ssd") -> None: ...

    @abstractmethod
    def unregister(self, node_id: str, keys: Sequence[bytes]) -> None: ...

    @abstractmethod
    def longest_prefix(self, keys: Sequence[bytes]) -> PrefixMatch: ...

    @abstractmethod
    def heartbeat(self, node_id: str, address: str, ttl_s: float) -> None: ...

    @abstractmethod
    def live_nodes(self) -> dict[str, str]:
        """node id -> address of every node whose heartbeat is current."""

    @abstractmethod
    def node_keys(self, node_id: str) -> set[bytes]:
        """Keys registered for ``node_id`` (maintenance path, not for requests)."""

    @abstractmethod
    def collect_dead(self) -> list[str]:
        """Drop every registration of nodes whose heartbeat expired; returns those nodes."""

    @abstractmethod
    def record_hits(self, keys: Sequence[bytes], now_s: float) -> None:
        """Count a hit on each unit; at most ``max_hot`` units are tracked (the coldest go)."""

    @abstractmethod
    def hot_units(self, limit: int, max_replicas: int, now_s: float) -> list[HotUnit]: ...

    @abstractmethod
    def epoch(self) -> str:
        """An id of the store's lifetime, created on first use."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    @staticmethod
    def _check_tier(tier: str) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; supported: {TIERS}")
