"""``ClusterCache``: the prompt cache as an engine on a node with a cache agent sees it.

``lookup`` asks the node's agent which leading units it holds and, in ONE directory round trip,
which live nodes hold the rest of the run; units are then "ram"/"ssd" (this node) or "remote".
``load_async`` reads the local ones straight from the node's store files (the agent says where
they are: no unit crosses gRPC on its own node; one the read misses, because it moved, went or
cannot be read here, comes through the agent), and fetches the remote ones from their holders,
several holders in parallel (each unit goes to one holder, spread evenly), verifies
every unit against the key, tokens and namespace the engine expects, retries a failed unit once
on another holder, and otherwise reports a miss there (the engine computes from that unit on).
A holder that failed (unreachable, timed out, or served a unit that failed verification) is
avoided for ``suspect_s``: a hanging or lying peer costs one bounded wait, not one per request.
A directory that is down or slow means local units only; an agent that is down means no hit.
``persist`` pushes new units to the node's agent in the background.

With the cluster's cache ``secret`` every unit is written with its namespace's MAC and every
unit read must carry it: a unit forged by anyone who can push to or serve from an agent (they
hold the agent token, not the secret) is a miss, and the recomputed unit replaces this node's
forged copy when it is persisted.

It keeps the bytes and seconds of every load by source (``transfer``) so the prefill load
balancer can use measured bandwidths.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from cachedir.agent.client import AgentClient, AgentError, BulkUnavailable
from cachedir.agent.service import MAX_UNIT_BYTES
from cachedir.directory.base import Directory, DirectoryUnavailable
from cachedir.hashing import unit_mac_key
from cachedir.layered import LayeredLoad, WholeLoad, fill_whole, read_layered
from cachedir.layout import coalesce, read_run
from cachedir.node_cache import LoadedUnit
from cachedir.staging import StagingBuffers
from cachedir.unit import Unit
from cachedir.unitfile import UnitCorrupt, decode

__all__ = ["ClusterCache"]

log = logging.getLogger(__name__)

_REMEMBER = 1 << 16  # keys whose holders are remembered between lookup and load


class ClusterCache:
    def __init__(
        self,
        node_id: str,
        local: AgentClient,
        directory: Directory | None,
        client_for: Callable[[str], AgentClient],
        io_threads: int = 8,
        live_ttl_s: float = 1.0,
        suspect_s: float = 30.0,
        secret: bytes = b"",
        max_unit_bytes: int = MAX_UNIT_BYTES,
        direct: bool = True,
        staging_bytes: int = 256 << 20,
        bulk: bool = True,
    ) -> None:
        """``local`` is this node's agent; ``client_for(address)`` gives a client for another;
        ``secret``: the cluster's cache secret (units are authenticated under it);
        ``max_unit_bytes``: the largest encoded unit of the model (a peer's larger one fails
        the fetch before its bytes are held); ``direct``: read this node's units from its store
        files (False: through its agent, as other nodes' are), into reusable buffers of at most
        ``staging_bytes`` (``cachedir.staging``); ``bulk``: other nodes' units over their agents'
        bulk TCP ports where they offer one (``cachedir.agent.bulk``), else over gRPC."""
        self.direct, self.bulk = direct, bulk
        self.node_id = node_id
        self._secret = secret
        self._max_unit_bytes = max_unit_bytes
        self.local = local
        self.directory = directory
        self._client_for = client_for
        # loads wait on fetches, so they run on separate pools (one pool could deadlock)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="cluster-cache")
        self._fetch_pool = ThreadPoolExecutor(2 * io_threads, thread_name_prefix="cluster-cache-fetch")
        self._read_pool = ThreadPoolExecutor(max(2, io_threads // 2), thread_name_prefix="cluster-cache-read")
        self._staging = StagingBuffers(staging_bytes)  # what direct reads (and opened units) land in
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self._holders: OrderedDict[bytes, list[str]] = OrderedDict()  # remote key -> live holders
        self._held: OrderedDict[bytes, None] = OrderedDict()  # keys known to be cached somewhere
        self._bad_local: OrderedDict[bytes, None] = OrderedDict()  # this node's copy failed verification
        self._live: tuple[float, dict[str, str]] = (-1e18, {})
        self._planned_addresses: dict[str, str] = {}  # node -> its agent's address, as the latest plan gave it
        self._live_ttl_s = live_ttl_s
        self._suspect_s = suspect_s
        # node -> (monotonic time until which it is avoided, the agent address that failed; None:
        # it sent a unit that failed verification, whatever address it has)
        self._suspects: dict[str, tuple[float, str | None]] = {}
        self.counters = {"lookups": 0, "directory_errors": 0, "agent_errors": 0, "remote_units": 0,
                         "local_units": 0, "verify_failures": 0, "retried_units": 0, "persisted_units": 0,
                         "suspected_holders": 0, "direct_units": 0, "direct_misses": 0, "bulk_units": 0}
        # source -> [bytes, seconds] of loads, for measured bandwidths
        self.transfer = {"local": [0, 0.0], "remote": [0, 0.0]}

    # -- bookkeeping ---------------------------------------------------------------------------
    def _remember(self, table: OrderedDict, key: bytes, value) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > _REMEMBER:
            table.popitem(last=False)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _agent_error(self, e: AgentError) -> None:
        """Counted; logged the first time and every 100th (a wrong token would fail every call)."""
        self._count("agent_errors")
        if self.counters["agent_errors"] % 100 == 1:
            log.warning("cache agent call failed (a cache miss; %d so far): %s", self.counters["agent_errors"], e)

    def _live_nodes(self, fresh: bool = False) -> dict[str, str]:
        """Live node -> its agent's address (the directory's, at most ``live_ttl_s`` old unless
        ``fresh``)."""
        at, live = self._live
        if fresh or time.monotonic() - at > self._live_ttl_s:
            live = self.directory.live_nodes()
            self._live = (time.monotonic(), live)
        return live

    def _suspect(self, node: str, address: str | None = None) -> None:
        """Avoid ``node`` as a holder for ``suspect_s``: its agent at ``address`` failed (an agent
        restarted since, at another address, is trusted again), or it sent a unit that failed
        verification (``address`` None: avoided wherever its agent listens)."""
        with self._lock:
            if self._suspects.get(node, (0.0, None))[0] < time.monotonic():
                self.counters["suspected_holders"] += 1
            self._suspects[node] = (time.monotonic() + self._suspect_s, address)

    def _trusted(self, nodes: list[str], live: dict[str, str]) -> list[str]:
        now = time.monotonic()
        with self._lock:
            suspects = {n: self._suspects.get(n, (0.0, None)) for n in nodes}
        return [n for n, (until, address) in suspects.items()
                if until < now or (address is not None and live.get(n) != address)]

    def holds(self, key: bytes) -> bool:
        """Cached on some node as far as this replica knows (so persisting it again is a waste)."""
        with self._lock:
            return key in self._held

    # -- lookups and loads ---------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], holders: Sequence[Sequence[str]] | None = None,
               addresses: Mapping[str, str] | None = None) -> list[str]:
        """Tiers of the leading units that can be loaded ("ram"/"ssd" here, "remote" on another
        node). ``holders`` (a prefix plan: the directory's answer the ingress got) replaces both
        the agent's and the directory's lookup: this node's units are "local" then; with the live
        holders' ``addresses`` the directory is not asked which nodes live either."""
        self._count("lookups")
        if holders is not None:
            local, remote = self._from_plan(holders, addresses)
        else:
            local, remote = self._ask(keys)
        tiers = []
        with self._lock:
            for i, k in enumerate(keys):
                if i < len(local) and local[i]:
                    tiers.append(local[i])
                    self._holders.pop(k, None)  # loaded from this node's agent
                elif i < len(remote) and remote[i]:
                    tiers.append("remote")
                    self._remember(self._holders, k, remote[i])
                else:
                    break
                self._remember(self._held, k, None)
        if tiers and self.directory is not None:  # hotness counts every request that finds a unit
            self._submit(self._record_hits, list(keys[: len(tiers)]))
        return tiers

    def _ask(self, keys: Sequence[bytes]) -> tuple[list[str], list[list[str]]]:
        """This node's tier of each unit (its agent) and the other live holders (the directory)."""
        try:
            local = self.local.has(keys)
        except AgentError as e:
            self._agent_error(e)
            local = [""] * len(keys)
        remote: list[list[str]] = []
        if self.directory is not None and not all(local):
            try:
                match = self.directory.longest_prefix(keys)
                live = self._live_nodes()
                remote = [self._trusted([h.node_id for h in hs if h.node_id != self.node_id and h.node_id in live], live)
                          for hs in match.holders]
            except DirectoryUnavailable:
                self._count("directory_errors")
        return local, remote

    def _from_plan(self, holders: Sequence[Sequence[str]],
                   addresses: Mapping[str, str] | None) -> tuple[list[str], list[list[str]]]:
        """The same from a plan's holders: "local" where this node is one, else the live others
        (those the plan gives an address, else those the directory lists as live)."""
        if addresses:
            live = dict(addresses)
            with self._lock:
                self._planned_addresses.update(live)
        else:
            try:
                live = self._live_nodes() if self.directory is not None else {}
            except DirectoryUnavailable:
                self._count("directory_errors")
                live = {}
        local = ["local" if self.node_id in hs else "" for hs in holders]
        return local, [self._trusted([n for n in hs if n != self.node_id and n in live], live) for hs in holders]

    def _record_hits(self, keys: list[bytes]) -> None:
        try:
            self.directory.record_hits(keys, time.time())
        except DirectoryUnavailable:
            self._count("directory_errors")

    def load_async(
        self, keys: Sequence[bytes], namespace: bytes, token_ids: Sequence[Sequence[int]]
    ) -> Future[list[LoadedUnit | None]]:
        """Verified units for ``keys`` (None where missing or damaged), in order."""
        return self._submit(self._load, list(keys), namespace, [tuple(t) for t in token_ids])

    def load_layered(self, keys: Sequence[bytes], namespace: bytes,
                     token_ids: Sequence[Sequence[int]]) -> LayeredLoad:
        """As ``load_async``, but handing the units over layer by layer (``cachedir.layered``)
        where this node's store holds every one in its files and reads are direct; else whole."""
        keys, tokens = list(keys), [tuple(t) for t in token_ids]
        with self._lock:
            elsewhere = any(self._holders.get(k) for k in keys)
        if not self.direct or elsewhere:
            return WholeLoad(self.load_async(keys, namespace, tokens))
        load = LayeredLoad()
        self._submit(self._read_layered, keys, namespace, tokens, load)
        return load

    def _read_layered(self, keys: list[bytes], namespace: bytes, tokens: list[tuple], load: LayeredLoad) -> None:
        t0 = time.perf_counter()
        try:
            where = self.local.locate(keys)
        except AgentError as e:
            self._agent_error(e)
            where = [None]
        if any(w is None for w in where):  # not all in this node's files: whole, through the agent too
            fill_whole(load, self._load(keys, namespace, tokens))
            return
        read_layered(where, keys, namespace, tokens, unit_mac_key(self._secret, namespace), self._staging.take, load)
        units = load.units(0)
        with self._lock:
            self.counters["direct_units"] += len(units)
            self.counters["local_units"] += len(units)
            self.counters["direct_misses"] += len(keys) - len(units)
            self.transfer["local"][0] += sum(len(u.unit.payload) for u in units)
            self.transfer["local"][1] += time.perf_counter() - t0

    def _submit(self, fn, *args) -> Future:
        fut = self._pool.submit(fn, *args)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(lambda f: self._pending.discard(f))
        return fut

    def _load(self, keys: list[bytes], namespace: bytes, tokens: list[tuple]) -> list[LoadedUnit | None]:
        out: list[LoadedUnit | None] = [None] * len(keys)
        with self._lock:
            holders = {i: self._holders.get(k) for i, k in enumerate(keys)}
        local = [i for i, h in holders.items() if not h]
        # each remote unit goes to the holder with the fewest units assigned so far
        assigned: dict[str, list[int]] = {}
        for i, hs in holders.items():
            if hs:
                assigned.setdefault(min(hs, key=lambda n: len(assigned.get(n, ()))), []).append(i)
        jobs = [self._fetch_pool.submit(self._fetch_local, local, keys, namespace, tokens)] if local else []
        jobs += [self._fetch_pool.submit(self._fetch, node, idx, keys, namespace, tokens) for node, idx in assigned.items()]
        failed: list[tuple[int, str]] = []
        for job in jobs:
            node, got = job.result()
            for i, unit in got.items():
                out[i] = unit
            failed += [(i, node) for i in got if got[i] is None and node is not None]
        retry: dict[str, list[int]] = {}  # a failed remote unit once more from another holder
        for i, bad in failed:
            others = [n for n in holders[i] if n != bad]
            if others:
                retry.setdefault(others[0], []).append(i)
        for node, idx in retry.items():
            self._count("retried_units", len(idx))
            _, got = self._fetch(node, idx, keys, namespace, tokens)
            for i, unit in got.items():
                out[i] = unit
        return out

    def _fetch_local(self, idx: list[int], keys: list[bytes], namespace: bytes,
                     tokens: list[tuple]) -> tuple[None, dict[int, LoadedUnit | None]]:
        """This node's units ``idx``: read from its store's files where its agent says they are,
        each verified as a fetched one is; those the read misses come through the agent."""
        got: dict[int, LoadedUnit | None] = dict.fromkeys(idx)
        if self.direct:
            got.update(self._read_direct(idx, keys, namespace, tokens))
        rest = [i for i in idx if got[i] is None]
        if rest:
            _, more = self._fetch(None, rest, keys, namespace, tokens)
            got.update(more)
        return None, got

    def _read_direct(self, idx: list[int], keys: list[bytes], namespace: bytes,
                     tokens: list[tuple]) -> dict[int, LoadedUnit]:
        """The units of ``idx`` this node's store holds, read from its files (runs of a segment
        in one read, the runs side by side); one that moved, went, or fails verification (a
        rewrite under the read) is left out: the agent's copy is tried next."""
        t0 = time.perf_counter()
        try:
            where = self.local.locate([keys[i] for i in idx])
        except AgentError as e:
            self._agent_error(e)
            return {}
        found = [(i, w) for i, w in zip(idx, where, strict=True) if w is not None]
        mac_key = unit_mac_key(self._secret, namespace)

        def read(group: list[int]) -> list[tuple[int, LoadedUnit | None, int]]:
            try:
                views = read_run([found[j][1][1] for j in group], self._staging.take)
            except OSError:  # gone, or not readable from this process: through the agent
                return [(found[j][0], None, 0) for j in group]
            out = []
            for j, view in zip(group, views, strict=True):
                i, (tier, _) = found[j]
                try:  # a sealed unit is opened into a staging buffer of its own
                    h, payload = decode(view, namespace, keys[i], tokens[i], mac_key=mac_key,
                                        out=self._staging.take(len(view) + 15) if mac_key else None)
                except UnitCorrupt:
                    out.append((i, None, 0))
                    continue
                unit = Unit(namespace, keys[i], h.parent, h.token_ids, payload, h.num_layers, h.dim, h.dtype, h.mac,
                            h.sealed)
                out.append((i, LoadedUnit(unit, tier), len(view)))
            return out

        results = [r for rs in self._read_pool.map(read, coalesce([w for _, (_, w) in found])) for r in rs]
        got = {i: unit for i, unit, _ in results if unit is not None}
        with self._lock:
            self.counters["direct_units"] += len(got)
            self.counters["local_units"] += len(got)
            self.counters["direct_misses"] += len(results) - len(got)
            self.transfer["local"][0] += sum(n for _, _, n in results)
            self.transfer["local"][1] += time.perf_counter() - t0
        return got

    def _fetch(self, node: str | None, idx: list[int], keys: list[bytes], namespace: bytes,
               tokens: list[tuple]) -> tuple[str | None, dict[int, LoadedUnit | None]]:
        """Fetch ``idx`` from ``node`` (None: this node's agent); verified units by index."""
        got: dict[int, LoadedUnit | None] = dict.fromkeys(idx)
        t0 = time.perf_counter()
        wanted = [keys[i] for i in idx]
        address = None
        try:
            if node is None:
                found = self.local.fetch(wanted, requester=self.node_id, max_unit_bytes=self._max_unit_bytes)
            else:
                with self._lock:
                    address = self._planned_addresses.get(node)
                address = address or self._live_nodes().get(node)
                if address is None:
                    return node, got
                try:
                    found = self._fetch_remote(self._client_for(address), wanted)
                except AgentError:
                    # its agent may have restarted since the directory was read: a new port
                    moved = self._live_nodes(fresh=True).get(node)
                    if moved is None or moved == address:
                        raise
                    address = moved
                    found = self._fetch_remote(self._client_for(address), wanted)
        except AgentError as e:
            self._agent_error(e)
            if node is not None:
                self._suspect(node, address)
            return node, got
        except DirectoryUnavailable:
            self._count("directory_errors")
            return node, got
        nbytes = 0
        lied = False
        mac_key = unit_mac_key(self._secret, namespace)
        for i, item in zip(idx, found, strict=True):
            if item is None:
                continue
            tier, data = item
            try:  # a sealed unit is opened into a staging buffer of its own
                h, payload = decode(data, namespace, keys[i], tokens[i], mac_key=mac_key,
                                    out=self._staging.take(len(data) + 15) if mac_key else None)
            except UnitCorrupt:
                self._count("verify_failures")
                lied = True
                if node is None:  # persisting the recomputed unit replaces this copy
                    with self._lock:
                        self._held.pop(keys[i], None)
                        self._remember(self._bad_local, keys[i], None)
                continue
            nbytes += len(data)
            unit = Unit(namespace, keys[i], h.parent, h.token_ids, payload, h.num_layers, h.dim, h.dtype, h.mac, h.sealed)
            got[i] = LoadedUnit(unit, tier if node is None else "remote")
        if lied and node is not None:
            self._suspect(node)
        source = "local" if node is None else "remote"
        with self._lock:
            self.counters[f"{source}_units"] += sum(u is not None for u in got.values())
            self.transfer[source][0] += nbytes
            self.transfer[source][1] += time.perf_counter() - t0
        return node, got

    def _fetch_remote(self, client: AgentClient, wanted: list[bytes]) -> list[tuple[str, bytes | memoryview] | None]:
        """Another node's units: through its agent's bulk port where it has one (what that
        misses, and everything when it fails, through gRPC)."""
        found = None
        if self.bulk:
            try:
                found = client.fetch_bulk(wanted, self.node_id, self._max_unit_bytes, self._staging.take)
            except BulkUnavailable as e:  # its gRPC answered: the units come that way
                self._agent_error(e)
        if found is None:
            return client.fetch(wanted, requester=self.node_id, max_unit_bytes=self._max_unit_bytes)
        self._count("bulk_units", sum(f is not None for f in found))
        rest = [i for i, f in enumerate(found) if f is None]
        if rest:
            for i, f in zip(rest, client.fetch([wanted[i] for i in rest], requester=self.node_id,
                                               max_unit_bytes=self._max_unit_bytes), strict=True):
                found[i] = f
        return found

    # -- persistence ---------------------------------------------------------------------------
    def persist(self, units: Sequence[Unit]) -> list[Future[bool]]:
        """Push new units to this node's agent in the background."""
        if not units:
            return []
        with self._lock:
            for u in units:
                self._remember(self._held, u.key, None)

        with self._lock:
            replace = frozenset(i for i, u in enumerate(units) if u.key in self._bad_local)
            for i in replace:
                del self._bad_local[units[i].key]

        def push() -> bool:
            mac_keys = {ns: unit_mac_key(self._secret, ns) for ns in {u.namespace for u in units}}
            try:
                accepted, _ = self.local.push((u.encode(mac_keys[u.namespace]) for u in units), replace=replace)
            except AgentError as e:
                self._agent_error(e)
                return False
            self._count("persisted_units", accepted)
            return accepted == len(units)

        return [self._submit(push)]

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the pushes and loads submitted so far (tests, shutdown)."""
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            fut.result(timeout=timeout_s)

    def memory_bytes(self) -> int:
        """The most this cache holds in the replica's memory: its read buffers."""
        return self._staging.capacity_bytes

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters)
            for source, (nbytes, secs) in self.transfer.items():
                out[f"{source}_bytes"] = nbytes
                out[f"{source}_seconds"] = round(secs, 6)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._fetch_pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)
