"""Redis directory (``redis://`` / ``rediss://``).

Key layout, all under ``tide:{namespace}:`` (several models and tenants share one Redis):

==========================  ======  ==========================================================
key                         type    content
==========================  ======  ==========================================================
``epoch``                   string  random id set on first use; a restarted-empty Redis has a new one
``u:{unit hex}``            hash    node id -> tier (``ram``/``ssd``) of every holder
``n:{node id}``             set     unit hex keys registered by the node (cleanup, re-registration)
``alive:{node id}``         string  the node's address, expiring after the heartbeat TTL
``nodes``                   set     node ids that ever registered (small; for ``collect_dead``)
``hot``                     zset    unit hex -> log2 of the time-scaled hit mass (see below);
                                    the hottest ``max_hot`` units
==========================  ======  ==========================================================

Hotness: a hit at time t adds ``2^(t/h)`` (h = half-life) to a unit's mass; storing ``log2`` of
the mass keeps it finite and the ordering of the ZSET equals the ordering by decayed count at any
time. The decayed count now is ``2^(score - now/h)``.

Every request-path call is one round trip (a Lua script or a pipeline); no SCAN anywhere. Any
connection failure or timeout raises ``DirectoryUnavailable``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import redis

from cachedir.directory.base import (
    MAX_HOT,
    Directory,
    DirectoryUnavailable,
    Holder,
    HotUnit,
    PrefixMatch,
)

__all__ = ["RedisDirectory"]

# Returns run-length encoded holder sets: {n1, "a=ssd,b=ram", n2, "a=ssd", ...}; consecutive
# units of a prompt are usually held by the same nodes, so 2,000 units come back as a few strings.
_LONGEST_PREFIX = """
local p = ARGV[1]
local alive = {}
local out = {}
local prev = nil
local run = 0
for i = 2, #ARGV do
  local h = redis.call('HGETALL', p .. 'u:' .. ARGV[i])
  local live = {}
  for j = 1, #h, 2 do
    local node = h[j]
    if alive[node] == nil then
      alive[node] = redis.call('EXISTS', p .. 'alive:' .. node)
    end
    if alive[node] == 1 then live[#live + 1] = node .. '=' .. h[j + 1] end
  end
  if #live == 0 then break end
  table.sort(live)
  local s = table.concat(live, ',')
  if s == prev then
    run = run + 1
  else
    if prev then out[#out + 1] = run; out[#out + 1] = prev end
    prev = s
    run = 1
  end
end
if prev then out[#out + 1] = run; out[#out + 1] = prev end
return out
"""

_RECORD_HITS = """
local p = ARGV[1]
local mass = tonumber(ARGV[2])
local ln2 = math.log(2)
for i = 4, #ARGV do
  local old = redis.call('ZSCORE', p .. 'hot', ARGV[i])
  local new = mass
  if old then
    old = tonumber(old)
    local hi, lo = old, mass
    if lo > hi then hi, lo = lo, hi end
    new = hi + math.log(1 + 2 ^ (lo - hi)) / ln2
  end
  redis.call('ZADD', p .. 'hot', new, ARGV[i])
end
local max_hot = tonumber(ARGV[3])
if redis.call('ZCARD', p .. 'hot') > max_hot then
  redis.call('ZREMRANGEBYRANK', p .. 'hot', 0, -max_hot - 1)
end
return #ARGV - 3
"""

_HOT_UNITS = """
local p = ARGV[1]
local limit = tonumber(ARGV[2])
local max_replicas = tonumber(ARGV[3])
local scan = tonumber(ARGV[4])
local ranked = redis.call('ZREVRANGE', p .. 'hot', 0, scan - 1, 'WITHSCORES')
local alive = {}
local out = {}
for i = 1, #ranked, 2 do
  local nodes = redis.call('HKEYS', p .. 'u:' .. ranked[i])
  local live = {}
  for _, node in ipairs(nodes) do
    if alive[node] == nil then alive[node] = redis.call('EXISTS', p .. 'alive:' .. node) end
    if alive[node] == 1 then live[#live + 1] = node end
  end
  if #live > 0 and #live < max_replicas then
    out[#out + 1] = {ranked[i], ranked[i + 1], live}
    if #out >= limit then break end
  end
end
return out
"""

_COLLECT_DEAD = """
local p = ARGV[1]
local dead = {}
for _, node in ipairs(redis.call('SMEMBERS', p .. 'nodes')) do
  if redis.call('EXISTS', p .. 'alive:' .. node) == 0 then
    for _, k in ipairs(redis.call('SMEMBERS', p .. 'n:' .. node)) do
      redis.call('HDEL', p .. 'u:' .. k, node)
    end
    redis.call('DEL', p .. 'n:' .. node)
    redis.call('SREM', p .. 'nodes', node)
    dead[#dead + 1] = node
  end
end
return dead
"""


class RedisDirectory(Directory):
    def __init__(
        self,
        url: str,
        namespace: str,
        half_life_s: float = 600.0,
        timeout_s: float = 0.25,
        password: str | None = None,
        ssl_ca_certs: str | None = None,
        batch: int = 1000,
        max_hot: int = MAX_HOT,
    ) -> None:
        super().__init__(namespace, half_life_s, max_hot)
        kwargs: dict = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        if password is not None:
            kwargs["password"] = password
        if ssl_ca_certs is not None:
            kwargs["ssl_ca_certs"] = ssl_ca_certs
        # Count round trips on our own connections: one per send (a pipeline or script is one).
        base = redis.SSLConnection if url.startswith("rediss://") else redis.Connection
        counter = self._sent = [0]

        class _Counting(base):  # type: ignore[misc, valid-type]
            def send_packed_command(self, command, check_health=True):
                counter[0] += 1
                return super().send_packed_command(command, check_health)

        kwargs["connection_class"] = _Counting
        self._r = redis.Redis.from_url(url, **kwargs)
        self._p = f"tide:{namespace}:"
        self._batch = batch
        self._longest = self._r.register_script(_LONGEST_PREFIX)
        self._hits = self._r.register_script(_RECORD_HITS)
        self._hot = self._r.register_script(_HOT_UNITS)
        self._dead = self._r.register_script(_COLLECT_DEAD)

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as e:
            raise DirectoryUnavailable(f"redis: {e}") from e

    def register(self, node_id: str, keys: Sequence[bytes], tier: str = "ssd") -> None:
        self._check_tier(tier)
        hexes = [k.hex() for k in keys]

        def run() -> None:
            pipe = self._r.pipeline(transaction=False)
            pipe.sadd(self._p + "nodes", node_id)
            pipe.set(self._p + "epoch", uuid.uuid4().hex, nx=True)
            for i in range(0, len(hexes), self._batch):
                chunk = hexes[i : i + self._batch]
                for h in chunk:
                    pipe.hset(self._p + "u:" + h, node_id, tier)
                pipe.sadd(self._p + "n:" + node_id, *chunk)
            pipe.execute()

        if hexes:
            self._call(run)

    def unregister(self, node_id: str, keys: Sequence[bytes]) -> None:
        hexes = [k.hex() for k in keys]

        def run() -> None:
            pipe = self._r.pipeline(transaction=False)
            for h in hexes:
                pipe.hdel(self._p + "u:" + h, node_id)
            pipe.srem(self._p + "n:" + node_id, *hexes)
            pipe.execute()

        if hexes:
            self._call(run)

    def longest_prefix(self, keys: Sequence[bytes]) -> PrefixMatch:
        if not keys:
            return PrefixMatch([])
        flat = self._call(self._longest, args=[self._p, *(k.hex() for k in keys)])
        holders: list[list[Holder]] = []
        for j in range(0, len(flat), 2):
            pairs = (item.split("=", 1) for item in flat[j + 1].decode().split(","))
            same = [Holder(node, tier) for node, tier in pairs]
            holders.extend([same] * int(flat[j]))  # the runs share one (read-only) list
        return PrefixMatch(holders)

    def heartbeat(self, node_id: str, address: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")

        def run() -> None:
            pipe = self._r.pipeline(transaction=False)
            pipe.set(self._p + "alive:" + node_id, address, px=max(1, int(ttl_s * 1000)))
            pipe.sadd(self._p + "nodes", node_id)
            pipe.execute()

        self._call(run)

    def live_nodes(self) -> dict[str, str]:
        def run() -> dict[str, str]:
            nodes = sorted(n.decode() for n in self._r.smembers(self._p + "nodes"))
            if not nodes:
                return {}
            addrs = self._r.mget([self._p + "alive:" + n for n in nodes])
            return {n: a.decode() for n, a in zip(nodes, addrs, strict=True) if a is not None}

        return self._call(run)

    def node_keys(self, node_id: str) -> set[bytes]:
        members = self._call(self._r.smembers, self._p + "n:" + node_id)
        return {bytes.fromhex(m.decode()) for m in members}

    def collect_dead(self) -> list[str]:
        return [n.decode() for n in self._call(self._dead, args=[self._p])]

    def record_hits(self, keys: Sequence[bytes], now_s: float) -> None:
        if keys:
            self._call(self._hits, args=[self._p, repr(now_s / self.half_life_s), self.max_hot,
                                         *(k.hex() for k in keys)])

    def hot_units(self, limit: int, max_replicas: int, now_s: float) -> list[HotUnit]:
        rows = self._call(self._hot, args=[self._p, limit, max_replicas, max(limit * 20, 100)])
        out = []
        for key, score, live in rows:
            decayed = 2.0 ** (float(score) - now_s / self.half_life_s)
            nodes = sorted(n.decode() for n in live)
            out.append(HotUnit(bytes.fromhex(key.decode()), decayed, len(nodes), nodes))
        return out

    def epoch(self) -> str:
        def run() -> str:
            self._r.set(self._p + "epoch", uuid.uuid4().hex, nx=True)
            return self._r.get(self._p + "epoch").decode()

        return self._call(run)

    def server_stats(self) -> dict[str, int]:
        """Redis's own counters (benchmarks): ``used_memory``, and the calls and microseconds of
        the Lua scripts it has run (``INFO commandstats``: EVALSHA and EVAL)."""
        def run() -> dict[str, int]:
            memory = self._r.info("memory")["used_memory"]
            stats = self._r.info("commandstats")
            rows = [stats.get(f"cmdstat_{c}", {}) for c in ("evalsha", "eval")]
            return {"used_memory": memory, "script_calls": sum(r.get("calls", 0) for r in rows),
                    "script_usec": sum(r.get("usec", 0) for r in rows)}

        return self._call(run)

    def round_trips(self) -> int:
        """Requests this client has sent to Redis (a pipeline or a script counts once)."""
        return self._sent[0]

    def close(self) -> None:
        self._r.close()
