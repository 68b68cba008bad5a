"""``NodeAgent``: everything one node's cache agent does, without Ray (the actor in
``actors/cache_agent.py`` is a thin shell around it; tests run it in-process too).

It owns the node's ``NodeCache`` (RAM tier over the SSD store, rebuilt from disk on start),
serves it over gRPC, and every ``sync_every_s`` publishes stored/removed units to the directory
in batches, heartbeats its gRPC address (a node whose heartbeat lapses is ignored by lookups at
once) and runs a replication tick.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from cachedir.agent.bulk import BulkServer
from cachedir.agent.client import AgentClient, ClientPool
from cachedir.agent.service import AgentBackend, ServerConfig, start_server
from cachedir.directory.base import Directory
from cachedir.keeping import KeepBudget, keep_units, warm_units
from cachedir.layout import Loc
from cachedir.node_cache import CacheConfig, NodeCache, done
from cachedir.publisher import DirectoryPublisher
from cachedir.replication import ReplicationConfig, Replicator
from cachedir.unit import UnitRemoved
from cachedir.unitfile import UnitCorrupt, read_header

__all__ = ["AgentConfig", "NodeAgent"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    node_id: str
    cache: CacheConfig
    server: ServerConfig = ServerConfig()
    advertise_host: str = "127.0.0.1"  # the host other nodes reach this agent at
    heartbeat_ttl_s: float = 10.0
    sync_every_s: float = 0.25
    replication: ReplicationConfig | None = field(default_factory=ReplicationConfig)  # None: off
    tls_root_certificates: bytes | None = None  # for pushing to other agents over TLS
    tls_server_name: str | None = None
    tls_client_certificate: tuple[bytes, bytes] | None = None  # (PEM key, PEM chain) for mutual TLS


class NodeAgent:
    def __init__(self, cfg: AgentConfig, directory: Directory | None = None) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        self.cache = NodeCache(cfg.cache)
        self.directory = directory
        self._removed: OrderedDict[bytes, float] = OrderedDict()  # key -> when it left this node
        self._lock = threading.Lock()
        self.counters = {"fetch_units": 0, "fetch_remote_units": 0, "fetch_missing": 0, "located_units": 0,
                         "push_accepted": 0, "push_refused": 0}
        # units to other nodes over plain TCP beside gRPC (not where gRPC runs over TLS)
        self.bulk = BulkServer(cfg.server.host, self.cache.locate) if cfg.server.tls_cert_chain is None else None
        self.server, self.port = start_server(
            AgentBackend(self.read, self.has, self.accept, self.stats, self.locate, self.reserve),
            dataclasses.replace(cfg.server, name=cfg.node_id, advertise_hosts=(cfg.advertise_host,)))
        self.address = f"{cfg.advertise_host}:{self.port}"
        self.publisher = self.replicator = None
        if directory is not None:
            self.publisher = DirectoryPublisher(directory, self.node_id, self.address, self.cache.holdings,
                                                cfg.heartbeat_ttl_s)
            if cfg.replication is not None:
                self.replicator = Replicator(cfg.replication, self.node_id, directory,
                                             self._read_one, self._push_to)
        self.client = ClientPool(lambda address: AgentClient(
            address, self.cfg.server.token, self.cfg.tls_root_certificates, tls_server_name=self.cfg.tls_server_name,
            name=self.node_id, client_certificate=self.cfg.tls_client_certificate))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cache-agent-sync", daemon=True)
        self._thread.start()

    # -- the service backend -----------------------------------------------------------------
    def read(self, keys: Sequence[bytes], requester: str = "") -> list[tuple[str, bytes] | None]:
        out = self.cache.read_encoded(keys)
        remote = bool(requester) and requester != self.node_id
        with self._lock:
            self.counters["fetch_units"] += sum(o is not None for o in out)
            self.counters["fetch_missing"] += sum(o is None for o in out)
            if remote:
                self.counters["fetch_remote_units"] += sum(o is not None for o in out)
        if remote and self.replicator is not None:
            for k, o in zip(keys, out, strict=True):
                if o is not None:
                    self.replicator.note_remote_fetch(k, requester)
        return out

    def has(self, keys: Sequence[bytes]) -> list[str]:
        return self.cache.has(keys)

    def reserve(self, keys: Sequence[bytes], requester: str = "") -> tuple[bytes, int]:
        """A ticket for the bulk port (``cachedir.agent.bulk``) and the port; (b"", 0) without one."""
        if self.bulk is None:
            return b"", 0
        if requester and requester != self.node_id and self.replicator is not None:
            for k in keys:  # a remote fetch, as ``read`` counts one
                if k in self.cache.ssd:
                    self.replicator.note_remote_fetch(k, requester)
        return self.bulk.reserve(keys), self.bulk.port

    def locate(self, keys: Sequence[bytes]) -> list[tuple[str, Loc] | None]:
        out = self.cache.locate(keys)
        with self._lock:
            self.counters["located_units"] += sum(o is not None for o in out)
        return out

    def accept(self, encoded: bytes, replace: bool = False) -> Future[bool]:
        """Store a pushed unit, unless it fails verification or this node evicted it lately; the
        future says whether it reached SSD. ``replace``: the pusher (a replica, which checks
        units' MACs) found the copy held under this key forged or damaged; it is dropped and this
        one kept."""
        try:
            key = read_header(encoded).key
        except UnitCorrupt:
            key = None
        cooldown = self.cfg.replication.cooldown_s if self.cfg.replication is not None else 0.0
        with self._lock:
            gone = self._removed.get(key) if key is not None else None
        refused = key is None or (not replace and gone is not None and time.monotonic() - gone < cooldown)
        if not refused and replace:
            self.cache.remove([key])
        counted: Future[bool] = Future()  # resolves after the count, so a pusher's next Stats sees it

        def count(stored: Future[bool]) -> None:
            ok = stored.exception() is None and stored.result()
            with self._lock:
                self.counters["push_accepted" if ok else "push_refused"] += 1
            counted.set_result(ok)

        (done(False) if refused else self.cache.accept(encoded)).add_done_callback(count)
        return counted

    def stats(self) -> dict:
        out = {"node_id": self.node_id, "address": self.address, **self.cache.stats()}
        with self._lock:
            out.update(self.counters)
        if self.bulk is not None:
            out.update({f"bulk_{k}": v for k, v in self.bulk.counters.items()})
        if self.publisher is not None:
            out.update(directory_pending=self.publisher.pending, directory_failures=self.publisher.failures,
                       directory_resyncs=self.publisher.resyncs)
        if self.replicator is not None:
            out.update({f"replication_{k}": v for k, v in self.replicator.stats.items()})
        return out

    # -- replication -----------------------------------------------------------------------
    def _read_one(self, key: bytes) -> bytes | None:
        found = self.cache.read_encoded([key])[0]
        return found[1] if found is not None else None

    def _push_to(self, address: str, encoded: bytes) -> bool:
        accepted, _ = self.client(address).push([encoded])
        return accepted == 1

    def keep(self, leaving: Sequence[str], budget: KeepBudget = KeepBudget()) -> dict[str, int]:
        """Before this node (and ``leaving``) stop serving: its hot units no staying node holds,
        copied to the nodes that stay (``cachedir.keeping``)."""
        if self.directory is None:
            return {}
        self.sync_once()  # the directory knows what this node holds now
        return keep_units(self.node_id, self.directory, leaving, self._read_one, self._push_to, budget)

    def warm(self, budget: KeepBudget = KeepBudget()) -> dict[str, int]:
        """Before this node serves again: the hot units it lacks, fetched from their holders
        (``cachedir.keeping.warm_units``)."""
        if self.directory is None:
            return {}
        self.sync_once()  # heartbeating, and the directory knows what this node holds

        def fetch(address: str, keys: list[bytes]) -> list[bytes | None]:
            return [f[1] if f is not None else None for f in self.client(address).fetch(keys, requester=self.node_id)]

        return warm_units(self.node_id, self.directory, fetch, lambda data: self.accept(data).result(60), budget)

    # -- the background loop -----------------------------------------------------------------
    def sync_once(self) -> None:
        events = self.cache.drain_events()
        now = time.monotonic()
        with self._lock:
            for ev in events:
                if isinstance(ev, UnitRemoved):
                    self._removed[ev.key] = now
                    self._removed.move_to_end(ev.key)
            while len(self._removed) > 65536:
                self._removed.popitem(last=False)
        if self.publisher is not None:
            self.publisher.record(events)
            self.publisher.sync()  # never raises; retried next time
        if self.replicator is not None:
            self.replicator.tick()

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.sync_every_s):
            try:
                self.sync_once()
            except Exception:  # noqa: BLE001 - the agent keeps serving; the next sync retries
                log.exception("cache agent sync failed")

    def evict(self, keys: Sequence[bytes]) -> int:
        n = self.cache.remove(keys)
        self.sync_once()
        return n

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.replicator is not None:
            self.replicator.close()
        self.server.stop(grace=1.0)
        if self.bulk is not None:
            self.bulk.close()
        self.client.close()
        self.cache.flush(timeout_s=30)
        self.cache.close()
