"""Publishes a node's unit events to the directory in batches, surviving directory outages.

The stores record ``UnitStored``/``UnitRemoved`` events; ``flush`` turns the pending ones into
one ``register``/``unregister`` batch per tier. When the directory is unavailable the events stay
pending (coalesced: a store then a remove of one key cancel out) and the next flush retries, so
scheduling never waits on Redis. ``sync`` heartbeats and, when the directory's epoch changed (a
Redis that restarted empty), re-registers everything the node holds.
"""

from __future__ import annotations

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
    ) -> None:
        """``holdings()`` returns every key the node holds, by tier (for full re-registration)."""
        self.directory = directory
        self.node_id = node_id
        self.address = address
        self.holdings = holdings
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._pending: dict[tuple[bytes, str], bool] = {}  # (key, tier) -> stored?
        self._epoch: str | None = None
        self.failures = 0
        self.resyncs = 0

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
            self.directory.heartbeat(self.node_id, self.address, self.heartbeat_ttl_s)
            epoch = self.directory.epoch()
            if epoch != self._epoch:
                for tier, keys in self.holdings().items():
                    self.directory.register(self.node_id, keys, tier)
                if self._epoch is not None:
                    self.resyncs += 1
                self._epoch = epoch
        except DirectoryUnavailable:
            self.failures += 1
            return False
        return self.flush()
