"""The host-RAM tier: a bounded LRU of recently used units above the SSD store."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cachedir.index import CapacityIndex
from cachedir.unit import Unit

__all__ = ["RamStats", "RamTier"]


@dataclass(slots=True)
class RamStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    units: int = 0
    bytes: int = 0


class RamTier:
    def __init__(self, capacity_bytes: int, now_s: Callable[[], float] = time.time) -> None:
        self._index = CapacityIndex(capacity_bytes, "lru")
        self._units: dict[bytes, Unit] = {}
        self._now = now_s
        self._lock = threading.Lock()
        self.stats = RamStats()

    def __contains__(self, key: bytes) -> bool:
        return key in self._units

    def get(self, key: bytes, namespace: bytes | None) -> Unit | None:
        """The unit if held (and of ``namespace``, unless that is None)."""
        with self._lock:
            unit = self._units.get(key)
            if unit is None or (namespace is not None and unit.namespace != namespace):
                self.stats.misses += 1
                return None
            self._index.touch(key, self._now())
            self.stats.hits += 1
            return unit

    def put(self, unit: Unit) -> None:
        if not isinstance(unit.payload, bytes):  # a view of a read buffer: keep only the unit's bytes
            unit = dataclasses.replace(unit, payload=bytes(unit.payload))
        with self._lock:
            for gone in self._index.add(unit.key, len(unit.payload), self._now()):
                del self._units[gone]
            if unit.key in self._index:
                self._units[unit.key] = unit
            self.stats.evictions = self._index.evictions
            self.stats.units = len(self._units)
            self.stats.bytes = self._index.bytes

    def remove(self, key: bytes) -> None:
        with self._lock:
            if self._index.remove(key):
                del self._units[key]
                self.stats.units = len(self._units)
                self.stats.bytes = self._index.bytes

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check_integrity()
            assert set(self._units) == set(self._index.keys())
