"""``tide bench all``: the CPU benchmarks one after another, within a time budget, as one report.

Each benchmark runs with its command's defaults, cheapest first; one that would start after the
budget is spent is listed as skipped, and one that fails keeps its error in the report and the
next one runs. With a trace (``--trace``), the trace replay runs on it too. A reviewer reproduces
every figure with one command; each entry is what the benchmark's own command prints.
"""

from __future__ import annotations

import platform
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch


def _eplb() -> dict[str, Any]:
    from deploy.bench.eplb_bench import run_eplb_bench

    return run_eplb_bench()


def _structured() -> dict[str, Any]:
    from deploy.bench.structured_bench import run_structured_bench

    return run_structured_bench()


def _engine() -> dict[str, Any]:
    from deploy.bench.engine_bench import run_engine_bench, run_itl_bench

    return {**run_engine_bench(), "itl": run_itl_bench()}


def _model() -> dict[str, Any]:
    from deploy.bench.model_bench import run_model_bench

    return run_model_bench(None)


def _ep() -> dict[str, Any]:
    from deploy.bench.ep_bench import run_ep_bench

    return run_ep_bench()


def _unit_io() -> dict[str, Any]:
    from deploy.bench.cache_bench import run_unit_io

    return run_unit_io()


def _directory() -> dict[str, Any]:
    from deploy.bench.directory_bench import run_directory

    return run_directory(None)


def _ttft() -> dict[str, Any]:
    from deploy.bench.ttft_bench import run_ttft

    return run_ttft(None)


def _serve() -> dict[str, Any]:
    from deploy.bench.serve_bench import run_serve_bench

    return run_serve_bench(None)


def _stream() -> dict[str, Any]:
    from deploy.bench.stream_bench import run_stream_bench

    return run_stream_bench(None)


def _trace(path: Path) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        from cachedir.admission import POLICIES
        from deploy.bench.cache_bench import bench_unit_bytes, run_trace

        return run_trace(path, list(POLICIES), None, 0.5, 64, bench_unit_bytes(), None, "lru", None)

    return run


# cheapest first, so a short budget still reports the most benchmarks
BENCHMARKS: dict[str, Callable[[], dict[str, Any]]] = {
    "eplb": _eplb, "structured": _structured, "directory": _directory, "unit-io": _unit_io,
    "engine": _engine, "ttft": _ttft, "model": _model, "ep": _ep, "stream": _stream, "serve": _serve,
}


def run_all(names: list[str], budget_s: float, trace: Path | None = None,
            clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Run ``names`` (of ``BENCHMARKS``; "trace" too with a ``trace``) in order until
    ``budget_s`` seconds have passed; each entry holds its ``seconds`` and ``result``, its
    ``error``, or ``skipped``."""
    table = dict(BENCHMARKS)
    if trace is not None:
        table["trace"] = _trace(trace)
    start = clock()
    report: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"), "budget_s": budget_s,
        "machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "benchmarks": {},
    }
    for name in names:
        if clock() - start >= budget_s:
            report["benchmarks"][name] = {"skipped": f"the {budget_s:g} s budget was spent"}
            continue
        t0 = clock()
        try:
            entry: dict[str, Any] = {"result": table[name]()}
        except Exception as e:  # noqa: BLE001 - the report keeps it; the next benchmark runs
            entry = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=5)}
        entry["seconds"] = round(clock() - t0, 1)
        report["benchmarks"][name] = entry
    report["seconds"] = round(clock() - start, 1)
    return report
