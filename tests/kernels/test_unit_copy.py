"""Unit gather/scatter (Triton) against the torch reference; pages outside the units untouched."""

from __future__ import annotations

import pytest
import torch

from kernels.unit_copy import gather_units, ref_gather_units, ref_scatter_units, scatter_units
from tests.kernels.triton_cases import DEVICE, TOLERANCES


@pytest.mark.parametrize("page_size", [4, 16, 64])
@pytest.mark.parametrize("num_units", [1, 3])
@pytest.mark.parametrize("dtype", [d for d, _, _ in TOLERANCES], ids=lambda d: str(d).replace("torch.", ""))
def test_gather_and_scatter_match_reference(page_size, num_units, dtype):
    gen = torch.Generator().manual_seed(page_size * 10 + num_units)
    layers, dim, unit = 2, 60, 64
    q = unit // page_size
    num_pages = num_units * q + 5
    pool = torch.randn(layers, num_pages * page_size, dim, generator=gen).to(dtype).to(DEVICE)
    pages = torch.randperm(num_pages, generator=gen)[: num_units * q].view(num_units, q).int().to(DEVICE)
    assert torch.equal(gather_units(pool, pages, page_size), ref_gather_units(pool, pages, page_size))

    units = torch.randn(num_units, layers, unit, dim, generator=gen).to(dtype).to(DEVICE)
    ours, theirs = pool.clone(), pool.clone()
    scatter_units(ours, pages, units, page_size)
    ref_scatter_units(theirs, pages, units, page_size)
    assert torch.equal(ours, theirs)
    assert torch.equal(gather_units(ours, pages, page_size), units)


def test_bad_pages_and_shapes_are_named():
    pool = torch.zeros(2, 64, 8)
    with pytest.raises(ValueError, match=r"0\.\.3"):
        gather_units(pool, torch.tensor([[4]]), 16)
    with pytest.raises(ValueError, match="units"):
        scatter_units(pool, torch.tensor([[0, 1]]), torch.zeros(1, 2, 16, 8), 16)
    with pytest.raises(ValueError, match="page_size 48"):
        gather_units(pool, torch.tensor([[0]]), 48)
