"""A prompt's KV from a prefill replica to a decode replica over plain TCP (P/D disaggregation).

The prefill replica puts the KV tensor in its ``KVOutbox`` and hands the decode replica a
``KVTicket`` (a few hundred bytes, through the caller's stream): where its listener is, a random
ticket, the tensor's shape and dtype, and, sealed, a fresh AES-256-GCM key. The decode replica
connects (up to ``PARTS`` connections for a large tensor, each a byte range), sends the ticket and
its range, and receives the bytes straight into a tensor of its own (``recv_into``): the sender
writes from the tensor's memory (``sendall`` of a view, no copy), the receiver reads into the
tensor it keeps. Sealed, each range is encrypted as it goes (its nonce its offset under the
transfer's own key, its tag after it) and opened as it comes, chunk by chunk.

A ticket is good until every byte was sent once or ``ttl_s`` passed; an outbox over
``max_bytes`` drops its oldest. A fetch that finds nothing (the prefill replica gone, the ticket
dropped or stale) or a range that does not open raises ``KVLost``: the request starts over
elsewhere; wrong KV is never taken. No Ray here: ``actors/pd_handoff.py`` wires it to the replicas.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from cachedir.tcp import Listener, recv_exactly, recv_into
from cluster.request import KVLost

__all__ = ["KVLost", "KVOutbox", "KVTicket", "fetch_kv"]

log = logging.getLogger(__name__)

TICKET_BYTES = 32
KEY_BYTES = 32
TAG_BYTES = 16
CHUNK = 4 << 20  # a sealed range is encrypted and opened this many bytes at a time
PARTS = 4  # connections side by side for one tensor, at most
PART_MIN_BYTES = 16 << 20  # ... each carrying at least this much
TTL_S = 60.0
MAX_BYTES = 4 << 30
HUGE_PAGE, MADV_HUGEPAGE = 2 << 20, 14
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None
_REQUEST = struct.Struct("<QQ")  # after the ticket: the range's offset and length
_LENGTH = struct.Struct("<Q")  # the answer: the range's length, 0 when the ticket is unknown


@dataclass(frozen=True, slots=True)
class KVTicket:
    """Where a handed-off KV tensor waits, and what it is."""

    host: str
    port: int
    ticket: bytes
    shape: tuple[int, ...]
    dtype: str  # torch's name without "torch.", e.g. "float32"
    key: bytes | None = None  # sealed: the transfer's AES-256-GCM key

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True)
class _Held:
    data: memoryview  # the tensor's bytes
    tensor: torch.Tensor  # kept alive while its bytes are served
    key: bytes | None
    until: float
    sent: int = 0  # bytes served so far: the entry goes once every byte went


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _cipher(key: bytes, offset: int, length: int, opening: bool = False):
    """A range's GCM encryptor (or decryptor, given its tag at the end: ``finalize_with_tag``):
    its nonce is its offset (the key is the transfer's own), and its offset and length are
    authenticated with it."""
    gcm = Cipher(algorithms.AES(key), modes.GCM(offset.to_bytes(12, "little")))
    ctx = gcm.decryptor() if opening else gcm.encryptor()
    ctx.authenticate_additional_data(_REQUEST.pack(offset, length))
    return ctx


class KVOutbox:
    def __init__(self, host: str, seal: bool = True, ttl_s: float = TTL_S, max_bytes: int = MAX_BYTES,
                 threads: int = PARTS) -> None:
        """Listens on ``host`` (any free port); ``seal``: tensors are encrypted on the wire."""
        self.host, self.seal, self.ttl_s, self.max_bytes = host, seal, ttl_s, max_bytes
        self._held: OrderedDict[bytes, _Held] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = {"put": 0, "sent_bytes": 0, "dropped": 0, "refused": 0}
        self._listener = Listener(host, self._serve, threads, "kv-outbox")
        self.port = self._listener.port

    def put(self, kv: torch.Tensor) -> KVTicket:
        """Hold ``kv`` (on the host; a GPU tensor is copied there) for one fetch: its ticket."""
        kv = kv.detach().to("cpu").contiguous()
        ticket, key = secrets.token_bytes(TICKET_BYTES), os.urandom(KEY_BYTES) if self.seal else None
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            self._held[ticket] = _Held(_bytes_of(kv), kv, key, now + self.ttl_s)
            self.counters["put"] += 1
            while sum(h.data.nbytes for h in self._held.values()) > self.max_bytes and len(self._held) > 1:
                self._held.popitem(last=False)
                self.counters["dropped"] += 1
        return KVTicket(self.host, self.port, ticket, tuple(kv.shape), str(kv.dtype).removeprefix("torch."), key)

    def held(self) -> int:
        """Tensors waiting for their fetch."""
        with self._lock:
            self._expire(time.monotonic())
            return len(self._held)

    def _expire(self, now: float) -> None:
        for t in [t for t, h in self._held.items() if h.until < now]:
            del self._held[t]
            self.counters["dropped"] += 1

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30.0)
        try:
            ticket = recv_exactly(conn, TICKET_BYTES)
            offset, length = _REQUEST.unpack(recv_exactly(conn, _REQUEST.size))
            with self._lock:  # counted as it goes out: the caller may hold it before this thread goes on
                held = self._held.get(ticket)
                if held is None or held.until < time.monotonic() or offset + length > held.data.nbytes:
                    self.counters["refused"] += 1
                    held = None
                else:
                    self.counters["sent_bytes"] += length
                    held.sent += length
                    if held.sent >= held.data.nbytes:
                        self._held.pop(ticket, None)
            if held is None:
                conn.sendall(_LENGTH.pack(0))
                return
            conn.sendall(_LENGTH.pack(length))
            part = held.data[offset : offset + length]
            if held.key is None:
                conn.sendall(part)
            else:
                _send_sealed(conn, part, held.key, offset)
        except OSError as e:  # the caller went: it starts the request over, or fetches again
            log.debug("kv transfer ended early: %s", e)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            self._held.clear()


def _send_sealed(conn: socket.socket, part: memoryview, key: bytes, offset: int) -> None:
    enc = _cipher(key, offset, part.nbytes)
    out = memoryview(bytearray(CHUNK + 15))
    for start in range(0, part.nbytes, CHUNK):
        n = enc.update_into(part[start : start + CHUNK], out)
        conn.sendall(out[:n])
    enc.finalize()
    conn.sendall(enc.tag)


def fetch_kv(t: KVTicket, timeout_s: float = 30.0) -> torch.Tensor:
    """The tensor ``t`` names, fetched from its outbox; ``KVLost`` when it cannot be."""
    size = t.nbytes
    raw = _receive_buffer(size)
    out, data = raw.view(getattr(torch, t.dtype)).view(t.shape), _bytes_of(raw)
    parts = max(1, min(PARTS, size // PART_MIN_BYTES))
    bounds = [size * i // parts for i in range(parts + 1)]
    ranges = list(zip(bounds, bounds[1:], strict=False))
    try:
        if parts == 1:
            _fetch_range(t, data, 0, size, timeout_s)
        else:
            with ThreadPoolExecutor(parts, thread_name_prefix="kv-fetch") as pool:
                for f in [pool.submit(_fetch_range, t, data, a, b - a, timeout_s) for a, b in ranges]:
                    f.result()
    except (OSError, ValueError) as e:
        raise KVLost(f"the handed-off KV at {t.host}:{t.port} could not be fetched: {e}") from e
    return out


def _receive_buffer(nbytes: int) -> torch.Tensor:
    """Fresh memory for a received tensor (uint8 [nbytes]), in huge pages where the kernel gives
    them (Linux's transparent huge pages, asked for with madvise): a large tensor's bytes arrive
    faster than its 4 KiB pages can be faulted in one by one."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    start = -(-buf.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (buf.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start and _LIBC is not None:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)  # advice: may fail
    return buf


def _fetch_range(t: KVTicket, data: memoryview, offset: int, length: int, timeout_s: float) -> None:
    with socket.create_connection((t.host, t.port), timeout=timeout_s) as conn:
        conn.sendall(t.ticket + _REQUEST.pack(offset, length))
        (got,) = _LENGTH.unpack(recv_exactly(conn, _LENGTH.size))
        if got != length:
            raise KVLost("the outbox holds it no more (its replica restarted, or the ticket expired)")
        if t.key is None:
            recv_into(conn, data[offset : offset + length])
            return
        end = offset + length
        dec = _cipher(t.key, offset, length, opening=True)
        scratch = memoryview(bytearray(CHUNK))
        for start in range(offset, end, CHUNK):
            n = min(CHUNK, end - start)
            recv_into(conn, scratch[:n])
            if start + n + 15 <= data.nbytes:  # GCM writes n bytes; the buffer must have 15 more
                dec.update_into(scratch[:n], data[start : start + n + 15])
            else:  # the tensor's last bytes: no room for the cipher's slack there
                tail = bytearray(n + 15)
                k = dec.update_into(scratch[:n], tail)
                data[start : start + k] = tail[:k]
        tag = recv_exactly(conn, TAG_BYTES)
        try:
            dec.finalize_with_tag(tag)
        except Exception as e:  # InvalidTag: another key, or bytes changed on the way
            raise KVLost("a range of the handed-off KV failed its seal") from e
