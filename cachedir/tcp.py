"""Plain TCP for bulk bytes: a listener that serves each connection on a thread pool, and exact
reads into memory the caller owns. The agents' unit port (``cachedir.agent.bulk``) and the P/D
handoff (``cluster.kv_transfer``) are both built on it; each speaks its own protocol over it."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Listener", "recv_exactly", "recv_into"]


class Listener:
    def __init__(self, host: str, serve: Callable[[socket.socket], None], threads: int, name: str) -> None:
        """Listens on ``host`` (any free port: ``port``); each connection is passed to ``serve``
        on one of ``threads`` threads and closed after it."""
        self._serve = serve
        self._sock = socket.create_server((host, 0))
        self.port = self._sock.getsockname()[1]
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._closed = False
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            try:
                self._pool.submit(self._run, conn)
            except RuntimeError:  # closed meanwhile
                conn.close()
                return

    def _run(self, conn: socket.socket) -> None:
        with conn:
            self._serve(conn)

    def close(self) -> None:
        """Stop listening (new connections are refused at once); those under way may finish."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def recv_into(conn: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``conn``; ``ConnectionError`` when it ends first."""
    got = 0
    while got < view.nbytes:
        k = conn.recv_into(view[got:], view.nbytes - got)
        if k == 0:
            raise ConnectionError(f"the connection ended after {got} of {view.nbytes} bytes")
        got += k


def recv_exactly(conn: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    recv_into(conn, memoryview(buf))
    return bytes(buf)
