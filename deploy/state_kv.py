"""A few Redis commands over the cluster's Redis (``RedisKV``, through the directory's links) or
this process's memory (``MemoryKV``), for the stores that keep small state there
(``deploy.batch_store``). Redis failing raises ``StoreUnavailable``."""

from __future__ import annotations

import threading
import time

from deploy.response_store import StoreUnavailable

__all__ = ["KV", "MemoryKV", "RedisKV"]

# compare-and-renew a lease: KEYS[1] lease, ARGV[1] holder, ARGV[2] ms
_LEASE = """
local held = redis.call('GET', KEYS[1])
if held == false then return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) and 1 or 0 end
if held == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
return 0
"""


class KV:
    """The few commands the stores use, each as Redis defines it (values are bytes)."""

    def get(self, key: str) -> bytes | None: ...
    def set(self, key: str, value: str | bytes, ex_s: int | None = None) -> None: ...
    def delete(self, *keys: str) -> None: ...
    def hsetnx(self, key: str, field: str, value: str) -> bool: ...
    def hgetall(self, key: str) -> dict[bytes, bytes]: ...
    def zadd(self, key: str, score: float, member: str) -> None: ...
    def zrem(self, key: str, member: str) -> None: ...
    def zrange(self, key: str) -> list[bytes]: ...
    def lease(self, key: str, holder: str, ttl_ms: int) -> bool: ...


class RedisKV(KV):
    def __init__(self, links) -> None:
        self._links = links
        self._lease = links.script(_LEASE)

    @classmethod
    def open(cls, directory, timeout_s: float = 2.0) -> RedisKV:
        """The KV in ``directory``'s Redis (``actors.replica_config.DirectorySection``)."""
        from actors.credentials import directory_password
        from cachedir.directory.redis_links import open_links

        return cls(open_links(directory.url, timeout_s, password=directory_password(directory),
                              ssl_ca_certs=directory.ca_file))

    def _one(self, key: str, *command):
        from cachedir.directory.redis_links import SEND_ERRORS

        try:
            (reply,) = self._links.send([(key, *command)])
        except SEND_ERRORS as e:
            raise StoreUnavailable(f"the batch store is unavailable: {e}") from None
        if isinstance(reply, Exception):
            raise StoreUnavailable(f"the batch store failed: {reply}")
        return reply

    def get(self, key):
        return self._one(key, "GET", key)

    def set(self, key, value, ex_s=None):
        self._one(key, "SET", key, value, *(("EX", ex_s) if ex_s else ()))

    def delete(self, *keys):
        for key in keys:
            self._one(key, "DEL", key)

    def hsetnx(self, key, field, value):
        return int(self._one(key, "HSETNX", key, field, value)) == 1

    def hgetall(self, key):
        flat = self._one(key, "HGETALL", key)
        return flat if isinstance(flat, dict) else dict(zip(flat[::2], flat[1::2], strict=True))

    def zadd(self, key, score, member):
        self._one(key, "ZADD", key, score, member)

    def zrem(self, key, member):
        self._one(key, "ZREM", key, member)

    def zrange(self, key):
        return self._one(key, "ZRANGE", key, 0, -1)

    def lease(self, key, holder, ttl_ms):
        return int(self._one(key, "EVALSHA", self._lease, 1, key, holder, ttl_ms)) == 1


class MemoryKV(KV):
    """The same commands on dicts, in this process (expiry by ``clock``)."""

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._values: dict[str, tuple[float | None, object]] = {}

    def _live(self, key: str, default):
        entry = self._values.get(key)
        if entry is None or (entry[0] is not None and entry[0] <= self._clock()):
            self._values.pop(key, None)
            return default
        return entry[1]

    def get(self, key):
        with self._lock:
            value = self._live(key, None)
        return value.encode() if isinstance(value, str) else value

    def set(self, key, value, ex_s=None):
        with self._lock:
            self._values[key] = (self._clock() + ex_s if ex_s else None, value)

    def delete(self, *keys):
        with self._lock:
            for key in keys:
                self._values.pop(key, None)

    def _container(self, key: str) -> dict:
        """The live hash or sorted set at ``key``, made empty where there is none (lock held)."""
        held = self._live(key, None)
        if held is None:
            held = {}
            self._values[key] = (None, held)
        return held

    def hsetnx(self, key, field, value):
        with self._lock:
            h = self._container(key)
            if field.encode() in h:
                return False
            h[field.encode()] = value.encode()
            return True

    def hgetall(self, key):
        with self._lock:
            return dict(self._live(key, {}))

    def zadd(self, key, score, member):
        with self._lock:
            self._container(key)[member.encode()] = score

    def zrem(self, key, member):
        with self._lock:
            self._live(key, {}).pop(member.encode(), None)

    def zrange(self, key):
        with self._lock:
            z = self._live(key, {})
            return sorted(z, key=lambda m: (z[m], m))

    def lease(self, key, holder, ttl_ms):
        with self._lock:
            held = self._live(key, None)
            if held not in (None, holder):
                return False
            self._values[key] = (self._clock() + ttl_ms / 1e3, holder)
            return True
