"""Redis directory: one server (``redis://``, ``rediss://``) or a Redis Cluster / Valkey cluster
(``redis+cluster://host:port[,host:port...]``, ``rediss+cluster://``).

Key layout. The node table of a namespace shares one hash slot (the ``{namespace}`` tag), so its
scripts run on one server; units, node unit sets and hotness spread over every slot by their own
names, so a cluster's primaries share lookups and registrations evenly (a hot system prompt is
many units, each on its own slot).

================================  ======  ========================================================
key                               type    content
================================  ======  ========================================================
``tide:{ns}:epoch``               string  random id set on first use; a restarted-empty Redis has a new one
``tide:{ns}:expiry``              hash    node id -> when its heartbeat ends (ms, that server's clock)
``tide:{ns}:addr``                hash    node id -> its cache agent's address
``tide:{ns}:reaping``             set     dead nodes whose units ``collect_dead`` is removing
``tide:ns:u:{unit hex}``          hash    node id -> tier (``ram``/``ssd``) of every holder; ``~gone`` ->
                                          when its last holder dropped it (the key then expires
                                          after ``GONE_TTL_S``; a registration keeps it again)
``tide:ns:n:{node id}:{s}``       set     the node's unit hex keys in shard s (cleanup, re-registration)
``tide:ns:hot:{s}``               zset    unit hex -> log2 of the time-scaled hit mass, shard s
                                          (the hottest ``max_hot / HOT_SHARDS`` of each shard)
================================  ======  ========================================================

Hotness: a hit at time t adds ``2^(t/h)`` (h = half-life) to a unit's mass; storing ``log2`` of
the mass keeps it finite and the ordering of a ZSET equals the ordering by decayed count at any
time. The decayed count now is ``2^(score - now/h)``.

Every call is a few batches sent with ``Links.send`` (one round trip each, however many primaries
they span): a lookup reads O(log n) of a chain's units in O(log n) rounds (``bisect_runs``), each
round plain ``HGETALL``s (the first also reads ``expiry`` and the node table's server ``TIME``);
no SCAN anywhere. Any connection failure, timeout or error reply raises ``DirectoryUnavailable``.
On a cluster the epoch also names the live primaries, so a failover (whose promoted replica may
lack the last writes it acknowledged) makes every node register its units again.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Sequence

import redis

from cachedir.directory.base import (
    GONE_TTL_S,
    HOLDER_BATCH,
    MAX_HOT,
    Directory,
    DirectoryUnavailable,
    Holder,
    HotUnit,
    PrefixMatch,
    bisect_runs,
)
from cachedir.directory.redis_links import ClusterLinks, LinkDown, open_links

__all__ = ["HOT_SHARDS", "NODE_SHARDS", "RedisDirectory"]

NODE_SHARDS = 32  # sets per node for its unit keys: a node's registrations spread over primaries
HOT_SHARDS = 16  # hotness sorted sets per namespace

# A heartbeat: the node's expiry in the node table's own clock (lookups compare it with that
# server's TIME: no clock of another machine) and its address. Returns 1 when the node was not
# live before (first beat, or a lapse after which its units may have been collected).
_HEARTBEAT = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local before = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
redis.call('HSET', KEYS[1], ARGV[1], now + tonumber(ARGV[3]))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('SREM', KEYS[3], ARGV[1])
if before > now then return 0 end
return 1
"""

# Dead nodes leave the node table for the reaping set; returns every node to clean up (also
# those a collector that stopped half-way left there).
_REAP = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do
  if tonumber(flat[i + 1]) <= now then
    redis.call('HDEL', KEYS[1], flat[i])
    redis.call('HDEL', KEYS[2], flat[i])
    redis.call('SADD', KEYS[3], flat[i])
  end
end
return redis.call('SMEMBERS', KEYS[3])
"""

# A node drops a unit; when no node is left on it the unit is remembered as dropped (``~gone``)
# and the key expires after ARGV[2] ms (``longest_prefix`` reports it as ``dropped_next``).
_DROP = """
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('HLEN', KEYS[1]) - redis.call('HEXISTS', KEYS[1], '~gone') == 0 then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], '~gone', t[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
GONE = b"~gone"

_RECORD_HITS = """
local mass = tonumber(ARGV[1])
local ln2 = math.log(2)
for i = 3, #ARGV do
  local old = redis.call('ZSCORE', KEYS[1], ARGV[i])
  local new = mass
  if old then
    old = tonumber(old)
    local hi, lo = old, mass
    if lo > hi then hi, lo = lo, hi end
    new = hi + math.log(1 + 2 ^ (lo - hi)) / ln2
  end
  redis.call('ZADD', KEYS[1], new, ARGV[i])
end
local max_hot = tonumber(ARGV[2])
if redis.call('ZCARD', KEYS[1]) > max_hot then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -max_hot - 1)
end
return #ARGV - 2
"""


def _pairs(reply) -> Iterable[tuple[bytes, bytes]]:
    """A raw HGETALL reply's (field, value) pairs: a map under RESP3, a flat list under RESP2."""
    return reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)


def _scored(reply) -> Iterable[tuple[bytes, float]]:
    """A raw ``WITHSCORES`` reply's (member, score) pairs: pairs under RESP3, flat under RESP2."""
    if reply and isinstance(reply[0], list):
        return ((m, float(s)) for m, s in reply)
    return ((m, float(s)) for m, s in zip(reply[::2], reply[1::2], strict=True))


def _shard(key: bytes, n: int) -> int:
    return int.from_bytes(key[-2:], "big") % n


def _now_ms(time_reply) -> int:
    sec, usec = time_reply
    return int(sec) * 1000 + int(usec) // 1000


class RedisDirectory(Directory):
    def __init__(
        self,
        url: str,
        namespace: str,
        half_life_s: float = 600.0,
        timeout_s: float = 0.25,
        password: str | None = None,
        ssl_ca_certs: str | None = None,
        max_hot: int = MAX_HOT,
    ) -> None:
        super().__init__(namespace, half_life_s, max_hot)
        if "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must not contain braces (a Redis Cluster hash tag), got {namespace!r}")
        self._links = open_links(url, timeout_s, password=password, ssl_ca_certs=ssl_ca_certs)
        self._clustered = isinstance(self._links, ClusterLinks)
        meta = f"tide:{{{namespace}}}:"
        self._epoch_key, self._expiry, self._addr, self._reaping = (
            meta + "epoch", meta + "expiry", meta + "addr", meta + "reaping")
        self._p = f"tide:{namespace}:"
        self._hot_max = -(-max_hot // HOT_SHARDS)
        self._beat = self._links.script(_HEARTBEAT)
        self._reap = self._links.script(_REAP)
        self._hits = self._links.script(_RECORD_HITS)
        self._drop = self._links.script(_DROP)

    # -- keys --------------------------------------------------------------------------------
    def _unit(self, hexkey: str) -> str:
        return self._p + "u:" + hexkey

    def _node_set(self, node_id: str, shard: int) -> str:
        return f"{self._p}n:{node_id}:{shard}"

    def _hot(self, shard: int) -> str:
        return f"{self._p}hot:{shard}"

    def _send(self, commands: list[tuple]) -> list:
        """``Links.send``; an error reply or a server that does not answer -> DirectoryUnavailable."""
        try:
            replies = self._links.send(commands)
        except LinkDown as e:
            raise DirectoryUnavailable(f"redis: {e}") from e
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise DirectoryUnavailable(f"redis: {reply}")
        return replies

    def _by_node_shard(self, keys: Sequence[bytes]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for k in keys:
            out.setdefault(_shard(k, NODE_SHARDS), []).append(k.hex())
        return out

    # -- the contract ------------------------------------------------------------------------
    def register(self, node_id: str, keys: Sequence[bytes], tier: str = "ssd") -> None:
        self._check_tier(tier)
        if not keys:
            return
        commands: list[tuple] = [(self._expiry, "HSETNX", self._expiry, node_id, 0),  # reaped if it never beats
                                 (self._epoch_key, "SET", self._epoch_key, uuid.uuid4().hex, "NX")]
        for k in keys:  # held: a unit remembered as dropped is kept again
            unit = self._unit(k.hex())
            commands += [(unit, "HSET", unit, node_id, tier), (unit, "HDEL", unit, GONE), (unit, "PERSIST", unit)]
        for shard, hexes in self._by_node_shard(keys).items():
            commands.append((self._node_set(node_id, shard), "SADD", self._node_set(node_id, shard), *hexes))
        self._send(commands)

    def unregister(self, node_id: str, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        ttl_ms = int(GONE_TTL_S * 1000)
        commands: list[tuple] = [(unit, "EVALSHA", self._drop, 1, unit, node_id, ttl_ms)
                                 for unit in (self._unit(k.hex()) for k in keys)]
        for shard, hexes in self._by_node_shard(keys).items():
            commands.append((self._node_set(node_id, shard), "SREM", self._node_set(node_id, shard), *hexes))
        self._send(commands)

    def longest_prefix(self, keys: Sequence[bytes]) -> PrefixMatch:
        live: set[bytes] | None = None
        dropped: set[int] = set()  # read units no live node holds that their last holder dropped

        def probe(indices: list[int]) -> list[str]:
            nonlocal live
            commands: list[tuple] = [(u, "HGETALL", u) for u in (self._unit(keys[i].hex()) for i in indices)]
            if live is None:  # the first round also reads whose heartbeat lasts, by that server's clock
                commands += [(self._expiry, "HGETALL", self._expiry), (self._expiry, "TIME")]
            replies = self._send(commands)
            if live is None:
                now_ms = _now_ms(replies[-1])
                live = {node for node, until in _pairs(replies[-2]) if int(until) > now_ms}
            out = []
            for i, h in zip(indices, replies[: len(indices)], strict=True):
                fields = dict(_pairs(h))
                out.append(",".join(sorted(n.decode() + "=" + t.decode() for n, t in fields.items() if n in live)))
                if not out[-1] and GONE in fields:
                    dropped.add(i)
            return out

        holders: list[list[Holder]] = []
        for count, held in bisect_runs(len(keys), probe):
            same = [Holder(*item.split("=", 1)) for item in held.split(",")]
            holders.extend([same] * count)  # the runs share one (read-only) list
        return PrefixMatch(holders, len(holders) in dropped)

    def heartbeat(self, node_id: str, address: str, ttl_s: float) -> bool:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        (revived,) = self._send([(self._expiry, "EVALSHA", self._beat, 3, self._expiry, self._addr, self._reaping,
                                  node_id, address, max(1, int(ttl_s * 1000)))])
        return bool(revived)

    def live_nodes(self) -> dict[str, str]:
        expiry, addr, now = self._send([(self._expiry, "HGETALL", self._expiry), (self._addr, "HGETALL", self._addr),
                                        (self._expiry, "TIME")])
        now_ms = _now_ms(now)
        addresses = dict(_pairs(addr))
        return {n.decode(): addresses[n].decode() for n, until in _pairs(expiry)
                if int(until) > now_ms and n in addresses}

    def node_keys(self, node_id: str) -> set[bytes]:
        sets = [self._node_set(node_id, s) for s in range(NODE_SHARDS)]
        replies = self._send([(k, "SMEMBERS", k) for k in sets])
        return {bytes.fromhex(m.decode()) for members in replies for m in members}

    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        out: list[list[Holder]] = []
        for start in range(0, len(keys), HOLDER_BATCH):
            batch = keys[start : start + HOLDER_BATCH]
            replies = self._send([(u, "HGETALL", u) for u in (self._unit(k.hex()) for k in batch)]
                                 + [(self._expiry, "HGETALL", self._expiry), (self._expiry, "TIME")])
            now_ms = _now_ms(replies[-1])
            live = {node for node, until in _pairs(replies[-2]) if int(until) > now_ms}
            out += [[Holder(n.decode(), t.decode()) for n, t in sorted(_pairs(h)) if n in live]
                    for h in replies[: len(batch)]]
        return out

    def collect_dead(self) -> list[str]:
        (reaping,) = self._send([(self._expiry, "EVALSHA", self._reap, 3, self._expiry, self._addr, self._reaping)])
        dead = sorted(n.decode() for n in reaping)
        if not dead:
            return []
        sets = [self._node_set(n, s) for n in dead for s in range(NODE_SHARDS)]
        members = self._send([(k, "SMEMBERS", k) for k in sets])
        commands: list[tuple] = []
        for key, hexes in zip(sets, members, strict=True):
            node = key[len(self._p) + 2 :].rpartition(":")[0]
            commands += [(self._unit(h.decode()), "HDEL", self._unit(h.decode()), node) for h in hexes]
            commands.append((key, "DEL", key))
        self._send(commands)
        # a collector that stops before here leaves them in the set: the next one finishes the job
        self._send([(self._reaping, "SREM", self._reaping, *dead)])
        return dead

    def record_hits(self, keys: Sequence[bytes], now_s: float) -> None:
        if not keys:
            return
        by_shard: dict[int, list[str]] = {}
        for k in keys:
            by_shard.setdefault(_shard(k, HOT_SHARDS), []).append(k.hex())
        mass = repr(now_s / self.half_life_s)
        self._send([(self._hot(s), "EVALSHA", self._hits, 1, self._hot(s), mass, self._hot_max, *hexes)
                    for s, hexes in by_shard.items()])

    def hot_units(self, limit: int, max_replicas: int, now_s: float) -> list[HotUnit]:
        scan = max(limit * 20, 100)
        replies = self._send([(self._hot(s), "ZREVRANGE", self._hot(s), 0, scan - 1, "WITHSCORES")
                              for s in range(HOT_SHARDS)]
                             + [(self._expiry, "HGETALL", self._expiry), (self._expiry, "TIME")])
        now_ms = _now_ms(replies[-1])
        live = {node for node, until in _pairs(replies[-2]) if int(until) > now_ms}
        ranked = sorted(((score, key) for reply in replies[:-2] for key, score in _scored(reply)), reverse=True)[:scan]
        if not ranked:
            return []
        holders = self._send([(self._unit(k.decode()), "HKEYS", self._unit(k.decode())) for _, k in ranked])
        out = []
        for (score, key), nodes in zip(ranked, holders, strict=True):
            alive = sorted(n.decode() for n in nodes if n in live)
            if 0 < len(alive) < max_replicas:
                decayed = 2.0 ** (score - now_s / self.half_life_s)
                out.append(HotUnit(bytes.fromhex(key.decode()), decayed, len(alive), alive))
                if len(out) >= limit:
                    break
        return out

    def epoch(self) -> str:
        commands: list[tuple] = [(self._epoch_key, "SET", self._epoch_key, uuid.uuid4().hex, "NX"),
                                 (self._epoch_key, "GET", self._epoch_key)]
        if self._clustered:
            commands.append((self._epoch_key, "CLUSTER", "NODES"))
        replies = self._send(commands)
        epoch = replies[1].decode()
        if not self._clustered:
            return epoch
        nodes = [line.split() for line in replies[2].decode().splitlines()]
        # a primary that failed ("fail"; not one merely suspected, "fail?") is no longer one
        primaries = sorted(n[0] for n in nodes if {"master"} <= set(n[2].split(",")) and "fail" not in n[2].split(","))
        return epoch + ":" + hashlib.sha1(" ".join(primaries).encode()).hexdigest()[:16]

    # -- maintenance and benchmarks ----------------------------------------------------------
    def server_stats(self) -> dict:
        """Redis's own counters over every primary (benchmarks): ``used_memory``; the
        microseconds its commands took, INFO's own excepted (``INFO commandstats``); its main
        thread's CPU time, which also counts reading requests and writing replies (``INFO
        cpu``); and the same per primary under ``servers``."""
        servers = {}
        try:
            for name, client in self._links.clients().items():
                stats = client.info("commandstats")
                cpu = client.info("cpu")
                servers[name] = {
                    "used_memory": client.info("memory")["used_memory"],
                    "command_usec": sum(row.get("usec", 0) for cmd, row in stats.items() if cmd != "cmdstat_info"),
                    "cpu_usec": int((cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"])
                                     + cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"])) * 1e6),
                }
        except (redis.RedisError, LinkDown) as e:
            raise DirectoryUnavailable(f"redis: {e}") from e
        totals = {k: sum(s[k] for s in servers.values()) for k in ("used_memory", "command_usec", "cpu_usec")}
        return {**totals, "servers": servers}

    def ping(self) -> None:
        """One empty round trip (benchmarks: what Redis spends on a request that does nothing)."""
        self._send([(self._expiry, "PING")])

    def round_trips(self) -> int:
        """Batches this client has sent (each one round trip, to every server it spans at once)."""
        return self._links.round_trips

    def close(self) -> None:
        self._links.close()
