"""The directory's connections to one Redis or to a Redis Cluster (Valkey too).

``send(commands)`` routes each command by its key to the server that owns the key's slot, writes
one pipeline to every server involved, then reads them all: a batch costs one round trip however
many primaries it spans, and replies come back raw (no response callbacks), in order. Error
replies come back as ``redis.ResponseError`` values; a script the server does not know yet
(``NOSCRIPT``) is loaded there and its command sent again.

URLs: ``redis://`` / ``rediss://`` (one server), ``redis+cluster://host:port[,host:port...]`` /
``rediss+cluster://`` (a cluster found from those seeds). A cluster's slot map is refreshed after
a connection error, a timeout or a ``MOVED``/``ASK``/``CLUSTERDOWN`` reply: during a failover the
calls that reach the failed primary raise ``LinkDown``, and once its replica is promoted the next
call goes there.
"""

from __future__ import annotations

import hashlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from urllib.parse import unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

__all__ = ["CLUSTER_SCHEMES", "SEND_ERRORS", "Links", "LinkDown", "open_links"]

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

Command = tuple  # (routing key, command name, *args): the key picks the server


class LinkDown(RuntimeError):
    """A server did not answer in time, or the cluster cannot serve a key's slot right now."""


SEND_ERRORS = (redis.RedisError, LinkDown, OSError)  # what ``Links.send`` raises when Redis fails


def _read(conn: redis.Connection):
    try:
        return conn.read_response()
    except redis.ResponseError as e:  # an error reply: the connection stays in step
        return e


class Links(ABC):
    """Routes and sends commands; counts the round trips it made (``round_trips``)."""

    def __init__(self) -> None:
        self.round_trips = 0
        self._scripts: dict[str, str] = {}  # sha1 -> source

    def script(self, source: str) -> str:
        """Register a Lua script; returns the sha1 to send with ``EVALSHA``."""
        sha = hashlib.sha1(source.encode()).hexdigest()
        self._scripts[sha] = source
        return sha

    def send(self, commands: Sequence[Command]) -> list:
        """Replies of ``commands`` (raw; error replies as ``ResponseError`` values)."""
        if not commands:
            return []
        replies = self._round(commands)
        missing = [i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)]
        if missing:  # a server that restarted, or a primary that took over, lost its scripts
            route = self.router()
            loads = {(route(commands[i][0]), commands[i][2]): commands[i][0] for i in missing}
            self._round([(key, "SCRIPT", "LOAD", self._scripts[sha]) for (_, sha), key in loads.items()])
            for i, r in zip(missing, self._round([commands[i] for i in missing]), strict=True):
                replies[i] = r
        return replies

    def _round(self, commands: Sequence[Command]) -> list:
        self.round_trips += 1
        route = self.router()
        groups: dict[str, list[int]] = {}
        for i, cmd in enumerate(commands):
            groups.setdefault(route(cmd[0]), []).append(i)
        replies: list = [None] * len(commands)
        taken: list[tuple[str, redis.ConnectionPool, redis.Connection]] = []
        try:
            for server, idx in groups.items():
                pool = self.pool(server)
                conn = pool.get_connection()
                taken.append((server, pool, conn))
                conn.send_packed_command(conn.pack_commands([commands[i][1:] for i in idx]))
            for (_, _, conn), idx in zip(taken, groups.values(), strict=True):
                for i in idx:
                    replies[i] = _read(conn)
        except BaseException as e:
            for _, _, conn in taken:
                conn.disconnect()  # a pipeline sent but not read must not go back to its pool
            if isinstance(e, (redis.ConnectionError, redis.TimeoutError, OSError)):
                self.stale()
                raise LinkDown(str(e)) from e
            raise
        finally:
            for _, pool, conn in taken:
                pool.release(conn)
        if any(isinstance(r, redis.ResponseError) and str(r).startswith(("MOVED", "ASK", "CLUSTERDOWN"))
               for r in replies):
            self.stale()
        return replies

    @abstractmethod
    def router(self) -> Callable[[str], str]:
        """A function giving the server that owns a key now (it raises ``LinkDown`` when none
        does)."""

    @abstractmethod
    def pool(self, server: str) -> redis.ConnectionPool: ...

    @abstractmethod
    def clients(self) -> dict[str, redis.Redis]:
        """A client per primary (maintenance: INFO, benchmarks)."""

    def stale(self) -> None:  # noqa: B027 - one server has no map to refresh
        """The routing may be out of date (a failover, a resharding)."""

    def close(self) -> None:
        for client in self.clients().values():
            client.close()


class SingleLinks(Links):
    def __init__(self, url: str, **kwargs) -> None:
        super().__init__()
        self._r = redis.Redis.from_url(url, **kwargs)

    def router(self) -> Callable[[str], str]:
        return lambda key: "redis"

    def pool(self, server: str) -> redis.ConnectionPool:
        return self._r.connection_pool

    def clients(self) -> dict[str, redis.Redis]:
        return {"redis": self._r}


class ClusterLinks(Links):
    """The slot map comes from redis-py's ``RedisCluster`` (built at first use, so a cluster that
    is down when the directory opens is a ``LinkDown`` later, not an error now)."""

    REFRESH_EVERY_S = 0.5  # at most one slot-map refresh per this, however many calls fail

    def __init__(self, seeds: list[tuple[str, int]], **kwargs) -> None:
        super().__init__()
        self._seeds, self._kwargs = seeds, kwargs
        self._rc: RedisCluster | None = None
        self._lock = threading.Lock()
        self._stale_since: float | None = None
        self._refreshed = 0.0

    def _cluster(self) -> RedisCluster:
        with self._lock:
            try:
                if self._rc is None:
                    self._rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self._seeds],
                                            require_full_coverage=False, **self._kwargs)
                    self._refreshed = time.monotonic()
                elif self._stale_since is not None and time.monotonic() - self._refreshed > self.REFRESH_EVERY_S:
                    self._refreshed = time.monotonic()
                    self._rc.nodes_manager.initialize()
                    self._stale_since = None
            except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
                raise LinkDown(f"cluster slot map: {e}") from e
            return self._rc

    def router(self) -> Callable[[str], str]:
        rc = self._cluster()

        def route(key: str) -> str:
            try:
                return rc.nodes_manager.get_node_from_slot(rc.keyslot(key)).name
            except redis.exceptions.RedisClusterException as e:  # SlotNotCoveredError: a primary failed
                self.stale()
                raise LinkDown(str(e)) from e

        return route

    def pool(self, server: str) -> redis.ConnectionPool:
        node = self._cluster().get_node(node_name=server)
        if node is None or node.redis_connection is None:
            self.stale()
            raise LinkDown(f"no connection to {server}")
        return node.redis_connection.connection_pool

    def clients(self) -> dict[str, redis.Redis]:
        return {n.name: n.redis_connection for n in self._cluster().get_primaries()}

    def stale(self) -> None:
        if self._stale_since is None:
            self._stale_since = time.monotonic()

    def close(self) -> None:
        if self._rc is not None:
            self._rc.close()


def _seeds(netloc: str) -> list[tuple[str, int]]:
    out = []
    for part in netloc.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a cluster seed must be host:port, got {part!r}")
        out.append((host.strip("[]"), int(port)))
    return out


def open_links(url: str, timeout_s: float, password: str | None = None, ssl_ca_certs: str | None = None) -> Links:
    """Links for a ``redis://``, ``rediss://``, ``redis+cluster://`` or ``rediss+cluster://`` URL
    (a password in the URL counts unless ``password`` is given)."""
    scheme = url.split("://", 1)[0]
    kwargs: dict = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if scheme not in CLUSTER_SCHEMES:
        if password is not None:
            kwargs["password"] = password
        if ssl_ca_certs is not None:
            kwargs["ssl_ca_certs"] = ssl_ca_certs
        return SingleLinks(url, **kwargs)
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    url_password = unquote(parts.netloc.rpartition("@")[0].rpartition(":")[2]) if "@" in parts.netloc else None
    if password is not None or url_password:
        kwargs["password"] = password if password is not None else url_password
    if scheme == "rediss+cluster":
        kwargs["ssl"] = True
        if ssl_ca_certs is not None:
            kwargs["ssl_ca_certs"] = ssl_ca_certs
    # the request path fails fast (the caller degrades to a miss), it never retries for seconds
    kwargs["retry"] = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
    return ClusterLinks(_seeds(netloc), cluster_error_retry_attempts=1, **kwargs)
