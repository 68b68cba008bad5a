"""Stored Responses (``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``,
``input_items``): each tenant's, in the cluster's Redis, for ``ttl_s``.

A record is one Response as the client got it, the input items of its request, and the
conversation up to and including its output (``history``: Responses input items), so that a
request naming it as ``previous_response_id`` goes on from there without walking a chain whose
links may have expired. A record over ``max_bytes`` is not kept; a tenant keeps at most
``max_per_tenant`` (the oldest go first). Without Redis, ``MemoryResponseStore`` keeps them in
the ingress replica, bounded the same way (lost when it restarts, not shared between replicas).

Keys carry the tenant: one tenant never reads, lists or deletes another's responses. Redis
failing raises ``StoreUnavailable``: a request that needs a stored response gets a 503 rather
than an answer that forgot the conversation; a response that could not be stored is still
returned (and counted)."""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["MemoryResponseStore", "RedisResponseStore", "StoreUnavailable", "StoredResponse"]


class StoreUnavailable(RuntimeError):
    """The response store did not answer."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the Response as returned
    input: list[dict[str, Any]]  # its request's input items (each with an id)
    history: list[dict[str, Any]]  # the conversation: earlier items, this input, this output

    def encode(self) -> bytes:
        return json.dumps({"response": self.response, "input": self.input, "history": self.history},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> StoredResponse:
        d = json.loads(raw)
        return cls(d["response"], d["input"], d["history"])


class ResponseStore(ABC):
    def __init__(self, ttl_s: int, max_bytes: int, max_per_tenant: int) -> None:
        self.ttl_s, self.max_bytes, self.max_per_tenant = ttl_s, max_bytes, max_per_tenant

    def put(self, tenant: str, record: StoredResponse) -> bool:
        """Keep ``record`` under its response's id; False when it is over ``max_bytes`` (not kept)."""
        raw = record.encode()
        if len(raw) > self.max_bytes:
            return False
        self._put(tenant, record.response["id"], raw)
        return True

    @abstractmethod
    def _put(self, tenant: str, rid: str, raw: bytes) -> None: ...

    @abstractmethod
    def get(self, tenant: str, rid: str) -> StoredResponse | None:
        """``tenant``'s response ``rid`` (None: none such, expired, or another tenant's)."""

    @abstractmethod
    def delete(self, tenant: str, rid: str) -> bool:
        """Remove ``tenant``'s response ``rid``; False when there was none."""


class MemoryResponseStore(ResponseStore):
    """In this process, least recently stored first out; a record expires after ``ttl_s``."""

    def __init__(self, ttl_s: int, max_bytes: int, max_per_tenant: int, clock=time.monotonic) -> None:
        super().__init__(ttl_s, max_bytes, max_per_tenant)
        self._clock = clock
        self._lock = threading.Lock()
        self._tenants: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}

    def _put(self, tenant: str, rid: str, raw: bytes) -> None:
        with self._lock:
            kept = self._tenants.setdefault(tenant, OrderedDict())
            kept[rid] = (self._clock() + self.ttl_s, raw)
            kept.move_to_end(rid)
            while len(kept) > self.max_per_tenant:
                kept.popitem(last=False)

    def get(self, tenant: str, rid: str) -> StoredResponse | None:
        with self._lock:
            entry = self._tenants.get(tenant, {}).get(rid)
            if entry is None or entry[0] <= self._clock():
                return None
        return StoredResponse.decode(entry[1])

    def delete(self, tenant: str, rid: str) -> bool:
        with self._lock:
            entry = self._tenants.get(tenant, {}).pop(rid, None)
        return entry is not None and entry[0] > self._clock()


class RedisResponseStore(ResponseStore):
    """In Redis (one server or a cluster: a tenant's keys share a hash slot): a string per
    response with the TTL, and a sorted set per tenant of its responses by time stored."""

    def __init__(self, links, namespace: str, ttl_s: int, max_bytes: int, max_per_tenant: int) -> None:
        super().__init__(ttl_s, max_bytes, max_per_tenant)
        self._links, self._ns = links, namespace

    @classmethod
    def open(cls, directory, ttl_s: int, max_bytes: int, max_per_tenant: int, timeout_s: float = 2.0):
        """The store in ``directory``'s Redis (``actors.replica_config.DirectorySection``)."""
        from actors.credentials import directory_password
        from cachedir.directory.redis_links import open_links

        links = open_links(directory.url, timeout_s, password=directory_password(directory),
                           ssl_ca_certs=directory.ca_file)
        return cls(links, directory.namespace, ttl_s, max_bytes, max_per_tenant)

    def _key(self, tenant: str, rid: str) -> str:
        return f"{self._ns}:responses:{{{tenant or '_'}}}:{rid}"

    def _index(self, tenant: str) -> str:
        return f"{self._ns}:responses:{{{tenant or '_'}}}"

    def _send(self, commands: list[tuple]) -> list:
        from cachedir.directory.redis_links import SEND_ERRORS

        try:
            replies = self._links.send(commands)
        except SEND_ERRORS as e:
            raise StoreUnavailable(f"the response store is unavailable: {e}") from None
        for r in replies:
            if isinstance(r, Exception):
                raise StoreUnavailable(f"the response store failed: {r}")
        return replies

    def _put(self, tenant: str, rid: str, raw: bytes) -> None:
        key, index = self._key(tenant, rid), self._index(tenant)
        now = time.time()
        *_, count = self._send([(key, "SET", key, raw, "EX", self.ttl_s), (index, "ZADD", index, now, rid),
                                (index, "ZREMRANGEBYSCORE", index, "-inf", now - self.ttl_s),  # expired ones
                                (index, "EXPIRE", index, self.ttl_s), (index, "ZCARD", index)])
        if int(count) > self.max_per_tenant:
            (oldest,) = self._send([(index, "ZPOPMIN", index, int(count) - self.max_per_tenant)])
            pairs = oldest if oldest and isinstance(oldest[0], list) else zip(oldest[::2], oldest[1::2], strict=True)
            gone = [member.decode() for member, _ in pairs]  # [[member, score], ...] or flat, by protocol
            self._send([(self._key(tenant, g), "DEL", self._key(tenant, g)) for g in gone])

    def get(self, tenant: str, rid: str) -> StoredResponse | None:
        key = self._key(tenant, rid)
        (raw,) = self._send([(key, "GET", key)])
        return None if raw is None else StoredResponse.decode(raw)

    def delete(self, tenant: str, rid: str) -> bool:
        key, index = self._key(tenant, rid), self._index(tenant)
        deleted, _ = self._send([(key, "DEL", key), (index, "ZREM", index, rid)])
        return int(deleted) == 1
