"""How the SSD store lays its units out on disk: one file per unit, or segment files.

* ``UnitFiles`` (``layout="unit"``): ``root/ab/cd/<key hex>.unit``, one self-describing file per
  unit (``cachedir.unitfile``). Simple to inspect; every unit costs a file create, an fsync and,
  on reads, an open.
* ``SegmentFiles`` (``layout="segment"``): ``root/segments/<seq>.seg``, the units of one write
  batch (what the store's write queue holds: the runs of units that requests persisted together)
  appended to one file, each record in the same self-describing format. One fsync per batch,
  and a run of units written together is read back with one sequential read. A removed unit's
  record is tombstoned in place (its magic becomes ``TIDEDEAD``) so a restart does not bring it
  back; a segment is deleted with its last live unit, and one whose live bytes fall under
  ``compact_below`` of its size is reported to the store, which rewrites its live units. Small
  segments (a replica's push or a single put is a batch of one unit) are merged the same way,
  ``merge_min`` or more into one, so their number stays bounded.

Both write a batch to a temporary name, fsync it and rename it: a process killed mid-write
leaves no visible partial unit, and temporaries are deleted on start. The store
(``cachedir.store``) owns the index, eviction, pins and events; a layout only moves bytes.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cachedir.unitfile import MAGIC, UnitCorrupt, UnitHeader, read_header

__all__ = ["LAYOUTS", "Loc", "SegmentFiles", "Staged", "UnitFiles", "make_layout", "nbytes", "private_dir", "tighten",
           "tighten_tree"]

log = logging.getLogger(__name__)

LAYOUTS = ("unit", "segment")
UNIT_SUFFIX = ".unit"
SEGMENT_SUFFIX = ".seg"
TOMBSTONE = b"TIDEDEAD"
_HEADER_PROBE = 64 * 1024  # enough for the fixed header plus 16k token ids
_MAX_READ_GAP = 256 * 1024  # dead bytes a coalesced segment read may skip over
_MAX_READ_BYTES = 4 << 20  # longer runs are split, so the I/O threads read them in parallel
_OPEN_SEGMENTS = 64  # read descriptors kept open (least recently used idle ones are closed)


@dataclass(frozen=True, slots=True)
class Loc:
    """Where a unit's encoded bytes are: ``length`` bytes at ``offset`` of ``path``."""

    path: Path
    offset: int
    length: int


@dataclass(slots=True)
class Staged:
    """A batch written and fsynced under temporary names, not yet visible."""

    temps: list[Path]
    locs: list[Loc]  # final locations, valid once committed
    keys: list[bytes] = field(default_factory=list)  # the unit of each location


def nbytes(parts: Sequence[bytes]) -> int:
    return sum(len(p) for p in parts)


def _write_synced(tmp: Path, chunks: Sequence[bytes], fsync: bool) -> None:
    # 0600: unit records hold tenants' token ids
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        for c in chunks:
            f.write(c)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def sync_dir(path: Path) -> None:
    """fsync a directory: a rename, create or unlink in it survives a power loss only then."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_dir(path: Path, fsync: bool = False) -> None:
    """Make ``path`` a directory only its owner may enter (0700), with any missing parents:
    each one made has its entry fsynced in its parent when ``fsync`` (else a power loss can take
    the directory, and what was acknowledged in it, away); an existing one of ours that is
    looser is tightened."""
    missing, p = [], path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue
        if fsync:
            sync_dir(d.parent)
    tighten(path, 0o700)


def tighten(path: Path, mode: int) -> None:
    """Take away from ``path`` (ours) any permission beyond ``mode`` (files and directories
    made before they were made private keep their old modes otherwise)."""
    try:
        st = path.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o777 & ~mode:
            os.chmod(path, st.st_mode & 0o777 & mode)
    except OSError:
        pass


def tighten_tree(root: Path) -> int:
    """``tighten`` every directory (0700) and file (0600) under ``root``; returns how many were
    looser."""
    loose = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name, mode in [(d, 0o700) for d in dirnames] + [(f, 0o600) for f in filenames]:
            path = Path(dirpath) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if st.st_mode & 0o777 & ~mode:
                loose += 1
                tighten(path, mode)
    return loose


def _fresh(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


def _pread_exact(path: Path, offset: int, length: int) -> bytearray:
    """Up to ``length`` bytes at ``offset`` (fewer only at the end of the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return bytearray(_pread_into(fd, _fresh(length), offset))
    finally:
        os.close(fd)


def _pread_into(fd: int, buf: memoryview, offset: int) -> memoryview:
    """Fill ``buf`` from ``offset``; the part filled (shorter only at the end of the file)."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if not n:
            break
        got += n
    return buf[:got]


def coalesce(locs: Sequence[Loc]) -> list[list[int]]:
    """Indices of ``locs`` grouped into runs that one read covers (same file, in order, at most
    ``_MAX_READ_GAP`` apart, at most ``_MAX_READ_BYTES`` long unless one unit is)."""
    order = sorted(range(len(locs)), key=lambda i: (locs[i].path, locs[i].offset))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            first, prev, loc = locs[groups[-1][0]], locs[groups[-1][-1]], locs[i]
            if (prev.path == loc.path and 0 <= loc.offset - (prev.offset + prev.length) <= _MAX_READ_GAP
                    and loc.offset + loc.length - first.offset <= _MAX_READ_BYTES):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def read_run(locs: Sequence[Loc], take: Callable[[int], memoryview] = _fresh) -> list[memoryview]:
    """One read covering ``locs`` (a group of ``coalesce``) into memory from ``take``: one view
    per unit (shorter where the file ends early). For readers outside the store, which open the
    file themselves."""
    start, end = locs[0].offset, locs[-1].offset + locs[-1].length
    fd = os.open(locs[0].path, os.O_RDONLY)
    try:
        buf = _pread_into(fd, take(end - start), start)
    finally:
        os.close(fd)
    return [buf[loc.offset - start : loc.offset - start + loc.length] for loc in locs]


def advise(loc: Loc, advice: int) -> None:
    """``posix_fadvise`` over every page the unit touches, the pages it shares with its
    neighbours in a segment included (the kernel only acts on whole pages in the range: asked
    for the unit's exact bytes, it keeps the two partial pages at its ends)."""
    start = loc.offset - loc.offset % mmap.PAGESIZE
    end = -(-(loc.offset + loc.length) // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        fd = os.open(loc.path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, start, end - start, advice)
    finally:
        os.close(fd)


class _OpenFiles:
    """Read descriptors of segment files, kept open between reads.

    The groups of a run are read in parallel by the store's I/O threads; sharing one descriptor
    they share the kernel's readahead state, which sees one sequential stream and reads ahead of
    it (a descriptor per read starts cold every time: measured 2-3x slower on a run). A file's
    descriptor is closed by ``forget`` (after the file is unlinked, so no read can open it
    again) once no read is using it."""

    def __init__(self, limit: int = _OPEN_SEGMENTS) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[Path, list[int]] = OrderedDict()  # path -> [fd, reads using it]
        self._closing: dict[int, int] = {}  # fd of a forgotten file -> reads still using it

    @contextmanager
    def fd(self, path: Path) -> Iterator[int]:
        with self._lock:
            entry = self._open.get(path)
            if entry is None:
                entry = self._open[path] = [os.open(path, os.O_RDONLY), 0]
                self._close_idle()
            self._open.move_to_end(path)
            entry[1] += 1
        fd = entry[0]
        try:
            yield fd
        finally:
            with self._lock:
                if fd in self._closing:
                    self._closing[fd] -= 1
                    if not self._closing[fd]:
                        del self._closing[fd]
                        os.close(fd)
                else:
                    entry[1] -= 1

    def _close_idle(self) -> None:
        idle = [p for p, (_, users) in self._open.items() if not users]
        for p in idle[: max(0, len(self._open) - self._limit)]:
            os.close(self._open.pop(p)[0])

    def forget(self, path: Path) -> None:
        with self._lock:
            entry = self._open.pop(path, None)
            if entry is None:
                return
            if entry[1]:
                self._closing[entry[0]] = entry[1]
            else:
                os.close(entry[0])

    def close(self) -> None:
        with self._lock:
            for fd, users in self._open.values():
                if users:
                    self._closing[fd] = users
                else:
                    os.close(fd)
            self._open.clear()


class _DeletedSyncs:
    """The files and directories deletions changed, synced later (``sync_deleted``): a
    deletion happens under the store's lock, its fsync after it is released."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: set[Path] = set()  # tombstoned segments
        self._dirs: set[Path] = set()  # directories a file was unlinked from

    def file(self, path: Path) -> None:
        with self._lock:
            self._files.add(path)

    def dir(self, path: Path) -> None:
        with self._lock:
            self._dirs.add(path)

    def sync(self) -> None:
        """fsync what the deletions so far changed (a file since gone needs none)."""
        if not self._files and not self._dirs:  # the common release: nothing was deleted under it
            return
        with self._lock:
            files, dirs, self._files, self._dirs = self._files, self._dirs, set(), set()
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            except OSError as e:  # the tombstone may not survive a power loss; the record is gone until then
                log.warning("could not fsync the tombstones in %s: %s", path.name, e)
            finally:
                os.close(fd)
        for path in dirs:
            sync_dir(path)


class UnitFiles:
    """One file per unit under ``root/ab/cd/``."""

    batch_bytes = 0  # one unit per write: the store's I/O threads write files in parallel

    def __init__(self, root: Path, fsync: bool = True) -> None:
        self.root, self.fsync = root, fsync
        self._deleted = _DeletedSyncs()

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / h[2:4] / (h + UNIT_SUFFIX)

    def scan(self, repair: bool = True) -> Iterator[tuple[UnitHeader, Loc]]:
        """Every valid unit on disk. With ``repair``, temporaries and bad files are deleted and
        counted in ``corrupt_found``."""
        self.corrupt_found = 0
        for path in self.root.glob("??/??/*"):  # the shard directories only (not segments/)
            if not path.is_file():
                continue
            if path.suffix != UNIT_SUFFIX:
                if repair and path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
                continue
            try:
                with open(path, "rb") as f:
                    h = read_header(f.read(_HEADER_PROBE))
                size = path.stat().st_size
                if size != h.file_len or path.name != h.key.hex() + UNIT_SUFFIX:
                    raise UnitCorrupt("size or name does not match header")
            except (UnitCorrupt, OSError):
                if repair:
                    self.corrupt_found += 1
                    path.unlink(missing_ok=True)
                continue
            yield h, Loc(path, 0, size)

    def stage(self, items: Sequence[tuple[bytes, Sequence[bytes]]]) -> Staged:
        """Write (key, encoded unit in parts) pairs to synced temporaries; raises OSError
        (nothing left)."""
        staged = Staged([], [])
        try:
            for key, parts in items:
                path = self.path(key)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                if not path.parent.is_dir():  # root/ab/cd/: both levels private, their entries synced
                    private_dir(path.parent, self.fsync)
                staged.temps.append(tmp)
                _write_synced(tmp, parts, self.fsync)
                staged.locs.append(Loc(path, 0, nbytes(parts)))
        except OSError:
            self.discard(staged)
            raise
        return staged

    def commit(self, staged: Staged, keep: Sequence[bool]) -> None:
        dirs = set()
        for tmp, loc, k in zip(staged.temps, staged.locs, keep, strict=True):
            if k:
                os.replace(tmp, loc.path)
                dirs.add(loc.path.parent)
            else:
                tmp.unlink(missing_ok=True)
        if self.fsync:
            for d in dirs:
                sync_dir(d)

    def discard(self, staged: Staged) -> None:
        for tmp in staged.temps:
            tmp.unlink(missing_ok=True)

    def delete(self, loc: Loc) -> Path | None:
        """Unlink the unit's file; its directory is synced by ``sync_deleted``."""
        loc.path.unlink(missing_ok=True)
        if self.fsync:  # an evicted unit must not come back after a power loss
            self._deleted.dir(loc.path.parent)
        return None

    def sync_deleted(self) -> None:
        """fsync what ``delete`` changed since the last call (the store calls it once its lock
        is released)."""
        self._deleted.sync()

    def sparse(self) -> list[Path]:
        return []

    def mergeable(self, busy: AbstractSet[Path]) -> list[list[Path]]:
        return []

    def read_groups(self, locs: Sequence[Loc]) -> list[list[int]]:
        return [[i] for i in range(len(locs))]

    def read(self, locs: Sequence[Loc], take: Callable[[int], memoryview] = _fresh) -> list[memoryview]:
        """The bytes of one read group, one view per unit (shorter where the file is), read into
        memory from ``take``."""
        (loc,) = locs
        fd = os.open(loc.path, os.O_RDONLY)
        try:  # one byte more than expected: a file that grew fails verification
            return [_pread_into(fd, take(loc.length + 1), 0)]
        finally:
            os.close(fd)

    def close(self) -> None:
        pass


@dataclass(slots=True)
class _Segment:
    size: int
    live: dict[int, int] = field(default_factory=dict)  # offset -> length of live records
    keys: dict[int, bytes] = field(default_factory=dict)  # offset -> unit key of live records

    @property
    def live_bytes(self) -> int:
        return sum(self.live.values())


def _seq_of(path: Path) -> int:
    """The sequence number of a segment file's name, or -1 for any other file."""
    if path.suffix != SEGMENT_SUFFIX:
        return -1
    try:
        return int(path.stem, 16)
    except ValueError:
        return -1


class SegmentFiles:
    """Units of a write batch appended to one segment file under ``root/segments/``."""

    def __init__(self, root: Path, fsync: bool = True, segment_bytes: int = 64 << 20,
                 compact_below: float = 0.5, merge_below: float = 1 / 16, merge_min: int = 16) -> None:
        self.root, self.fsync = root / "segments", fsync
        self.batch_bytes, self.compact_below = segment_bytes, compact_below
        self.merge_below, self.merge_min = merge_below, merge_min
        self._small: set[Path] = set()  # segments under merge_below of a batch
        private_dir(self.root, fsync)
        self._lock = threading.Lock()
        self._segments: dict[Path, _Segment] = {}
        self._seq = itertools.count()
        self._files = _OpenFiles()
        self._deleted = _DeletedSyncs()

    def scan(self, repair: bool = True) -> Iterator[tuple[UnitHeader, Loc]]:
        """Every live record on disk, segment by segment. With ``repair``, temporaries and
        segments with nothing live are deleted, records after an unreadable one are lost (counted
        in ``corrupt_found``), and the records found are registered as live."""
        self.corrupt_found = 0
        entries = sorted(self.root.iterdir())
        if repair:  # before anything is yielded: the store may start writing (compaction) at once
            for path in entries:
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
            self._seq = itertools.count(max((_seq_of(p) for p in entries), default=-1) + 1)
        for path in entries:
            if _seq_of(path) < 0:
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            records = list(self._records(path, size, repair))
            if repair:
                if not records:
                    self._drop(path)
                    continue
                # all registered before the store may delete any of them
                self._register(path, _Segment(size, {loc.offset: loc.length for _, loc in records},
                                              {loc.offset: h.key for h, loc in records}))
            yield from records

    def _records(self, path: Path, size: int, repair: bool) -> Iterator[tuple[UnitHeader, Loc]]:
        offset = 0
        while offset < size:
            try:
                probe = _pread_exact(path, offset, _HEADER_PROBE)
                dead = probe[: len(TOMBSTONE)] == TOMBSTONE
                if dead:
                    probe[: len(MAGIC)] = MAGIC
                h = read_header(probe)
                if offset + h.file_len > size:
                    raise UnitCorrupt("record runs past the end of its segment")
            except (UnitCorrupt, OSError):
                if repair:
                    self.corrupt_found += 1  # the rest of the segment cannot be parsed
                return
            if not dead:
                yield h, Loc(path, offset, h.file_len)
            offset += h.file_len

    def stage(self, items: Sequence[tuple[bytes, Sequence[bytes]]]) -> Staged:
        with self._lock:
            path = self.root / f"{next(self._seq):016x}{SEGMENT_SUFFIX}"
        tmp = path.with_name(f".{path.name}.tmp")
        locs, offset = [], 0
        for _, parts in items:
            locs.append(Loc(path, offset, nbytes(parts)))
            offset += nbytes(parts)
        try:
            _write_synced(tmp, [chunk for _, parts in items for chunk in parts], self.fsync)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return Staged([tmp], locs, [key for key, _ in items])

    def commit(self, staged: Staged, keep: Sequence[bool]) -> None:
        (tmp,) = staged.temps
        if not any(keep):
            tmp.unlink(missing_ok=True)
            return
        for loc, k in zip(staged.locs, keep, strict=True):
            if not k:
                self._tombstone(tmp, loc.offset)
        path = staged.locs[0].path
        kept = [(loc, key) for loc, key, k in zip(staged.locs, staged.keys, keep, strict=True) if k]
        self._register(path, _Segment(staged.locs[-1].offset + staged.locs[-1].length,
                                      {loc.offset: loc.length for loc, _ in kept},
                                      {loc.offset: key for loc, key in kept}))
        os.replace(tmp, path)
        if self.fsync:
            sync_dir(self.root)

    def _register(self, path: Path, seg: _Segment) -> None:
        with self._lock:
            self._segments[path] = seg
            if seg.size < self.merge_below * self.batch_bytes:
                self._small.add(path)

    def discard(self, staged: Staged) -> None:
        for tmp in staged.temps:
            tmp.unlink(missing_ok=True)

    def _tombstone(self, path: Path, offset: int, defer_sync: bool = False) -> None:
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            return
        try:
            os.pwrite(fd, TOMBSTONE, offset)
            if self.fsync and defer_sync:  # a deleted record must stay deleted after a power loss
                self._deleted.file(path)
            elif self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _drop(self, path: Path, defer_sync: bool = False) -> None:
        with self._lock:
            self._segments.pop(path, None)
            self._small.discard(path)
        path.unlink(missing_ok=True)
        self._files.forget(path)  # after the unlink: no read opens it again
        if self.fsync and defer_sync:
            self._deleted.dir(self.root)
        elif self.fsync:
            sync_dir(self.root)

    def sync_deleted(self) -> None:
        """fsync the tombstones and unlinks ``delete`` made since the last call (the store calls
        it once its lock is released)."""
        self._deleted.sync()

    def delete(self, loc: Loc) -> Path | None:
        """Tombstone the record (synced by ``sync_deleted``); returns its segment when that is
        now worth compacting."""
        with self._lock:
            seg = self._segments.get(loc.path)
            if seg is None or seg.live.pop(loc.offset, None) is None:
                return None
            del seg.keys[loc.offset]
            empty = not seg.live
            sparse = seg.live_bytes < self.compact_below * seg.size
        if empty:
            self._drop(loc.path, defer_sync=True)
            return None
        try:
            self._tombstone(loc.path, loc.offset, defer_sync=True)
        except OSError as e:  # the record would come back after a restart: rewrite the segment without it
            log.warning("could not tombstone a record in %s (%s); compacting the segment", loc.path.name, e)
            return loc.path
        return loc.path if sparse else None

    def read_groups(self, locs: Sequence[Loc]) -> list[list[int]]:
        return coalesce(locs)

    def read(self, locs: Sequence[Loc], take: Callable[[int], memoryview] = _fresh) -> list[memoryview]:
        """One read covering ``locs`` (a group from ``read_groups``) into memory from ``take``;
        one view per unit."""
        start, end = locs[0].offset, locs[-1].offset + locs[-1].length
        with self._files.fd(locs[0].path) as fd:
            buf = _pread_into(fd, take(end - start), start)
        return [buf[loc.offset - start : loc.offset - start + loc.length] for loc in locs]

    def sparse(self) -> list[Path]:
        """Segments worth compacting (live bytes under ``compact_below`` of their size)."""
        with self._lock:
            return [p for p, s in self._segments.items() if s.live_bytes < self.compact_below * s.size]

    def mergeable(self, busy: AbstractSet[Path]) -> list[list[Path]]:
        """Groups of small segments to merge, each into one (oldest first; at least
        ``merge_min`` segments and at most a batch of live bytes to a group); ``busy`` ones (a
        merge or compaction under way) are left out."""
        with self._lock:
            if len(self._small) < self.merge_min:
                return []
            groups: list[list[Path]] = [[]]
            size = 0
            for path in sorted(self._small - busy, key=_seq_of):
                live = self._segments[path].live_bytes
                if groups[-1] and size + live > self.batch_bytes:
                    groups.append([])
                    size = 0
                groups[-1].append(path)
                size += live
            return [g for g in groups if len(g) >= self.merge_min]

    def live(self) -> dict[Path, dict[int, int]]:
        with self._lock:
            return {p: dict(s.live) for p, s in self._segments.items()}

    def live_units(self, path: Path) -> dict[bytes, Loc]:
        """Key and location of every live record of the segment ``path`` (what a compaction
        moves), without walking every unit the store holds."""
        with self._lock:
            seg = self._segments.get(path)
            if seg is None:
                return {}
            return {key: Loc(path, off, seg.live[off]) for off, key in seg.keys.items()}

    def close(self) -> None:
        self._files.close()


def make_layout(name: str, root: Path, fsync: bool, segment_bytes: int, compact_below: float = 0.5,
                merge_below: float = 1 / 16, merge_min: int = 16):
    if name == "unit":
        return UnitFiles(root, fsync)
    if name == "segment":
        return SegmentFiles(root, fsync, segment_bytes, compact_below, merge_below, merge_min)
    raise ValueError(f"unknown store layout {name!r}; supported: {', '.join(LAYOUTS)}")
