"""``tide bench kernels``: achieved bandwidth of MLA decode and TFLOP/s of the MoE grouped GEMM.

CUDA only (on CPU the Triton kernels run in an interpreter, which measures nothing useful). MLA
decode is memory-bound: bytes = the latent cache read once (B x context x 576 values) plus
queries and outputs; the fraction is of the device's peak memory bandwidth as NVML reports it
(bus width x memory clock x 2 for DDR), or ``--peak-gbps``.
"""

from __future__ import annotations

from typing import Any

import torch

# DeepSeek-V3 attention and expert shapes
HEADS, KV_LORA_RANK, ROPE_DIM = 128, 512, 64
HIDDEN, MOE_INTER, EXPERTS, TOP_K = 7168, 2048, 256, 8
PAGE_SIZE = 64


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


def _time_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def bench_mla_decode(batch: int, context: int, peak_gbps: float | None) -> dict[str, Any]:
    from kernels.mla_decode import mla_decode

    dev, dt = "cuda", torch.bfloat16
    pages_per_seq = context // PAGE_SIZE
    kv = torch.randn(batch * pages_per_seq * PAGE_SIZE, KV_LORA_RANK + ROPE_DIM, device=dev, dtype=dt)
    table = torch.randperm(batch * pages_per_seq, device=dev, dtype=torch.int32).view(batch, -1)
    q_lat = torch.randn(batch, HEADS, KV_LORA_RANK, device=dev, dtype=dt)
    q_rope = torch.randn(batch, HEADS, ROPE_DIM, device=dev, dtype=dt)
    lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    ms = _time_ms(lambda: mla_decode(q_lat, q_rope, kv, table, lens, 0.07, PAGE_SIZE))
    nbytes = (kv.numel() + q_lat.numel() * 2 + q_rope.numel()) * 2 + table.numel() * 4
    gbps = nbytes / ms / 1e6
    return {
        "batch": batch,
        "context": context,
        "ms": round(ms, 4),
        "gb_per_s": round(gbps, 1),
        "fraction_of_peak": round(gbps / peak_gbps, 3) if peak_gbps else None,
    }


def bench_moe_grouped(tokens: int, experts: int) -> dict[str, Any]:
    from kernels.moe_grouped import moe_grouped_mlp

    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=dt, generator=gen)
    ids = torch.randint(0, experts, (tokens, TOP_K), device=dev, generator=gen)
    w = torch.rand(tokens, TOP_K, device=dev, generator=gen)
    gate_up = torch.randn(experts, 2 * MOE_INTER, HIDDEN, device=dev, dtype=dt, generator=gen) * 0.02
    down = torch.randn(experts, HIDDEN, MOE_INTER, device=dev, dtype=dt, generator=gen) * 0.02
    ms = _time_ms(lambda: moe_grouped_mlp(x, ids, w, gate_up, down))
    flops = 2 * tokens * TOP_K * 3 * HIDDEN * MOE_INTER
    return {"tokens": tokens, "experts": experts, "top_k": TOP_K, "ms": round(ms, 3),
            "tflop_per_s": round(flops / ms / 1e9, 1)}


def run_kernel_bench(peak_gbps: float | None = None) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "tide bench kernels needs CUDA; no CUDA device here"}
    peak = peak_gbps or peak_memory_gbps(torch.cuda.current_device())
    return {
        "device": torch.cuda.get_device_name(),
        "peak_memory_gb_per_s": peak,
        "mla_decode": [bench_mla_decode(b, c, peak) for b in (64, 128) for c in (4096, 32768)],
        # 32 local experts = one shard of 256 experts over 8 GPUs; 256 = all experts on one GPU
        "moe_grouped_gemm": [bench_moe_grouped(t, e) for t, e in ((4096, 32), (16384, 256))],
    }
