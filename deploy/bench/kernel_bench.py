"""``tide bench kernels``: achieved bandwidth of MLA decode and TFLOP/s of the MoE grouped GEMM.

CUDA only (on CPU the Triton kernels run in an interpreter, which measures nothing useful). MLA
decode: bytes = the latent cache read once (B x context x 576 values) plus queries and outputs;
the fraction is of the device's peak memory bandwidth as NVML reports it (bus width x memory
clock x 2 for DDR), or ``--peak-gbps``. With 128 heads every cached token also feeds
128 x (576 + 512) x 2 FLOPs, ~242 FLOPs per byte, about an H100/H200's ratio of tensor FLOP/s to
bandwidth, so ``tflop_per_s`` is reported beside it: the kernel is bound by either. The same
cases with 16 heads (the heads one GPU holds under 8-way tensor parallelism, 30 FLOPs per byte)
show the memory-bound side (``mla_decode_16_heads``). Pages hold 16 tokens, as the engine's
pool does; ``mla_decode_mixed`` gives the batch's sequences lengths drawn between an eighth of
the context and all of it (a real decode batch is ragged), its bytes counted from the actual
lengths.

FP8 (DeepSeek-V3's weights as published, ``kernels.fp8_gemm``): a dense projection and the
grouped experts with e4m3 weights in 128x128 blocks, TFLOP/s against the device's FP8 peak
(``FP8_PEAK_TFLOPS``) and the error against the same product in BF16.

Decode step (``decode_step``): the engine's decode pass of its own, a whole step of a small
DeepSeek-shaped model, eager and replayed as its bucket's CUDA graph: what the graphs save.

MoE: prefill-sized batches (thousands of tokens: bound by tensor FLOP/s) and decode-sized ones
(64-256 tokens over a shard's 32 experts: bound by reading the experts' weights, so GB/s of the
weights touched and their fraction of the peak bandwidth are reported beside TFLOP/s).

Every case is first checked against the torch reference (``max_abs_err``, on two sequences of
the batch), then timed as the median of ``triton.testing.do_bench``; the first call tunes the
kernel's tiles, and ``config`` names the ones it chose.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shapes:
    """Attention and expert sizes of a benchmark (default: DeepSeek-V3's)."""

    heads: int = 128
    kv_lora_rank: int = 512
    rope_dim: int = 64
    hidden: int = 7168
    moe_inter: int = 2048
    top_k: int = 8
    page_size: int = 16  # the engine's (cluster.engine.EngineConfig.page_size)


V3 = Shapes()


def peak_memory_gbps(device_index: int = 0) -> float | None:
    """Theoretical DRAM bandwidth from NVML, or None when NVML cannot tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        mem_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        return bus_bits / 8 * mem_mhz * 1e6 * 2 / 1e9
    except Exception:  # noqa: BLE001 - any NVML failure just means "unknown peak"
        return None


def _time_ms(fn, device: str) -> float:
    """Median milliseconds per call; the first call (which tunes the tiles) is not timed. Off
    CUDA (the interpreter, for tests) a plain wall-clock median of three calls."""
    fn()
    if device != "cuda":
        return statistics.median(_wall_ms(fn) for _ in range(3))
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _wall_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _tuned(kernel) -> str | None:
    """The tile config the autotuner chose at the last launch, e.g. ``BLOCK_H: 32, BLOCK_N: 32, num_warps: 8, ...``
    (of the shape class launched last, for a kernel tuned per class: ``kernels.TunedByShape``)."""
    from kernels import TunedByShape

    if isinstance(kernel, TunedByShape):
        kernel = kernel(kernel.last) if kernel.last is not None else None
    best = getattr(kernel, "best_config", None)
    return str(best) if best is not None else None


def bench_mla_decode(
    batch: int, context: int, peak_gbps: float | None, shapes: Shapes = V3, device: str = "cuda",
    mixed: bool = False,
) -> dict[str, Any]:
    """``mixed``: lengths drawn between context/8 and context (seeded) instead of all equal."""
    from kernels.mla_decode import MLA_SPLIT, mla_decode, ref_mla_decode

    sh, dt = shapes, torch.bfloat16
    pages_per_seq = -(-context // sh.page_size)
    kv = torch.randn(batch * pages_per_seq * sh.page_size, sh.kv_lora_rank + sh.rope_dim, device=device, dtype=dt)
    table = torch.randperm(batch * pages_per_seq, device=device, dtype=torch.int32).view(batch, -1)
    q_lat = torch.randn(batch, sh.heads, sh.kv_lora_rank, device=device, dtype=dt)
    q_rope = torch.randn(batch, sh.heads, sh.rope_dim, device=device, dtype=dt)
    if mixed:
        lens = torch.randint(max(1, context // 8), context + 1, (batch,), generator=torch.Generator().manual_seed(0))
        lens = lens.to(device=device, dtype=torch.int32)
    else:
        lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    tokens = int(lens.sum())
    scale = (sh.kv_lora_rank + sh.rope_dim) ** -0.5

    def run() -> torch.Tensor:
        return mla_decode(q_lat, q_rope, kv, table, lens, scale, sh.page_size)

    checked = min(batch, 2)
    ref = ref_mla_decode(q_lat[:checked], q_rope[:checked], kv, table[:checked], lens[:checked], scale, sh.page_size)
    err = float((run()[:checked].float() - ref.float()).abs().max())
    ms = _time_ms(run, device)
    nbytes = (tokens * (sh.kv_lora_rank + sh.rope_dim) + q_lat.numel() * 2 + q_rope.numel()) * 2 \
        + table.numel() * 4
    flops = 2 * sh.heads * tokens * (2 * sh.kv_lora_rank + sh.rope_dim)
    gbps = nbytes / ms / 1e6
    return {
        "batch": batch,
        "context": context,
        "mean_length": round(tokens / batch, 1),
        "page_size": sh.page_size,
        "ms": round(ms, 4),
        "gb_per_s": round(gbps, 1),
        "fraction_of_peak": round(gbps / peak_gbps, 3) if peak_gbps else None,
        "tflop_per_s": round(flops / ms / 1e9, 1),
        "max_abs_err": round(err, 5),
        "config": _tuned(MLA_SPLIT),
    }


def bench_moe_grouped(tokens: int, experts: int, shapes: Shapes = V3, device: str = "cuda",
                      peak_gbps: float | None = None) -> dict[str, Any]:
    from kernels.moe_grouped import _gate_up_silu, moe_grouped_mlp, ref_moe_grouped_mlp

    sh, dt = shapes, torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, sh.hidden, device=device, dtype=dt, generator=gen)
    ids = torch.rand(tokens, experts, device=device, generator=gen).argsort(dim=1)[:, : sh.top_k]  # distinct per token
    w = torch.rand(tokens, sh.top_k, device=device, generator=gen)
    gate_up = (torch.randn(experts, 2 * sh.moe_inter, sh.hidden, device=device, generator=gen) * 0.02).to(dt)
    down = (torch.randn(experts, sh.hidden, sh.moe_inter, device=device, generator=gen) * 0.02).to(dt)

    def run() -> torch.Tensor:
        return moe_grouped_mlp(x, ids, w, gate_up, down)

    few = slice(0, 64)  # the reference loops over experts: check some of the tokens
    ref = ref_moe_grouped_mlp(x[few], ids[few], w[few], gate_up, down).float()
    err = float((run()[few].float() - ref).abs().max() / ref.abs().max())
    ms = _time_ms(run, device)
    flops = 2 * tokens * sh.top_k * 3 * sh.hidden * sh.moe_inter
    # each expert any token chose is read once: its gate, up and down weights (bf16)
    weight_bytes = int(ids.unique().numel()) * 3 * sh.hidden * sh.moe_inter * 2
    gbps = (weight_bytes + 2 * x.numel() * 2) / ms / 1e6
    return {"tokens": tokens, "experts": experts, "top_k": sh.top_k, "ms": round(ms, 3),
            "tflop_per_s": round(flops / ms / 1e9, 1), "weight_gb_per_s": round(gbps, 1),
            "fraction_of_peak_bandwidth": round(gbps / peak_gbps, 3) if peak_gbps else None,
            "max_rel_err": round(err, 5), "config": _tuned(_gate_up_silu)}


# dense FP8 tensor-core TFLOP/s by device name (NVIDIA's datasheets, SXM parts, no sparsity)
FP8_PEAK_TFLOPS = {"H100": 1979.0, "H200": 1979.0, "H800": 1979.0, "H20": 296.0, "B200": 4500.0}


def peak_fp8_tflops(device_name: str) -> float | None:
    """The FP8 peak of the named device, when this table knows it."""
    return next((v for k, v in FP8_PEAK_TFLOPS.items() if k in device_name), None)


def bench_fp8_linear(tokens: int, n: int, k: int, peak_tflops: float | None, device: str = "cuda") -> dict[str, Any]:
    """A dense projection with DeepSeek's fp8 weights (128x128 blocks): TFLOP/s, its fraction of
    the FP8 peak, and the error against the same product in BF16."""
    from kernels.fp8_gemm import FP8_MATMUL, fp8_linear, quantize_blocks

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, k, device=device, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(torch.bfloat16)
    q, scale = quantize_blocks(w, (128, 128))

    def run() -> torch.Tensor:
        return fp8_linear(x, q, scale)

    ref = (x @ w.T).float()
    err = float((run().float() - ref).abs().max() / ref.abs().max())
    ms = _time_ms(run, device)
    tflops = 2 * tokens * n * k / ms / 1e9
    return {"tokens": tokens, "n": n, "k": k, "ms": round(ms, 3), "tflop_per_s": round(tflops, 1),
            "fraction_of_fp8_peak": round(tflops / peak_tflops, 3) if peak_tflops else None,
            "max_rel_err_vs_bf16": round(err, 4), "config": _tuned(FP8_MATMUL)}


def bench_moe_grouped_fp8(tokens: int, experts: int, shapes: Shapes = V3, device: str = "cuda",
                          peak_tflops: float | None = None) -> dict[str, Any]:
    """The grouped expert MLP with fp8 experts: TFLOP/s, the fraction of the FP8 peak, and the
    error against the BF16 grouped GEMM on the unquantized weights."""
    from kernels.fp8_gemm import moe_grouped_mlp_fp8, quantize_blocks
    from kernels.moe_grouped import moe_grouped_mlp

    sh = shapes
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, sh.hidden, device=device, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, device=device, generator=gen).argsort(dim=1)[:, : sh.top_k]
    w = torch.rand(tokens, sh.top_k, device=device, generator=gen)
    gate_up = (torch.randn(experts, 2 * sh.moe_inter, sh.hidden, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    down = (torch.randn(experts, sh.hidden, sh.moe_inter, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    fp8 = (*quantize_blocks(gate_up, (128, 128)), *quantize_blocks(down, (128, 128)))

    def run() -> torch.Tensor:
        return moe_grouped_mlp_fp8(x, ids, w, *fp8)

    ref = moe_grouped_mlp(x, ids, w, gate_up, down).float()
    err = float((run().float() - ref).abs().max() / ref.abs().max())
    ms = _time_ms(run, device)
    tflops = 2 * tokens * sh.top_k * 3 * sh.hidden * sh.moe_inter / ms / 1e9
    return {"tokens": tokens, "experts": experts, "top_k": sh.top_k, "ms": round(ms, 3),
            "tflop_per_s": round(tflops, 1),
            "fraction_of_fp8_peak": round(tflops / peak_tflops, 3) if peak_tflops else None,
            "max_rel_err_vs_bf16": round(err, 4)}


def bench_decode_step(batches: tuple[int, ...] = (1, 8, 32, 64), context: int = 1024, config: str = "bench",
                      device: str = "cuda") -> dict[str, Any]:
    """A whole decode step of a small DeepSeek-shaped model (``config``'s dims, random weights,
    every row's latents ``context`` tokens long) as the engine runs a decode pass of its own
    (``model.fixed_decode``): eager, and replayed as its bucket's CUDA graph (CUDA only; elsewhere
    both run eagerly), ms per step by batch, and the replayed logits against the eager step's.
    What a graph saves is the host's launching, which a small batch's step is mostly made of."""
    from model.checkpoint import build_model, random_state_dict
    from model.config import named_config
    from model.fixed_decode import FixedShapeDecode, buckets_up_to

    cfg = named_config(config)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(cfg, {k: v.to(device, dtype) for k, v in random_state_dict(cfg, seed=0).items()})
    page = 16
    width = -(-(context + 1) // page)
    rows = max(batches)
    pool = model.new_pool(rows * width + 1, page)  # the last page is the padding rows' scratch page
    pool.data.normal_()
    tables = torch.arange(rows * width, device=device).view(rows, width)
    eager = FixedShapeDecode(model, pool, rows * width, width, buckets_up_to(rows))
    graphs = FixedShapeDecode(model, pool, rows * width, width, buckets_up_to(rows), capture=device == "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (rows,), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.full((rows,), context, device=device)
    out = []
    for b in batches:
        def step(fixed: FixedShapeDecode, b: int = b) -> torch.Tensor:
            return fixed(tokens[:b], tables[:b], positions[:b])

        err = float((step(eager).float() - step(graphs).float()).abs().max())
        eager_ms, graph_ms = _time_ms(lambda: step(eager), device), _time_ms(lambda: step(graphs), device)
        out.append({"batch": b, "eager_ms": round(eager_ms, 3), "graph_ms": round(graph_ms, 3),
                    "speedup": round(eager_ms / graph_ms, 2), "max_abs_err": round(err, 5)})
    return {"config": config, "dtype": str(dtype).removeprefix("torch."), "context": context,
            "captured": graphs.captured, "steps": out}


def run_kernel_bench(peak_gbps: float | None = None) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "tide bench kernels needs CUDA; no CUDA device here"}
    peak = peak_gbps or peak_memory_gbps(torch.cuda.current_device())
    fp8_peak = peak_fp8_tflops(torch.cuda.get_device_name())
    return {
        "device": torch.cuda.get_device_name(),
        "peak_memory_gb_per_s": peak,
        "mla_decode": [bench_mla_decode(b, c, peak) for b in (64, 128) for c in (4096, 32768)],
        "mla_decode_mixed": [bench_mla_decode(b, c, peak, mixed=True) for b in (64, 128) for c in (4096, 32768)],
        "mla_decode_16_heads": [bench_mla_decode(b, c, peak, Shapes(heads=16)) for b in (64, 128)
                                for c in (4096, 32768)],
        # 32 local experts = one shard of 256 experts over 8 GPUs; 256 = all experts on one GPU
        "moe_grouped_gemm": [bench_moe_grouped(t, e, peak_gbps=peak) for t, e in ((4096, 32), (16384, 256))],
        # a decode step's tokens over one shard: memory-bound
        "moe_grouped_gemm_decode": [bench_moe_grouped(t, 32, peak_gbps=peak) for t in (64, 256)],
        # DeepSeek-V3's fp8 weights as published: o_proj-sized (16384 -> 7168) prefill and decode
        "peak_fp8_tflop_per_s": fp8_peak,
        "fp8_linear": [bench_fp8_linear(t, 7168, 16384, fp8_peak) for t in (4096, 64)],
        "moe_grouped_gemm_fp8": [bench_moe_grouped_fp8(t, e, peak_tflops=fp8_peak) for t, e in ((4096, 32), (64, 32))],
        # the engine's decode pass of its own, eager and as a replayed CUDA graph
        "decode_step": bench_decode_step(),
    }
