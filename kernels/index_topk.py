"""The lightning indexer's top-k at decode (DeepSeek-V3.2, V4's CSA): Triton scores, C++ on the CPU,
and the torch reference.

Legend: B rows, G indexer heads, I head dim, S candidate keys per row, k kept, N key slots.

Each row's candidates are slots of a key plane (a paged pool's: V3.2's indexer keys per token, or
V4's compressed indexer keys), the first ``lens[b]`` of them real. A candidate's score is

    score[b, s] = sum_g w[b, g] * relu(scale * q[b, g] . keys[slots[b, s]])

and a row keeps its k best, ties at the k-th score broken towards the earlier candidate (a row's
choice must not depend on the batch it is padded in). Returns the kept candidates' indices
[B, k] in 0..S-1, ascending, -1 where a row has fewer than k. Candidates past ``lens`` may hold
anything (the tests fill their slots with NaN); slots must index ``keys`` where they are real.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cpu_gemv import cpu_kernels

__all__ = ["index_topk", "kept_indices", "ref_index_topk", "top_k_earliest", "triton_index_scores"]


def top_k_earliest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, S] -> bool [T, S]: each row's k best, ties at the k-th score broken towards earlier
    positions (``torch.topk`` breaks them by its own order, which changes with the row's length)."""
    k = min(k, scores.shape[-1])
    if k == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    threshold = scores.topk(k, dim=-1).values[:, -1:]  # [T, 1]
    above = scores > threshold
    tied = scores == threshold
    room = k - above.sum(dim=-1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=-1) <= room))


def kept_indices(keep: torch.Tensor, k: int) -> torch.Tensor:
    """bool [B, S] with at most k per row -> their indices [B, k] ascending, -1 after."""
    s = keep.shape[1]
    pos = torch.arange(s, device=keep.device).expand_as(keep)
    ranked = torch.where(keep, pos, s + pos).topk(min(k, s), dim=-1, largest=False).values  # kept first, in order
    out = torch.where(ranked < s, ranked, torch.full_like(ranked, -1))
    if out.shape[1] < k:
        out = torch.cat((out, out.new_full((out.shape[0], k - out.shape[1]), -1)), dim=1)
    return out


def _select(scores: torch.Tensor, lens: torch.Tensor, k: int) -> torch.Tensor:
    real = torch.arange(scores.shape[1], device=scores.device)[None, :] < lens[:, None]
    scores = scores.masked_fill(~real, float("-inf"))
    return kept_indices(top_k_earliest(scores, k) & real, k)


def ref_index_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                   k: int, scale: float) -> torch.Tensor:
    """q [B, G, I], w [B, G], keys [N, I], slots [B, S] int64, lens [B] int64 -> [B, k] int64."""
    cand = keys.index_select(0, slots.clamp(0, keys.shape[0] - 1).reshape(-1)).view(*slots.shape, -1).float()
    s = torch.einsum("bgi,bsi->bgs", q.float(), cand).mul_(scale).relu_()
    scores = torch.einsum("bg,bgs->bs", w.float(), s)
    return _select(torch.nan_to_num(scores, nan=float("-inf")), lens.to(scores.device), k)


@triton.jit
def _index_scores(q, w, keys, slots, lens, out, scale, G, S, stride_qb, stride_qg, stride_wb, stride_k,
                  stride_sb, stride_ob, DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr):
    b = tl.program_id(0)
    sblock = tl.program_id(1)
    offs_s = sblock * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_i = tl.arange(0, BLOCK_I)
    n = tl.load(lens + b)
    real = offs_s < n
    slot = tl.load(slots + b * stride_sb + offs_s, mask=real, other=0)
    key = tl.load(keys + slot[:, None] * stride_k + offs_i[None, :],
                  mask=real[:, None] & (offs_i[None, :] < DIM), other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_I]
    acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    for g in range(0, G):
        qg = tl.load(q + b * stride_qb + g * stride_qg + offs_i, mask=offs_i < DIM, other=0.0).to(tl.float32)
        d = tl.sum(key * qg[None, :], axis=1) * scale
        acc += tl.load(w + b * stride_wb + g).to(tl.float32) * tl.maximum(d, 0.0)
    tl.store(out + b * stride_ob + offs_s, tl.where(real, acc, float("-inf")), mask=offs_s < S)


def triton_index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                        lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The candidates' scores [B, S] fp32 (-inf past ``lens``), keys read in place."""
    b, g, i = q.shape
    s = slots.shape[1]
    if keys.shape[1] != i or w.shape != (b, g) or slots.shape[0] != b or lens.shape != (b,):
        raise ValueError(f"shapes q {tuple(q.shape)}, w {tuple(w.shape)}, keys {tuple(keys.shape)}, "
                         f"slots {tuple(slots.shape)}, lens {tuple(lens.shape)} do not agree")
    q, w, slots, lens = q.contiguous(), w.contiguous(), slots.contiguous(), lens.contiguous()
    if keys.stride(1) != 1:
        raise ValueError("keys must be row-major (stride 1 along I)")
    out = torch.empty(b, s, device=q.device, dtype=torch.float32)
    block_s = 32
    _index_scores[(b, triton.cdiv(s, block_s))](
        q, w, keys, slots, lens, out, scale, g, s, q.stride(0), q.stride(1), w.stride(0), keys.stride(0),
        slots.stride(0), out.stride(0), DIM=i, BLOCK_S=block_s, BLOCK_I=triton.next_power_of_2(i))
    return out


def index_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
               k: int, scale: float, impl: str = "ref") -> torch.Tensor:
    """``ref_index_topk``'s contract: Triton's scores on a GPU (``impl="triton"``), the C++
    kernel for float32 CPU tensors, else the reference."""
    if impl == "triton":
        return _select(triton_index_scores(q, w, keys, slots, lens, scale), lens, k)
    mod = cpu_kernels() if q.device.type == "cpu" else None
    if mod is not None and q.dtype == w.dtype == keys.dtype == torch.float32:
        return mod.index_topk(q, w, keys, slots, lens, k, scale)
    return ref_index_topk(q, w, keys, slots, lens, k, scale)
