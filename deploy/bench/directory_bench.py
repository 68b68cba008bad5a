"""``tide bench directory``: the cache directory's cost to Redis and to its clients, on one Redis
and on a Redis Cluster of three primaries (each with a replica), both started here unless a URL is
given.

Per store:
* ``chain``: one 2,000-unit chain (128K tokens) held by two nodes, looked up by one client:
  round trips, latency, Redis command time and main-thread CPU per lookup, memory per unit.
* ``concurrent``: ``clients`` threads, each with its own connections, looking the chain up at once:
  lookups/s and p50/p99 as the clients see them.
* ``trace``: the requests of a Mooncake-format trace in order, as a serving cluster meets them:
  each prompt's units looked up, then the ones no node held registered on the node that computed
  them (the one its first block hashes to: prefix affinity), over ``trace_nodes`` nodes. Lookups/s,
  p50/p99, units per chain and hit units; on a cluster ``cluster_imbalance``, the largest
  primary's share of the Redis command time of the replay over the mean share (1.0: even).
"""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from cachedir.directory import open_directory
from cachedir.hashing import chain_keys
from cachedir.trace import BLOCK_TOKENS, read_trace
from deploy.bench.machine import machine

__all__ = ["run_directory"]

UNIT_TOKENS = 64


def _percentiles(times: list[float]) -> dict[str, float]:
    return {"p50_lookup_ms": round(statistics.median(times) * 1000, 3),
            "p99_lookup_ms": round(float(np.percentile(times, 99)) * 1000, 3)}


def _chain(url: str, namespace: str, units: int, lookups: int) -> tuple[dict[str, Any], list[bytes]]:
    d = open_directory(url, namespace, timeout_s=5.0)
    d.heartbeat("node-a", "127.0.0.1:1", ttl_s=3600)
    d.heartbeat("node-b", "127.0.0.1:2", ttl_s=3600)
    keys = chain_keys(b"\0" * 16, np.arange(units * UNIT_TOKENS) % 30_000, UNIT_TOKENS)
    memory0 = d.server_stats()["used_memory"]
    t0 = time.perf_counter()
    for i in range(0, units, 500):
        d.register("node-a", keys[i : i + 500])
    reg_s = time.perf_counter() - t0
    memory1 = d.server_stats()["used_memory"]
    d.register("node-b", keys[: units // 2], "ram")
    d.longest_prefix(keys[:1])
    stats0, before, times = d.server_stats(), d.round_trips(), []
    for _ in range(lookups):
        t0 = time.perf_counter()
        m = d.longest_prefix(keys)
        times.append(time.perf_counter() - t0)
        assert m.num_units == units, m.num_units
    trips = (d.round_trips() - before) / lookups
    stats1 = d.server_stats()
    for _ in range(lookups):  # the CPU floor of one round trip on this machine, for scale
        d.ping()
    stats2 = d.server_stats()
    d.close()
    return {
        "chain_units": units,
        "round_trips_per_lookup": trips,
        "lookups_per_s": round(lookups / sum(times), 1),
        **_percentiles(times),
        "registrations_per_s": round(units / reg_s, 1),
        # Redis's own time per lookup (INFO commandstats: every command the lookups ran, on every
        # primary), the same from the main threads' CPU clocks (parsing requests and writing
        # replies too), and memory per unit one node holds
        "redis_us_per_lookup": round((stats1["command_usec"] - stats0["command_usec"]) / lookups, 1),
        "redis_cpu_us_per_lookup": round((stats1["cpu_usec"] - stats0["cpu_usec"]) / lookups, 1),
        "redis_cpu_us_per_ping": round((stats2["cpu_usec"] - stats1["cpu_usec"]) / lookups, 1),
        "redis_bytes_per_unit": round((memory1 - memory0) / units, 1),
    }, keys


def _concurrent(url: str, namespace: str, keys: list[bytes], clients: int, per_client: int) -> dict[str, Any]:
    """``clients`` threads with a directory each (their own connections) looking ``keys`` up."""
    dirs = [open_directory(url, namespace, timeout_s=5.0) for _ in range(clients)]
    for d in dirs:
        d.longest_prefix(keys[:1])  # connected before the clock starts
    times: list[list[float]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def run(i: int) -> None:
        start.wait()
        for _ in range(per_client):
            t0 = time.perf_counter()
            dirs[i].longest_prefix(keys)
            times[i].append(time.perf_counter() - t0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for d in dirs:
        d.close()
    flat = [x for ts in times for x in ts]
    return {"clients": clients, "lookups": len(flat), "lookups_per_s": round(len(flat) / wall, 1), **_percentiles(flat)}


def _trace_keys(hash_ids: tuple[int, ...], input_length: int) -> list[bytes]:
    """A prompt's unit keys as the engine makes them: a hash chained from token 0 (the trace's
    blocks stand for 512 tokens each, whole 64-token units only)."""
    keys, parent = [], b"\0" * 16
    for b, block in enumerate(hash_ids):
        in_block = min(BLOCK_TOKENS, input_length - b * BLOCK_TOKENS)
        for j in range(max(0, in_block) // UNIT_TOKENS):
            parent = hashlib.blake2b(parent + block.to_bytes(8, "little") + j.to_bytes(4, "little"),
                                     digest_size=16).digest()
            keys.append(parent)
        if in_block < BLOCK_TOKENS:
            break
    return keys


def _trace(url: str, namespace: str, trace: Path, limit: int, nodes: int) -> dict[str, Any]:
    d = open_directory(url, namespace, timeout_s=5.0)
    for n in range(nodes):
        d.heartbeat(f"node{n}", f"127.0.0.1:{n + 1}", ttl_s=3600)
    before = d.server_stats()
    times, units, hits = [], 0, 0
    for req in read_trace(trace, limit):
        keys = _trace_keys(req.hash_ids, req.input_length)
        if not keys:
            continue
        t0 = time.perf_counter()
        m = d.longest_prefix(keys)
        times.append(time.perf_counter() - t0)
        units, hits = units + len(keys), hits + m.num_units
        if m.num_units < len(keys):
            d.register(f"node{req.hash_ids[0] % nodes}", keys[m.num_units :])
    after = d.server_stats()
    d.close()
    usec = {name: after["servers"][name]["command_usec"] - s["command_usec"] for name, s in before["servers"].items()}
    out: dict[str, Any] = {
        "requests": len(times), "nodes": nodes, "mean_chain_units": round(units / max(1, len(times)), 1),
        "hit_units_fraction": round(hits / max(1, units), 4),
        "lookups_per_s": round(len(times) / max(sum(times), 1e-9), 1), **_percentiles(times or [0.0]),
        "redis_us_per_request": round(sum(usec.values()) / max(1, len(times)), 1),
    }
    if len(usec) > 1:
        mean = sum(usec.values()) / len(usec)
        out["command_usec_per_primary"] = usec
        out["cluster_imbalance"] = round(max(usec.values()) / mean, 3) if mean else None
    return out


def _figures(url: str, units: int, lookups: int, clients: int, trace: Path | None, trace_limit: int,
             trace_nodes: int) -> dict[str, Any]:
    ns = f"bench{time.time_ns()}"
    chain, keys = _chain(url, ns + "c", units, lookups)
    out = {"url": url.split("@")[-1], "chain": chain,
           "concurrent": _concurrent(url, ns + "c", keys, clients, max(2, lookups // clients))}
    if trace is not None:
        out["trace"] = _trace(url, ns + "t", trace, trace_limit, trace_nodes)
    return out


def run_directory(redis_url: str | None, units: int = 2000, lookups: int = 300, clients: int = 16,
                  trace: Path | None = None, trace_limit: int = 2000, trace_nodes: int = 8,
                  cluster: bool = True) -> dict[str, Any]:
    """The figures on ``redis_url``, or on a local redis-server and (``cluster``) a local Redis
    Cluster, by store name."""
    from deploy.redis_proc import RedisClusterServer, RedisServer

    args = (units, lookups, clients, trace, trace_limit, trace_nodes)
    out: dict[str, Any] = {**machine(), "lookups": lookups}
    if redis_url is not None:
        out["given"] = _figures(redis_url, *args)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "single").start()
        try:
            out["single"] = _figures(server.url, *args)
        finally:
            server.kill()
        if cluster:
            servers = RedisClusterServer(Path(tmp) / "cluster").start()
            try:
                out["cluster"] = {"primaries": servers.primaries, "replicas_each": servers.replicas,
                                  **_figures(servers.url, *args)}
            finally:
                servers.kill()
    return out
