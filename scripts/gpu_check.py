"""The GPU checks in one run with a clear verdict, phase by phase, each within its own budget.

A lent GPU comes rarely and for minutes, cold (nothing compiled), with no package registry: this
runs on the machine's own python, torch and triton and imports nothing else of the environment
(not pydantic, Ray, Redis or FastAPI). Phases:

- ``env``: the device, torch and triton, and that the modules the checks use import.
- ``tests``: the GPU-marked tests (the model on CUDA against ``transformers``, CUDA graphs of the
  decode step, expert shards on CUDA), two pytest processes side by side, each stopping at its
  first failure; no CPU kernel is built (``TIDE_CPU_KERNELS=0``).
- ``kernels``: the Triton kernels at DeepSeek-V3's shapes, each case checked against its torch
  reference (error) and timed against the device's peak (efficiency): MLA decode at batch 64 x
  4K and batch 1 x 128K, with 128 and 16 heads; the grouped expert GEMM on prefill and decode
  batches; DeepSeek's fp8 GEMM at M = 64 and 4096 and its grouped experts.
- ``mtp``: MTP speculative decoding on CUDA, where a replica drafts by default: the default
  model's engine decode tokens/s with and without drafts at batch 1 and 8 (CUDA graphs, bf16;
  ``deploy.bench.mtp_bench``), its drafts' acceptance, and whether drafting pays at batch 1.

Every case prints one JSON line as it finishes, every phase one line with its outcome; the last
line is the verdict (exit status 0 when every phase passed). ``--dry-run`` runs the same phases
on the CPU in Triton's interpreter at toy shapes (errors checked, efficiency not), so the script
itself is tested where there is no GPU.

Usage: ``scripts/gpu-check.sh [--dry-run] [--min-efficiency SCALE] [--phases env,tests,kernels,mtp]``;
output also under ``$OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the GPU-marked tests, named by file (collecting every test module would import packages a GPU
# image may lack), in two processes side by side
TESTS = (["tests/model/test_gpu.py", "tests/model/test_fixed_decode.py", "-m", "gpu"],
         ["tests/cluster/test_ep.py", "tests/cluster/test_engine.py", "-m", "gpu"])


@dataclass(frozen=True)
class Phase:
    name: str
    budget_s: float  # on a GPU; a dry run gets its own


# 550 s in all: on a lent GPU, two calls (``--phases env,tests,mtp``, 320 s, then ``--phases
# kernels``, 230 s) within the 600 s a call may run and, with a machine's start, the device budget
PHASES = (Phase("env", 30), Phase("tests", 200), Phase("kernels", 230), Phase("mtp", 90))
DRY_BUDGETS = {"env": 60, "tests": 120, "kernels": 240, "mtp": 120}
# MTP at batch 1 on CUDA, where drafting is on by default: its drafts must be mostly accepted
# (the default model accepts 85-91% on the CPU) and the step must pay (judged on a GPU only).
# MTP_GOAL is the speedup the project aims for at batch 1 (medians of MTP_REPEATS runs): reported
# as met or not, without failing the phase.
MTP_FLOORS = {"acceptance": 0.5, "speedup": 1.0}
MTP_GOAL = 1.4
MTP_REPEATS = 5


@dataclass(frozen=True)
class Case:
    """One kernel check: ``run(device, toy)`` returns the bench's figures; ``limits`` are the
    errors that must not be exceeded and ``floors`` the efficiencies that must be reached
    (keys of the figures; floors scaled by ``--min-efficiency``, and skipped in a dry run)."""

    name: str
    run: Callable[[str, bool], dict]
    limits: dict[str, float]
    floors: dict[str, float]


def _shapes(toy: bool):
    from deploy.bench.kernel_bench import V3, Shapes

    # toy: small enough for the interpreter, fp8's 128-wide blocks kept
    return Shapes(heads=4, kv_lora_rank=32, rope_dim=16, hidden=128, moe_inter=128, top_k=2) if toy else V3


def _peaks(device: str) -> tuple[float | None, float | None, float | None]:
    """(memory GB/s, BF16 and FP8 dense TFLOP/s) of the device, where known."""
    from deploy.bench.kernel_bench import peak_fp8_tflops, peak_memory_gbps

    if device != "cuda":
        return None, None, None
    import torch

    name = torch.cuda.get_device_name()
    fp8 = peak_fp8_tflops(name)
    return peak_memory_gbps(torch.cuda.current_device()), fp8 / 2 if fp8 else None, fp8


def _mla(batch: int, context: int, heads: int | None = None):
    def run(device: str, toy: bool) -> dict:
        import dataclasses

        from deploy.bench.kernel_bench import bench_mla_decode

        shapes = _shapes(toy)
        if heads is not None and not toy:
            shapes = dataclasses.replace(shapes, heads=heads)
        b, c = (min(batch, 2), min(context, 256)) if toy else (batch, context)
        return bench_mla_decode(b, c, _peaks(device)[0], shapes, device)
    return run


def _moe(tokens: int, experts: int):
    def run(device: str, toy: bool) -> dict:
        from deploy.bench.kernel_bench import bench_moe_grouped

        gbps, bf16, _ = _peaks(device)
        t, e = (min(tokens, 16), min(experts, 4)) if toy else (tokens, experts)
        out = bench_moe_grouped(t, e, _shapes(toy), device, gbps)
        out["fraction_of_bf16_peak"] = round(out["tflop_per_s"] / bf16, 3) if bf16 else None
        return out
    return run


def _fp8(tokens: int):
    def run(device: str, toy: bool) -> dict:
        from deploy.bench.kernel_bench import bench_fp8_linear

        gbps, _, fp8 = _peaks(device)
        t, n, k = (min(tokens, 16), 256, 256) if toy else (tokens, 7168, 16384)
        out = bench_fp8_linear(t, n, k, fp8, device)
        weights_gbps = n * k / out["ms"] / 1e6  # e4m3: a byte per weight, read once
        out["weight_fraction_of_peak_bandwidth"] = round(weights_gbps / gbps, 3) if gbps else None
        return out
    return run


def _moe_fp8(tokens: int, experts: int):
    def run(device: str, toy: bool) -> dict:
        from deploy.bench.kernel_bench import bench_moe_grouped_fp8

        t, e = (min(tokens, 16), min(experts, 4)) if toy else (tokens, experts)
        return bench_moe_grouped_fp8(t, e, _shapes(toy), device, _peaks(device)[2])
    return run


# Error limits: bf16 MLA against its float reference; relative errors of the grouped GEMM (bf16)
# and of fp8 against bf16 (e4m3 keeps 3 mantissa bits). Efficiency floors: where the kernel is
# bound by memory, its share of the peak bandwidth; where by tensor cores, of the peak FLOP/s.
CASES = (
    Case("mla_decode_b64_4k", _mla(64, 4096), {"max_abs_err": 0.05}, {"fraction_of_peak": 0.25}),
    Case("mla_decode_b1_128k", _mla(1, 131072), {"max_abs_err": 0.05}, {"fraction_of_peak": 0.2}),
    Case("mla_decode_16_heads_b64_32k", _mla(64, 32768, heads=16), {"max_abs_err": 0.05}, {"fraction_of_peak": 0.4}),
    Case("moe_grouped_prefill_4096x32", _moe(4096, 32), {"max_rel_err": 0.02}, {"fraction_of_bf16_peak": 0.2}),
    Case("moe_grouped_decode_64x32", _moe(64, 32), {"max_rel_err": 0.02}, {"fraction_of_peak_bandwidth": 0.25}),
    Case("fp8_linear_m64", _fp8(64), {"max_rel_err_vs_bf16": 0.06}, {"weight_fraction_of_peak_bandwidth": 0.25}),
    Case("fp8_linear_m4096", _fp8(4096), {"max_rel_err_vs_bf16": 0.06}, {"fraction_of_fp8_peak": 0.25}),
    Case("moe_grouped_fp8_4096x32", _moe_fp8(4096, 32), {"max_rel_err_vs_bf16": 0.1}, {"fraction_of_fp8_peak": 0.15}),
)


def failures(case: Case, figures: dict, efficiency: float | None) -> list[str]:
    """What a case's figures miss: an error over its limit, an efficiency under its floor times
    ``efficiency`` (None: efficiency not judged)."""
    out = [f"{k} {figures.get(k)} > {v}" for k, v in case.limits.items()
           if figures.get(k) is None or figures[k] > v]
    if efficiency:
        out += [f"{k} {figures.get(k)} < {v * efficiency:.3f}" for k, v in case.floors.items()
                if figures.get(k) is None or figures[k] < v * efficiency]
    return out


def emit(record: dict, log) -> None:
    line = json.dumps(record, default=str)
    print(line, flush=True)
    log.write(line + "\n")
    log.flush()


# -- phases, each run as a child process with its budget ----------------------------------------
def run_env(dry: bool) -> dict:
    import torch
    import triton

    import kernels.fp8_gemm  # noqa: F401 - what the kernel phase imports, checked up front
    import kernels.mla_decode  # noqa: F401
    import kernels.moe_grouped  # noqa: F401
    from deploy.bench import kernel_bench  # noqa: F401

    unwanted = sorted(m for m in ("pydantic", "ray", "redis", "fastapi") if m in sys.modules)
    out = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.cuda.is_available(),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "interpreter": os.environ.get("TRITON_INTERPRET") == "1", "imports_beyond_torch": unwanted}
    if unwanted:
        raise RuntimeError(f"the checks import {unwanted}, which a GPU image may lack")
    if not dry and not out["cuda"]:
        raise RuntimeError("no CUDA device (use --dry-run without one)")
    return out


def run_kernels(dry: bool, efficiency: float, log) -> bool:
    device = "cpu" if dry else "cuda"
    ok = True
    for case in CASES:
        t0 = time.monotonic()
        try:
            figures = case.run(device, dry)
            missed = failures(case, figures, None if dry else efficiency)
        except Exception as e:  # noqa: BLE001 - reported as the case's failure
            figures, missed = {}, [f"{type(e).__name__}: {e}"]
        ok &= not missed
        emit({"phase": "kernels", "case": case.name, "ok": not missed, "failures": missed,
              "seconds": round(time.monotonic() - t0, 1), **figures}, log)
    return ok


def run_mtp(dry: bool, log) -> bool:
    """The default model's decode with and without MTP drafts (``deploy.bench.mtp_bench``): on
    CUDA at batch 1 and 8; a dry run at batch 1 on the CPU, a few tokens, judged on acceptance
    only."""
    from deploy.bench.mtp_bench import mtp_decode_bench
    from model.default import default_checkpoint

    t0 = time.monotonic()
    try:
        if dry:
            out = mtp_decode_bench(default_checkpoint(), tokens=8, repeats=1, batches=(1,))
        else:
            out = mtp_decode_bench(default_checkpoint(), tokens=64, repeats=MTP_REPEATS, batches=(1, 8),
                                   device="cuda", dtype="bfloat16")
        one = out["1"]
        figures = {"acceptance": one["acceptance_per_position"][0], "speedup": one["speedup"]}
        missed = [f"{k} {figures[k]} < {v}" for k, v in MTP_FLOORS.items() if not (dry and k == "speedup")
                  and figures[k] < v]
        out = {"goal": {"speedup_at_batch_1": MTP_GOAL, "met": one["speedup"] >= MTP_GOAL}, **out}
    except Exception as e:  # noqa: BLE001 - reported as the phase's failure
        out, missed = {}, [f"{type(e).__name__}: {e}"]
    emit({"phase": "mtp", "case": "mtp_decode", "ok": not missed, "failures": missed,
          "seconds": round(time.monotonic() - t0, 1), **out}, log)
    return not missed


def _tests(dry: bool, budget_s: float, out_dir: Path) -> dict:
    """The GPU-marked tests, two pytest processes side by side (a dry run collects them only)."""
    env = {**os.environ, "TIDE_CPU_KERNELS": "0", "PYTHONPATH": str(ROOT)}
    procs = []
    for i, args in enumerate(TESTS):
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rs", *args]
        cmd += ["--collect-only"] if dry else []
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(out_dir / f"tests-{i}.log", "w"),
                                      stderr=subprocess.STDOUT))
    deadline = time.monotonic() + budget_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append("timeout")
    tails = [(out_dir / f"tests-{i}.log").read_text().strip().splitlines()[-1:] for i in range(len(TESTS))]
    return {"codes": codes, "summaries": [t[0] if t else "" for t in tails],
            "ok": all(c == 0 for c in codes)}


def _child(phase: str, dry: bool, efficiency: float, budget_s: float, log) -> dict:
    """Run ``phase`` in a child process within ``budget_s``, relaying its JSON lines."""
    cmd = [sys.executable, __file__, "--phase", phase, "--min-efficiency", str(efficiency)] + (["--dry-run"] if dry else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def relay() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("{"):
                print(line, end="", flush=True)
                log.write(line)
                log.flush()

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "timeout"
    reader.join(timeout=5)
    other = [ln for ln in lines if not ln.startswith("{")][-5:]
    return {"ok": code == 0, "code": code, **({"output": other} if code != 0 and other else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, in Triton's interpreter, at toy shapes")
    ap.add_argument("--min-efficiency", type=float, default=1.0,
                    help="scale of the efficiency floors (0: judge errors only)")
    ap.add_argument("--phases", default=",".join(p.name for p in PHASES),
                    help="the phases to run, comma-separated (always in the order env, tests, kernels, mtp; default: all)")
    ap.add_argument("--phase", choices=[p.name for p in PHASES], help=argparse.SUPPRESS)  # a child's
    a = ap.parse_args(argv)
    chosen = [x for x in a.phases.split(",") if x]
    unknown = sorted(set(chosen) - {p.name for p in PHASES})
    if unknown or not chosen:
        ap.error(f"--phases {a.phases!r}: choose among {', '.join(p.name for p in PHASES)}")
    phases = [p for p in PHASES if p.name in chosen]
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    out_dir = Path(os.environ.get("OUT", ROOT / "gpu-check"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.phase is not None:  # a child: run one phase, its lines on stdout
        with open(os.devnull, "w") as sink:
            if a.phase == "env":
                emit({"phase": "env", **run_env(a.dry_run)}, sink)
                return 0
            if a.phase == "mtp":
                return 0 if run_mtp(a.dry_run, sink) else 1
            return 0 if run_kernels(a.dry_run, a.min_efficiency, sink) else 1
    with open(out_dir / "gpu-check.jsonl", "w") as log:
        budgets = {p.name: DRY_BUDGETS[p.name] if a.dry_run else p.budget_s for p in phases}
        emit({"plan": [{"phase": p, "budget_s": b} for p, b in budgets.items()], "dry_run": a.dry_run}, log)
        results, t_all = {}, time.monotonic()
        for p in phases:
            t0 = time.monotonic()
            if p.name == "tests":
                result = _tests(a.dry_run, budgets[p.name], out_dir)
            else:
                result = _child(p.name, a.dry_run, a.min_efficiency, budgets[p.name], log)
            result["seconds"] = round(time.monotonic() - t0, 1)
            results[p.name] = result
            emit({"phase": p.name, "budget_s": budgets[p.name], **result}, log)
            if p.name == "env" and not result["ok"]:
                break  # nothing else can run
        verdict = "pass" if all(r["ok"] for r in results.values()) and len(results) == len(phases) else "fail"
        emit({"verdict": verdict, "seconds": round(time.monotonic() - t_all, 1),
              "failed": [n for n, r in results.items() if not r["ok"]]}, log)
    return 0 if verdict == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
