"""The node's SSD unit store: one atomic, verified file per unit under a byte budget.

Files live at ``root/ab/cd/<key hex>.unit``. Writes go to a temporary name, are fsynced and then
renamed, so a process killed mid-write never leaves a visible partial unit (leftover temporaries
are deleted on start). Every read verifies the file (``unitfile.decode``); a unit that fails is
deleted, counted in ``stats.corrupt`` and reported as a miss. On start the index is rebuilt from
the headers on disk, so a restart loses nothing. Mutations append ``UnitStored``/``UnitRemoved``
events that the node's agent publishes to the directory in batches.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cachedir.eviction import make_policy
from cachedir.index import CapacityIndex
from cachedir.unit import Unit, UnitRemoved, UnitStored
from cachedir.unitfile import UnitCorrupt, decode, read_header

__all__ = ["StoreConfig", "StoreStats", "UnitStore"]

SUFFIX = ".unit"
PINS_FILE = "pinned.keys"  # hex keys of pinned units, one per line
_HEADER_PROBE = 64 * 1024  # enough for the fixed header plus 16k token ids


@dataclass(frozen=True, slots=True)
class StoreConfig:
    root: Path
    capacity_bytes: int
    eviction: str = "lru"  # "lru" | "lfu"
    lfu_half_life_s: float = 3600.0
    max_age_s: float | None = None  # units unused for longer are dropped
    io_threads: int = 4
    fsync: bool = True

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {self.capacity_bytes}")
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {self.eviction!r}; supported: lfu, lru")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {self.max_age_s}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")


@dataclass(slots=True)
class StoreStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    write_errors: int = 0
    evictions: int = 0
    units: int = 0
    bytes: int = 0


class UnitStore:
    def __init__(self, cfg: StoreConfig, now_s: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.root = Path(cfg.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._now = now_s
        self._lock = threading.RLock()
        self._namespaces: dict[bytes, bytes] = {}  # key -> namespace
        self._index = CapacityIndex(
            cfg.capacity_bytes, make_policy(cfg.eviction, cfg.lfu_half_life_s), cfg.max_age_s
        )
        self._events: list[UnitStored | UnitRemoved] = []
        self.stats = StoreStats()
        self._pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="unit-io")
        self._pending_writes: set[Future] = set()
        self._rebuild()

    # -- paths -------------------------------------------------------------------------
    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / h[2:4] / (h + SUFFIX)

    # -- index ---------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Index every valid unit header on disk; delete temporaries and unreadable files."""
        now = self._now()
        for path in self.root.rglob("*"):
            if not path.is_file():
                continue
            if path.suffix != SUFFIX:
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
                continue
            try:
                with open(path, "rb") as f:
                    h = read_header(f.read(_HEADER_PROBE))
                size = path.stat().st_size
                if size != h.file_len or path.name != h.key.hex() + SUFFIX:
                    raise UnitCorrupt("size or name does not match header")
            except (UnitCorrupt, OSError):
                self.stats.corrupt += 1
                path.unlink(missing_ok=True)
                continue
            for gone in self._index.add(h.key, size, now):
                self._delete_file(gone)
            if h.key in self._index:
                self._namespaces[h.key] = h.namespace
        self._load_pins()
        self._sync_stats()

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self, namespace: bytes | None = None) -> list[bytes]:
        with self._lock:
            return [k for k, ns in self._namespaces.items() if namespace is None or ns == namespace]

    # -- pins ----------------------------------------------------------------------------
    @property
    def _pins_path(self) -> Path:
        return self.root / PINS_FILE

    def pin(self, keys: Sequence[bytes]) -> int:
        """Exempt held units from eviction (kept across restarts); returns how many are pinned."""
        with self._lock:
            n = sum(self._index.pin(k) for k in keys)
            self._save_pins()
        return n

    def unpin(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n = sum(self._index.unpin(k, self._now()) for k in keys)
            self._save_pins()
        return n

    def pinned(self) -> list[bytes]:
        with self._lock:
            return sorted(self._index.pinned)

    def _save_pins(self) -> None:
        tmp = self._pins_path.with_suffix(".tmp")
        tmp.write_text("".join(k.hex() + "\n" for k in sorted(self._index.pinned)))
        os.replace(tmp, self._pins_path)

    def _load_pins(self) -> None:
        try:
            lines = self._pins_path.read_text().split()
        except FileNotFoundError:
            return
        for line in lines:
            try:
                self._index.pin(bytes.fromhex(line))
            except ValueError:
                continue  # a damaged line pins nothing

    def namespace_of(self, key: bytes) -> bytes | None:
        with self._lock:
            return self._namespaces.get(key)

    def drain_events(self) -> list[UnitStored | UnitRemoved]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def _sync_stats(self) -> None:
        self.stats.units = len(self._index)
        self.stats.bytes = self._index.bytes
        self.stats.evictions = self._index.evictions

    def _delete_file(self, key: bytes) -> None:
        """Forget a key the index already dropped: its namespace entry, file and event."""
        self._namespaces.pop(key, None)
        self.path(key).unlink(missing_ok=True)
        self._events.append(UnitRemoved(key, "ssd"))

    def _remove_locked(self, key: bytes) -> None:
        if self._index.remove(key):
            self._delete_file(key)
            self._sync_stats()

    def remove(self, key: bytes) -> bool:
        with self._lock:
            present = key in self._index
            self._remove_locked(key)
            return present

    # -- writes --------------------------------------------------------------------------
    def put(self, unit: Unit) -> bool:
        """Persist ``unit`` (idempotent). False when it was not stored (too large, disk full)."""
        if unit.key in self._index:
            with self._lock:
                if unit.key in self._index:
                    self._index.touch(unit.key, self._now())
                    return True
        data = unit.encode()
        if len(data) > self.cfg.capacity_bytes:
            return False
        path = self.path(unit.key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                if self.cfg.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as e:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.stats.write_errors += 1
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):
                raise
            return False
        with self._lock:
            if unit.key in self._index:  # another writer won the race
                tmp.unlink(missing_ok=True)
                return True
            for gone in self._index.add(unit.key, len(data), self._now()):
                self._delete_file(gone)
            if unit.key not in self._index:  # no room: only pinned units are left
                tmp.unlink(missing_ok=True)
                self._sync_stats()
                return False
            os.replace(tmp, path)
            self._namespaces[unit.key] = unit.namespace
            self._events.append(UnitStored(unit.key, len(data), "ssd"))
            self.stats.writes += 1
            self.stats.bytes_written += len(data)
            self._sync_stats()
        return True

    def put_async(self, unit: Unit) -> Future[bool]:
        fut = self._pool.submit(self.put, unit)
        with self._lock:
            self._pending_writes.add(fut)
        fut.add_done_callback(self._write_done)
        return fut

    def _write_done(self, fut: Future) -> None:
        with self._lock:
            self._pending_writes.discard(fut)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the background writes submitted so far."""
        with self._lock:
            pending = list(self._pending_writes)
        for fut in pending:
            fut.result(timeout=timeout_s)

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: bytes, namespace: bytes, token_ids: Sequence[int] | None = None) -> Unit | None:
        """The verified unit, or None (absent, or failed verification and now deleted)."""
        if key not in self._index:
            with self._lock:
                self.stats.misses += 1
            return None
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                buf = f.read()
            h, payload = decode(buf, namespace, key, token_ids)
        except FileNotFoundError:
            with self._lock:
                self._remove_locked(key)
                self.stats.misses += 1
            return None
        except (UnitCorrupt, OSError):
            with self._lock:
                self._remove_locked(key)
                self.stats.corrupt += 1
                self.stats.misses += 1
            return None
        with self._lock:
            if key in self._index:
                self._index.touch(key, self._now())
            self.stats.hits += 1
            self.stats.bytes_read += len(buf)
        # the payload stays a zero-copy view of the file buffer
        return Unit(namespace, key, h.parent, h.token_ids, payload, h.num_layers, h.dim, h.dtype)

    def get_many_async(
        self, keys: Sequence[bytes], namespace: bytes, token_ids: Sequence[Sequence[int] | None]
    ) -> Future[list[Unit | None]]:
        """Read a run of units in parallel; the future holds one result per key, in order.

        Every file's read-ahead is requested first (``POSIX_FADV_WILLNEED``), so the device sees
        the whole batch at once instead of one file per I/O thread."""
        for k in keys:
            if k in self._index:
                self._advise(k, os.POSIX_FADV_WILLNEED)
        futures = [self._pool.submit(self.get, k, namespace, t) for k, t in zip(keys, token_ids, strict=True)]
        done: Future[list[Unit | None]] = Future()
        remaining = [len(futures)]
        lock = threading.Lock()

        def finish(_: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                try:
                    done.set_result([f.result() for f in futures])
                except BaseException as e:  # propagate an unexpected read failure
                    done.set_exception(e)

        if not futures:
            done.set_result([])
        for f in futures:
            f.add_done_callback(finish)
        return done

    def _advise(self, key: bytes, advice: int) -> None:
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        finally:
            os.close(fd)

    def drop_page_cache(self, key: bytes) -> None:
        """Ask the kernel to forget the file's cached pages (benchmarks of cold SSD reads)."""
        self._advise(key, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def check_integrity(self) -> None:
        """Index, byte count and files agree (tests call this after every operation)."""
        with self._lock:
            self._index.check_integrity()
            assert set(self._namespaces) == set(self._index.keys()), "namespace map and index differ"
            assert self.stats.bytes == self._index.bytes and self.stats.units == len(self._index)
            on_disk = {p.name[: -len(SUFFIX)] for p in self.root.rglob("*" + SUFFIX)}
            assert on_disk == {k.hex() for k in self._index.keys()}, "index and files differ"
