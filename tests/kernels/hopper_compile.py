"""Compile every Triton kernel, in every tuning config, for Hopper (sm_90) without a GPU.

The interpreter tests check what the kernels compute; they cannot see what only the GPU compiler
sees: a tile shape ``tl.dot`` rejects, a config that needs more shared memory than an SM has, or
one that spills registers to local memory (slow). Triton's wheel carries ``ptxas`` and
``cuobjdump``, so this compiles each kernel ahead of time for sm_90 at the shapes tideserve runs
(DeepSeek-V3's: 128 heads, kv_lora_rank 512, rope 64; hidden 7168, expert width 2048) and reads
the resource usage of the cubin.

Run as ``python -m tests.kernels.hopper_compile`` (prints one JSON line per kernel config). It must
run without ``TRITON_INTERPRET``: under the interpreter ``triton.jit`` makes no compilable kernel,
so ``test_hopper_compile.py`` runs it in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one block may take on an H100/H200
# The compiler the tile configs were checked with (scripts/setup.sh pins it on CPU machines);
# another version may allocate registers differently.
TUNED_WITH_TRITON = "3.9.0"


@dataclass
class Case:
    """One kernel compiled with one set of constexprs and launch options."""

    module: str
    kernel: str
    pointers: dict[str, str]  # pointer argument -> element type ("bf16", "fp32", "i32", "i64")
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 2
    floats: tuple[str, ...] = ("scale", "scaling")
    # Integer arguments that need not be multiples of 16 at these shapes; every other one is (the
    # strides and sizes of DeepSeek-V3's tensors), and Triton specializes a launch on that.
    unaligned: tuple[str, ...] = ("num_splits", "num_tokens")


def cases() -> list[Case]:
    from kernels.mla_decode import MLA_CONFIGS
    from kernels.moe_grouped import BLOCK_ROWS, GROUPED_CONFIGS

    out = []
    # the engine's: int64 block tables of 16-token pages (cluster.kv_manager, EngineConfig.page_size)
    mla_ptrs = {"q_lat": "bf16", "q_rope": "bf16", "kv": "bf16", "block_table": "i64",
                "seq_lens": "i32", "part_out": "fp32", "part_lse": "fp32"}
    for cfg in MLA_CONFIGS:
        out.append(Case("kernels.mla_decode", "_mla_decode_split", mla_ptrs,
                        dict(R=512, P=64, Z=16, BLOCK_R=512, BLOCK_P=64, UPCAST=False, **cfg.kwargs),
                        cfg.num_warps, cfg.num_stages))
    from kernels.mla_decode import MERGE_SPLITS

    out.append(Case("kernels.mla_decode", "_mla_decode_merge",
                    {"part_out": "fp32", "part_lse": "fp32", "out": "bf16"},
                    dict(R=512, BLOCK_R=512, BLOCK_C=MERGE_SPLITS)))
    for bm in BLOCK_ROWS:
        for cfg in GROUPED_CONFIGS:
            out.append(Case("kernels.moe_grouped", "_gate_up_silu",
                            {"x": "bf16", "gate_up": "bf16", "rows": "i32", "block_expert": "i32", "h": "bf16"},
                            dict(TOPK=8, BM=bm, UPCAST=False, **cfg.kwargs), cfg.num_warps, cfg.num_stages))
            out.append(Case("kernels.moe_grouped", "_down_weighted",
                            {"h": "bf16", "down": "bf16", "rows": "i32", "block_expert": "i32",
                             "weights": "fp32", "y": "fp32"},
                            dict(BM=bm, UPCAST=False, **cfg.kwargs), cfg.num_warps, cfg.num_stages))
    out.append(Case("kernels.moe_route", "_moe_route_v3",
                    {"logits": "fp32", "bias": "fp32", "ids_out": "i32", "w_out": "fp32"},
                    dict(E=256, G=8, K=8, KG=4, BLOCK_T=4, BLOCK_G=8, BLOCK_F=32, BLOCK_K=8,
                         HAS_BIAS=True, NORM=True)))
    from kernels.fp8_gemm import FP8_CONFIGS, GROUPED_FP8_BN, grouped_fp8_launch

    out.append(Case("kernels.fp8_gemm", "_quantize_rows", {"x": "bf16", "q": "fp8e4nv", "s": "fp32"}, dict(SK=128)))
    for cfg in FP8_CONFIGS:
        out.append(Case("kernels.fp8_gemm", "_fp8_matmul",
                        {"a": "fp8e4nv", "a_s": "fp32", "w": "fp8e4nv", "w_s": "fp32", "out": "bf16"},
                        dict(SN=128, SK=128, **cfg.kwargs), cfg.num_warps, cfg.num_stages, unaligned=("M",)))
    for bm in BLOCK_ROWS:
        out.append(Case("kernels.fp8_gemm", "_gate_up_silu_fp8",
                        {"x": "fp8e4nv", "x_s": "fp32", "gate_up": "fp8e4nv", "gate_up_s": "fp32", "rows": "i32",
                         "block_expert": "i32", "h": "fp32"},
                        dict(TOPK=8, SN=128, SK=128, BM=bm, BN=GROUPED_FP8_BN), **grouped_fp8_launch(bm)))
        out.append(Case("kernels.fp8_gemm", "_down_weighted_fp8",
                        {"h": "fp8e4nv", "h_s": "fp32", "down": "fp8e4nv", "down_s": "fp32", "rows": "i32",
                         "block_expert": "i32", "weights": "fp32", "y": "fp32"},
                        dict(SN=128, SK=128, BM=bm, BN=GROUPED_FP8_BN), **grouped_fp8_launch(bm)))
    for to_units in (True, False):
        out.append(Case("kernels.unit_copy", "_copy_pages",
                        {"pool": "bf16", "units": "bf16", "unit_pages": "i32"},
                        dict(Z=64, BLOCK_D=256, TO_UNITS=to_units)))
    return out


def compile_case(case: Case) -> dict[str, object]:
    """Compile ``case`` for sm_90; returns its registers, spill bytes and shared memory."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.autotuner import Autotuner

    fn = getattr(importlib.import_module(case.module), case.kernel)
    if isinstance(fn, Autotuner):  # an autotuned kernel wraps the JIT function
        fn = fn.fn
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in case.constexprs:
            signature[name] = "constexpr"
        elif name in case.pointers:
            signature[name] = "*" + case.pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif name in case.floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name not in case.unaligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    result: dict[str, object] = {
        "kernel": case.kernel,
        "constexprs": {k: v for k, v in case.constexprs.items() if k.startswith(("BLOCK", "BM", "BN", "BK"))},
        "num_warps": case.num_warps,
        "num_stages": case.num_stages,
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=case.constexprs, attrs=attrs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": case.num_warps, "num_stages": case.num_stages})
    except Exception as e:  # noqa: BLE001 - report which config fails and why (ptxas's own words)
        lines = [ln for ln in str(e).splitlines() if "fatal" in ln or "error" in ln.lower()]
        return result | {"error": " / ".join(lines[:3]) or type(e).__name__}
    usage, sass = _inspect(kernel.asm["cubin"])
    return result | {
        "registers": usage["REG"],
        "spill_bytes": usage["LOCAL"] + usage["STACK"],
        "shared_bytes": kernel.metadata.shared,
        # warpgroup MMA: HGMMA (16-bit inputs), QGMMA (fp8); HMMA / QMMA: one warp's
        "tensor_core": next((op for op in ("HGMMA", "QGMMA", "HMMA", "QMMA") if op in sass), None),
    }


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _inspect(cubin: bytes) -> tuple[dict[str, int], str]:
    """(resource usage: REG, LOCAL, STACK, SHARED ..., SASS text) of a one-kernel cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage, sass = (subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True, text=True,
                                      check=True).stdout for flag in ("--dump-resource-usage", "--dump-sass"))
    line = next(ln for ln in usage.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}, sass


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter makes no compilable kernels", file=sys.stderr)
        return 2
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for result in pool.map(compile_case, cases()):
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
