"""The benchmark commands print one JSON object with the promised fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _tide(*args):
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", *args], capture_output=True,
                       text=True, timeout=600, env={**os.environ})
    return r


def test_bench_trace_json(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 8,
                                         "hash_ids": [i % 3, 100 + i]}) + "\n" for i in range(20)))
    r = _tide("trace", "--trace", str(trace), "--policy", "every", "--capacity-fraction", "0.5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {p["policy"] for p in out["policies"]} == {"all", "deepseek", "second-sight"}
    for p in out["policies"]:
        assert {"token_hit_rate", "upper_bound_hit_rate", "bytes_written", "bytes_read", "evictions"} <= set(p)


@pytest.mark.parametrize("args, message", [
    (["trace", "--trace", "/nope.jsonl"], "/nope.jsonl"),
    (["trace", "--trace", __file__, "--policy", "fifo"], "fifo"),
    (["trace", "--trace", __file__, "--unit", "100"], "100"),
])
def test_bench_trace_bad_arguments(args, message):
    r = _tide(*args)
    assert r.returncode == 2 and message in r.stderr.replace("\n", " ").replace("│", "")


@pytest.mark.redis
def test_bench_directory_json():
    r = _tide("directory", "--units", "300", "--lookups", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["round_trips_per_lookup"] == 1.0
    assert out["lookups_per_s"] > 0 and out["p99_lookup_ms"] > 0 and out["registrations_per_s"] > 0


def test_bench_unit_io_json(tmp_path):
    r = _tide("unit-io", "--dir", str(tmp_path), "--total-mb", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for shape in ("bench_model", "deepseek_v3"):
        assert out[shape]["write_gb_per_s"] > 0 and out[shape]["raw_read_gb_per_s"] > 0


def test_bench_kernels_without_cuda_says_so_and_exits_0():
    import torch

    r = _tide("kernels", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    if torch.cuda.is_available():
        assert out["mla_decode"] and all(m["gb_per_s"] > 0 for m in out["mla_decode"])
        assert all(g["tflop_per_s"] > 0 for g in out["moe_grouped_gemm"])
    else:
        assert "needs CUDA" in out["skipped"]
