"""Publishes a node's unit events to the directory in batches, surviving directory outages.

The stores record ``UnitStored``/``UnitRemoved`` events; ``flush`` turns the pending ones into
one ``register``/``unregister`` batch per tier. When the directory is unavailable the events stay
pending (coalesced: a store then a remove of one key cancel out) and the next flush retries, so
scheduling never waits on Redis. ``sync`` heartbeats and re-registers everything the node holds
when the directory's epoch changed (a Redis that restarted empty, a cluster failover) or when the
node was not live before the heartbeat (its units may have been collected); every ``reap_every_s``
it also collects dead nodes' registrations, so the directory does not grow with departed nodes.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable

from cachedir.directory.base import Directory, DirectoryUnavailable
from cachedir.unit import UnitRemoved, UnitStored

__all__ = ["DirectoryPublisher"]


class DirectoryPublisher:
    def __init__(
        self,
        directory: Directory,
        node_id: str,
        address: str,
        holdings: Callable[[], dict[str, list[bytes]]],
        heartbeat_ttl_s: float = 10.0,
        reap_every_s: float = 60.0,
        now_s: Callable[[], float] = time.monotonic,
    ) -> None:
        """``holdings()`` returns every key the node holds, by tier (for full re-registration).
        Nodes reap at a phase of their own within ``reap_every_s`` (0: never)."""
        self.directory = directory
        self.node_id = node_id
        self.address = address
        self.holdings = holdings
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.reap_every_s = reap_every_s
        self._now = now_s
        self._pending: dict[tuple[bytes, str], bool] = {}  # (key, tier) -> stored?
        self._epoch: str | None = None
        self._next_reap = now_s() + reap_every_s * (zlib.crc32(node_id.encode()) % 1000) / 1000
        self.failures = 0
        self.resyncs = 0
        self.reaped = 0  # dead nodes whose registrations this node collected

    def record(self, events: Iterable[UnitStored | UnitRemoved]) -> None:
        for ev in events:
            self._pending[(ev.key, ev.tier)] = isinstance(ev, UnitStored)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def flush(self) -> bool:
        """Send pending events. False when the directory was unavailable (they stay pending)."""
        if not self._pending:
            return True
        batch = dict(self._pending)
        by_tier_add: dict[str, list[bytes]] = {}
        by_tier_del: dict[str, list[bytes]] = {}
        for (key, tier), stored in batch.items():
            (by_tier_add if stored else by_tier_del).setdefault(tier, []).append(key)
        try:
            for tier, keys in by_tier_add.items():
                self.directory.register(self.node_id, keys, tier)
            for keys in by_tier_del.values():
                self.directory.unregister(self.node_id, keys)
        except DirectoryUnavailable:
            self.failures += 1
            return False
        for item, stored in batch.items():
            if self._pending.get(item) == stored:
                del self._pending[item]
        return True

    def sync(self) -> bool:
        """Heartbeat; re-register all holdings if the directory is new; then flush."""
        try:
            revived = self.directory.heartbeat(self.node_id, self.address, self.heartbeat_ttl_s)
            epoch = self.directory.epoch()
            if epoch != self._epoch or revived:
                for tier, keys in self.holdings().items():
                    self.directory.register(self.node_id, keys, tier)
                if self._epoch is not None:
                    self.resyncs += 1
                self._epoch = epoch
            if self.reap_every_s > 0 and self._now() >= self._next_reap:
                self._next_reap = self._now() + self.reap_every_s
                self.reaped += len(self.directory.collect_dead())
        except DirectoryUnavailable:
            self.failures += 1
            return False
        return self.flush()
