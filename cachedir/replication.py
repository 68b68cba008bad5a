"""Hot-unit replication: copy units that many requests hit to more nodes, with spare bandwidth.

Every node's agent runs a ``Replicator``. Each ``tick`` asks the directory for the hottest units
with fewer than ``replicas`` live holders (the directory's hit counters decay, so "hot" means hit
often *recently*). A unit is pushed by exactly one of its holders (the smallest node id among the
live ones, so two holders never both push it) to one node that lacks it: preferably a node that
recently fetched it remotely (it will use the copy), otherwise the node chosen by rendezvous
hashing of (unit, node) so copies of different units spread evenly.

A copy being pushed, or accepted but not yet registered by its receiver (receivers publish on
their next sync), counts towards R for ``settle_s``: without that, the next tick would see the
unit still under R and push a third copy elsewhere.

Bounds: at most ``max_inflight`` pushes at once and ``bytes_per_s`` per node (a token bucket),
so replication only uses spare bandwidth. Hysteresis: a (unit, target) pair is not tried again
within ``retry_after_s``, and a node that evicted a unit refuses it for ``cooldown_s`` (the agent
checks that on receipt), so eviction and replication do not fight.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from cachedir.directory.base import Directory, DirectoryUnavailable

__all__ = ["ReplicationConfig", "Replicator"]


@dataclass(frozen=True, slots=True)
class ReplicationConfig:
    replicas: int = 2  # R: wanted live copies of a hot unit
    min_hits: float = 2.0  # decayed hit count from which a unit counts as hot (hits decay, so > n-1)
    scan_limit: int = 64  # hot units examined per tick
    max_inflight: int = 2
    bytes_per_s: float = 100e6
    retry_after_s: float = 30.0
    cooldown_s: float = 300.0
    settle_s: float = 5.0  # a started push counts as a copy this long, until its receiver registers it

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.max_inflight < 1 or self.bytes_per_s <= 0:
            raise ValueError("max_inflight must be >= 1 and bytes_per_s > 0")


class _TokenBucket:
    def __init__(self, rate: float, burst: float, now: Callable[[], float]) -> None:
        self.rate, self.burst, self._now = rate, burst, now
        self.level, self.t = burst, now()

    def take(self, n: float) -> bool:
        t = self._now()
        self.level = min(self.burst, self.level + (t - self.t) * self.rate)
        self.t = t
        if self.level < min(n, self.burst):  # a unit larger than the burst waits for a full bucket
            return False
        self.level -= n
        return True


class Replicator:
    def __init__(
        self,
        cfg: ReplicationConfig,
        node_id: str,
        directory: Directory,
        read: Callable[[bytes], bytes | None],
        push: Callable[[str, bytes], bool],
        now_s: Callable[[], float] = time.monotonic,
    ) -> None:
        """``read(key)`` gives the encoded unit this node holds; ``push(address, encoded)`` sends
        it to the agent at ``address`` and says whether it was accepted."""
        self.cfg = cfg
        self.node_id = node_id
        self.directory = directory
        self._read, self._push, self._now = read, push, now_s
        self._bucket = _TokenBucket(cfg.bytes_per_s, max(cfg.bytes_per_s, 8 << 20), now_s)
        self._pool = ThreadPoolExecutor(cfg.max_inflight, thread_name_prefix="replicate")
        self._inflight: set[Future] = set()
        self._tried: OrderedDict[tuple[bytes, str], float] = OrderedDict()
        self._fetched_by: OrderedDict[bytes, list[str]] = OrderedDict()
        self._placing: OrderedDict[bytes, dict[str, float]] = OrderedDict()  # key -> {target: when pushed}
        self._lock = threading.Lock()
        self.stats = {"pushed": 0, "refused": 0, "failed": 0, "bytes": 0}

    def note_remote_fetch(self, key: bytes, requester: str) -> None:
        """``requester`` fetched ``key`` from this node (it is the preferred replica target)."""
        if not requester or requester == self.node_id:
            return
        with self._lock:
            nodes = self._fetched_by.pop(key, [])
            if requester not in nodes:
                nodes.append(requester)
            self._fetched_by[key] = nodes[-4:]
            while len(self._fetched_by) > 65536:
                self._fetched_by.popitem(last=False)

    def _target(self, key: bytes, holders: set[str], live: dict[str, str]) -> str | None:
        now = self._now()
        candidates = [n for n in live if n not in holders
                      and now - self._tried.get((key, n), -1e18) >= self.cfg.retry_after_s]
        if not candidates:
            return None
        with self._lock:
            preferred = [n for n in reversed(self._fetched_by.get(key, [])) if n in candidates]
        if preferred:
            return preferred[0]
        return max(candidates, key=lambda n: xxhash.xxh3_64_intdigest(key + n.encode()))

    def tick(self) -> int:
        """Start the pushes that are due now; returns how many started."""
        self._inflight = {f for f in self._inflight if not f.done()}
        free = self.cfg.max_inflight - len(self._inflight)
        if free <= 0:
            return 0
        try:
            hot = self.directory.hot_units(self.cfg.scan_limit, self.cfg.replicas, time.time())
            live = self.directory.live_nodes() if hot else {}
        except DirectoryUnavailable:
            return 0
        started = 0
        for unit in hot:
            if unit.hits < self.cfg.min_hits or started == free:
                break
            holders = {n for n in unit.holders if n in live}
            if self.node_id not in holders or self.node_id != min(holders):
                continue  # another holder pushes it (or this node no longer has it)
            placing = self._placing_to(unit.key, holders)
            if len(holders) + len(placing) >= self.cfg.replicas:
                continue  # enough copies once the pushes under way are registered
            target = self._target(unit.key, holders | placing, live)
            if target is None:
                continue
            data = self._read(unit.key)
            if data is None or not self._bucket.take(len(data)):
                continue
            self._tried[(unit.key, target)] = self._now()
            while len(self._tried) > 65536:
                self._tried.popitem(last=False)
            with self._lock:
                self._placing.setdefault(unit.key, {})[target] = self._now()
                self._placing.move_to_end(unit.key)
                while len(self._placing) > 65536:
                    self._placing.popitem(last=False)
            fut = self._pool.submit(self._send, unit.key, target, live[target], data)
            self._inflight.add(fut)
            started += 1
        return started

    def _placing_to(self, key: bytes, holders: set[str]) -> set[str]:
        """Targets of this node's recent pushes of ``key`` that are not registered holders yet."""
        now = self._now()
        with self._lock:
            placing = self._placing.get(key)
            if not placing:
                return set()
            for n in [n for n, t in placing.items() if n in holders or now - t >= self.cfg.settle_s]:
                del placing[n]  # registered, or given up on (it may have been evicted meanwhile)
            if not placing:
                del self._placing[key]
            return set(placing)

    def _send(self, key: bytes, target: str, address: str, data: bytes) -> None:
        try:
            outcome = "pushed" if self._push(address, data) else "refused"
        except Exception:  # noqa: BLE001 - a failed push is retried after retry_after_s
            outcome = "failed"
        with self._lock:
            self.stats[outcome] += 1
            if outcome == "pushed":
                self.stats["bytes"] += len(data)
            else:  # no copy is coming from this push
                self._placing.get(key, {}).pop(target, None)

    def wait(self, timeout_s: float | None = None) -> None:
        for f in list(self._inflight):
            f.result(timeout=timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
