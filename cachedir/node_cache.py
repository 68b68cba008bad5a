"""One node's prompt cache: the RAM tier over the SSD store, behind one small interface.

``lookup`` says how many leading units this node holds and in which tier; ``load_async`` reads
them (RAM first, then one batched SSD read) on I/O threads and returns a future, so a request's
load overlaps its wait in the queue; ``persist`` puts units in RAM and writes them to SSD in the
background. Verification failures are misses; nothing here raises on a damaged file.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from cachedir.layout import Loc
from cachedir.ram import RamTier
from cachedir.store import StoreConfig, UnitStore
from cachedir.unit import Unit, UnitRemoved, UnitStored
from cachedir.unitfile import UnitCorrupt, decode, holds, read_header

__all__ = ["CacheConfig", "LoadedUnit", "NodeCache", "PromptCache"]


def done(result: bool) -> Future[bool]:
    """A future that already holds ``result``."""
    fut: Future[bool] = Future()
    fut.set_result(result)
    return fut


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
    tier: str  # "ram" | "ssd" | "remote" (another node's agent)


class PromptCache(Protocol):
    """What the engine needs from a prompt cache: ``NodeCache`` (this process owns the node's
    store) and ``cachedir.agent.ClusterCache`` (the node's agent owns it; other nodes' units
    are reachable) both provide it."""

    def lookup(self, keys: Sequence[bytes], holders: Sequence[Sequence[str]] | None = None,
               addresses: Mapping[str, str] | None = None) -> list[str]:
        """The tier of each leading unit of ``keys`` that can be loaded, stopping at the first
        that cannot. ``holders``: the nodes the directory already listed for each, and
        ``addresses`` their agents' (a prefix plan): no directory round trip then."""
        ...

    def load_async(
        self, keys: Sequence[bytes], namespace: bytes, token_ids: Sequence[Sequence[int]]
    ) -> Future[list[LoadedUnit | None]]: ...

    def persist(self, units: Sequence[Unit]) -> list[Future[bool]]: ...

    def holds(self, key: bytes) -> bool: ...

    def memory_bytes(self) -> int:
        """The most this cache holds in the replica's memory (RAM tier, read buffers)."""
        ...

    def stats(self) -> dict: ...


class NodeCache:
    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.ssd = UnitStore(cfg.ssd)
        self.ram = RamTier(cfg.ram_bytes) if cfg.ram_bytes else None
        self._lock = threading.Lock()
        self.persist_failures = 0

    def lookup(self, keys: Sequence[bytes], holders: Sequence[Sequence[str]] | None = None,
               addresses: Mapping[str, str] | None = None) -> list[str]:
        """Tier of each leading unit this node holds (stops at the first it lacks); ``holders``
        and ``addresses`` do not matter here (the units this process can load are its own)."""
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
            if unit is not None and holds(unit, namespace, keys[i], token_ids[i]):
                if unit.sealed:  # its ids are withheld: the reader's are the unit's
                    unit = dataclasses.replace(unit, token_ids=tuple(int(t) for t in token_ids[i]))
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

    def has(self, keys: Sequence[bytes]) -> list[str]:
        """Tier of every key ("" where absent), without stopping at a gap."""
        return ["ram" if self.ram is not None and k in self.ram else "ssd" if k in self.ssd else "" for k in keys]

    def holds(self, key: bytes) -> bool:
        return key in self.ssd

    def locate(self, keys: Sequence[bytes]) -> list[tuple[str, Loc] | None]:
        """(tier, where on SSD) of each key this node's store holds, for a reader on this node
        (``UnitStore.locate``); None where the SSD has none."""
        return [None if loc is None else ("ram" if self.ram is not None and k in self.ram else "ssd", loc)
                for k, loc in zip(keys, self.ssd.locate(keys), strict=True)]

    def read_encoded(self, keys: Sequence[bytes]) -> list[tuple[str, bytes] | None]:
        """(tier, encoded unit file) for each key of any namespace, None where absent or damaged
        (serves other nodes; they verify again against what they expect)."""
        out: list[tuple[str, bytes] | None] = [None] * len(keys)
        by_namespace: dict[bytes, list[int]] = {}
        for i, k in enumerate(keys):
            unit = self.ram.get(k, None) if self.ram is not None else None
            if unit is not None:
                out[i] = ("ram", unit.encode())
                continue
            ns = self.ssd.namespace_of(k)
            if ns is not None:
                by_namespace.setdefault(ns, []).append(i)
        reads = [(idx, self.ssd.get_many_async([keys[i] for i in idx], ns, [None] * len(idx)))
                 for ns, idx in by_namespace.items()]
        for idx, fut in reads:
            for i, unit in zip(idx, fut.result(), strict=True):
                if unit is not None:
                    out[i] = ("ssd", unit.encode())
                    if self.ram is not None:
                        self.ram.put(unit)
        return out

    def accept(self, encoded: bytes) -> Future[bool]:
        """Verify an encoded unit from elsewhere (its key is the chain hash of its parent and
        tokens, its payload matches its checksum) and persist it. The future says whether it is
        on SSD: False at once when it fails verification, True at once when already held."""
        try:
            h = read_header(encoded)
            _, payload = decode(encoded, h.namespace, h.key)
        except UnitCorrupt:
            return done(False)
        unit = Unit(h.namespace, h.key, h.parent, h.token_ids, payload, h.num_layers, h.dim, h.dtype, h.mac, h.sealed)
        writes = self.persist([unit])
        return writes[0] if writes else done(True)

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop units from both tiers (``tide cache evict``); returns how many the SSD held."""
        n = 0
        for k in keys:
            if self.ram is not None:
                self.ram.remove(k)
            n += self.ssd.remove(k)
        return n

    def persist(self, units: Sequence[Unit]) -> list[Future[bool]]:
        """Keep ``units`` in RAM and write them to SSD in the background."""
        if self.ram is not None:
            for u in units:
                self.ram.put(u)
        return self.ssd.put_many_async([u for u in units if u.key not in self.ssd])  # one batch

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for background SSD writes (tests, shutdown)."""
        self.ssd.flush(timeout_s)

    def drain_events(self) -> list[UnitStored | UnitRemoved]:
        return self.ssd.drain_events()

    def holdings(self) -> dict[str, list[bytes]]:
        return {"ssd": self.ssd.keys()}

    def memory_bytes(self) -> int:
        return self.cfg.ram_bytes + self.cfg.ssd.staging_bytes

    def stats(self) -> dict:
        s = self.ssd.stats
        out = {
            "ssd_units": s.units, "ssd_bytes": s.bytes, "ssd_hits": s.hits, "ssd_misses": s.misses,
            "ssd_corrupt": s.corrupt, "ssd_evictions": s.evictions, "ssd_write_errors": s.write_errors,
            "ssd_bytes_written": s.bytes_written, "ssd_bytes_read": s.bytes_read,
            "ssd_pinned": len(self.ssd.pinned()),
        }
        if self.ram is not None:
            r = self.ram.stats
            out.update({"ram_units": r.units, "ram_bytes": r.bytes, "ram_hits": r.hits,
                        "ram_evictions": r.evictions})
        return out

    def close(self) -> None:
        self.ssd.close()
