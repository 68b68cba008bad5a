"""Shared inputs for the Triton kernel tests: dtypes with their tolerances, a poisoned paged pool."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (dtype, atol, rtol) for outputs of order 1.
TOLERANCES = [
    (torch.float32, 1e-4, 1e-4),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 2e-2, 2e-2),
]


def poisoned_paged_kv(
    lens: list[int], page_size: int, dim: int, dtype: torch.dtype, gen: torch.Generator, spare_pages: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool [slots, dim] where only the tokens of ``lens`` hold numbers and everything else is
    NaN, with ragged block tables [B, X] over shuffled pages; unused table entries point far
    outside the pool, so a stray read either fails or poisons the output."""
    pages_per_seq = [(n + page_size - 1) // page_size for n in lens]
    num_pages = sum(pages_per_seq) + spare_pages
    width = max(pages_per_seq) + 1
    kv = torch.full((num_pages * page_size, dim), float("nan"), dtype=dtype)
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lens), width), 1 << 30, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(lens):
        for j in range(pages_per_seq[b]):
            page = int(perm[taken])
            taken += 1
            table[b, j] = page
            used = min(page_size, n - j * page_size)
            kv[page * page_size : page * page_size + used] = torch.randn(used, dim, generator=gen).to(dtype)
    return kv.to(DEVICE), table.to(DEVICE)
