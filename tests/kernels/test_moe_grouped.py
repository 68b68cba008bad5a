"""Grouped expert GEMM (Triton) against the per-expert torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_grouped import (
    GROUPED_CONFIGS,
    block_rows,
    moe_grouped_mlp,
    ref_moe_grouped_mlp,
    sort_rows_by_expert,
)
from tests.kernels.triton_cases import DEVICE, TOLERANCES


def _case(t, k, e, m, i, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, m, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(t, k, generator=gen)
    gate_up = (torch.randn(e, 2 * i, m, generator=gen) / m**0.5).to(dtype)
    down = (torch.randn(e, m, i, generator=gen) / i**0.5).to(dtype)
    return [v.to(DEVICE) for v in (x, ids, w, gate_up, down)]


@pytest.mark.parametrize(
    "t, k, e, m, i",
    [(1, 1, 1, 8, 4), (63, 3, 5, 60, 36), (5, 2, 16, 64, 32), (11, 6, 24, 100, 70), (40, 1, 3, 65, 129)],
)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES, ids=lambda v: str(v).replace("torch.", ""))
def test_matches_reference(t, k, e, m, i, dtype, atol, rtol):
    args = _case(t, k, e, m, i, dtype, seed=t + e)
    out = moe_grouped_mlp(*args)
    ref = ref_moe_grouped_mlp(*args)
    assert out.dtype == dtype and out.shape == (t, m)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol * 4, rtol=rtol * 4)


def test_no_tokens():
    args = _case(0, 2, 4, 8, 4, torch.float32, seed=0)
    assert moe_grouped_mlp(*args).shape == (0, 8)


def test_block_rows_follow_an_experts_average_share():
    assert block_rows(64 * 8, 256) == 16  # decode: 2 rows per expert
    assert block_rows(40, 1) == 64
    assert block_rows(4096 * 8, 32) == 128  # a prefill batch on one shard: 1,024 rows per expert
    assert block_rows(0, 8) == 16


def test_sort_rows_by_expert_pads_each_run():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # rows 0..5 -> experts 2,0,2,1,0,2
    rows, block_expert = sort_rows_by_expert(ids, num_experts=4, block_m=2)
    pad = ids.numel()
    blocks = rows.view(-1, 2).tolist()
    used = [(int(block_expert[b]), blocks[b]) for b in range(len(blocks)) if block_expert[b] >= 0]
    assert used == [(0, [1, 4]), (1, [3, pad]), (2, [0, 2]), (2, [5, pad])]
    assert (block_expert[len(used):] == -1).all()


def test_shape_errors_are_named():
    x, ids, w, gate_up, down = _case(3, 2, 4, 8, 4, torch.float32, seed=1)
    with pytest.raises(ValueError, match="weights"):
        moe_grouped_mlp(x, ids, w[:, :1], gate_up, down)
    with pytest.raises(ValueError, match="hidden size 8"):
        moe_grouped_mlp(x, ids, w, gate_up, down[:, :, :3])
    with pytest.raises(TypeError, match="dtypes differ"):
        moe_grouped_mlp(x.half(), ids, w, gate_up, down)


@pytest.mark.parametrize("config", GROUPED_CONFIGS, ids=lambda c: f"n{c.kwargs['BN']}k{c.kwargs['BK']}w{c.num_warps}")
@pytest.mark.parametrize("t", [3, 70])  # rows per block 16 and 64
def test_every_tuning_config_matches_reference(config, t):
    """The autotuner may pick any of ``GROUPED_CONFIGS`` on a device: each one computes the same."""
    dtype, atol, rtol = TOLERANCES[2] if DEVICE == "cuda" else TOLERANCES[0]
    args = _case(t, 2, 3, 150, 140, dtype, seed=t)  # widths past one tile of every config
    out = moe_grouped_mlp(*args, config=config)
    torch.testing.assert_close(out.float(), ref_moe_grouped_mlp(*args).float(), atol=atol * 4, rtol=rtol * 4)
