"""One node's prompt cache: the RAM tier over the SSD store, behind one small interface.

``lookup`` says how many leading units this node holds and in which tier; ``load_async`` reads
them (RAM first, then one batched SSD read) on I/O threads and returns a future, so a request's
load overlaps its wait in the queue; ``persist`` puts units in RAM and writes them to SSD in the
background. Verification failures are misses; nothing here raises on a damaged file.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from cachedir.ram import RamTier
from cachedir.store import StoreConfig, UnitStore
from cachedir.unit import Unit, UnitRemoved, UnitStored

__all__ = ["CacheConfig", "LoadedUnit", "NodeCache"]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    ssd: StoreConfig
    ram_bytes: int = 256 << 20
    admission: str = "all"

    def __post_init__(self) -> None:
        if self.ram_bytes < 0:
            raise ValueError(f"ram_bytes must be >= 0, got {self.ram_bytes}")


@dataclass(frozen=True, slots=True)
class LoadedUnit:
    unit: Unit
    tier: str  # "ram" | "ssd"


class NodeCache:
    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.ssd = UnitStore(cfg.ssd)
        self.ram = RamTier(cfg.ram_bytes) if cfg.ram_bytes else None
        self._lock = threading.Lock()
        self.persist_failures = 0

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Tier of each leading unit this node holds (stops at the first it lacks)."""
        tiers = []
        for k in keys:
            if self.ram is not None and k in self.ram:
                tiers.append("ram")
            elif k in self.ssd:
                tiers.append("ssd")
            else:
                break
        return tiers

    def load_async(
        self, keys: Sequence[bytes], namespace: bytes, token_ids: Sequence[Sequence[int]]
    ) -> Future[list[LoadedUnit | None]]:
        """Verified units for ``keys`` (None where missing or damaged), in order."""
        out: list[LoadedUnit | None] = [None] * len(keys)
        from_ssd = []
        for i, k in enumerate(keys):
            unit = self.ram.get(k, namespace) if self.ram is not None else None
            if unit is not None and tuple(unit.token_ids) == tuple(token_ids[i]):
                out[i] = LoadedUnit(unit, "ram")
            else:
                from_ssd.append(i)
        done: Future[list[LoadedUnit | None]] = Future()
        if not from_ssd:
            done.set_result(out)
            return done
        inner = self.ssd.get_many_async([keys[i] for i in from_ssd], namespace, [token_ids[i] for i in from_ssd])

        def finish(f: Future) -> None:
            try:
                for i, unit in zip(from_ssd, f.result(), strict=True):
                    if unit is not None:
                        out[i] = LoadedUnit(unit, "ssd")
                        if self.ram is not None:
                            self.ram.put(unit)  # promoted on hit
                done.set_result(out)
            except BaseException as e:  # an unexpected I/O failure: the caller computes instead
                done.set_exception(e)

        inner.add_done_callback(finish)
        return done

    def persist(self, units: Sequence[Unit]) -> list[Future[bool]]:
        """Keep ``units`` in RAM and write them to SSD in the background."""
        futures = []
        for u in units:
            if self.ram is not None:
                self.ram.put(u)
            if u.key not in self.ssd:
                futures.append(self.ssd.put_async(u))
        return futures

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for background SSD writes (tests, shutdown)."""
        self.ssd.flush(timeout_s)

    def drain_events(self) -> list[UnitStored | UnitRemoved]:
        return self.ssd.drain_events()

    def holdings(self) -> dict[str, list[bytes]]:
        return {"ssd": self.ssd.keys()}

    def stats(self) -> dict:
        s = self.ssd.stats
        out = {
            "ssd_units": s.units, "ssd_bytes": s.bytes, "ssd_hits": s.hits, "ssd_misses": s.misses,
            "ssd_corrupt": s.corrupt, "ssd_evictions": s.evictions, "ssd_write_errors": s.write_errors,
            "ssd_bytes_written": s.bytes_written, "ssd_bytes_read": s.bytes_read,
        }
        if self.ram is not None:
            r = self.ram.stats
            out.update({"ram_units": r.units, "ram_bytes": r.bytes, "ram_hits": r.hits,
                        "ram_evictions": r.evictions})
        return out

    def close(self) -> None:
        self.ssd.close()
