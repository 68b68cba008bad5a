"""Top-K routing for the DeepSeek-V3 gate (``noaux_tc``), Triton + reference.

Legend: T tokens, E routed experts, G expert groups, F = E / G experts per group, K experts per
token, KG groups kept per token (``topk_group``).

From the gate logits [T, E]:

    scores  = sigmoid(logits)
    choice  = scores + bias                     # the bias steers the choice only
    group   = sum of the top-2 ``choice`` in each group; keep the KG best groups
    ids     = top-K of ``choice`` inside the kept groups
    weights = scores[ids] (normalised to sum 1 if ``norm``) * ``scaling``

Each program keeps the [tokens, G, F] score tile of a few tokens in registers and selects by repeated argmax
(K and KG are small), so no sort and no second pass over memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cpu_gemv import ref_moe_route

__all__ = ["moe_route_v3", "ref_moe_route_v3"]


@triton.jit
def _moe_route_v3(
    logits, bias, ids_out, w_out, num_tokens, stride_t, scaling,
    E: tl.constexpr, G: tl.constexpr, K: tl.constexpr, KG: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
):
    F: tl.constexpr = E // G
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t3 = t[:, None, None]
    g3 = tl.arange(0, BLOCK_G)[None, :, None]
    f3 = tl.arange(0, BLOCK_F)[None, None, :]
    ok = (t3 < num_tokens) & (g3 < G) & (f3 < F)
    e3 = g3 * F + f3  # [1, BG, BF] expert id of each cell
    x = tl.load(logits + t3 * stride_t + e3, mask=ok, other=0.0).to(tl.float32)  # [BT, BG, BF]
    scores = tl.sigmoid(x)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias + e3, mask=(g3 < G) & (f3 < F), other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))

    # Group score: the sum of the two best choices of the group (one when a group has one expert).
    group_score = tl.max(choice, axis=2)  # [BT, BG]
    if F > 1:
        first = tl.argmax(choice, axis=2)
        group_score += tl.max(tl.where(f3 == first[:, :, None], float("-inf"), choice), axis=2)
    g2 = tl.arange(0, BLOCK_G)[None, :]
    group_score = tl.where(g2 < G, group_score, float("-inf"))
    keep = g2 < 0
    for _ in tl.static_range(KG):
        top = tl.argmax(group_score, axis=1)[:, None]  # [BT, 1]
        keep = keep | (g2 == top)
        group_score = tl.where(g2 == top, float("-inf"), group_score)
    choice = tl.where(keep[:, :, None], choice, float("-inf"))

    k2 = tl.arange(0, BLOCK_K)[None, :]
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    ws = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for k in tl.static_range(K):
        row = tl.argmax(tl.max(choice, axis=2), axis=1)[:, None, None]  # group of the best left
        in_row = tl.where(g3 == row, choice, float("-inf"))
        col = tl.argmax(tl.max(in_row, axis=1), axis=1)[:, None, None]
        hit = (g3 == row) & (f3 == col)
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)  # [BT]
        ids = tl.where(k2 == k, (row * F + col).reshape(BLOCK_T, 1), ids)
        ws = tl.where(k2 == k, w[:, None], ws)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        ws = ws / (tl.sum(ws, axis=1)[:, None] + 1e-20)
    out_ok = (t[:, None] < num_tokens) & (k2 < K)
    tl.store(ids_out + t[:, None] * K + k2, ids, mask=out_ok)
    tl.store(w_out + t[:, None] * K + k2, ws * scaling, mask=out_ok)


def moe_route_v3(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_group: int,
    norm: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype), bias [E] or None -> (ids [T, K] int64, weights [T, K] fp32).

    The ids of a token come out best first."""
    _check(logits, bias, top_k, num_groups, topk_group)
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        block_g = triton.next_power_of_2(num_groups)
        block_f = triton.next_power_of_2(e // num_groups)
        block_t = max(1, min(16, 1024 // (block_g * block_f)))  # a few tokens per program
        _moe_route_v3[(triton.cdiv(t, block_t),)](
            logits, bias if bias is not None else logits, ids, weights, t, logits.stride(0), scaling,
            E=e, G=num_groups, K=top_k, KG=topk_group, BLOCK_T=block_t,
            BLOCK_G=block_g, BLOCK_F=block_f, BLOCK_K=triton.next_power_of_2(top_k),
            HAS_BIAS=bias is not None, NORM=norm and top_k > 1,
        )
    return ids.long(), weights


def ref_moe_route_v3(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_group: int,
    norm: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``moe_route_v3`` in plain torch (``kernels.cpu_gemv.ref_moe_route``)."""
    _check(logits, bias, top_k, num_groups, topk_group)
    return ref_moe_route(logits, bias, top_k, num_groups, topk_group, "noaux_tc", False, norm, scaling)


def _check(logits, bias, top_k, num_groups, topk_group) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got {tuple(logits.shape)}")
    e = logits.shape[1]
    if num_groups <= 0 or e % num_groups:
        raise ValueError(f"num_groups {num_groups} must divide the {e} experts")
    if not 0 < topk_group <= num_groups:
        raise ValueError(f"topk_group {topk_group} must be in 1..{num_groups}")
    if not 0 < top_k <= topk_group * (e // num_groups):
        raise ValueError(f"top_k {top_k} must be in 1..{topk_group * (e // num_groups)} (kept experts)")
    if bias is not None and bias.shape != (e,):
        raise ValueError(f"bias must be [E={e}], got {tuple(bias.shape)}")
