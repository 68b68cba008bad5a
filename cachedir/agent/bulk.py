"""Units between nodes over plain TCP: a remote load at the network's speed, not gRPC's.

gRPC carries the control: a caller's signed ``Reserve`` call names the units it wants and gets
a ticket (random, good for one connection within ``TICKET_TTL_S``) and the port of the agent's
bulk listener. The caller connects and sends the ticket; the agent writes each unit it still
holds as an 8-byte length and the unit's encoded bytes, straight from its store's file
(``sendfile``: they never pass through the agent's memory), in the order asked; a length of 0 is
a unit it no longer has on SSD. The caller reads each into memory of its own, at most
``max_unit_bytes`` a unit, and verifies it as any fetched unit (checksum, key, tokens, and the
seal under the cluster's key: units are sealed, so encrypted on the wire, whenever the cluster
has a cache secret). An agent serving gRPC over TLS offers no bulk port: its units go through
TLS. Anything that goes wrong on the bulk connection makes the caller fetch through gRPC.
"""

from __future__ import annotations

import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from cachedir.layout import Loc
from cachedir.tcp import Listener, recv_exactly, recv_into

__all__ = ["TICKET_BYTES", "BulkServer", "fetch_bulk"]

log = logging.getLogger(__name__)

TICKET_BYTES = 32
TICKET_TTL_S = 30.0
_LENGTH = struct.Struct("<Q")


class BulkServer:
    def __init__(self, host: str, locate: Callable[[Sequence[bytes]], list[tuple[str, Loc] | None]],
                 threads: int = 4, ticket_ttl_s: float = TICKET_TTL_S) -> None:
        """Listens on ``host`` (any free port: ``port``); ``locate`` says where the node's store
        holds each key, asked when a ticket's connection comes."""
        self._locate = locate
        self._ttl = ticket_ttl_s
        self._tickets: dict[bytes, tuple[float, list[bytes]]] = {}
        self._lock = threading.Lock()
        self.counters = {"connections": 0, "units": 0, "bytes": 0, "refused": 0}
        self._listener = Listener(host, self._serve, threads, "cache-agent-bulk")
        self.port = self._listener.port

    def reserve(self, keys: Sequence[bytes]) -> bytes:
        """A ticket for one connection that receives ``keys``."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for old in [t for t, (until, _) in self._tickets.items() if until < now]:
                del self._tickets[old]
            self._tickets[ticket] = (now + self._ttl, list(keys))
        return ticket

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10.0)
        try:
            ticket = recv_exactly(conn, TICKET_BYTES)
        except OSError:
            return
        with self._lock:
            until, keys = self._tickets.pop(ticket, (0.0, None))
            self.counters["connections"] += 1
        if keys is None or until < time.monotonic():
            with self._lock:
                self.counters["refused"] += 1
            return  # an unknown or stale ticket: closed without a byte
        try:
            for found in self._locate(keys):
                self._send_unit(conn, found)
        except OSError as e:  # the caller went, or a file did: it fetches the rest through gRPC
            log.debug("bulk transfer ended early: %s", e)

    def _send_unit(self, conn: socket.socket, found: tuple[str, Loc] | None) -> None:
        if found is None:
            conn.sendall(_LENGTH.pack(0))
            return
        loc = found[1]
        try:
            f = open(loc.path, "rb")  # noqa: SIM115 - closed below, after the unit is sent
        except FileNotFoundError:  # gone since it was located
            conn.sendall(_LENGTH.pack(0))
            return
        with self._lock:  # counted as it goes out: the caller may hold it before this thread goes on
            self.counters["units"] += 1
            self.counters["bytes"] += loc.length
        with f:
            conn.sendall(_LENGTH.pack(loc.length))
            # os.sendfile under the socket's timeout: the bytes go from the page cache to the socket
            if conn.sendfile(f, loc.offset, loc.length) != loc.length:
                raise OSError(f"{loc.path} ended inside a unit")  # the stream cannot go on

    def close(self) -> None:
        self._listener.close()


def fetch_bulk(host: str, port: int, ticket: bytes, n: int, max_unit_bytes: int,
               take: Callable[[int], memoryview], timeout_s: float) -> list[memoryview | None]:
    """The ``n`` units a ticket names, each in memory from ``take`` (None where the agent has it
    no more); ``OSError`` when the connection fails or a unit declares more than
    ``max_unit_bytes``: the caller fetches the units through gRPC instead."""
    out: list[memoryview | None] = [None] * n
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.sendall(ticket)
        for i in range(n):
            (length,) = _LENGTH.unpack(recv_exactly(conn, _LENGTH.size))
            if length == 0:
                continue
            if length > max_unit_bytes:
                raise OSError(f"bulk unit {i} declares {length} bytes, more than a unit's {max_unit_bytes}")
            buf = take(length)
            recv_into(conn, buf[:length])
            out[i] = buf
    return out
