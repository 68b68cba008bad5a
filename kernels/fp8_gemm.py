"""Block-scaled FP8 GEMMs (Triton + references): DeepSeek-V3's published weights, used as stored.

Legend: T rows (tokens), K input features, N output features, SN x SK the weight's scale block
(128 x 128 in DeepSeek's checkpoints), E experts, I expert intermediate size.

A weight is e4m3 ``q`` [N, K] with ``scale`` [ceil(N/SN), ceil(K/SK)] (the checkpoint's
``weight_scale_inv``: w = q * scale block by block). Activations are quantized on the fly per row
and SK-column block (``quantize_rows_fp8``: the block's absolute max maps to e4m3's largest value,
448). The product then sums, block by block along K, an FP8 tensor-core dot scaled by the row's
and the weight block's scales, accumulated in float32:

    y[t, n] = sum_kb (xq[t, kb] . q[n, kb]) * xs[t, kb] * scale[n // SN, kb]

so the depth tile is SK and the column tile any multiple of 16. ``fp8_linear`` is a dense
projection; ``moe_grouped_mlp_fp8`` is ``kernels.moe_grouped``'s grouped expert MLP with e4m3
weights (the intermediate ``h`` is quantized per row block like the input). Each has a ``ref_*``
twin of the same signature that quantizes the activations the same way and multiplies the
dequantized operands in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import TunedByShape, shape_class, tuned_configs, with_config
from kernels.moe_grouped import block_rows, sort_rows_by_expert

__all__ = [
    "FP8_CONFIGS", "FP8_DTYPE", "FP8_MAX", "GROUPED_FP8_BN", "dequantize_blocks", "fp8_linear", "grouped_fp8_launch",
    "moe_grouped_mlp_fp8",
    "quantize_blocks", "quantize_rows_fp8", "ref_fp8_linear", "ref_moe_grouped_mlp_fp8", "ref_quantize_rows_fp8",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
_TINY = 1e-12  # the scale of an all-zero block (its values stay 0)

# Row (BM) and column (BN) tiles of the dense kernel; the depth tile is the scale block (SK).
FP8_CONFIGS = [
    triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st)
    for bm, bn, w, st in [(64, 128, 4, 3), (16, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4)]
]
_TUNE = tuned_configs(FP8_CONFIGS)


# --- activations ----------------------------------------------------------------------------------

@triton.jit
def _quantize_rows(x, q, s, K, stride_x, stride_q, stride_s, SK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1)
    cols = kb * SK + tl.arange(0, SK)
    ok = cols < K
    v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12), 448.0)
    # round to e4m3's 3 mantissa bits (nearest, ties to even) on the float32 bits; the conversion
    # then meets only values it holds (Triton's interpreter rounds 124.3 to 64, not 128)
    bits = tl.math.div_rn(v, scale).to(tl.int32, bitcast=True)  # IEEE division, as torch divides
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    v = tl.clamp(bits.to(tl.float32, bitcast=True), -448.0, 448.0)
    tl.store(q + row * stride_q + cols, v.to(q.dtype.element_ty), mask=ok)
    tl.store(s + row * stride_s + kb, scale)


def quantize_rows_fp8(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, ceil(K/block)]): each row's ``block``-column
    runs scaled so that their absolute max is e4m3's largest value."""
    t, k = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()  # the kernel reads a row's columns as one run
    q = torch.empty(t, k, device=x.device, dtype=FP8_DTYPE)
    s = torch.empty(t, triton.cdiv(k, block), device=x.device, dtype=torch.float32)
    if t:
        _quantize_rows[(t, s.shape[1])](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), SK=block)
    return q, s


def ref_quantize_rows_fp8(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``quantize_rows_fp8``, in torch."""
    return quantize_blocks(x, (1, block))


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], float32 scales [..., ceil(N/bn), ceil(K/bk)]) per
    ``block`` (bn, bk): how DeepSeek's checkpoints store weights (the scales are their
    ``weight_scale_inv``), and with (1, bk) how activations are quantized."""
    bn, bk = block
    *lead, n, k = w.shape
    nb, kb = triton.cdiv(n, bn), triton.cdiv(k, bk)
    padded = torch.zeros(*lead, nb * bn, kb * bk, device=w.device, dtype=torch.float32)
    padded[..., :n, :k] = w.float()
    blocks = padded.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))  # [..., nb, bn, kb, bk]
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(_TINY) / FP8_MAX  # [..., nb, kb]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2).flatten(-3, -2)[..., :n, :k].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The inverse of ``quantize_blocks``: float32 [..., N, K]."""
    bn, bk = block
    n, k = q.shape[-2:]
    s = scale.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    return q.float() * s


# --- dense ---------------------------------------------------------------------------------------

@triton.jit
def _fp8_matmul(
    a, a_s, w, w_s, out, M, N, K,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    SN: tl.constexpr, SK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(K, SK)):
        kk = kb * SK + tl.arange(0, SK)
        k_ok = kk < K
        at = tl.load(a + rm[:, None] * stride_am + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w + rn[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        sa = tl.load(a_s + rm * stride_asm + kb, mask=m_ok, other=0.0)  # [BM]
        sw = tl.load(w_s + (rn // SN) * stride_wsn + kb, mask=n_ok, other=0.0)  # [BN]
        acc += tl.dot(at, wt) * sa[:, None] * sw[None, :]
    tl.store(out + rm[:, None] * stride_om + rn[None, :], acc.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# the dense GEMM's tiles are tuned per class of rows: decode steps (64 and fewer) apart from prefill
M_CLASSES = (16, 64, 256, 1024, 4096)
FP8_MATMUL = TunedByShape(_fp8_matmul, _TUNE, key=["N", "K"])


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
               config: triton.Config | None = None) -> torch.Tensor:
    """x [T, K] (any float dtype) times an e4m3 weight ``q`` [N, K] with block ``scale``
    [ceil(N/SN), ceil(K/SK)] -> [T, N] in x's dtype; x is quantized per row and SK columns.
    ``config`` (one of ``FP8_CONFIGS``) fixes the tiles instead of tuning them."""
    _check_weight(q, scale, block)
    sn, sk = block
    t, k = x.shape
    n = q.shape[0]
    if k != q.shape[1]:
        raise ValueError(f"x has {k} features, the weight {q.shape[1]}")
    out = torch.empty(t, n, device=x.device, dtype=x.dtype)
    if t == 0:
        return out
    xq, xs = quantize_rows_fp8(x, sk)
    kernel, fixed = with_config(FP8_MATMUL(shape_class(t, M_CLASSES)), config)
    kernel[lambda meta: (triton.cdiv(t, meta["BM"]), triton.cdiv(n, meta["BN"]))](
        xq, xs, q, scale, out, t, n, k, xq.stride(0), xs.stride(0), q.stride(0), scale.stride(0), out.stride(0),
        SN=sn, SK=sk, **fixed)
    return out


def ref_fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                   config: triton.Config | None = None) -> torch.Tensor:
    """Same contract as ``fp8_linear``: the quantized operands dequantized and multiplied in
    float32 (``config`` is ignored)."""
    _check_weight(q, scale, block)
    xq, xs = ref_quantize_rows_fp8(x, block[1])
    return (dequantize_blocks(xq, xs, (1, block[1])) @ dequantize_blocks(q, scale, block).T).to(x.dtype)


def _check_weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"an fp8 weight is {FP8_DTYPE}, not {q.dtype}")
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"scales of shape {tuple(scale.shape)} for a {list(q.shape)} weight in {block} blocks; "
                         f"expected {want}")
    if block[1] < 16 or block[1] & (block[1] - 1):
        raise ValueError(f"the scale block's columns ({block[1]}) must be a power of two >= 16 (a dot's depth)")


# --- grouped experts ------------------------------------------------------------------------------

@triton.jit
def _gate_up_silu_fp8(
    x, x_s, gate_up, gate_up_s, rows, block_expert, h, num_rows, HIDDEN, INTER,
    stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    TOPK: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    blk = tl.program_id(0)
    e = tl.load(block_expert + blk)
    if e < 0:
        return
    r = tl.load(rows + blk * BM + tl.arange(0, BM))  # [BM] flat (token, k) row ids, pads = num_rows
    ok = r < num_rows
    tok = tl.where(ok, r // TOPK, 0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < INTER
    w = gate_up + e.to(tl.int64) * stride_we
    ws = gate_up_s + e.to(tl.int64) * stride_se
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(HIDDEN, SK)):
        kk = kb * SK + tl.arange(0, SK)
        k_ok = kk < HIDDEN
        xt = tl.load(x + tok[:, None] * stride_x + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        sx = tl.load(x_s + tok * stride_xs + kb, mask=ok, other=0.0)
        wmask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w + n[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)  # [SK, BN]
        wu = tl.load(w + (n[None, :] + INTER) * stride_wn + kk[:, None], mask=wmask, other=0.0)
        sg = tl.load(ws + (n // SN) * stride_sn + kb, mask=n_ok, other=0.0)
        su = tl.load(ws + ((n + INTER) // SN) * stride_sn + kb, mask=n_ok, other=0.0)
        acc_g += tl.dot(xt, wg) * sx[:, None] * sg[None, :]
        acc_u += tl.dot(xt, wu) * sx[:, None] * su[None, :]
    out = acc_g * tl.sigmoid(acc_g) * acc_u
    h_rows = (blk * BM + tl.arange(0, BM)).to(tl.int64)
    tl.store(h + h_rows[:, None] * stride_h + n[None, :], out, mask=n_ok[None, :])


@triton.jit
def _down_weighted_fp8(
    h, h_s, down, down_s, rows, block_expert, weights, y, num_rows, HIDDEN, INTER,
    stride_h, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_y,
    SN: tl.constexpr, SK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    blk = tl.program_id(0)
    e = tl.load(block_expert + blk)
    if e < 0:
        return
    r = tl.load(rows + blk * BM + tl.arange(0, BM))
    ok = r < num_rows
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < HIDDEN
    w = down + e.to(tl.int64) * stride_we
    ws = down_s + e.to(tl.int64) * stride_se
    h_rows = (blk * BM + tl.arange(0, BM)).to(tl.int64)
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(INTER, SK)):
        kk = kb * SK + tl.arange(0, SK)
        k_ok = kk < INTER
        ht = tl.load(h + h_rows[:, None] * stride_h + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        sh = tl.load(h_s + h_rows * stride_hs + kb, mask=ok, other=0.0)
        wd = tl.load(w + n[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        sd = tl.load(ws + (n // SN) * stride_sn + kb, mask=n_ok, other=0.0)
        acc += tl.dot(ht, wd) * sh[:, None] * sd[None, :]
    rw = tl.load(weights + r, mask=ok, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    tl.store(y + tl.where(ok, r, 0).to(tl.int64)[:, None] * stride_y + n[None, :], acc,
             mask=ok[:, None] & n_ok[None, :])


GROUPED_FP8_BN = 64  # the column tile of both expert kernels (their depth tile is SK)


def grouped_fp8_launch(bm: int) -> dict[str, int]:
    """Warps and stages of the expert kernels at BM rows: 128-row tiles take 8 warps (with 4 the
    gate/up kernel spills registers on Hopper)."""
    return {"num_warps": 8 if bm >= 128 else 4, "num_stages": 3}


def moe_grouped_mlp_fp8(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
    gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """``kernels.moe_grouped.moe_grouped_mlp`` with e4m3 experts: gate_up [E, 2I, M] with scales
    [E, ceil(2I/SN), ceil(M/SK)], down [E, M, I] with [E, ceil(M/SN), ceil(I/SK)] -> [T, M] in
    x's dtype. x and the intermediate are quantized per row and SK columns."""
    _check_experts(x, expert_ids, weights, gate_up, gate_up_scale, down, down_scale, block)
    t, m = x.shape
    k = expert_ids.shape[1]
    e, two_i, _ = gate_up.shape
    i = two_i // 2
    if t == 0:
        return torch.zeros_like(x)
    sn, sk = block
    xq, xs = quantize_rows_fp8(x, sk)
    bm = block_rows(t * k, e)
    rows, block_expert = sort_rows_by_expert(expert_ids, e, bm)
    nb = block_expert.shape[0]
    h = torch.zeros(nb * bm, i, device=x.device, dtype=torch.float32)
    _gate_up_silu_fp8[(nb, triton.cdiv(i, GROUPED_FP8_BN))](
        xq, xs, gate_up, gate_up_scale, rows, block_expert, h, t * k, m, i,
        xq.stride(0), xs.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0),
        gate_up_scale.stride(1), h.stride(0), TOPK=k, SN=sn, SK=sk, BM=bm, BN=GROUPED_FP8_BN, **grouped_fp8_launch(bm))
    hq, hs = quantize_rows_fp8(h, sk)
    y = torch.empty(t * k, m, device=x.device, dtype=torch.float32)
    _down_weighted_fp8[(nb, triton.cdiv(m, GROUPED_FP8_BN))](
        hq, hs, down, down_scale, rows, block_expert, weights.float().contiguous().reshape(-1), y, t * k, m, i,
        hq.stride(0), hs.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1),
        y.stride(0), SN=sn, SK=sk, BM=bm, BN=GROUPED_FP8_BN, **grouped_fp8_launch(bm))
    return y.view(t, k, m).sum(1).to(x.dtype)


def ref_moe_grouped_mlp_fp8(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
    gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """Same contract as ``moe_grouped_mlp_fp8``: a loop over the experts that have tokens, the
    quantized operands dequantized and multiplied in float32."""
    _check_experts(x, expert_ids, weights, gate_up, gate_up_scale, down, down_scale, block)
    sk = block[1]
    i = gate_up.shape[1] // 2
    xq, xs = ref_quantize_rows_fp8(x, sk)
    xd = dequantize_blocks(xq, xs, (1, sk))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in expert_ids.unique().tolist():
        tok, slot = (expert_ids == e).nonzero(as_tuple=True)
        gu = xd[tok] @ dequantize_blocks(gate_up[e], gate_up_scale[e], block).T
        h = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        hq, hs = ref_quantize_rows_fp8(h, sk)
        y = dequantize_blocks(hq, hs, (1, sk)) @ dequantize_blocks(down[e], down_scale[e], block).T
        out.index_add_(0, tok, y * weights[tok, slot].float()[:, None])
    return out.to(x.dtype)


def _check_experts(x, expert_ids, weights, gate_up, gate_up_scale, down, down_scale, block) -> None:
    _check_weight(gate_up, gate_up_scale, block)
    _check_weight(down, down_scale, block)
    e, two_i, m = gate_up.shape
    if x.dim() != 2 or x.shape[1] != m or tuple(down.shape) != (e, m, two_i // 2):
        raise ValueError(f"x {list(x.shape)}, gate_up {list(gate_up.shape)} and down {list(down.shape)} "
                         f"do not fit [T, M], [E, 2I, M] and [E, M, I]")
    if expert_ids.shape != weights.shape or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids {list(expert_ids.shape)} and weights {list(weights.shape)} must be [T, K]")
