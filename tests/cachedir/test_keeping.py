"""Keeping the cache through the night (``cachedir/keeping.py``): before nodes leave serving,
their units that no staying node holds move to the nodes that stay, hottest first, then the
others, within a byte budget, and the directory finds them there at once."""

from __future__ import annotations

import time

import pytest

from cachedir.directory.memory import MemoryDirectory
from cachedir.keeping import KeepBudget, keep_units
from tests.cachedir.test_agent import _agent, _store
from tests.cachedir.units import make_units

TOKENS = list(range(2000, 2000 + 64 * 6))


@pytest.fixture
def agents(tmp_path):
    """Two real agents on one directory, node A holding six units (none hit yet), B none."""
    d = MemoryDirectory("keeping-agents")
    a, b = _agent(tmp_path, "node-a", d), _agent(tmp_path, "node-b", d)
    units = make_units(TOKENS)
    _store(a, units)
    b.sync_once()  # b heartbeats
    yield d, a, b, units
    a.close()
    b.close()


def _fleet(held: dict[str, list[bytes]], hits: dict[bytes, int]) -> MemoryDirectory:
    d = MemoryDirectory("keeping")
    for node in ("a", "b", "c", "d"):
        d.heartbeat(node, f"{node}:1", 60)
    for node, keys in held.items():
        d.register(node, keys)
    now = time.time()
    for key, n in hits.items():
        for _ in range(n):
            d.record_hits([key], now)
    return d


def test_only_hot_units_that_only_leaving_nodes_hold_move_hottest_first_within_the_budget():
    k = [bytes([i]) * 16 for i in range(6)]
    # a leaves with c; b and d stay. k0 (hottest) and k1: only a. k2: a and b (kept anyway).
    # k3: a and c, both leaving: a pushes it (the smaller id). k4: c alone: c's to push. k5: cold.
    d = _fleet({"a": [k[0], k[1], k[2], k[3], k[5]], "b": [k[2]], "c": [k[3], k[4]]},
               {k[0]: 9, k[1]: 5, k[2]: 7, k[3]: 3, k[4]: 8, k[5]: 0})
    pushed: list[tuple[str, bytes]] = []

    def push(address: str, data: bytes) -> bool:
        pushed.append((address, data))
        return True

    out = keep_units("a", d, ["c"], lambda key: key * 4, push)  # a unit's bytes: 64 here
    assert [data[:16] for _, data in pushed] == [k[0], k[1], k[3], k[5]]  # hottest first, then the cold
    assert {address for address, _ in pushed} <= {"b:1", "d:1"}  # to the nodes that stay
    assert out == {"kept": 4, "bytes": 4 * 64, "over_budget": 0, "failed": 0, "held_elsewhere": 1}
    for key in (k[0], k[1], k[3], k[5]):  # the directory finds each copy at once, on a staying node
        assert {"b", "d"} & {h.node_id for h in d.longest_prefix([key]).holders[0]}
    pushed.clear()
    out = keep_units("c", d, ["a"], lambda key: key * 4, push)
    assert [data[:16] for _, data in pushed] == [k[4]]  # k3 is on a staying node now
    # without fill, the hot units alone
    d = _fleet({"a": [k[0], k[5]]}, {k[0]: 2})
    out = keep_units("a", d, [], lambda key: key * 4, lambda address, data: True, KeepBudget(fill=False))
    assert out["kept"] == 1
    assert keep_units("a", d, [], lambda key: key * 4, lambda address, data: True)["kept"] == 1  # then k5

    d = _fleet({"a": k[:3]}, dict.fromkeys(k[:3], 4))
    out = keep_units("a", d, [], lambda key: key * 4, lambda address, data: True, KeepBudget(max_bytes=2 * 64))
    assert (out["kept"], out["over_budget"]) == (2, 1)
    out = keep_units("a", d, [], lambda key: key * 4, lambda address, data: False)
    assert out["kept"] == 0 and out["failed"] == 1  # k2, the one left: refused, a miss in the morning


def test_a_leaving_agent_copies_its_hot_units_to_an_agent_that_stays(agents):
    d, a, b, units = agents
    d.record_hits([u.key for u in units[:4]], time.time())  # four hot, two cold
    assert b.cache.has([u.key for u in units]) == [""] * 6
    out = a.keep([a.node_id], KeepBudget(fill=False))
    assert out["kept"] == 4 and out["failed"] == 0
    b.cache.flush()
    assert b.cache.has([u.key for u in units]) == ["ssd"] * 4 + [""] * 2
    assert a.keep([a.node_id])["kept"] == 2  # with fill (the default): then the cold ones
    b.cache.flush()
    assert b.cache.has([u.key for u in units]) == ["ssd"] * 6
    got = b.read([u.key for u in units[:4]])
    assert [tier for tier, _ in got] == ["ssd"] * 4
    match = d.longest_prefix([u.key for u in units])
    assert match.num_units == 6 and all(b.node_id in {h.node_id for h in hs} for hs in match.holders[:4])


def test_a_node_coming_back_fetches_the_hot_units_it_lacks_then_the_rest_within_its_budget(agents):
    d, a, b, units = agents
    now = time.time()
    for j, u in enumerate(units[:4]):  # four hot, the first the hottest; two cold
        d.record_hits([u.key] * (4 - j), now)
    size = len(a.cache.read_encoded([units[0].key])[0][1])
    out = b.warm(KeepBudget(max_bytes=3 * size))
    assert (out["warmed"], out["over_budget"], out["failed"]) == (3, 1, 0)
    b.cache.flush()
    assert b.cache.has([u.key for u in units]) == ["ssd"] * 3 + [""] * 3  # the hottest three
    match = d.longest_prefix([u.key for u in units[:3]])
    assert all(b.node_id in {h.node_id for h in hs} for hs in match.holders)  # found there at once
    # later, with room: the fourth, then the two never hit; a node warms only what it lacks
    assert b.warm(KeepBudget(fill=False))["warmed"] == 1
    assert b.warm()["warmed"] == 2 and b.warm()["warmed"] == 0
    b.cache.flush()
    assert b.cache.has([u.key for u in units]) == ["ssd"] * 6
