"""Block-scaled FP8 GEMMs (Triton) against their torch references, and the references against
the unquantized products within e4m3's error."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import (
    FP8_CONFIGS,
    FP8_DTYPE,
    dequantize_blocks,
    fp8_linear,
    moe_grouped_mlp_fp8,
    quantize_blocks,
    quantize_rows_fp8,
    ref_fp8_linear,
    ref_moe_grouped_mlp_fp8,
    ref_quantize_rows_fp8,
)
from kernels.moe_grouped import ref_moe_grouped_mlp
from tests.kernels.triton_cases import DEVICE

E4M3_STEP = 2.0**-3  # the relative spacing of e4m3 values (3 mantissa bits)
# kernel vs reference: the interpreter sums exactly as the reference does, up to float32 order; a
# Hopper's fp8 tensor cores accumulate a 128-deep block in fewer bits (hence the per-block scaling)
MATCH = 1e-5 if DEVICE == "cpu" else 2e-3


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("t, k", [(1, 128), (5, 200), (33, 64), (3, 1000)])
def test_rows_quantize_like_the_reference_and_round_to_nearest(t, k):
    # values at the top of a binade (124.3 of the block's 448) round up to the next power of two
    x = torch.randn(t, k, generator=_gen(t)).to(DEVICE)
    q, s = quantize_rows_fp8(x, 128)
    rq, rs = ref_quantize_rows_fp8(x, 128)
    assert q.dtype == FP8_DTYPE and s.shape == (t, (k + 127) // 128)
    torch.testing.assert_close(s, rs)
    assert torch.equal(q.float(), rq.float())
    back = dequantize_blocks(q, s, (1, 128))
    assert ((back - x).abs() <= x.abs() * E4M3_STEP / 2 + s.repeat_interleave(128, 1)[:, :k] * 2**-9).all()


def test_rows_with_strided_columns_quantize_like_contiguous_ones():
    x = torch.randn(200, 6, generator=_gen(9)).to(DEVICE).T  # [6, 200], column stride 6
    q, s = quantize_rows_fp8(x)
    rq, rs = ref_quantize_rows_fp8(x.contiguous())
    assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs)


def test_block_quantization_round_trips_within_e4m3s_step_and_keeps_zero_blocks():
    w = torch.randn(300, 260, generator=_gen(1)) * 0.02
    w[128:256, :128] = 0  # an all-zero block
    q, s = quantize_blocks(w, (128, 128))
    assert q.shape == w.shape and s.shape == (3, 3)
    back = dequantize_blocks(q, s, (128, 128))
    assert (back[128:256, :128] == 0).all()
    assert _relative(back, w) <= E4M3_STEP


@pytest.mark.parametrize("t, n, k", [(1, 64, 128), (7, 150, 200), (40, 256, 384), (2, 17, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_matches_the_reference(t, n, k, dtype):
    gen = _gen(t + n)
    x = torch.randn(t, k, generator=gen).to(dtype).to(DEVICE)
    q, s = quantize_blocks(torch.randn(n, k, generator=gen) / k**0.5, (128, 128))
    q, s = q.to(DEVICE), s.to(DEVICE)
    out, ref = fp8_linear(x, q, s), ref_fp8_linear(x, q, s)
    assert out.dtype == dtype and out.shape == (t, n)
    assert _relative(out, ref) <= (MATCH if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("config", FP8_CONFIGS, ids=lambda c: f"BM{c.kwargs['BM']}-BN{c.kwargs['BN']}")
def test_every_tile_config_computes_the_same(config):
    gen = _gen(3)
    x = torch.randn(20, 256, generator=gen).to(DEVICE)
    q, s = (v.to(DEVICE) for v in quantize_blocks(torch.randn(192, 256, generator=gen) / 16, (128, 128)))
    assert _relative(fp8_linear(x, q, s, config=config), ref_fp8_linear(x, q, s)) <= MATCH


def test_the_fp8_product_stays_within_e4m3s_error_of_the_exact_one():
    gen = _gen(4)
    x, w = torch.randn(16, 512, generator=gen), torch.randn(256, 512, generator=gen) / 512**0.5
    q, s = quantize_blocks(w, (128, 128))
    exact = x @ w.T
    err = _relative(ref_fp8_linear(x, q, s), exact)
    assert 0 < err <= E4M3_STEP  # two operands each within half a step per element, errors averaging over K


def test_bad_weights_are_clear_errors():
    x = torch.randn(2, 128)
    q, s = quantize_blocks(torch.randn(64, 128), (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, q.float(), s)
    with pytest.raises(ValueError, match="scales of shape"):
        fp8_linear(x, q, s[:, :0])
    with pytest.raises(ValueError, match="features"):
        fp8_linear(torch.randn(2, 64), q, s)


def _experts(t, k, e, m, i, seed):
    gen = _gen(seed)
    x = torch.randn(t, m, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    gate_up = torch.randn(e, 2 * i, m, generator=gen) / m**0.5
    down = torch.randn(e, m, i, generator=gen) / i**0.5
    return x, ids, w, gate_up, down


@pytest.mark.parametrize("t, k, e, m, i", [(1, 1, 1, 128, 64), (9, 2, 4, 192, 160), (30, 4, 8, 256, 96)])
def test_grouped_experts_match_the_reference_and_the_exact_mlp(t, k, e, m, i):
    x, ids, w, gate_up, down = _experts(t, k, e, m, i, seed=t)
    gq, gs = quantize_blocks(gate_up, (128, 128))
    dq, ds = quantize_blocks(down, (128, 128))
    args = [v.to(DEVICE) for v in (x, ids, w, gq, gs, dq, ds)]
    out, ref = moe_grouped_mlp_fp8(*args), ref_moe_grouped_mlp_fp8(*args)
    assert out.shape == (t, m) and out.dtype == x.dtype
    # the intermediate is quantized after float32 sums in another order: a value on a rounding
    # edge may land one e4m3 step apart
    assert _relative(out, ref) <= max(1e-3, 2 * MATCH)
    assert _relative(ref, ref_moe_grouped_mlp(x, ids, w, gate_up, down)) <= 2 * E4M3_STEP


def test_grouped_experts_without_tokens():
    x, ids, w, gate_up, down = _experts(1, 2, 4, 128, 64, seed=0)
    out = moe_grouped_mlp_fp8(x[:0], ids[:0], w[:0], *quantize_blocks(gate_up, (128, 128)),
                              *quantize_blocks(down, (128, 128)))
    assert out.shape == (0, 128)
