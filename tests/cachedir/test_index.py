"""Eviction policies and the byte-bounded index under random operation sequences, against
brute-force models; ``check_integrity`` after every operation."""

from __future__ import annotations

import random

import pytest

from cachedir.eviction import LRU, LFUDecay, make_policy
from cachedir.index import CapacityIndex


def _key(i: int) -> bytes:
    return i.to_bytes(2, "big")


@pytest.mark.parametrize("seed", range(3))
def test_lru_evicts_the_least_recently_used(seed):
    rng, lru, last = random.Random(seed), LRU(), {}
    t = 0.0
    for _ in range(3000):
        t += rng.random()
        key = _key(rng.randrange(40))
        op = rng.choice(["use", "use", "remove", "victim", "expired"])
        if op == "use":
            (lru.touch if key in last else lru.insert)(key, t)
            last[key] = t
        elif op == "remove":
            lru.remove(key)
            last.pop(key, None)
        elif op == "victim":
            assert lru.victim() == (min(last, key=last.get) if last else None)
        else:
            age = rng.uniform(0, 20)
            assert lru.expired(t, age) == sorted((k for k, s in last.items() if t - s > age), key=last.get)
        assert len(lru) == len(last)


@pytest.mark.parametrize("seed", range(3))
def test_lfu_decay_evicts_the_lowest_decayed_count(seed):
    """The victim's count, decayed to now (halving per half-life of disuse), is the lowest."""
    rng, half_life = random.Random(seed), 10.0
    lfu, state = LFUDecay(half_life), {}  # the model: key -> (count at t0, t0)
    t = 0.0
    for _ in range(3000):
        t += rng.random()
        key = _key(rng.randrange(40))
        op = rng.choice(["use", "use", "use", "remove", "victim"])
        if op == "use":
            if key in state:
                c, t0 = state[key]
                state[key] = (c * 2 ** (-(t - t0) / half_life) + 1, t)
                lfu.touch(key, t)
            else:
                state[key] = (1.0, t)
                lfu.insert(key, t)
        elif op == "remove":
            lfu.remove(key)
            state.pop(key, None)
        elif state:
            now = {k: c * 2 ** (-(t - t0) / half_life) for k, (c, t0) in state.items()}
            victim = lfu.victim()
            assert now[victim] <= min(now.values()) * (1 + 1e-9)
        assert len(lfu) == len(state)
    with pytest.raises(ValueError, match="half_life_s"):
        LFUDecay(0)
    with pytest.raises(ValueError, match="supported: lfu, lru"):
        make_policy("fifo")


@pytest.mark.parametrize("seed", range(4))
def test_capacity_index_against_a_model(seed):
    """Bytes never exceed the capacity; evictions take the least recently used unpinned key;
    pinned keys are never evicted or expired; a key only pinned keys stand in front of, or
    one larger than the capacity, is not admitted."""
    rng, cap, max_age = random.Random(seed), 1000, 50.0
    index = CapacityIndex(cap, "lru", max_age_s=max_age)
    sizes, last, pinned = {}, {}, set()  # the model
    t = 0.0
    for step in range(3000):
        t += rng.random() * 2
        key = _key(rng.randrange(60))
        op = rng.choice(["add", "add", "add", "touch", "remove", "pin", "unpin"])
        if op == "add":
            n = rng.choice([1, 50, 120, 300, cap + 1])
            if key in sizes:
                evicted = index.add(key, n, t)
                assert evicted == []
                if key not in pinned:
                    last[key] = t
            else:
                evicted = index.add(key, n, t)
                want = []
                if n <= cap:
                    want = sorted((k for k in sizes if k not in pinned and t - last[k] > max_age), key=last.get)
                    for k in want:
                        del sizes[k], last[k]
                    while sum(sizes.values()) + n > cap:
                        free = [k for k in sizes if k not in pinned]
                        if not free:
                            break
                        victim = min(free, key=last.get)
                        del sizes[victim], last[victim]
                        want.append(victim)
                    if sum(sizes.values()) + n <= cap:
                        sizes[key], last[key] = n, t
                assert evicted == want, step
        elif op == "touch":
            index.touch(key, t)
            if key in sizes and key not in pinned:
                last[key] = t
        elif op == "remove":
            assert index.remove(key) == (key in sizes)
            sizes.pop(key, None)
            last.pop(key, None)
            pinned.discard(key)
        elif op == "pin":
            assert index.pin(key) == (key in sizes)
            if key in sizes:
                pinned.add(key)
        else:
            assert index.unpin(key, t) == (key in pinned)
            if key in pinned:
                pinned.discard(key)
                last[key] = t
        index.check_integrity()
        assert dict((k, index.size(k)) for k in index.keys()) == sizes and index.pinned == pinned, step
        assert index.bytes == sum(sizes.values()) <= cap
