"""MLA decode attention in the absorbed form over the paged latent cache (Triton + reference).

Legend: B sequences, H query heads, R ``kv_lora_rank``, P rope dims, D = R + P latent values per
token, Z page size, X pages per block table row, S context length, C context splits.

Each decode query has already folded ``W_UK`` into its no-RoPE part (``q_lat = q_nope @ W_UK``,
[B, H, R]); every head then attends over the same cached latents ``[c_kv (R), k_rope (P)]``:

    score[b, h, s] = (q_lat[b, h] . c_kv[s] + q_rope[b, h] . k_rope[s]) * scale
    out[b, h]      = softmax_s(score) @ c_kv            # [R], still in latent space

``W_UV`` is applied by the caller. Token ``s`` of sequence ``b`` lives in slot
``block_table[b, s // Z] * Z + s % Z`` of ``kv`` [slots, D]; only ``s < seq_lens[b]`` is read,
so unused pages and table entries may hold anything (the tests fill them with NaN).

Long contexts are split into C chunks handled by separate programs (split-K, as in flash-decoding):
each writes a partial output normalised by its own softmax sum plus its log-sum-exp, and a second
kernel merges the C partials.

Programs run head block fastest: the head blocks of one (sequence, chunk) run side by side and
read the same latents, so a chunk comes from DRAM about once and from L2 for the other head
blocks. The tile shapes are tuned on the device at the first call per (H, R, P, Z) from
``MLA_CONFIGS`` (``tests/kernels/test_hopper_compile.py`` compiles every one for Hopper and checks
that none spills registers). At 128 heads (DeepSeek-V3) a token's 1,152 bytes feed ~280k FLOPs,
so the kernel is bound by the tensor cores about as much as by memory.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import TunedByShape, shape_class, triton_interpreted, tuned_configs, with_config

__all__ = ["MLA_CONFIGS", "mla_decode", "ref_mla_decode"]

# Tile shapes (heads x context tokens per step) tried on the device; tl.dot needs every tile
# dimension >= 16 (``kernels.tuned_configs``: the interpreter takes the first). Each compiles for Hopper without spilling
# registers (tests/kernels/test_hopper_compile.py). 64 heads x 16 tokens with 8 warps is the one
# 64-head tile that fits (Hopper's warpgroup MMA needs 64 rows; 32 tokens spill).
MLA_CONFIGS = [
    triton.Config({"BLOCK_H": bh, "BLOCK_N": bn}, num_warps=w, num_stages=st)
    for bh, bn, w, st in [(16, 32, 4, 2), (16, 16, 4, 2), (16, 64, 8, 2), (32, 16, 4, 2),
                          (32, 32, 8, 2), (32, 64, 8, 2), (64, 16, 8, 2)]
]
# A chunk is a whole number of the largest BLOCK_N.
_CHUNK_ALIGN = 64


@triton.jit
def _mla_decode_split(
    q_lat, q_rope, kv, block_table, seq_lens, part_out, part_lse,
    scale, num_heads, split_len,
    stride_qb, stride_qh, stride_rb, stride_rh, stride_kv, stride_bt,
    stride_pb, stride_ph, stride_ps,
    R: tl.constexpr, P: tl.constexpr, Z: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    UPCAST: tl.constexpr,
):
    h0 = tl.program_id(0) * BLOCK_H
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    heads = h0 + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    head_ok = heads < num_heads
    ql = tl.load(q_lat + b * stride_qb + heads[:, None] * stride_qh + r[None, :],
                 mask=head_ok[:, None] & (r[None, :] < R), other=0.0)  # [BH, BR]
    qr = tl.load(q_rope + b * stride_rb + heads[:, None] * stride_rh + p[None, :],
                 mask=head_ok[:, None] & (p[None, :] < P), other=0.0)  # [BH, BP]
    if UPCAST:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        page = tl.load(block_table + b * stride_bt + pos // Z, mask=ok, other=0)
        slot = page.to(tl.int64) * Z + pos % Z
        c = tl.load(kv + slot[:, None] * stride_kv + r[None, :],
                    mask=ok[:, None] & (r[None, :] < R), other=0.0)  # [BN, BR]
        k = tl.load(kv + slot[:, None] * stride_kv + R + p[None, :],
                    mask=ok[:, None] & (p[None, :] < P), other=0.0)  # [BN, BP]
        if UPCAST:
            c = c.to(tl.float32)
            k = k.to(tl.float32)
        # "ieee": fp32 inputs stay fp32 on GPUs (Triton's default there is tf32); no effect on bf16.
        s = tl.dot(ql, tl.trans(c), input_precision="ieee")
        s = tl.dot(qr, tl.trans(k), s, input_precision="ieee")  # [BH, BN]
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(s - m_new[:, None])  # [BH, BN]
        l_i = l_i * alpha + tl.sum(w, axis=1)
        acc = tl.dot(w.to(c.dtype), c, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new

    # An empty split (its chunk lies past the sequence end: block tables as wide as the longest
    # context, a fixed-shape step's) writes only lse = -inf; the merge does not read its output.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    base = b * stride_pb + split * stride_ps
    tl.store(part_out + base + heads[:, None] * stride_ph + r[None, :], out,
             mask=head_ok[:, None] & ~empty[:, None] & (r[None, :] < R))
    tl.store(part_lse + (b * num_heads + heads) * tl.num_programs(2) + split, lse, mask=head_ok)


@triton.jit
def _mla_decode_merge(
    part_out, part_lse, out, num_heads, num_splits,
    stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The splits' partial outputs weighted by their softmax mass, BLOCK_C splits at a time (a
    running maximum, as flash attention does): registers stay [BLOCK_C, BLOCK_R] whatever the
    split count."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    m = tl.full((), float("-inf"), tl.float32)
    denom = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, num_splits, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        lse = tl.load(part_lse + (b * num_heads + h) * num_splits + c, mask=c < num_splits,
                      other=float("-inf"))  # [BC]
        # split 0 always holds a token, so from the first chunk on the maximum is finite
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        w = tl.exp(lse - m_new)  # empty splits: exp(-inf) = 0
        filled = (c < num_splits) & (lse > float("-inf"))
        parts = tl.load(part_out + b * stride_pb + h * stride_ph + c[:, None] * stride_ps + r[None, :],
                        mask=filled[:, None] & (r[None, :] < R), other=0.0)  # [BC, BR]
        alpha = tl.exp(m - m_new)
        acc = acc * alpha + tl.sum(parts * w[:, None], axis=0)
        denom = denom * alpha + tl.sum(tl.where(filled, w, 0.0), axis=0)
        m = m_new
    tl.store(out + b * stride_ob + h * stride_oh + r, (acc / denom).to(out.dtype.element_ty), mask=r < R)


# the split kernel's tiles are tuned per class of batch and of context (block table width x page):
# one long sequence (batch 1, 128K) wants other tiles than a batch of 64 short ones
BATCH_CLASSES = (1, 8, 32, 128, 512)
CONTEXT_CLASSES = (1024, 4096, 16384, 65536, 262144)
MLA_SPLIT = TunedByShape(_mla_decode_split, tuned_configs(MLA_CONFIGS), key=["num_heads", "R", "P", "Z"])
MERGE_SPLITS = 16  # splits the merge weighs at a time (its tiles do not grow with the split count)


def mla_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    num_splits: int | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """q_lat [B, H, R], q_rope [B, H, P], kv [slots, R+P], block_table [B, X] int32/int64,
    seq_lens [B] (each >= 1, <= X*Z) -> out [B, H, R] in q's dtype. ``num_splits`` None picks
    enough context splits to fill the device; ``config`` (one of ``MLA_CONFIGS``) fixes the
    tiles instead of tuning them."""
    b, h, r = q_lat.shape
    p = q_rope.shape[2]
    _check(q_lat, q_rope, kv, block_table, seq_lens, page_size)
    if kv.stride(1) != 1 or q_lat.stride(2) != 1 or q_rope.stride(2) != 1:
        raise ValueError("q_lat, q_rope and kv need a contiguous last dimension")
    out = torch.empty_like(q_lat)
    if b == 0:
        return out
    max_len = block_table.shape[1] * page_size
    if num_splits is None:
        # Enough (sequence, chunk) pairs for a few programs per SM, chunks of >= 256 tokens.
        sm = _sm_count(q_lat.device.index or 0) if q_lat.is_cuda else 4
        num_splits = max(1, min(triton.cdiv(max_len, 256), triton.cdiv(4 * sm, b * triton.cdiv(h, 64))))
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), _CHUNK_ALIGN) * _CHUNK_ALIGN
    num_splits = triton.cdiv(max_len, split_len)
    part_out = torch.empty(b, num_splits, h, r, device=q_lat.device, dtype=torch.float32)
    part_lse = torch.empty(b, h, num_splits, device=q_lat.device, dtype=torch.float32)
    block_r, block_p = max(16, triton.next_power_of_2(r)), max(16, triton.next_power_of_2(p))
    kernel, fixed = with_config(MLA_SPLIT((shape_class(b, BATCH_CLASSES), shape_class(max_len, CONTEXT_CLASSES))),
                                config)
    kernel[lambda meta: (triton.cdiv(h, meta["BLOCK_H"]), b, num_splits)](
        q_lat, q_rope, kv, block_table, seq_lens, part_out, part_lse,
        scale, h, split_len,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), kv.stride(0),
        block_table.stride(0), part_out.stride(0), part_out.stride(2), part_out.stride(1),
        R=r, P=p, Z=page_size, BLOCK_R=block_r, BLOCK_P=block_p,
        UPCAST=triton_interpreted() or kv.dtype == torch.float32, **fixed,
    )
    _mla_decode_merge[(b, h)](
        part_out, part_lse, out, h, num_splits,
        part_out.stride(0), part_out.stride(2), part_out.stride(1), out.stride(0), out.stride(1),
        R=r, BLOCK_R=block_r, BLOCK_C=MERGE_SPLITS,
    )
    return out


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def ref_mla_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    num_splits: int | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """Same contract as ``mla_decode`` in plain torch (fp32 math); ``num_splits`` and ``config``
    are ignored."""
    _check(q_lat, q_rope, kv, block_table, seq_lens, page_size)
    r = q_lat.shape[2]
    out = torch.empty_like(q_lat)
    for i in range(q_lat.shape[0]):
        n = int(seq_lens[i])
        pos = torch.arange(n, device=kv.device)
        slots = block_table[i].long()[pos // page_size] * page_size + pos % page_size
        lat = kv[slots].float()  # [S, D]
        s = q_lat[i].float() @ lat[:, :r].T + q_rope[i].float() @ lat[:, r:].T  # [H, S]
        out[i] = ((s * scale).softmax(-1) @ lat[:, :r]).to(out.dtype)  # [H, R]
    return out


def _check(q_lat, q_rope, kv, block_table, seq_lens, page_size) -> None:
    if q_lat.dim() != 3 or q_rope.dim() != 3 or q_lat.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_lat {tuple(q_lat.shape)} and q_rope {tuple(q_rope.shape)} must be [B, H, *]")
    b, _, r = q_lat.shape
    if kv.dim() != 2 or kv.shape[1] != r + q_rope.shape[2]:
        raise ValueError(f"kv {tuple(kv.shape)} must be [slots, R+P] = [*, {r + q_rope.shape[2]}]")
    if q_lat.dtype != kv.dtype or q_rope.dtype != kv.dtype:
        raise TypeError(f"dtypes differ: q_lat {q_lat.dtype}, q_rope {q_rope.dtype}, kv {kv.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table {tuple(block_table.shape)} {block_table.dtype} must be [B={b}, X] int")
    if seq_lens.shape != (b,):
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} must be [B={b}]")
    if page_size <= 0 or kv.shape[0] % page_size:
        raise ValueError(f"page_size {page_size} must divide the {kv.shape[0]} kv slots")
