"""A prefix load that hands its units over layer by layer, so the engine computes while it reads.

Loading a prefix and computing the prompt's suffix need not run one after the other: the suffix's
layer ``l`` needs every cached unit's layer ``l``, not the rest. A ``LayeredLoad`` reads this
node's unit records layer-major, in ``BANDS`` bands of layers (every unit's first band, then
every unit's second, ...: each unit's payload is [layers, tokens, dim], so a band is one slice of
each record), opening each slice as it arrives (``unitfile.PayloadOpener``: the checksum and, sealed, AES-GCM run over the
pieces in order). The engine takes layer ``l`` just before its pass reaches layer ``l``
(``layer``), so a hit costs about max(load, suffix compute), as LMCache and Mooncake load.

Whether the units were what they claimed is known only when the last slice was read
(``verified``): the engine uses nothing of the pass (no token, no shared page, no persisted
unit) before then, and recomputes the prompt when it says no. Before any payload is read the
headers are read and checked (``units``), so the engine knows how many units it gets when it
gives the prompt its pages; a unit that is missing or whose header is wrong ends the run there.

``WholeLoad`` gives the same interface over a load that delivers whole verified units (another
node's units, the agent's copies): every layer is there once it finished.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from cachedir.layout import Loc
from cachedir.node_cache import LoadedUnit
from cachedir.unit import Unit
from cachedir.unitfile import ITEMSIZE, PayloadOpener, UnitCorrupt, check_header

__all__ = ["LayeredLoad", "WholeLoad", "fill_whole", "read_layered"]

BANDS = 4  # layer bands a layered read hands over (each read of a record covers one)
HEADER_READ = 4096  # bytes read first from each record: its header and token ids (64 tokens: 400 bytes)


class LayeredLoad:
    """A load whose units fill layer by layer (``read_layered`` fills it on a thread of its own)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._units: list[LoadedUnit] | None = None
        self._layers = 0  # layers every unit of ``units`` holds so far
        self._verified: bool | None = None

    # -- the reader's side -------------------------------------------------------------
    def set_units(self, units: list[LoadedUnit]) -> None:
        with self._cond:
            self._units = units
            self._cond.notify_all()

    def set_layers(self, n: int) -> None:
        with self._cond:
            self._layers = n
            self._cond.notify_all()

    def finish(self, ok: bool) -> None:
        """The read ended: every slice was read and opened and every unit verified (``ok``), or not."""
        with self._cond:
            if self._units is None:
                self._units = []
            self._verified = ok
            self._cond.notify_all()

    # -- the engine's side -------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def units(self, timeout_s: float) -> list[LoadedUnit]:
        """The leading units the load brings (their headers checked; their payloads fill in as
        ``layer`` says); none when it could not say within ``timeout_s``."""
        if not self._wait(lambda: self._units is not None, timeout_s):
            return []
        return list(self._units)

    def layer(self, index: int, timeout_s: float) -> bool:
        """Whether layer ``index`` of every unit is in its payload (waiting up to ``timeout_s``);
        False when the read failed or did not get there in time (``verified`` will say no)."""
        return self._wait(lambda: self._layers > index or self._verified is not None, timeout_s) and \
            self._layers > index

    def verified(self, timeout_s: float) -> bool:
        """Whether every unit was read whole and is what it claimed (checksum, key, tokens and,
        sealed, the seal); False when the read failed or did not end within ``timeout_s``."""
        return self._wait(lambda: self._verified is not None, timeout_s) and bool(self._verified)


class WholeLoad(LayeredLoad):
    """``LayeredLoad``'s view of a load of whole verified units (``PromptCache.load_async``)."""

    def __init__(self, future: Future) -> None:
        super().__init__()
        future.add_done_callback(self._done)

    def _done(self, future: Future) -> None:
        try:
            got = future.result()
        except Exception:  # noqa: BLE001 - a failed load is a miss
            got = []
        fill_whole(self, got)


def fill_whole(load: LayeredLoad, got: Sequence[LoadedUnit | None]) -> None:
    """``load`` given whole verified units ``got`` (its leading run up to the first miss)."""
    units: list[LoadedUnit] = []
    for r in got:
        if r is None:
            break
        units.append(r)
    load.set_units(units)
    load.set_layers(max((u.unit.num_layers for u in units), default=0))
    load.finish(True)


def _bands(layers: int) -> list[tuple[int, int]]:
    """The layer ranges read one after another: ``BANDS`` of them (fewer reads, fewer wake-ups of
    the reader beside the compute), each handed over whole."""
    n = min(layers, BANDS)
    bounds = [layers * i // n for i in range(n + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def read_layered(locs: Sequence[tuple[str, Loc] | None], keys: Sequence[bytes], namespace: bytes,
                 tokens: Sequence[Sequence[int]], mac_key: bytes | None, take: Callable[[int], memoryview],
                 load: LayeredLoad) -> None:
    """Fill ``load`` from this node's records at ``locs`` ((tier, where) per key, None where the
    store holds none): the headers first, then the payloads layer-major. Runs on the caller's
    thread until the read ends."""
    fds: dict[str, int] = {}
    ok = False
    try:
        units, readers = [], []
        for (tier_loc, key, toks) in zip(locs, keys, tokens, strict=False):
            if tier_loc is None:
                break
            tier, loc = tier_loc
            try:
                fd = fds.get(str(loc.path))
                if fd is None:
                    fd = fds[str(loc.path)] = os.open(loc.path, os.O_RDONLY)
                head = os.pread(fd, min(HEADER_READ, loc.length), loc.offset)
                h = check_header(head, namespace, key, toks, mac_key)
            except (OSError, UnitCorrupt):
                break  # the run of units ends here
            if h.file_len != loc.length or h.header_len > len(head):
                break
            plain = take(h.payload_len + 15)  # the payload's plaintext, filled layer by layer
            unit = Unit(namespace, key, h.parent, h.token_ids, plain[: h.payload_len], h.num_layers, h.dim, h.dtype,
                        h.mac, h.sealed)
            units.append(LoadedUnit(unit, tier))
            readers.append((fd, loc.offset + h.header_len, PayloadOpener(head, h, mac_key), plain,
                            h.payload_len // h.num_layers))
        load.set_units(units)
        if not units:
            ok = True
            return
        layers = min(u.unit.num_layers for u in units)
        if any(u.unit.num_layers != layers for u in units) or any(u.unit.dtype not in ITEMSIZE for u in units):
            return
        bands = _bands(layers)
        for lo, hi in bands:  # the disk reads every band ahead, in the order they are needed
            for fd, start, _, _, size in readers:
                os.posix_fadvise(fd, start + lo * size, (hi - lo) * size, os.POSIX_FADV_WILLNEED)
        widest = max(hi - lo for lo, hi in bands) * max(r[4] for r in readers)
        stored = take(widest) if mac_key is not None else None  # a band as stored, reused
        for lo, hi in bands:
            for fd, start, opener, plain, size in readers:
                at, n = lo * size, (hi - lo) * size
                into = plain[at : at + n] if stored is None else stored[:n]
                if os.preadv(fd, [into], start + at) != n:
                    return  # the record ended early: not the unit it was
                opener.feed(into, plain[at : at + n + 15])
            load.set_layers(hi)
        ok = all(opener.verified() for _, _, opener, _, _ in readers)
    except OSError:
        ok = False
    finally:
        for fd in fds.values():
            os.close(fd)
        load.finish(ok)
