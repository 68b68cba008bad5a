"""``tide stats`` after a replayed load: the report's numbers add up."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest

from cachedir.hashing import Namespace
from cachedir.node_cache import CacheConfig, NodeCache
from cachedir.store import StoreConfig
from cachedir.trace import read_trace
from cluster.daily_report import JsonlLog, NodeSample, UsageRecord
from cluster.engine import Engine, EngineConfig
from cluster.request import GenerationRequest
from model.checkpoint import build_model, random_state_dict
from model.config import named_config
from model.tokenizer import ByteTokenizer
from tests.cli import tide_here
from tests.conftest import require

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
T0 = 1_796_000_000.0
TOKENS_PER_HASH = 32  # the trace's 512-token blocks, scaled down


def _sharing_requests(n: int):
    """The first ``n`` trace requests whose first two blocks another request also starts with
    (so the replay has prefixes to hit), in trace order."""
    from collections import Counter

    reqs = list(islice(read_trace(TRACE), 3000))
    starts = Counter(r.hash_ids[:2] for r in reqs if len(r.hash_ids) >= 3)
    return [r for r in reqs if len(r.hash_ids) >= 3 and starts[r.hash_ids[:2]] >= 2][:n]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """Replay the first requests of the trace through a real engine with a disk cache and log
    every finished request as the serving app does."""
    require(TRACE.is_file(), f"no trace at {TRACE}")  # a failure under CI=true: the trace ships beside the project
    home = tmp_path_factory.mktemp("home")
    cfg = named_config("tiny")
    model = build_model(cfg, random_state_dict(cfg, seed=1))
    cache = NodeCache(CacheConfig(StoreConfig(home / "ssd", capacity_bytes=1 << 30), ram_bytes=32 << 20))
    engine = Engine(model, EngineConfig(num_pages=512, itl_factor=0.0), Namespace(cfg.fingerprint(), "t", "float32", "l", 64),
                    ByteTokenizer().decode, None, cache)
    log = JsonlLog(home / "usage" / "replica-0.jsonl")
    for i, req in enumerate(_sharing_requests(12)):
        hashes = req.hash_ids[:8]  # prompts cut to 8 blocks of 32 tokens so the replay is quick
        prompt = tuple(t for h in hashes for t in ((h * 7 + j) % 250 for j in range(TOKENS_PER_HASH)))
        engine.add_request(GenerationRequest(f"r{i}", prompt, 4))
        for outs in engine.run_to_completion().values():
            o = outs[-1]
            log.append(UsageRecord(T0 + req.timestamp_ms / 1000, o.prompt_tokens, o.cached_tokens,
                                   o.completion_tokens, max(o.decode_s, 1e-3)))
        cache.flush()
    nodes = JsonlLog(home / "nodes.jsonl")
    nodes.append(NodeSample(T0 - 3600, 3))
    nodes.append(NodeSample(T0 + 600, 1))
    return home


def test_stats_json_adds_up(replayed):
    r = tide_here("stats", "--window", "24h", "--now", str(T0 + 20 * 3600), "--price-hit", "1", "--price-miss", "2",
              "--price-output", "4", "--node-hour-cost", "10", "--json", env={"TIDE_HOME": str(replayed)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    records = [json.loads(line) for line in (replayed / "usage" / "replica-0.jsonl").read_text().splitlines()]
    assert out["requests"] == len(records) == 12
    assert out["input_tokens"] == sum(u["prompt_tokens"] for u in records)
    assert out["cache_hit_tokens"] + out["cache_miss_tokens"] == out["input_tokens"]
    assert out["cache_hit_tokens"] > 0  # the trace's shared prefixes hit the disk cache
    assert out["cache_hit_rate"] == round(out["cache_hit_tokens"] / out["input_tokens"], 4)
    assert out["output_tokens"] == 12 * 4
    assert out["revenue"] == pytest.approx(
        (out["cache_hit_tokens"] * 1 + out["cache_miss_tokens"] * 2 + out["output_tokens"] * 4) / 1e6)
    assert out["serving_nodes_peak"] == 3
    # nodes are known from the first sample (T0-1h): 3 until T0+600s, then 1 until T0+20h
    assert out["node_hours"] == pytest.approx(3 * (1 + 600 / 3600) + 1 * (20 - 600 / 3600), rel=1e-3)
    assert out["cost"] == pytest.approx(10 * out["node_hours"], rel=1e-3)
    for field in ("avg_output_tokens_per_s", "avg_kv_length", "serving_nodes_avg", "margin"):
        assert out[field] is not None


def test_stats_table_and_bad_arguments(replayed):
    env = {"TIDE_HOME": str(replayed)}
    r = tide_here("stats", "--now", str(T0 + 3600), "--node-hour-cost", "1000", env=env)
    assert r.returncode == 0 and "cache hit rate" in r.stdout
    out = json.loads(tide_here("stats", "--now", str(T0 + 3600), "--node-hour-cost", "1000", "--json", env=env).stdout)
    assert out["margin"] < 0 and f"{100 * out['margin']:,.1f}%" in r.stdout  # a margin reads as a percentage...
    assert f"cost is {1 - out['margin']:,.1f}x the revenue" in r.stdout  # ... with what a negative one means
    r = tide_here("stats", "--window", "yesterday", env=env)
    assert r.returncode == 2 and "'yesterday'" in r.stderr
    r = tide_here("stats", "--usage-dir", "/nonexistent", env=env)
    assert r.returncode == 2 and "/nonexistent" in r.stderr.replace("\n", "").replace("│", "")


def test_stats_plot_draws_the_daily_chart(replayed, tmp_path):
    env = {"TIDE_HOME": str(replayed)}
    png = tmp_path / "day.png"
    r = tide_here("stats", "--now", str(T0 + 20 * 3600), "--plot", str(png), "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["plot"] == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # a drawn chart, not an empty canvas
    r = tide_here("stats", "--plot", str(tmp_path / "day.txt"), env=env)
    assert r.returncode == 2 and "day.txt" in r.stderr
