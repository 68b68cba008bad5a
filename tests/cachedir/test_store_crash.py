"""Crash consistency of the unit store: a crash at every file-system boundary (each fsync,
rename, unlink and tombstone write under the store's directory) of a workload that writes,
removes, pins and compacts; then a restart must find the index agreeing with the files, every
unit it serves verified, every acknowledged write there and every acknowledged removal gone.

A crash is simulated in-process: from the failpoint on, every such call raises (nothing more
reaches the disk) and the store is abandoned unclosed; a new store then opens the directory. A
power loss also undoes what was not made durable: a rename or an unlink until its directory is
fsynced, a tombstone until its file is (data written through file objects is only ever made
visible by a rename after its fsync, so the model leaves it alone)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cachedir.store import StoreConfig, UnitStore
from tests.cachedir.units import NS, make_units

UNITS = make_units(list(range(64 * 14)))


class Crash(BaseException):
    """The simulated power cut (a BaseException: nothing in the store may swallow it as an error)."""


class Failpoints:
    """Counts the store's file-system boundaries and crashes at the ``at``-th (0: never);
    ``power``: the crash is a power loss (``power_loss`` undoes what was not durable)."""

    CALLS = ("fsync", "replace", "unlink", "pwrite")

    def __init__(self, monkeypatch, root: Path, at: int, power: bool = False) -> None:
        self.root, self.at, self.count, self.crashed = str(root), at, 0, False
        self.power = power
        self.pending: list[tuple[str, object]] = []  # (path whose fsync makes it durable, undo)
        self._real = {name: getattr(os, name) for name in self.CALLS}
        for name in self.CALLS:
            monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))

    def _track(self, name: str, args) -> None:
        """Before ``name(*args)`` runs: how to undo it, until which fsync."""
        if name == "fsync":
            path = os.readlink(f"/proc/self/fd/{args[0]}")
            self.pending = [(p, undo) for p, undo in self.pending if p != path]
            return
        if name == "pwrite":
            fd, data, offset = args[:3]
            path = os.readlink(f"/proc/self/fd/{fd}")
            with open(path, "rb") as f:  # (the store's descriptor is write-only)
                f.seek(offset)
                old = f.read(len(data))

            def undo(path=path, old=old, offset=offset):
                if not os.path.exists(path):
                    return  # removed since, durably (a compacted segment): nothing left to undo
                with open(path, "r+b") as f:
                    f.seek(offset)
                    f.write(old)
        else:
            path = Path(args[1] if name == "replace" else args[0])
            old = path.read_bytes() if path.is_file() else None

            def undo(path=path, old=old):
                if old is None:
                    path.unlink(missing_ok=True)  # (the real unlink: failpoints are off by then)
                else:
                    path.write_bytes(old)
            path = str(path.parent)
        self.pending.append((str(path), undo))

    def power_loss(self) -> None:
        for _, undo in reversed(self.pending):
            undo()
        self.pending = []

    def _under_root(self, arg) -> bool:
        if isinstance(arg, int):  # a descriptor (fsync, pwrite)
            try:
                arg = os.readlink(f"/proc/self/fd/{arg}")
            except OSError:
                return False
        return str(arg).startswith(self.root) and not str(arg).endswith("/.lock")  # the lock is no data

    def _wrap(self, name: str, real):
        def call(*args, **kwargs):
            if self.crashed:
                raise Crash
            if args and self._under_root(args[0] if name != "replace" else args[1]):
                self.count += 1
                if self.count == self.at:
                    self.crashed = True
                    raise Crash
                if self.power:
                    self._track(name, args)
            return real(*args, **kwargs)
        return call


def _workload(root: Path, layout: str, acked: dict) -> None:
    """Writes, removals (one segment left sparse enough to compact), pins and a restart-free
    close; ``acked`` records what the store acknowledged before any crash."""
    store = UnitStore(StoreConfig(root, capacity_bytes=1 << 30, layout=layout, io_threads=1,
                                  segment_bytes=4 * len(UNITS[0].encode()), compact_below=0.5))
    acked["store"] = store
    for f, unit in zip(store.put_many_async(UNITS[:8]), UNITS[:8], strict=True):
        if f.result():
            acked["put"].add(unit.key)
    for unit in UNITS[8:12]:
        if store.put(unit):
            acked["put"].add(unit.key)
    for unit in UNITS[1:4]:  # most of the first segment: it gets compacted
        acked["removing"].add(unit.key)  # asked: after a crash now, it may be either way
        if store.remove(unit.key):
            acked["removed"].add(unit.key)
    if store.pin([UNITS[9].key]):
        acked["pinned"].add(UNITS[9].key)
    store.flush()
    acked["removing"].add(UNITS[10].key)
    store.remove(UNITS[10].key)
    acked["removed"].add(UNITS[10].key)
    store.close()


def _run(tmp_path, monkeypatch, layout: str, at: int, power: bool = False) -> tuple[dict, int]:
    root = tmp_path / f"{layout}-{at}"
    acked: dict = {"put": set(), "removing": set(), "removed": set(), "pinned": set()}
    pools: list[ThreadPoolExecutor] = []
    with monkeypatch.context() as m:
        init = ThreadPoolExecutor.__init__
        m.setattr(ThreadPoolExecutor, "__init__", lambda self, *a, **k: pools.append(self) or init(self, *a, **k))
        points = Failpoints(m, root, at, power)
        try:
            _workload(root, layout, acked)
        except Crash:
            pass
        for pool in pools:  # the crashed store's threads end (every call they make still fails)
            pool.shutdown(wait=True)
    if power and points.crashed:
        points.power_loss()
    for fd in os.listdir("/proc/self/fd"):  # the crashed process's descriptors go with it: its lock
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(root / ".lock"):
                os.close(int(fd))
        except OSError:
            pass
    return acked, points.count


@pytest.mark.parametrize("power", [False, True], ids=["crash", "power_loss"])
@pytest.mark.parametrize("layout", ["segment", "unit"])
def test_a_crash_at_any_boundary_loses_nothing_acknowledged(tmp_path, monkeypatch, layout, power):
    _, boundaries = _run(tmp_path, monkeypatch, layout, at=0)
    assert boundaries > 20  # the workload crosses every kind of boundary many times
    for at in range(1, boundaries + 1):
        acked, _ = _run(tmp_path, monkeypatch, layout, at, power)
        again = UnitStore(StoreConfig(tmp_path / f"{layout}-{at}", capacity_bytes=1 << 30, layout=layout))
        try:
            again.flush()  # compactions a restart starts
            again.check_integrity()
            for unit in UNITS[:12]:
                got = again.get(unit.key, NS.seed, unit.token_ids)
                if unit.key in acked["removed"]:
                    assert got is None, (at, "a removed unit came back")
                elif unit.key in acked["put"] and unit.key not in acked["removing"]:
                    assert got is not None and bytes(got.payload) == bytes(unit.payload), (at, "an acknowledged unit was lost")
            for key in acked["pinned"] - acked["removed"]:
                assert key in again.pinned(), (at, "an acknowledged pin was lost")
            assert again.stats.corrupt == 0, at
        finally:
            again.close()
