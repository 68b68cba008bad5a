"""The node's SSD unit store: atomic, verified units on disk under a byte budget.

The bytes are laid out by ``cachedir.layout``: one file per unit (``layout="unit"``) or segment
files holding the units written together (``layout="segment"``). Either way a write batch goes to
a temporary name, is fsynced and then renamed, so a process killed mid-write never leaves a
visible partial unit (leftover temporaries are deleted on start). Every read verifies the unit
(``unitfile.decode``); a unit that fails is removed, counted in ``stats.corrupt`` and reported as
a miss. On start the index is rebuilt from the headers on disk, so a restart loses nothing.
Mutations append ``UnitStored``/``UnitRemoved`` events that the node's agent publishes to the
directory in batches.

Writes queue up: ``put_async`` adds the unit to a queue and an I/O thread writes what the queue
holds as one batch (up to the layout's ``batch_bytes``; one unit per batch for ``unit``).
``get_many_async`` reads a run of units with one read per group the layout can coalesce, into
reusable staging buffers (``cachedir.staging``); the units returned are views of them.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cachedir.eviction import make_policy
from cachedir.index import CapacityIndex
from cachedir.layout import (
    LAYOUTS,
    Loc,
    SegmentFiles,
    advise,
    make_layout,
    nbytes,
    private_dir,
    sync_dir,
    tighten_tree,
)
from cachedir.staging import StagingBuffers
from cachedir.unit import Unit, UnitRemoved, UnitStored
from cachedir.unitfile import UnitCorrupt, decode

__all__ = ["StoreConfig", "StoreLocked", "StoreStats", "UnitStore"]

log = logging.getLogger(__name__)

PINS_FILE = "pinned.keys"  # hex keys of pinned units, one per line
LOCK_FILE = ".lock"  # held (flock) by the one store that has the directory open
GONE_MEMORY = 1 << 16  # dropped keys a store remembers, with why (UnitStore.gone; ~6 MB)

_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)  # a write skipped, not a bug


class StoreLocked(RuntimeError):
    """Another store (in this or another process) has the directory open."""


def _lock_dir(root: Path) -> int:
    """An exclusive lock on ``root``, held while the returned descriptor is open: two stores on
    one directory would delete each other's segments and temporaries."""
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreLocked(f"the unit store {root} is in use by another store (pid {holder}); "
                          "give each node agent or replica its own cache_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


@dataclass(frozen=True, slots=True)
class StoreConfig:
    root: Path
    capacity_bytes: int
    eviction: str = "lru"  # "lru" | "lfu"
    lfu_half_life_s: float = 3600.0
    max_age_s: float | None = None  # units unused for longer are dropped
    io_threads: int = 4
    fsync: bool = True
    layout: str = "segment"  # "segment" (a file per write batch) | "unit" (a file per unit)
    segment_bytes: int = 64 << 20  # the most one segment (write batch) holds
    # segment upkeep (``cachedir.layout.SegmentFiles``): a segment whose live bytes fall under
    # compact_below of its size is rewritten; segments under merge_below x segment_bytes are
    # merged, merge_min or more at a time
    compact_below: float = 0.5
    merge_below: float = 1 / 16
    merge_min: int = 16
    staging_bytes: int = 256 << 20  # reusable read buffers (``cachedir.staging``)
    queue_bytes: int = 1 << 30  # the most unit bytes waiting to be written; more are dropped

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {self.capacity_bytes}")
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {self.eviction!r}; supported: lfu, lru")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {self.max_age_s}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.queue_bytes <= 0:
            raise ValueError(f"queue_bytes must be > 0, got {self.queue_bytes}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown store layout {self.layout!r}; supported: {', '.join(LAYOUTS)}")
        if self.segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be > 0, got {self.segment_bytes}")
        if not 0 < self.compact_below < 1:
            raise ValueError(f"compact_below must be in (0, 1), got {self.compact_below}")
        if not 0 < self.merge_below <= 1:
            raise ValueError(f"merge_below must be in (0, 1], got {self.merge_below}")
        if self.merge_min < 2:
            raise ValueError(f"merge_min must be >= 2 (a merge of one segment frees nothing), got {self.merge_min}")
        if self.staging_bytes < 0:
            raise ValueError(f"staging_bytes must be >= 0, got {self.staging_bytes}")


@dataclass(slots=True)
class StoreStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    write_errors: int = 0
    queue_full: int = 0  # units not queued: queue_bytes were already waiting (a slow disk)
    evictions: int = 0
    units: int = 0
    bytes: int = 0


class _StoreLock:
    """The store's re-entrant lock. What deletions under it changed on disk (tombstones,
    unlinks) is fsynced when its outermost holder releases it (``after``): an fsync takes
    milliseconds, and under the lock it would hold up every read and write of the store."""

    def __init__(self, after: Callable[[], None]) -> None:
        self._lock, self._after, self._held = threading.RLock(), after, threading.local()

    def __enter__(self) -> None:
        self._lock.acquire()
        self._held.depth = getattr(self._held, "depth", 0) + 1

    def __exit__(self, *exc) -> None:
        self._held.depth -= 1
        outermost = self._held.depth == 0
        self._lock.release()
        if outermost:
            self._after()


class UnitStore:
    def __init__(self, cfg: StoreConfig, now_s: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.root = Path(cfg.root)
        private_dir(self.root, cfg.fsync)  # unit records hold tenants' token ids
        self._lock_fd = _lock_dir(self.root)
        if tighten_tree(self.root):  # written before the store made everything private
            log.warning("cache files under %s were readable by others; made private (0600, dirs 0700)", self.root)
        self.layout = self._make_layout(cfg.layout)
        self._now = now_s
        self._lock = _StoreLock(lambda: self.layout.sync_deleted())
        self._namespaces: dict[bytes, bytes] = {}  # key -> namespace
        self._locs: dict[bytes, Loc] = {}  # key -> where its bytes are
        self._index = CapacityIndex(
            cfg.capacity_bytes, make_policy(cfg.eviction, cfg.lfu_half_life_s), cfg.max_age_s
        )
        self._events: list[UnitStored | UnitRemoved] = []
        self._gone: OrderedDict[bytes, str] = OrderedDict()  # recently dropped key -> why (``gone``)
        self.stats = StoreStats()
        self._pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="unit-io")
        self.staging = StagingBuffers(cfg.staging_bytes)
        self._queue: deque[tuple[Unit, Future[bool]]] = deque()
        self._queued_bytes = 0
        self._pending_writes: set[Future] = set()
        self._closing = False
        self._compacting: set[Path] = set()  # segments a compaction or merge is rewriting
        self._rebuilding = False  # the index is being rebuilt from disk (no compaction starts)
        self._rebuild()

    def _make_layout(self, name: str):
        cfg = self.cfg
        return make_layout(name, self.root, cfg.fsync, cfg.segment_bytes, cfg.compact_below, cfg.merge_below,
                           cfg.merge_min)

    # -- index ---------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Index every valid unit on disk (the layout deletes temporaries and unreadable files).
        Segments that evictions made sparse are compacted once the scan is done: a compaction
        running beside it would race its bookkeeping."""
        now = self._now()
        pins = self._read_pins()  # before the scan: a pinned unit found late is not evicted for those before it
        self._rebuilding = True
        try:
            self._index_disk(now, pins)
        finally:
            self._rebuilding = False
        self.stats.corrupt += self.layout.corrupt_found
        self.layout.sync_deleted()
        for path in self.layout.sparse():
            self._compact_async([path])
        self._merge_small()
        self._sync_stats()
        self._takeover = self._pool.submit(self._migrate, pins)

    def _index_disk(self, now: float, pins: set[bytes]) -> None:
        for h, loc in self.layout.scan():
            if h.key in self._index:  # a second copy (a compaction cut short): keep one
                self.layout.delete(loc)
                continue
            for gone in self._index.add(h.key, loc.length, now):
                self._delete_file(gone, "evicted")
            if h.key in self._index:
                self._namespaces[h.key] = h.namespace
                self._locs[h.key] = loc
                if h.key in pins:
                    self._index.pin(h.key)
            else:
                self.layout.delete(loc)

    def _migrate(self, pins: set[bytes]) -> None:
        """Rewrite units the other layout left under ``root`` into this one, then delete them.

        A store last opened with the other layout (before ``segment`` became the default, or
        after ``--cache-layout`` changed) would otherwise ignore those files: no hits from them,
        and disk used outside the capacity. Runs in the background after the start (a large
        cache takes minutes; its units serve hits as they arrive); each is verified as on a
        read and pinned again if it was (``pins``: the keys the pins file named). A write
        failure, or ``close``, leaves the rest in place for the next start."""
        other_name = "unit" if self.cfg.layout == "segment" else "segment"
        if other_name == "segment" and not (self.root / "segments").is_dir():
            return
        other = self._make_layout(other_name)
        batch: list[tuple[Unit, Loc]] = []
        size = 0
        try:
            for h, loc in other.scan():
                if self._closing:
                    return
                try:
                    (view,) = other.read([loc])
                    _, payload = decode(view, h.namespace, h.key)
                except (OSError, UnitCorrupt):
                    with self._lock:
                        self.stats.corrupt += 1
                    other.delete(loc)
                    continue
                batch.append((Unit(h.namespace, h.key, h.parent, h.token_ids, payload, h.num_layers,
                                   h.dim, h.dtype, h.mac, h.sealed), loc))
                size += loc.length
                if size >= self.cfg.segment_bytes:
                    if not self._migrate_batch(other, batch, pins):
                        return
                    batch, size = [], 0
            if batch:
                self._migrate_batch(other, batch, pins)
        finally:
            other.sync_deleted()
            other.close()

    def _migrate_batch(self, other, batch: list[tuple[Unit, Loc]], pins: set[bytes]) -> bool:
        """Store ``batch`` in this layout and delete it from ``other``; False on a write error."""
        errors = self.stats.write_errors
        self.put_many([u for u, _ in batch])
        if self.stats.write_errors > errors:
            return False
        if pins:
            self.pin([u.key for u, _ in batch if u.key in pins])
        for _, loc in batch:  # stored, or evicted to stay within the capacity
            other.delete(loc)
        return True

    def path(self, key: bytes) -> Path:
        """The file that holds ``key``'s bytes (``location`` says where in it)."""
        loc = self._locs.get(key)
        if loc is not None:
            return loc.path
        if self.cfg.layout == "unit":
            return self.layout.path(key)
        raise KeyError(key.hex())

    def location(self, key: bytes) -> Loc | None:
        with self._lock:
            return self._locs.get(key)

    def locate(self, keys: Sequence[bytes]) -> list[Loc | None]:
        """Where each unit's bytes are, for a reader of the files on this node; each one held
        counts as read for eviction. What a reader finds there may have moved or gone since: it
        verifies what it reads (a unit evicted, rewritten or compacted away is a miss)."""
        with self._lock:
            locs = [self._locs.get(k) for k in keys]
            now = self._now()
            for k, loc in zip(keys, locs, strict=True):
                if loc is not None and k in self._index:
                    self._index.touch(k, now)
        return locs

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
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write("".join(k.hex() + "\n" for k in sorted(self._index.pinned)))
            if self.cfg.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self._pins_path)
        if self.cfg.fsync:
            sync_dir(self.root)

    def _read_pins(self) -> set[bytes]:
        """Every key the pins file names."""
        try:
            lines = self._pins_path.read_text().split()
        except FileNotFoundError:
            return set()
        keys = set()
        for line in lines:
            try:
                keys.add(bytes.fromhex(line))
            except ValueError:
                continue  # a damaged line pins nothing
        return keys

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

    def gone(self, keys: Sequence[bytes]) -> list[str]:
        """Why each key was dropped, among the last ``GONE_MEMORY`` dropped and not stored
        since: "evicted" (capacity or age), "removed" (``tide cache evict``) or "damaged"; ""
        otherwise (never stored here, or long ago). ``tide cache explain`` reads it."""
        with self._lock:
            return [self._gone.get(k, "") for k in keys]

    def _delete_file(self, key: bytes, why: str) -> None:
        """Forget a key the index already dropped: its namespace entry, bytes on disk and event."""
        self._gone[key] = why
        self._gone.move_to_end(key)
        if len(self._gone) > GONE_MEMORY:
            self._gone.popitem(last=False)
        self._namespaces.pop(key, None)
        loc = self._locs.pop(key, None)
        if loc is not None:
            sparse = self.layout.delete(loc)
            if sparse is not None and not self._rebuilding:  # a rebuild compacts when its scan is done
                self._compact_async([sparse])
        self._events.append(UnitRemoved(key, "ssd"))

    def _remove_locked(self, key: bytes, why: str = "removed") -> None:
        if self._index.remove(key):
            self._delete_file(key, why)
            self._sync_stats()

    def _remove_if_at(self, key: bytes, loc: Loc) -> bool:
        """Remove ``key`` if its bytes are still at ``loc`` (not rewritten meanwhile: a damaged
        copy must not take a good one with it); under the lock."""
        if self._locs.get(key) != loc:
            return False
        self._remove_locked(key, "damaged")
        return True

    def remove(self, key: bytes) -> bool:
        with self._lock:
            present = key in self._index
            self._remove_locked(key)
            return present

    # -- writes --------------------------------------------------------------------------
    def put(self, unit: Unit) -> bool:
        """Persist ``unit`` (idempotent). False when it was not stored (too large, disk full)."""
        return self.put_many([unit])[0]

    def put_many(self, units: Sequence[Unit]) -> list[bool]:
        """Persist ``units`` as one write batch (one segment); one result per unit, as ``put``."""
        out: list[bool] = [False] * len(units)
        todo: dict[bytes, tuple[int, Unit]] = {}
        with self._lock:
            now = self._now()
            for i, u in enumerate(units):
                if u.key in self._index:
                    self._index.touch(u.key, now)
                    out[i] = True
                elif u.key not in todo:
                    todo[u.key] = (i, u)
        items = []  # (key, encoded unit in parts: header, payload)
        for key, (_, u) in todo.items():
            parts = u.encode_parts()
            if nbytes(parts) <= self.cfg.capacity_bytes:
                items.append((key, parts))
        if not items:
            return self._same_keys(units, out)
        try:
            staged = self.layout.stage(items)
        except OSError as e:
            with self._lock:
                self.stats.write_errors += len(items)
            if e.errno not in _DISK_ERRNOS:
                raise
            return self._same_keys(units, out)
        with self._lock:
            now, fresh = self._now(), {key for key, _ in items}
            for key, parts in items:
                if key in self._index:  # another writer won the race
                    fresh.discard(key)
                    continue
                for gone in self._index.add(key, nbytes(parts), now):
                    if gone in fresh:  # a unit of this very batch: it was never visible
                        fresh.discard(gone)
                    else:
                        self._delete_file(gone, "evicted")
                if key not in self._index:  # no room: only pinned units are left
                    fresh.discard(key)
            keep = [key in fresh and key in self._index for key, _ in items]
            self.layout.commit(staged, keep)
            for (key, _), loc, k in zip(items, staged.locs, keep, strict=True):
                i, u = todo[key]
                out[i] = k or key in self._index
                if k:
                    self._locs[key] = loc
                    self._namespaces[key] = u.namespace
                    self._gone.pop(key, None)
                    self._events.append(UnitStored(key, loc.length, "ssd"))
                    self.stats.writes += 1
                    self.stats.bytes_written += loc.length
            self._sync_stats()
            self._merge_small()
        return self._same_keys(units, out)

    @staticmethod
    def _same_keys(units: Sequence[Unit], out: list[bool]) -> list[bool]:
        """A key given twice in one batch gets the result of its first occurrence."""
        first: dict[bytes, bool] = {}
        return [first.setdefault(u.key, ok) for u, ok in zip(units, out, strict=True)]

    def put_async(self, unit: Unit) -> Future[bool]:
        return self.put_many_async([unit])[0]

    def put_many_async(self, units: Sequence[Unit]) -> list[Future[bool]]:
        """Queue ``units`` (together: a run lands in one segment); an I/O thread writes what the
        queue holds as one batch. One future per unit, as ``put``; False at once for a unit that
        finds ``queue_bytes`` already waiting (a cache unit may be dropped; memory may not grow)."""
        futures: list[Future[bool]] = [Future() for _ in units]
        queued = 0
        with self._lock:
            for u, fut in zip(units, futures, strict=True):
                if self._queued_bytes + len(u.payload) > self.cfg.queue_bytes:
                    self.stats.queue_full += 1
                    fut.set_result(False)
                    continue
                self._queued_bytes += len(u.payload)
                self._queue.append((u, fut))
                self._pending_writes.add(fut)
                fut.add_done_callback(self._write_done)
                queued += 1
        for _ in range(min(queued, self.cfg.io_threads)):
            self._pool.submit(self._write_queued)
        return futures

    def _write_queued(self) -> None:
        """Write batches from the queue until it is empty (other I/O threads take batches too)."""
        limit = self.layout.batch_bytes
        while True:
            with self._lock:
                batch, size = [], 0
                while self._queue and (not batch or size + len(self._queue[0][0].payload) <= limit):
                    batch.append(self._queue.popleft())
                    size += len(batch[-1][0].payload)
                self._queued_bytes -= size
            if not batch:
                return
            try:
                results = self.put_many([u for u, _ in batch])
            except BaseException as e:  # noqa: BLE001 - handed to the callers' futures
                for _, fut in batch:
                    fut.set_exception(e)
                continue
            for (_, fut), ok in zip(batch, results, strict=True):
                fut.set_result(ok)

    def _write_done(self, fut: Future) -> None:
        with self._lock:
            self._pending_writes.discard(fut)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the background writes (and compactions) submitted so far."""
        with self._lock:
            pending = list(self._pending_writes)
        for fut in pending:
            fut.result(timeout=timeout_s)

    def wait_for_takeover(self, timeout_s: float | None = None) -> None:
        """Wait until the units the other layout left are taken over (``_migrate``)."""
        self._takeover.result(timeout=timeout_s)

    def _merge_small(self) -> None:
        """Merge small segments (batches of a unit or a few: replica pushes, single puts)."""
        with self._lock:
            for group in self.layout.mergeable(self._compacting):
                self._compact_async(group)

    def _compact_async(self, paths: Sequence[Path]) -> None:
        """Rewrite the live units of ``paths`` (a sparse segment, or small ones to merge) to one
        new segment on an I/O thread; segments another rewrite has taken are left out."""
        with self._lock:
            paths = [p for p in paths if p not in self._compacting]
            if not paths:
                return
            self._compacting.update(paths)
            try:
                fut = self._pool.submit(self._compact, paths)
            except RuntimeError:  # closing: compacted after the next start
                self._compacting.difference_update(paths)
                return
            self._pending_writes.add(fut)
        fut.add_done_callback(self._write_done)

    def _compact(self, paths: Sequence[Path]) -> None:
        try:
            self._rewrite_live(paths)
        finally:
            with self._lock:
                self._compacting.difference_update(paths)

    def _rewrite_live(self, paths: Sequence[Path]) -> None:
        """Rewrite the live units of ``paths`` to one new segment; each old one goes with its
        last live unit."""
        with self._lock:
            moving = {k: loc for path in paths for k, loc in self.layout.live_units(path).items()
                      if self._locs.get(k) == loc}
        keys = list(moving)
        items, damaged = [], []
        for group in self.layout.read_groups([moving[k] for k in keys]):
            try:
                views = self.layout.read([moving[keys[i]] for i in group])
            except OSError:
                continue  # found (and removed) by the next read
            for i, view in zip(group, views, strict=True):
                try:
                    decode(view, self._namespaces.get(keys[i], b""), keys[i])
                except UnitCorrupt:
                    damaged.append(keys[i])
                    continue
                items.append((keys[i], [view]))
        if damaged:  # as a read would: gone, and counted (a later rewrite does not meet them again)
            with self._lock:
                for key in damaged:
                    if self._remove_if_at(key, moving[key]):
                        self.stats.corrupt += 1
        if not items:
            return
        try:
            staged = self.layout.stage(items)
        except OSError:
            return  # the segments stay; a later deletion or write tries again
        with self._lock:
            keep = [self._locs.get(key) == moving[key] for key, _ in items]  # not removed meanwhile
            self.layout.commit(staged, keep)
            for (key, _), loc, k in zip(items, staged.locs, keep, strict=True):
                if k:
                    self.layout.delete(self._locs[key])
                    self._locs[key] = loc

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: bytes, namespace: bytes, token_ids: Sequence[int] | None = None) -> Unit | None:
        """The verified unit, or None (absent, or failed verification and now removed)."""
        return self._get_group([key], namespace, [token_ids])[0]

    def _get_group(
        self, keys: Sequence[bytes], namespace: bytes, token_ids: Sequence[Sequence[int] | None],
        again: bool = True,
    ) -> list[Unit | None]:
        """Units the layout reads with one read (one key, or a run of one segment). A unit
        that a compaction moved while it was read (its old record tombstoned or its segment
        gone) is read again where it went, once (``again``): moved is not damaged."""
        with self._lock:
            locs = [self._locs.get(k) for k in keys]
        out: list[Unit | None] = [None] * len(keys)
        present = [i for i, loc in enumerate(locs) if loc is not None]
        views: list[memoryview | None] = [None] * len(keys)
        missing: set[int] = set()
        if present:
            try:
                for i, v in zip(present, self.layout.read([locs[i] for i in present], self.staging.take), strict=True):
                    views[i] = v
            except FileNotFoundError:
                missing = set(present)
            except OSError:
                pass  # every unit of the read counts as damaged
        # verify outside the store lock (checksums of a few MiB): the other I/O threads' reads
        # and the request path's puts and lookups go on meanwhile
        corrupt: set[int] = set()
        for i in present:
            try:
                if views[i] is None:
                    raise FileNotFoundError if i in missing else UnitCorrupt("unreadable")
                h, payload = decode(views[i], namespace, keys[i], token_ids[i])
            except FileNotFoundError:
                continue  # gone meanwhile: a plain miss
            except UnitCorrupt:
                corrupt.add(i)
                continue
            # the payload stays a zero-copy view of the read buffer (a staging buffer: it is
            # reused once nothing refers to the units read into it)
            out[i] = Unit(namespace, keys[i], h.parent, h.token_ids, payload, h.num_layers, h.dim, h.dtype, h.mac, h.sealed)
        hits = nbytes = 0
        moved: list[int] = []
        with self._lock:
            for i, key in enumerate(keys):
                if out[i] is not None:
                    if key in self._index:
                        self._index.touch(key, self._now())
                    hits += 1
                    nbytes += len(views[i])
                    continue
                if again and locs[i] is not None and self._locs.get(key) not in (None, locs[i]):
                    moved.append(i)
                    continue
                if locs[i] is not None:
                    self._remove_if_at(key, locs[i])
                if i in corrupt:
                    self.stats.corrupt += 1
                self.stats.misses += 1
            self.stats.hits += hits
            self.stats.bytes_read += nbytes
        if moved:
            found = self._get_group([keys[i] for i in moved], namespace, [token_ids[i] for i in moved], again=False)
            for i, unit in zip(moved, found, strict=True):
                out[i] = unit
        return out

    def get_many_async(
        self, keys: Sequence[bytes], namespace: bytes, token_ids: Sequence[Sequence[int] | None]
    ) -> Future[list[Unit | None]]:
        """Read a run of units; the future holds one result per key, in order.

        The layout groups the keys into reads (a run of units written together is one read of
        its segment, split into groups of a few MiB) and the I/O threads read the groups in
        parallel. (Asking for the groups' readahead first with ``POSIX_FADV_WILLNEED`` was
        measured to halve the throughput: the kernel then reads in small synchronous pieces.)"""
        with self._lock:
            locs = [self._locs.get(k) for k in keys]
        known = [i for i, loc in enumerate(locs) if loc is not None]
        groups = [[known[j] for j in g] for g in self.layout.read_groups([locs[i] for i in known])]
        groups += [[i] for i, loc in enumerate(locs) if loc is None]
        futures = [self._pool.submit(self._get_group, [keys[i] for i in g], namespace, [token_ids[i] for i in g])
                   for g in groups]
        done: Future[list[Unit | None]] = Future()
        remaining = [len(futures)]
        lock = threading.Lock()

        def finish(_: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                try:
                    out: list[Unit | None] = [None] * len(keys)
                    for g, f in zip(groups, futures, strict=True):
                        for i, unit in zip(g, f.result(), strict=True):
                            out[i] = unit
                    done.set_result(out)
                except BaseException as e:  # propagate an unexpected read failure
                    done.set_exception(e)
                finally:  # the group futures and this callback refer to each other: part them,
                    futures.clear()  # so the units (and their staging buffers) go with the result

        if not futures:
            done.set_result([])
        for f in futures:
            f.add_done_callback(finish)
        return done

    def drop_page_cache(self, key: bytes) -> None:
        """Ask the kernel to forget the unit's cached pages (benchmarks of cold SSD reads)."""
        loc = self.location(key)
        if loc is not None:
            advise(loc, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self._closing = True  # a takeover of the other layout's units stops (goes on next start)
        self._pool.shutdown(wait=True)
        self.layout.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the directory lock
            self._lock_fd = None

    def check_integrity(self) -> None:
        """Index, byte count, locations and the units on disk agree (tests call this after
        every operation)."""
        with self._lock:
            self._index.check_integrity()
            assert set(self._namespaces) == set(self._index.keys()), "namespace map and index differ"
            assert set(self._locs) == set(self._index.keys()), "locations and index differ"
            assert self.stats.bytes == self._index.bytes and self.stats.units == len(self._index)
            on_disk = {h.key: loc for h, loc in self.layout.scan(repair=False)}
            assert on_disk == self._locs, "index and files differ"
            if isinstance(self.layout, SegmentFiles):  # its live-record accounting too
                live = {(p, off, n) for p, recs in self.layout.live().items() for off, n in recs.items()}
                assert live == {(loc.path, loc.offset, loc.length) for loc in self._locs.values()}, \
                    "segment accounting and index differ"
                by_segment = {k: loc for p in self.layout.live() for k, loc in self.layout.live_units(p).items()}
                assert by_segment == self._locs, "segment records' keys and index differ"
