"""Gather/scatter between the paged latent KV pool and contiguous cache-unit buffers (Triton + ref).

Legend: L layers, Z page size, D latent values per token, U units, Q pages per unit (64 // Z for
64-token units), S slots of the pool (pages * Z).

A cache unit is a run of Q whole pages of one sequence. Persisting a unit gathers its pages from
the pool ``[L, S, D]`` into ``[L, Q*Z, D]`` (the unit file's payload order); loading scatters a
unit back into freshly allocated pages. One program copies one page of one layer of one unit,
so a batch of units is one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gather_units", "ref_gather_units", "ref_scatter_units", "scatter_units"]


@triton.jit
def _copy_pages(
    pool, units, unit_pages, stride_pl, stride_ps, stride_uu, stride_ul, stride_ut, stride_q,
    D, Z: tl.constexpr, BLOCK_D: tl.constexpr, TO_UNITS: tl.constexpr,
):
    # 64-bit offsets: a pool of a real model holds more than 2**31 values (61 layers x 262k slots
    # x 576), and so can a batch of units.
    u = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    q = tl.program_id(2)
    page = tl.load(unit_pages + u * stride_q + q).to(tl.int64)
    z = tl.arange(0, Z)
    pool_row = pool + layer * stride_pl + (page * Z + z)[:, None] * stride_ps
    unit_row = units + u * stride_uu + layer * stride_ul + (q * Z + z)[:, None] * stride_ut
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)[None, :]
        ok = d < D
        if TO_UNITS:
            tl.store(unit_row + d, tl.load(pool_row + d, mask=ok), mask=ok)
        else:
            tl.store(pool_row + d, tl.load(unit_row + d, mask=ok), mask=ok)


def gather_units(pool: torch.Tensor, unit_pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """pool [L, S, D], unit_pages [U, Q] int (page ids) -> units [U, L, Q*Z, D] (new tensor)."""
    _check(pool, unit_pages, page_size)
    u, q = unit_pages.shape
    units = torch.empty(u, pool.shape[0], q * page_size, pool.shape[2], dtype=pool.dtype, device=pool.device)
    _launch(pool, units, unit_pages, page_size, to_units=True)
    return units


def scatter_units(pool: torch.Tensor, unit_pages: torch.Tensor, units: torch.Tensor, page_size: int) -> None:
    """Write units [U, L, Q*Z, D] into ``pool`` [L, S, D] at ``unit_pages`` [U, Q] (in place)."""
    _check(pool, unit_pages, page_size)
    _check_units(pool, unit_pages, units, page_size)
    _launch(pool, units.contiguous(), unit_pages, page_size, to_units=False)


def _launch(pool, units, unit_pages, page_size, to_units: bool) -> None:
    u, q = unit_pages.shape
    if u == 0:
        return
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two for the Triton kernel, got {page_size}")
    unit_pages = unit_pages.contiguous()
    d = pool.shape[2]
    _copy_pages[(u, pool.shape[0], q)](
        pool, units, unit_pages, pool.stride(0), pool.stride(1),
        units.stride(0), units.stride(1), units.stride(2), unit_pages.stride(0),
        d, Z=page_size, BLOCK_D=min(256, triton.next_power_of_2(d)), TO_UNITS=to_units,
    )


def ref_gather_units(pool: torch.Tensor, unit_pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Same contract as ``gather_units`` in plain torch."""
    _check(pool, unit_pages, page_size)
    slots = _slots(unit_pages, page_size)  # [U, Q*Z]
    return pool[:, slots].transpose(0, 1).contiguous()  # [U, L, Q*Z, D]


def ref_scatter_units(pool: torch.Tensor, unit_pages: torch.Tensor, units: torch.Tensor, page_size: int) -> None:
    """Same contract as ``scatter_units`` in plain torch."""
    _check(pool, unit_pages, page_size)
    _check_units(pool, unit_pages, units, page_size)
    pool[:, _slots(unit_pages, page_size)] = units.transpose(0, 1).to(pool.dtype)


def _slots(unit_pages: torch.Tensor, page_size: int) -> torch.Tensor:
    z = torch.arange(page_size, device=unit_pages.device)
    return (unit_pages.long()[:, :, None] * page_size + z).flatten(1)  # [U, Q*Z]


def _check(pool, unit_pages, page_size) -> None:
    if pool.dim() != 3 or pool.stride(2) != 1:
        raise ValueError(f"pool must be [L, S, D] with a contiguous last dim, got {tuple(pool.shape)}")
    if page_size <= 0 or pool.shape[1] % page_size:
        raise ValueError(f"page_size {page_size} must divide the pool's {pool.shape[1]} slots")
    if unit_pages.dim() != 2 or unit_pages.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"unit_pages must be [U, Q] int, got {tuple(unit_pages.shape)} {unit_pages.dtype}")
    num_pages = pool.shape[1] // page_size
    if unit_pages.numel() and not 0 <= int(unit_pages.min()) <= int(unit_pages.max()) < num_pages:
        raise ValueError(f"unit_pages must lie in 0..{num_pages - 1}")


def _check_units(pool, unit_pages, units, page_size) -> None:
    u, q = unit_pages.shape
    want = (u, pool.shape[0], q * page_size, pool.shape[2])
    if tuple(units.shape) != want:
        raise ValueError(f"units {tuple(units.shape)} must be [U, L, Q*Z, D] = {want}")
    if units.dtype != pool.dtype:
        raise TypeError(f"units dtype {units.dtype} != pool dtype {pool.dtype}")
