"""Routed experts as a grouped GEMM over expert-sorted tokens (Triton + reference).

Legend: T tokens, K experts per token, E experts (or physical slots of a shard), M hidden size,
I expert intermediate size, BM rows per block, NB row blocks.

Every (token, expert) pair is a row. Rows are sorted by expert and each expert's run is padded
to a multiple of BM, so a block of BM rows belongs to one expert: the block reads that expert's
weights once for all its rows. Two kernels, each a tiled GEMM over (row block, output columns):

    h = silu(x @ W_gate[e].T) * (x @ W_up[e].T)     # [rows, I]   (gate/up fused, SiLU in-kernel)
    y = (h @ W_down[e].T) * routing weight            # [rows, M]

and the K rows of a token are summed in torch (no atomics, deterministic). Weights stay in
Hugging Face layout: ``gate_up`` [E, 2I, M] (gate rows then up rows), ``down`` [E, M, I].

BM follows the rows an expert gets on average (decode: a few, so 16 and little padding; a large
prefill batch: hundreds, so 128 and each weight tile read once per 128 rows). The column and
depth tiles are tuned on the device at the first call per (M, I, BM) from ``GROUPED_CONFIGS``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import triton_interpreted, tuned_configs, with_config

__all__ = ["BLOCK_ROWS", "GROUPED_CONFIGS", "block_rows", "moe_grouped_mlp", "ref_moe_grouped_mlp", "sort_rows_by_expert"]

# Rows per block (BM), smallest first; tl.dot needs >= 16.
BLOCK_ROWS = (16, 32, 64, 128)
# Column (BN) and depth (BK) tiles tried on the device (``kernels.tuned_configs``). Each
# compiles for Hopper with every BM without spilling (tests/kernels/test_hopper_compile.py).
GROUPED_CONFIGS = [
    triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 4, 3), (128, 32, 8, 4)]
]
_TUNE = tuned_configs(GROUPED_CONFIGS)


@triton.autotune(_TUNE, key=["HIDDEN", "INTER", "BM"])
@triton.jit
def _gate_up_silu(
    x, gate_up, rows, block_expert, h, num_rows, HIDDEN, INTER,
    stride_x, stride_we, stride_wn, stride_h,
    TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr,
):
    blk = tl.program_id(0)
    e = tl.load(block_expert + blk)
    if e < 0:
        return
    r = tl.load(rows + blk * BM + tl.arange(0, BM))  # [BM] flat (token, k) row ids, pads = num_rows
    ok = r < num_rows
    tok = tl.where(ok, r // TOPK, 0).to(tl.int64)  # 64-bit offsets: T x M passes 2**31 at 300k tokens
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    w = gate_up + e.to(tl.int64) * stride_we
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, HIDDEN, BK):
        kk = k0 + tl.arange(0, BK)
        xt = tl.load(x + tok[:, None] * stride_x + kk[None, :], mask=ok[:, None] & (kk[None, :] < HIDDEN), other=0.0)
        wmask = (kk[:, None] < HIDDEN) & (n[None, :] < INTER)
        wg = tl.load(w + n[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)  # [BK, BN]
        wu = tl.load(w + (n[None, :] + INTER) * stride_wn + kk[:, None], mask=wmask, other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        # "ieee": fp32 inputs stay fp32 on GPUs (Triton's default there is tf32); no effect on bf16.
        acc_g = tl.dot(xt, wg, acc_g, input_precision="ieee")
        acc_u = tl.dot(xt, wu, acc_u, input_precision="ieee")
    out = acc_g * tl.sigmoid(acc_g) * acc_u
    h_rows = (blk * BM + tl.arange(0, BM)).to(tl.int64)
    tl.store(h + h_rows[:, None] * stride_h + n[None, :], out.to(h.dtype.element_ty), mask=(n[None, :] < INTER))


@triton.autotune(_TUNE, key=["HIDDEN", "INTER", "BM"])
@triton.jit
def _down_weighted(
    h, down, rows, block_expert, weights, y, num_rows, HIDDEN, INTER,
    stride_h, stride_we, stride_wn, stride_y,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr,
):
    blk = tl.program_id(0)
    e = tl.load(block_expert + blk)
    if e < 0:
        return
    r = tl.load(rows + blk * BM + tl.arange(0, BM))
    ok = r < num_rows
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    w = down + e.to(tl.int64) * stride_we
    h_rows = (blk * BM + tl.arange(0, BM)).to(tl.int64)  # 64-bit offsets (rows x M passes 2**31)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, INTER, BK):
        kk = k0 + tl.arange(0, BK)
        ht = tl.load(h + h_rows[:, None] * stride_h + kk[None, :],
                     mask=ok[:, None] & (kk[None, :] < INTER), other=0.0)  # [BM, BK]
        wd = tl.load(w + n[None, :] * stride_wn + kk[:, None],
                     mask=(kk[:, None] < INTER) & (n[None, :] < HIDDEN), other=0.0)  # [BK, BN]
        if UPCAST:
            ht = ht.to(tl.float32)
            wd = wd.to(tl.float32)
        acc = tl.dot(ht, wd, acc, input_precision="ieee")
    rw = tl.load(weights + r, mask=ok, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    tl.store(y + tl.where(ok, r, 0).to(tl.int64)[:, None] * stride_y + n[None, :], acc.to(y.dtype.element_ty),
             mask=ok[:, None] & (n[None, :] < HIDDEN))


def block_rows(num_rows: int, num_experts: int) -> int:
    """BM for ``num_rows`` (token, expert) rows over ``num_experts``: the smallest of
    ``BLOCK_ROWS`` that holds an expert's average share, at most the largest."""
    share = triton.cdiv(num_rows, max(1, num_experts))
    return next((bm for bm in BLOCK_ROWS if bm >= share), BLOCK_ROWS[-1])


def sort_rows_by_expert(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [T, K] -> (rows [NB*BM] int32, block_expert [NB] int32), without a host sync.

    ``rows`` lists flat (token, k) row ids grouped by expert, each expert's run padded to a
    multiple of BM with the sentinel T*K; ``block_expert[b]`` is the expert of block b, -1 for
    blocks past the end. NB = ceil(T*K / BM) + min(E, T*K) bounds the blocks any routing needs."""
    flat = expert_ids.reshape(-1).long()  # [T*K]
    n = flat.numel()
    num_blocks = triton.cdiv(n, block_m) + min(num_experts, n)
    order = flat.argsort(stable=True)
    # counted by index_add_, not bincount: bincount reads the largest id back to size its output
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    run_start = counts.cumsum(0) - counts
    e_sorted = flat[order]
    dest = pad_start[e_sorted] + torch.arange(n, device=flat.device) - run_start[e_sorted]
    rows = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=flat.device)
    rows[dest] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_start < pad_end[-1], block_expert, -1).to(torch.int32)
    return rows, block_expert


def moe_grouped_mlp(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """x [T, M], expert_ids [T, K] (indexes ``gate_up``'s first dim), weights [T, K],
    gate_up [E, 2I, M], down [E, M, I] -> [T, M] in x's dtype:
    sum_k weights[t, k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])) with e = ids[t, k].
    ``config`` (one of ``GROUPED_CONFIGS``) fixes the tiles of both kernels instead of tuning them."""
    _check(x, expert_ids, weights, gate_up, down)
    t, m = x.shape
    k = expert_ids.shape[1]
    e, two_i, _ = gate_up.shape
    i = two_i // 2
    if t == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    bm = block_rows(t * k, e)
    rows, block_expert = sort_rows_by_expert(expert_ids, e, bm)
    nb = block_expert.shape[0]
    h = torch.empty(nb * bm, i, device=x.device, dtype=x.dtype)
    y = torch.empty(t * k, m, device=x.device, dtype=torch.float32)
    upcast = triton_interpreted() or x.dtype == torch.float32
    gate_up_kernel, fixed = with_config(_gate_up_silu, config)
    down_kernel, _ = with_config(_down_weighted, config)
    gate_up_kernel[lambda meta: (nb, triton.cdiv(i, meta["BN"]))](
        x, gate_up, rows, block_expert, h, t * k, m, i,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        TOPK=k, BM=bm, UPCAST=upcast, **fixed,
    )
    down_kernel[lambda meta: (nb, triton.cdiv(m, meta["BN"]))](
        h, down, rows, block_expert, weights.float().contiguous().reshape(-1), y, t * k, m, i,
        h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        BM=bm, UPCAST=upcast, **fixed,
    )
    return y.view(t, k, m).sum(1).to(x.dtype)


def ref_moe_grouped_mlp(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """Same contract as ``moe_grouped_mlp``: a loop over the experts that have tokens
    (``config`` is ignored)."""
    _check(x, expert_ids, weights, gate_up, down)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in expert_ids.unique().tolist():
        tok, slot = (expert_ids == e).nonzero(as_tuple=True)
        g, u = F.linear(x[tok].float(), gate_up[e].float()).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e].float())  # [rows, M]
        out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out.to(x.dtype)


def _check(x, expert_ids, weights, gate_up, down) -> None:
    if x.dim() != 2 or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} must be [T, M] and expert_ids {tuple(expert_ids.shape)} [T, K]")
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights {tuple(weights.shape)} must match expert_ids {tuple(expert_ids.shape)}")
    e, two_i, m = gate_up.shape
    if m != x.shape[1] or two_i % 2 or down.shape != (e, m, two_i // 2):
        raise ValueError(
            f"gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} do not fit hidden size "
            f"{x.shape[1]}: need [E, 2I, M] and [E, M, I]"
        )
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise TypeError(f"dtypes differ: x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}")
