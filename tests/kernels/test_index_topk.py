"""The lightning indexer's decode top-k: Triton (interpreter here) and C++ against the torch
reference, over ragged, NaN-poisoned paged keys; ties go to the earlier candidate."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_gemv import cpu_kernels
from kernels.index_topk import index_topk, ref_index_topk, top_k_earliest
from model.kv_cache import slots_for
from tests.kernels.triton_cases import DEVICE, poisoned_paged_kv


def _case(lens: list[int], heads: int, dim: int, seed: int):
    """Queries, head weights and a paged key plane whose unused slots are NaN; each row's
    candidates are its first ``lens[b]`` tokens' slots (past them: slots of poison)."""
    gen = torch.Generator().manual_seed(seed)
    keys, table = poisoned_paged_kv(lens, 16, dim, torch.float32, gen)
    width = max(lens) + 3
    table = table.long().clamp(max=keys.shape[0] // 16 - 1)  # past a row's pages: pages of poison
    slots = slots_for(table, torch.arange(width, device=table.device).expand(len(lens), width).contiguous(), 16)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(DEVICE)
    w = torch.randn(len(lens), heads, generator=gen).to(DEVICE)
    return q, w, keys, slots.to(DEVICE), torch.tensor(lens, device=DEVICE)


@pytest.mark.parametrize("lens", [[1], [63], [5, 64, 0, 130], [200, 17]], ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize("k", [1, 16, 150])
def test_the_kernels_keep_the_references_keys(lens, k):
    q, w, keys, slots, n = _case(lens, heads=7, dim=60, seed=sum(lens) + k)  # odd heads and widths
    want = ref_index_topk(q, w, keys, slots, n, k, 0.3)
    assert want.shape == (len(lens), k)
    for b, length in enumerate(lens):  # the kept count, ascending, -1 after
        kept = want[b][want[b] >= 0]
        assert len(kept) == min(k, length) and torch.equal(kept, kept.sort().values)
    assert torch.equal(index_topk(q, w, keys, slots, n, k, 0.3, impl="triton"), want)
    if DEVICE == "cpu" and cpu_kernels() is not None:
        assert torch.equal(cpu_kernels().index_topk(q, w, keys, slots, n, k, 0.3), want)


def test_ties_go_to_the_earlier_candidate_in_every_implementation():
    """Identical keys score alike: the earliest are kept, however long the row is padded."""
    q, w, keys, slots, n = _case([40], heads=3, dim=8, seed=3)
    keys[slots[0, :40]] = keys[slots[0, 5]].clone()  # every candidate the same key
    for impl in ("ref", "triton") + (("cpu",) if DEVICE == "cpu" and cpu_kernels() is not None else ()):
        fn = (lambda *a: cpu_kernels().index_topk(*a)) if impl == "cpu" else \
            (lambda *a, impl=impl: index_topk(*a, impl=impl))
        assert fn(q, w, keys, slots, n, 6, 0.5).tolist() == [[0, 1, 2, 3, 4, 5]], impl
    scores = torch.tensor([[1.0, 0.0, 0.0, 0.0, 2.0] + [float("-inf")] * 30])
    assert top_k_earliest(scores, 3).nonzero()[:, 1].tolist() == [0, 1, 4]


def test_bad_shapes_are_refused():
    q, w, keys, slots, n = _case([10], heads=2, dim=8, seed=1)
    with pytest.raises(ValueError, match="do not agree"):
        index_topk(q, w[:, :1], keys, slots, n, 4, 1.0, impl="triton")
    if cpu_kernels() is not None and DEVICE == "cpu":
        with pytest.raises(RuntimeError, match="lens"):
            cpu_kernels().index_topk(q, w, keys, slots, torch.tensor([999]), 4, 1.0)
