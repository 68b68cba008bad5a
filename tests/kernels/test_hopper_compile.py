"""Every Triton kernel, in every tuning config, compiles for Hopper (sm_90) without a GPU, within
an SM's shared memory and without spilling registers; the 64-row tiles use Hopper's warpgroup
MMA (HGMMA; QGMMA for the fp8 GEMMs). What the kernels compute is checked by the interpreter tests beside this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.hopper_compile import SM90_SHARED_BYTES, TUNED_WITH_TRITON

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # compiling every config takes ~15 s: not the inner loop


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.hopper_compile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_config_compiles_for_hopper(compiled):
    from kernels.fp8_gemm import FP8_CONFIGS
    from kernels.mla_decode import MLA_CONFIGS
    from kernels.moe_grouped import BLOCK_ROWS, GROUPED_CONFIGS

    kernels = {r["kernel"] for r in compiled}
    assert kernels == {"_mla_decode_split", "_mla_decode_merge", "_gate_up_silu", "_down_weighted",
                       "_moe_route_v3", "_copy_pages", "_quantize_rows", "_fp8_matmul", "_gate_up_silu_fp8",
                       "_down_weighted_fp8"}
    assert sum(r["kernel"] == "_mla_decode_split" for r in compiled) == len(MLA_CONFIGS)
    assert sum(r["kernel"] == "_gate_up_silu" for r in compiled) == len(BLOCK_ROWS) * len(GROUPED_CONFIGS)
    assert sum(r["kernel"] == "_fp8_matmul" for r in compiled) == len(FP8_CONFIGS)
    assert sum(r["kernel"] == "_gate_up_silu_fp8" for r in compiled) == len(BLOCK_ROWS)
    failed = [r for r in compiled if "error" in r]
    assert not failed, failed


def _tuned_compiler() -> None:
    import triton

    if triton.__version__ != TUNED_WITH_TRITON:
        pytest.skip(f"configs were checked with Triton {TUNED_WITH_TRITON}, this is {triton.__version__}")


def test_no_config_spills_or_overflows_shared_memory(compiled):
    _tuned_compiler()
    ok = [r for r in compiled if "error" not in r]
    assert [r for r in ok if r["spill_bytes"]] == []
    assert [r for r in ok if r["shared_bytes"] > SM90_SHARED_BYTES] == []


def test_64_row_tiles_use_warpgroup_mma(compiled):
    _tuned_compiler()
    wide = [r for r in compiled if "error" not in r and
            (r["constexprs"].get("BLOCK_H", 0) >= 64 or r["constexprs"].get("BM", 0) >= 64)]
    fp8 = {"_fp8_matmul", "_gate_up_silu_fp8", "_down_weighted_fp8"}
    assert wide and all(r["tensor_core"] == ("QGMMA" if r["kernel"] in fp8 else "HGMMA") for r in wide), wide
    # narrower tiles use one warp's MMA (Hopper has no warp-level fp8 MMA: fp8 is widened to fp16)
    narrow_dots = [r for r in compiled if r["kernel"] in ("_mla_decode_split", "_gate_up_silu", *fp8) and r not in wide]
    assert narrow_dots and all(r["tensor_core"] == "HMMA" for r in narrow_dots)


def test_the_mla_cases_are_the_engines_shapes():
    """What is compiled is what runs: the engine's pages (EngineConfig.page_size) and its block
    tables (int64, cluster.kv_manager), and one merge tile for every split count."""
    from cluster.engine_config import EngineConfig
    from cluster.kv_manager import long_tensor
    from kernels.mla_decode import MERGE_SPLITS
    from tests.kernels.hopper_compile import cases

    mla = [c for c in cases() if c.module == "kernels.mla_decode"]
    table_type = {"torch.int64": "i64", "torch.int32": "i32"}[str(long_tensor([1]).dtype)]
    for case in mla:
        if case.kernel == "_mla_decode_split":
            assert case.constexprs["Z"] == EngineConfig().page_size and case.pointers["block_table"] == table_type
        else:
            assert case.constexprs["BLOCK_C"] == MERGE_SPLITS
