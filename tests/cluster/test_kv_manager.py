"""The KV manager's block-table rows (``cluster/kv_manager.py``, ``cluster/block_tables.py``):
running sequences take the lowest free row, a batch of consecutive rows reads its tables without
a copy, and the tables live on the engine's device, changed in place: a step moves the entries it
changed, not batch x context."""

from __future__ import annotations

from cluster.kv_manager import KVManager
from cluster.request import GenerationRequest, Sequence


def _running(kv: KVManager, name: str, tokens: int) -> Sequence:
    seq = Sequence(GenerationRequest(name, tuple(range(1, tokens + 1)), 4), [])
    assert kv.admit(seq, [], tokens)
    kv.claim_row(seq)
    return seq


def test_rows_stay_packed_and_consecutive_rows_are_a_view(model):
    kv = KVManager(model, num_pages=64, page_size=16, max_rows=4, unit_tokens=64)
    a, b, c = (_running(kv, n, t) for n, t in (("a", 40), ("b", 20), ("c", 70)))
    assert [s.row for s in (a, b, c)] == [0, 1, 2]
    tables = kv.tables([a, b, c])
    on_device = kv._tables.device_copy()
    assert tables.shape == (3, 5) and tables.data_ptr() == on_device.data_ptr()  # rows 0-2: no copy
    assert tables[0, :3].tolist() == a.pages and tables[2].tolist() == c.pages
    gathered = kv.tables([c, a])  # rows out of order: gathered, the same values
    assert gathered.data_ptr() != on_device.data_ptr() and gathered[0].tolist() == c.pages
    for gone in (a, b):  # rows 0, then 1
        kv.free_row(gone)
        kv.release(gone)
    d = _running(kv, "d", 10)
    assert d.row == 0  # the lowest free row, not the last one freed
    kv.check_integrity([c, d], [c, d])


def test_a_decode_step_moves_only_the_pages_it_added(model):
    """Long contexts, many steps: the entries moved to the device are exactly the pages added
    (claimed rows once, then a page per 16 tokens), never the rows' whole tables; the tables a
    pass reads are the device copy, equal to the sequences' pages."""
    kv = KVManager(model, num_pages=1024, page_size=16, max_rows=8, unit_tokens=64)
    seqs = [_running(kv, f"s{i}", 1500 + 37 * i) for i in range(6)]
    claimed = sum(len(s.pages) for s in seqs)
    tables = kv.tables(seqs)
    assert kv._tables.moved == claimed and tables.data_ptr() == kv._tables.device_copy().data_ptr()
    assert tables.data_ptr() != kv._tables.host.data_ptr()
    length = {s.req.request_id: len(s.req.prompt_ids) for s in seqs}
    for _ in range(100):  # decode steps: each sequence one token longer
        before, pages = kv._tables.moved, sum(len(s.pages) for s in seqs)
        for s in seqs:
            length[s.req.request_id] += 1
            assert kv.grow_to(s, length[s.req.request_id])
        tables = kv.tables(seqs)
        assert kv._tables.moved - before == sum(len(s.pages) for s in seqs) - pages  # at most a page a row
        for i, s in enumerate(seqs):
            assert tables[i, : len(s.pages)].tolist() == s.pages
    kv.check_integrity(seqs, seqs)
    assert kv._tables.moved < claimed + 100 * len(seqs) // 4  # vs 100 x 6 x ~100 entries copied whole
