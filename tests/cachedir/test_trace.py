"""Trace replay through the real admission and eviction code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachedir.admission import AllUnits, DeepSeekPrefixes, SecondSight
from cachedir.trace import read_trace, replay, unique_unit_count
from tests.conftest import require

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_small_trace_hits_exactly_the_shared_prefix(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 10, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 20, "input_length": 700, "output_length": 10, "hash_ids": [1, 9]},
    ])
    r = replay(read_trace(trace), "all", unit_bytes=100)
    # request 2 hits blocks 1 and 2 (16 units); request 3 hits block 1 (8 units)
    assert r.hit_tokens == 16 * 64 + 8 * 64 == r.upper_bound_hit_tokens
    assert r.prompt_tokens == 1100 + 1024 + 700


def test_malformed_line_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(read_trace(bad))


def test_admission_policies():
    keys = [bytes([i]) * 16 for i in range(10)]
    assert AllUnits().on_input_end(keys[:4]).units == [0, 1, 2, 3]
    s = SecondSight()
    assert s.on_input_end(keys[:4]).units == []
    assert s.on_input_end(keys[:6]).units == [0, 1, 2, 3]
    d = DeepSeekPrefixes(every_units=4)
    first = d.on_input_end(keys[:9])
    assert first.prefixes == [4, 8, 9]  # every 4 units, and the end of the input
    second = d.on_input_end(keys[:6] + [b"x" * 16] * 3)
    assert 6 in second.prefixes  # the common prefix with the first request became a boundary
    out = d.on_output_end(keys[:9] + [b"y" * 16] * 5, num_input_units=9)
    assert out.prefixes == [13, 14]


@pytest.mark.slow
def test_shared_trace_unlimited_all_equals_the_upper_bound_and_all_beats_deepseek():
    require(SHARED_TRACE.is_file(), f"no shared trace at {SHARED_TRACE}")  # a failure under CI=true: the trace ships beside the project
    requests = list(read_trace(SHARED_TRACE, limit=1500))
    unlimited = replay(requests, "all")
    assert unlimited.hit_tokens == unlimited.upper_bound_hit_tokens > 0
    cap = int(unique_unit_count(requests) * 327_680 * 0.25)
    rates = {p: replay(requests, p, cap).hit_tokens for p in ("all", "deepseek", "second-sight")}
    assert rates["all"] >= rates["deepseek"]
