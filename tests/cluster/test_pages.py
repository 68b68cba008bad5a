"""Page allocation and the prefix table under random operation sequences, against a model of
reference counts: no leaked page, no double free, match/evict as specified."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from cluster.pages import PageAllocator, PrefixTable


def test_allocation_is_all_or_nothing_and_release_returns_pages():
    pages = PageAllocator(4)
    a = pages.allocate(3)
    assert len(set(a)) == 3 and pages.num_free == 1
    assert pages.allocate(2) is None and pages.num_free == 1  # nothing taken
    pages.release(a)
    assert pages.num_free == 4
    with pytest.raises(AssertionError, match="double free"):
        pages.release(a[:1])
    with pytest.raises(AssertionError, match="incref of free page"):
        pages.incref(a[:1])
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_refcounts_equal_to_a_model(seed):
    rng = random.Random(seed)
    n = 64
    alloc = PageAllocator(n)
    table = PrefixTable(alloc)
    refs = [0] * n  # the model
    owned: list[list[int]] = []  # page lists held by "sequences"
    entries: OrderedDict[bytes, list[int]] = OrderedDict()  # the table, as the model sees it
    for step in range(2000):
        op = rng.choice(["alloc", "alloc", "release", "share", "insert", "match", "evict"])
        if op == "alloc":
            k = rng.randint(1, 6)
            got = alloc.allocate(k)
            if sum(r == 0 for r in refs) < k:
                assert got is None
            else:
                assert got is not None and len(got) == k and all(refs[p] == 0 for p in got)
                for p in got:
                    refs[p] = 1
                owned.append(got)
        elif op == "release" and owned:
            pages = owned.pop(rng.randrange(len(owned)))
            alloc.release(pages)
            for p in pages:
                refs[p] -= 1
        elif op == "share" and owned:  # a sequence reuses another's pages
            pages = rng.choice(owned)
            alloc.incref(pages)
            for p in pages:
                refs[p] += 1
            owned.append(list(pages))
        elif op == "insert" and owned:
            key = bytes([rng.randrange(16)])
            pages = rng.choice(owned)
            table.insert(key, pages)
            if key in entries:
                entries.move_to_end(key)
            else:
                entries[key] = pages
                for p in pages:
                    refs[p] += 1
        elif op == "match":
            keys = [bytes([rng.randrange(16)]) for _ in range(rng.randint(1, 4))]
            want = []
            for k in keys:
                if k not in entries:
                    break
                entries.move_to_end(k)
                want.append(entries[k])
            assert table.match(keys) == want
        elif op == "evict":
            need = rng.randint(0, n)
            table.evict(need)
            while sum(r == 0 for r in refs) < need and entries:  # least recently used first
                _, pages = entries.popitem(last=False)
                for p in pages:
                    refs[p] -= 1
        alloc.check_integrity()
        assert [alloc.refcount(p) for p in range(n)] == refs, step
        assert alloc.num_free == refs.count(0) and len(table) == len(entries)
        assert sorted(map(tuple, table.entries())) == sorted(map(tuple, entries.values()))
