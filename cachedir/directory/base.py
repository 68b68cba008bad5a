"""The cache directory: which live nodes hold which units, and how hot each unit is.

Contract shared by every backend (``tests/cachedir/test_directory_contract.py`` runs it on each):

* ``register``/``unregister`` are batched and idempotent; a key is a 16-byte unit key.
* ``longest_prefix(keys)`` returns, per leading unit, the *live* holders and their tiers, up to
  the first unit no live node holds. It reads O(log n) units per change of the holder set in
  O(log n) rounds (``bisect_runs``: 2,000 keys, a 128K-token prompt, take 3 or 4 round trips),
  not every unit: exact wherever each node's units are a prefix of the chain (units persist as
  whole prefixes, and at unlimited capacity that always holds); past a hole that no read saw it
  may go on (a reader then finds the unit missing on load: a shorter hit, never wrong KV), and
  it never stops before the first hole. Size 0 -> no match.
* A node is live while its heartbeat (TTL) lasts. Units of a dead node are ignored at once and
  removed by ``collect_dead`` (every node's publisher calls it now and then); a heartbeat says
  when the node was not live before, so a node that comes back registers its units again.
* ``holders(keys)`` gives each key's live holders and ``node_keys(node)`` a node's keys: the
  maintenance paths (night keeping, lending plans), never a request's.
* ``record_hits`` adds to per-unit hit counters that halve every ``half_life_s``; ``hot_units``
  returns the hottest units with fewer than ``max_replicas`` live holders.
* Backends raise ``DirectoryUnavailable`` when their store cannot be reached in time; callers on
  a request path treat that as "no hit".
* ``epoch`` identifies the store's lifetime: it changes when the store restarts empty, telling
  nodes to re-register their units.
* A unit that every node holding it unregistered (evicted it, or dropped it otherwise) is
  remembered as dropped for ``GONE_TTL_S``, until a node registers it again; a lookup says
  whether the unit right after the run it found is such a unit (``PrefixMatch.dropped_next``:
  the cache's accounting tells an evicted prefix from one never seen). Units of dead nodes that
  ``collect_dead`` removes are not.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Directory", "DirectoryUnavailable", "Holder", "HotUnit", "PrefixMatch", "FANOUT", "GONE_TTL_S",
           "HOLDER_BATCH", "TIERS", "bisect_runs"]

TIERS = ("ram", "ssd")
HOLDER_BATCH = 4096  # units ``Directory.holders`` reads per round trip
GONE_TTL_S = 86400.0  # how long a unit every holder dropped is remembered as dropped


class DirectoryUnavailable(RuntimeError):
    """The directory's backing store did not answer in time."""


@dataclass(frozen=True, slots=True)
class Holder:
    node_id: str
    tier: str


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    holders: list[list[Holder]]  # one list per matched unit, in order
    dropped_next: bool = False  # the unit after the match was held once and dropped by its holders

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


FANOUT = 16  # units read per span per round of a lookup


def _spread(a: int, b: int, fanout: int) -> list[int]:
    """Up to ``fanout - 1`` units evenly spaced strictly between ``a`` and ``b``."""
    if b - a <= fanout:
        return list(range(a + 1, b))
    step = (b - a) / fanout
    return sorted({a + round(step * j) for j in range(1, fanout)} - {a, b})


def bisect_runs(
    n: int, probe: Callable[[list[int]], list[str]], fanout: int = FANOUT,
) -> list[tuple[int, str]]:
    """The leading units of an ``n``-unit chain as runs (count, holders) of equal holders, where
    ``probe(indices)`` gives those units' holders, each as one canonical string ("" where none),
    in one round (one round trip for a remote store).

    Each round reads ``fanout - 1`` units spread over the span where the chain's end lies (the
    first unit found empty after the last one found held) and over every span between two read
    units whose holders differ; a span whose ends agree is taken to hold them throughout. So a
    chain of n units whose holder set changes k times takes about log_fanout(n) + 1 rounds of
    at most (k + 1) fanout units each, not n units."""
    seen: dict[int, str] = {}

    def ask(indices: list[int]) -> None:
        todo = sorted({i for i in indices if i not in seen})
        if todo:
            seen.update(zip(todo, probe(todo), strict=True))

    if n == 0:
        return []
    ask([0, *_spread(0, n, fanout), n - 1])  # the last unit too: a whole hit is one round
    if not seen[0]:
        return []
    lo, hi = 0, n  # seen[lo] held; hi: n, or the first unit after lo found empty
    while True:
        for i in sorted(i for i in seen if lo < i < hi):
            if not seen[i]:
                hi = i
                break
            lo = i
        held = sorted(i for i in seen if i <= lo)
        want = _spread(lo, hi, fanout)
        for a, b in zip(held, held[1:], strict=False):
            if b - a > 1 and seen[a] != seen[b]:
                want += _spread(a, b, fanout)
        if not want:
            break
        ask(want)
    held = sorted(i for i in seen if i <= lo)
    runs: list[tuple[int, str]] = []
    for a, b in zip(held, [*held[1:], lo + 1], strict=True):
        if runs and runs[-1][1] == seen[a]:
            runs[-1] = (runs[-1][0] + b - a, seen[a])
        else:
            runs.append((b - a, seen[a]))
    return runs


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
    def heartbeat(self, node_id: str, address: str, ttl_s: float) -> bool:
        """Keep ``node_id`` live for ``ttl_s``. True when it was not live before (its first
        heartbeat, or one after its TTL lapsed, when ``collect_dead`` may have removed its
        units): the caller then registers everything it holds again."""

    @abstractmethod
    def live_nodes(self) -> dict[str, str]:
        """node id -> address of every node whose heartbeat is current."""

    @abstractmethod
    def node_keys(self, node_id: str) -> set[bytes]:
        """Keys registered for ``node_id`` (maintenance path, not for requests)."""

    @abstractmethod
    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        """The live holders of each of ``keys``, by node id (maintenance path: a call reads every
        key it is given, in batches of ``HOLDER_BATCH``)."""

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
