"""The KV manager's block-table rows (``cluster/kv_manager.py``): running sequences take the
lowest free row, and a batch of consecutive rows reads its tables without a copy."""

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
    assert tables.shape == (3, 5) and tables.data_ptr() == kv._tables.data_ptr()  # rows 0-2: no copy
    assert tables[0, :3].tolist() == a.pages and tables[2].tolist() == c.pages
    gathered = kv.tables([c, a])  # rows out of order: gathered, the same values
    assert gathered.data_ptr() != kv._tables.data_ptr() and gathered[0].tolist() == c.pages
    for gone in (a, b):  # rows 0, then 1
        kv.free_row(gone)
        kv.release(gone)
    d = _running(kv, "d", 10)
    assert d.row == 0  # the lowest free row, not the last one freed
    kv.check_integrity([c, d], [c, d])
