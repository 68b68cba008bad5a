"""Redis directory (``redis://`` / ``rediss://``).

Key layout, all under ``tide:{namespace}:`` (several models and tenants share one Redis):

==========================  ======  ==========================================================
key                         type    content
==========================  ======  ==========================================================
``epoch``                   string  random id set on first use; a restarted-empty Redis has a new one
``u:{unit hex}``            hash    node id -> tier (``ram``/``ssd``) of every holder
``n:{node id}``             set     unit hex keys registered by the node (cleanup, re-registration)
``alive:{node id}``         string  the node's address, expiring after the heartbeat TTL
``expiry``                  hash    node id -> when its heartbeat ends (ms, Redis's clock)
``nodes``                   set     node ids that ever registered (small; for ``collect_dead``)
``hot``                     zset    unit hex -> log2 of the time-scaled hit mass (see below);
                                    the hottest ``max_hot`` units
==========================  ======  ==========================================================

Hotness: a hit at time t adds ``2^(t/h)`` (h = half-life) to a unit's mass; storing ``log2`` of
the mass keeps it finite and the ordering of the ZSET equals the ordering by decayed count at any
time. The decayed count now is ``2^(score - now/h)``.

A lookup reads O(log n) of a chain's units in O(log n) rounds (``bisect_runs``), each round one
pipeline of plain ``HGETALL``s (the first also reads ``expiry`` and ``TIME``): a Lua script would
take each unit key as an argument, which alone costs Redis more CPU than the reads. Every other
request-path call is one round trip; no SCAN anywhere. Any connection failure or timeout raises
``DirectoryUnavailable``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence

import redis

from cachedir.directory.base import (
    MAX_HOT,
    Directory,
    DirectoryUnavailable,
    Holder,
    HotUnit,
    PrefixMatch,
    bisect_runs,
)

__all__ = ["RedisDirectory"]

# A heartbeat: the node's address (expiring) and its expiry in Redis's own clock (lookups read
# every node's expiry with one HGETALL and compare it with TIME: no clock of another machine).
_HEARTBEAT = """
local p, node, address, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local t = redis.call('TIME')
redis.call('HSET', p .. 'expiry', node, t[1] * 1000 + math.floor(t[2] / 1000) + ttl)
redis.call('SET', p .. 'alive:' .. node, address, 'PX', ttl)
redis.call('SADD', p .. 'nodes', node)
return 1
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
    redis.call('HDEL', p .. 'expiry', node)
    dead[#dead + 1] = node
  end
end
return dead
"""


def _pairs(reply) -> Iterable[tuple[bytes, bytes]]:
    """A raw HGETALL reply's (field, value) pairs: a map under RESP3, a flat list under RESP2."""
    return reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)


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
        self._beat = self._r.register_script(_HEARTBEAT)
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
        live: set[bytes] | None = None

        def probe(indices: list[int]) -> list[str]:
            nonlocal live
            commands = [("HGETALL", self._p + "u:" + keys[i].hex()) for i in indices]
            if live is None:  # the first round also reads whose heartbeat lasts, by Redis's clock
                commands += [("HGETALL", self._p + "expiry"), ("TIME",)]
            replies = self._raw(commands)
            if live is None:
                expiry, (sec, usec) = replies[-2], replies[-1]
                now_ms = int(sec) * 1000 + int(usec) // 1000
                live = {node for node, until in _pairs(expiry) if int(until) > now_ms}
            return [",".join(sorted(n.decode() + "=" + t.decode() for n, t in _pairs(h) if n in live))
                    for h in replies[: len(indices)]]

        runs = self._call(bisect_runs, len(keys), probe)
        holders: list[list[Holder]] = []
        for count, held in runs:
            same = [Holder(*item.split("=", 1)) for item in held.split(",")]
            holders.extend([same] * count)  # the runs share one (read-only) list
        return PrefixMatch(holders)

    def _raw(self, commands: list[tuple]) -> list:
        """Send ``commands`` as one pipeline and return their raw replies (no per-command
        response callbacks: a lookup's few dozen replies cost the client a fraction of a
        ``Pipeline``'s time)."""
        conn = self._r.connection_pool.get_connection("PIPELINE")
        try:
            conn.send_packed_command(conn.pack_commands(commands))
            replies = [conn.read_response() for _ in commands]
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._r.connection_pool.release(conn)
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise reply
        return replies

    def heartbeat(self, node_id: str, address: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")

        self._call(self._beat, args=[self._p, node_id, address, max(1, int(ttl_s * 1000))])

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
        """Redis's own counters (benchmarks): ``used_memory``; the microseconds its commands
        took, INFO's own excepted (``INFO commandstats``); and its main thread's CPU time, which
        also counts reading requests and writing replies (``INFO cpu``)."""
        def run() -> dict[str, int]:
            memory = self._r.info("memory")["used_memory"]
            stats = self._r.info("commandstats")
            usec = sum(row.get("usec", 0) for name, row in stats.items() if name != "cmdstat_info")
            cpu = self._r.info("cpu")
            main = cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"]) + cpu.get(
                "used_cpu_sys_main_thread", cpu["used_cpu_sys"])
            return {"used_memory": memory, "command_usec": usec, "cpu_usec": int(main * 1e6)}

        return self._call(run)

    def ping(self) -> None:
        """One empty round trip (benchmarks: what Redis spends on a request that does nothing)."""
        self._call(self._r.ping)

    def round_trips(self) -> int:
        """Requests this client has sent to Redis (a pipeline or a script counts once)."""
        return self._sent[0]

    def close(self) -> None:
        self._r.close()
