"""The benchmark commands print one JSON object with the promised fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli import tide, tide_here
from tests.conftest import require


def test_bench_trace_json(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 8,
                                         "hash_ids": [i % 3, 100 + i]}) + "\n" for i in range(20)))
    r = tide_here("bench", "trace", "--trace", str(trace), "--policy", "every", "--capacity-fraction", "0.5", "--json")
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
    r = tide_here("bench", *args)
    assert r.returncode == 2 and message in r.stderr.replace("\n", " ").replace("│", "")


@pytest.mark.redis
def test_bench_directory_json(tmp_path):
    """One Redis and a 3-primary cluster run the same work: the same chain, the same trace with
    the same hits (the directory answers alike); the cluster splits it over its primaries."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 2048 + 64 * (i % 5), "output_length": 8,
                                         "hash_ids": [i % 4, 100 + i % 7, 200 + i, 300 + i, 400 + i]}) + "\n"
                             for i in range(60)))
    r = tide("bench", "directory", "--units", "1000", "--lookups", "8", "--clients", "4", "--trace", str(trace), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    single, cluster = out["single"], out["cluster"]
    assert cluster["primaries"] == 3 and cluster["url"].startswith("redis+cluster://")
    for store in (single, cluster):
        chain = store["chain"]
        assert chain["chain_units"] == 1000 and 1 <= chain["round_trips_per_lookup"] <= 4  # log16 of 1,000, and the first
        assert chain["lookups_per_s"] > 0 and chain["p99_lookup_ms"] >= chain["p50_lookup_ms"] > 0
        # Redis's own cost: a lookup's command time, and its memory per unit (a hash, a set member:
        # well over a key's 16 bytes, well under a kilobyte)
        assert chain["redis_us_per_lookup"] > 0 and 32 < chain["redis_bytes_per_unit"] < 1024
        assert store["concurrent"]["clients"] == 4 and store["concurrent"]["lookups"] == 4 * 2
    assert single["trace"]["requests"] == cluster["trace"]["requests"] == 60
    assert single["trace"]["hit_units_fraction"] == cluster["trace"]["hit_units_fraction"] > 0
    assert len(cluster["trace"]["command_usec_per_primary"]) == 3 and cluster["trace"]["cluster_imbalance"] >= 1.0
    assert "cluster_imbalance" not in single["trace"]
    bad = tide_here("bench", "directory", "--redis-url", "memcached://x")
    assert bad.returncode == 2 and "memcached://x" in bad.stderr


def test_bench_unit_io_json(tmp_path):
    """Each layout beside fio's raw figure for the block that layout reads (one unit; a
    segment's coalesced run, up to 4 MiB or one unit)."""
    require(shutil.which("fio") is not None, "fio is not installed (scripts/test.sh installs it; --fast does not)")
    r = tide_here("bench", "unit-io", "--dir", str(tmp_path), "--total-mb", "8", "--repeats", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["io_threads"] == 4 and "O_DIRECT" in out["raw"] and out["repeats"] == 1
    assert out["cpus"] >= 1 and out["machine"] and out["torch"]  # where it ran
    for shape in ("bench_model", "deepseek_v3"):
        unit = out[shape]["unit_bytes"]
        assert out[shape]["unit"]["block_bytes"] == unit
        assert out[shape]["segment"]["block_bytes"] == max(unit, min(4 << 20, 128 * unit))
        for layout in ("unit", "segment"):
            figures = out[shape][layout]
            assert figures["fio_read_gb_per_s"] > 0 and figures["write_gb_per_s"] > 0
            assert figures["read_fraction_of_raw"] == pytest.approx(
                figures["read_gb_per_s"] / figures["fio_read_gb_per_s"], rel=0.01, abs=0.002)
        seal = out[shape]["integrity"]  # units are sealed and opened (AES-256-GCM), per unit on one core
        assert seal["seal"] == "AES-256-GCM" and seal["open_gb_per_s"] > 0 and seal["seal_us_per_unit"] > 0
        fio = max(out[shape][layout]["fio_read_gb_per_s"] for layout in ("unit", "segment"))
        assert seal["open_over_fio_read"] == pytest.approx(seal["open_gb_per_s"] / fio, rel=0.02)
    r = tide_here("bench", "unit-io", "--dir", str(tmp_path), "--total-mb", "8", "--layout", "segment", "--layout", "tape")
    assert r.returncode == 2 and "tape" in r.stderr


def test_bench_kernels_without_cuda_says_so_and_exits_0():
    import torch

    r = tide_here("bench", "kernels", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    if torch.cuda.is_available():
        assert out["mla_decode"] and all(m["gb_per_s"] > 0 for m in out["mla_decode"])
        assert all(g["tflop_per_s"] > 0 for g in out["moe_grouped_gemm"])
    else:
        assert "needs CUDA" in out["skipped"]


def test_kernel_bench_cases_check_then_time_the_kernels_at_small_shapes():
    """The bench's own code at toy shapes (the kernels in the interpreter on CPU), so the one GPU
    run a session gets is not spent on a bug in the bench."""
    import torch

    from deploy.bench.kernel_bench import Shapes, bench_mla_decode, bench_moe_grouped

    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = Shapes(heads=4, kv_lora_rank=32, rope_dim=16, hidden=64, moe_inter=32, top_k=2, page_size=16)
    mla = bench_mla_decode(2, 100, 1000.0, small, device)
    assert mla["max_abs_err"] < 0.05 and mla["ms"] > 0 and mla["gb_per_s"] >= 0 and mla["tflop_per_s"] >= 0
    assert mla["fraction_of_peak"] == round(mla["gb_per_s"] / 1000.0, 3) and "BLOCK_H" in mla["config"]
    assert mla["mean_length"] == 100 and mla["page_size"] == 16 == Shapes().page_size  # the engine's pages
    ragged = bench_mla_decode(3, 100, 1000.0, small, device, mixed=True)
    assert ragged["max_abs_err"] < 0.05 and 12 <= ragged["mean_length"] < 100
    moe = bench_moe_grouped(24, 4, small, device, peak_gbps=1000.0)
    assert moe["max_rel_err"] < 0.05 and moe["ms"] > 0 and "BN" in moe["config"]
    assert moe["fraction_of_peak_bandwidth"] == round(moe["weight_gb_per_s"] / 1000.0, 3)
    from deploy.bench.kernel_bench import bench_fp8_linear, bench_moe_grouped_fp8, peak_fp8_tflops

    lin = bench_fp8_linear(8, 64, 256, 100.0, device)
    assert 0 < lin["max_rel_err_vs_bf16"] < 0.1 and lin["ms"] > 0 and "BM" in lin["config"]
    assert lin["fraction_of_fp8_peak"] == round(lin["tflop_per_s"] / 100.0, 3)
    fp8_moe = bench_moe_grouped_fp8(24, 4, small, device, peak_tflops=100.0)
    assert 0 < fp8_moe["max_rel_err_vs_bf16"] < 0.1 and fp8_moe["ms"] > 0
    assert peak_fp8_tflops("NVIDIA H200") == 1979.0 and peak_fp8_tflops("NVIDIA A100-SXM4-80GB") is None
    from deploy.bench.kernel_bench import bench_decode_step

    step = bench_decode_step((1, 3), context=40, config="tiny", device=device)
    assert step["captured"] == ([1, 2, 3] if device == "cuda" else [])  # every bucket up to the largest batch
    assert [s["batch"] for s in step["steps"]] == [1, 3]
    assert all(s["eager_ms"] > 0 and s["graph_ms"] > 0 and s["speedup"] > 0 for s in step["steps"])
    assert all(s["max_abs_err"] < (0.05 if device == "cuda" else 1e-6) for s in step["steps"])


@pytest.mark.parametrize("args, message", [
    (["cluster", "--trace", "/nope.jsonl"], "/nope.jsonl"),
    (["cluster", "--trace", __file__, "--modes", "shared,fifo"], "fifo"),
    (["cluster", "--trace", __file__], "not a trace record"),
    (["cluster", "--trace", __file__, "--nodes", "1"], "--nodes"),
    (["cluster", "--trace", __file__, "--scenario", "rush-hour"], "rush-hour"),
    (["cluster", "--trace", __file__, "--scenario", "scale,rush-hour"], "'rush-hour'"),
    (["cluster", "--trace", __file__, "--scenario", "scale,scale"], "named twice"),
    (["cluster", "--trace", __file__, "--rate", "0"], "--rate 0.0: requests a second must be positive"),
    (["cluster", "--trace", __file__, "--max-num-seqs", "0"], "--max-num-seqs"),
    (["cluster", "--trace", __file__, "--pace", "5,2"], "--pace '5,2': give three numbers"),
    (["cluster", "--trace", __file__, "--pace", "5,x,1"], "--pace '5,x,1'"),
    (["cluster", "--trace", __file__, "--pace", "5,1,inf"], "row_ms must be a finite number of ms >= 0, got inf"),
])
def test_bench_cluster_bad_arguments(args, message):
    r = tide_here("bench", *args)
    assert r.returncode == 2 and message in " ".join(r.stderr.replace("│", "").split())


def test_trace_prompts_share_blocks_exactly_like_the_trace(tmp_path):
    from deploy.bench.cluster_bench import trace_prompts

    trace = tmp_path / "t.jsonl"
    records = [{"timestamp": 0, "input_length": 1500, "output_length": 40, "hash_ids": [1, 2, 3]},
               {"timestamp": 5, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]},
               {"timestamp": 9, "input_length": 600, "output_length": 1, "hash_ids": [7, 2]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    (p0, m0), (p1, m1), (p2, m2) = trace_prompts(trace, 10, block_tokens=64, max_prompt_tokens=4096, max_tokens=4)
    assert (len(p0), len(p1), len(p2)) == (188, 128, 75)  # lengths / 8, rounded up
    assert p1 == p0[:128] and p2[:64] != p0[:64] and p2[64:] == p0[64:75]  # same block = same tokens
    assert (m0, m1, m2) == (4, 1, 1)  # outputs scaled and capped
    # past the first record (--skip 1): the same prompts from the second on, blocks as before
    assert trace_prompts(trace, 10, block_tokens=64, max_prompt_tokens=4096, max_tokens=4, skip=1) == [(p1, m1), (p2, m2)]
    r = tide_here("bench", "cluster", "--trace", str(trace), "--skip", "3")
    assert r.returncode == 2 and "--skip 3: the trace has 3 records" in " ".join(r.stderr.replace("│", "").split())


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.slow
def test_bench_cluster_json(tmp_path):
    """The fleet scenarios in one run on one simulated cluster. Failure: the shared directory and
    the prefix-affinity baseline replay the same requests, a node removed half way; without a
    directory no KV comes from another node; each request's TTFT is counted under its source; the
    window after the failure has its own figures and what each replica did (the node left served
    it all). Night: no node lent, one lent and removed, one lent with its units kept; a new node
    in the morning. (The scale scenario's lending and return are the night's; its windows are
    the failure's.) Requests arrive in an open loop (--rate), each window and part of the night
    from its first arrival. Paced (--pace): every prompt computes at least 64 tokens, at 2 ms each
    on the emulated device, so no first token comes in under 128 ms."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 2048, "output_length": 16,
                                         "hash_ids": [i % 2, 10 + i % 2, 20 + i, 30 + i]}) + "\n" for i in range(9)))
    r = tide("bench", "cluster", "--trace", str(trace), "--nodes", "2", "--block-tokens", "32",
              "--modes", "shared,prefix_affinity", "--rate", "5", "--max-num-seqs", "16", "--repeats", "1",
              "--scenario", "failure,night", "--pace", "0,2,0", "--plot", str(tmp_path / "cluster.png"))
    assert r.returncode == 0, r.stderr[-3000:]
    scenarios = json.loads(r.stdout)["scenarios"]
    assert list(scenarios) == ["failure", "night"]
    assert (tmp_path / "cluster.png").read_bytes()[:4] == b"\x89PNG"  # hit rate and TTFT by mode, a row each
    out = scenarios["failure"]
    assert out["scale_factor"] == 16 and out["requests"] == 9 and out["repeats"] == 1 and out["ray"]
    assert out["affinity_tokens"] == 16 and out["scenario"] == "failure"
    assert (out["rate"], out["concurrency"]) == (5, None) and scenarios["night"]["rate"] == 5
    assert out["max_num_seqs"] == scenarios["night"]["max_num_seqs"] == 16
    assert out["pace"] == scenarios["night"]["pace"] == {"pass_ms": 0.0, "token_ms": 2.0, "row_ms": 0.0}
    assert out["shared_vs_prefix_affinity"]["after_failure"]["hit_rate"] == "single_run"  # one run: no spread
    for mode in ("shared", "prefix_affinity"):
        m = out[mode]
        (run,) = m["runs"]
        assert m["errors"] == 0 and run["requests"] == 9 and run["prompt_tokens"] == out["prompt_tokens"]
        assert m["token_hit_rate"]["median"] == run["token_hit_rate"] and set(m["hit_rate_by_source"]) == {
            "ram", "local_ssd", "remote"}
        assert sum(run["hit_rate_by_source"].values()) == pytest.approx(run["token_hit_rate"], abs=1e-3)
        assert sum(s["requests"] for s in run["ttft_by_source"].values()) == 9 and "compute" in run["ttft_by_source"]
        assert run["ttft_p50_ms"] >= 128  # the replicas were paced
        after = run["windows"]["after_failure"]
        assert after["requests"] == 5 and after["event"]["killed"] and after["errors"] == 0
        assert [r["requests"] for r in after["replica_load"]["replicas"]] == [5]  # the node left
        assert {r["max_num_seqs"] for r in after["replica_load"]["replicas"]} == {16}  # --max-num-seqs reached them
    assert out["prefix_affinity"]["runs"][0]["hit_rate_by_source"]["remote"] == 0  # no directory, no remote KV
    # requests 2..8 share a 64-token unit with an earlier one (at most 7 x 64 of 9 x 128 tokens)
    assert 0 < out["shared"]["runs"][0]["token_hit_rate"] <= 7 * 64 / (9 * 128) + 1e-3
    night = scenarios["night"]
    assert (night["night_requests"], night["morning_requests"]) == (3, 3)
    for case in ("stay", "lend", "lend_keep"):
        (run,) = night[case]["runs"]
        assert run["errors"] == 0 and run["requests"] == 3 and run["morning"]["errors"] == 0
        # the night served by the replica left (by both when none was lent)
        assert len(run["replica_load"]["replicas"]) == (2 if case == "stay" else 1)
        assert {r["max_num_seqs"] for r in run["replica_load"]["replicas"]} == {16}
        assert run["ttft_p50_ms"] >= 128
    assert night["stay"]["kept_units"] == [0] and night["lend"]["kept_units"] == [0]
    assert "morning_node_gap_points" in night["lend_keep"] and "keeping_gap_points" in night


def test_cluster_plot_draws_every_mode_from_the_benchmarks_json(tmp_path):
    from deploy.bench.cluster_bench import _medians
    from deploy.bench.plots import plot_cluster

    def run(hit, p50):
        return {"token_hit_rate": hit, "ttft_p50_ms": p50, "ttft_p99_ms": 2 * p50, "errors": 0,
                "hit_rate_by_source": {"ram": hit, "local_ssd": 0.0, "remote": 0.0}}

    out = {"requests": 8, "repeats": 2, "nodes": 2, "shared": _medians([run(0.5, 30.0), run(0.4, 20.0)]),
           "round_robin": _medians([run(0.1, 90.0), run(0.2, 80.0)])}
    plot_cluster(out, tmp_path / "c.pdf")
    assert (tmp_path / "c.pdf").read_bytes()[:5] == b"%PDF-"


def test_cluster_bench_verdicts_are_on_medians_over_runs():
    from deploy.bench.cluster_bench import _medians, _source_of

    def run(hit, p50):
        return {"token_hit_rate": hit, "ttft_p50_ms": p50, "ttft_p99_ms": 2 * p50, "errors": 0,
                "hit_rate_by_source": {"ram": hit, "local_ssd": 0.0, "remote": 0.0}}

    m = _medians([run(0.5, 30.0), run(0.1, 90.0), run(0.4, 20.0)])  # one bad run does not decide
    assert m["token_hit_rate"] == {"median": 0.4, "range": [0.1, 0.5], "runs": 3}
    assert m["ttft_p50_ms"] == {"median": 30.0, "range": [20.0, 90.0], "runs": 3} and len(m["runs"]) == 3
    assert _source_of({"prompt_cache_hit_tokens": 0, "prompt_cache_hit_sources": {"ram": 0, "ssd": 0, "remote": 0}}) == "compute"
    assert _source_of({"prompt_cache_hit_tokens": 192, "prompt_cache_hit_sources": {"ram": 64, "ssd": 0, "remote": 128}}) == "remote"
    assert _source_of({"prompt_cache_hit_tokens": 64, "prompt_cache_hit_sources": {"ram": 0, "ssd": 64, "remote": 0}}) == "local_ssd"


def test_scenario_windows_get_medians_and_verdicts_of_their_own():
    from deploy.bench.cluster_bench import _medians, _verdicts

    def run(hit, p99, after_hit, after_p99, busiest):
        fig = {"ttft_p50_ms": 10.0, "errors": 0, "hit_rate_by_source": {"ram": 0.0, "local_ssd": 0.0, "remote": 0.0}}
        return {**fig, "token_hit_rate": hit, "ttft_p99_ms": p99, "replica_load": {"busiest_share": busiest},
                "windows": {"after_failure": {**fig, "token_hit_rate": after_hit, "ttft_p99_ms": after_p99}}}

    shared = _medians([run(0.30, 100.0, 0.30, 50.0, 0.4), run(0.32, 120.0, 0.28, 60.0, 0.5)])
    affinity = _medians([run(0.31, 110.0, 0.10, 90.0, 0.6), run(0.33, 130.0, 0.12, 80.0, 0.7)])
    assert shared["windows"]["after_failure"]["token_hit_rate"] == {"median": 0.29, "range": [0.28, 0.3], "runs": 2}
    assert shared["busiest_replica_share"]["median"] == 0.45
    v = _verdicts(shared, affinity)
    assert (v["hit_rate"], v["ttft_p99"]) == ("no_margin", "no_margin")  # over the whole replay
    assert (v["after_failure"]["hit_rate"], v["after_failure"]["ttft_p99"]) == ("beats", "beats")


def test_replica_load_says_what_each_replica_did_between_two_reads():
    from deploy.bench.fleet_events import load_summary

    def counts(node, finished, prefill, prompt, cached, local):
        return {"node": node, "max_num_seqs": 16, "finished": finished, "prefill_tokens": prefill, "decode_tokens": finished,
                "finished_prompt_tokens": prompt, "finished_cached_tokens": cached, "finished_local_tokens": local}

    before = {"a": counts("node-a" * 4, 10, 1000, 1000, 0, 0), "gone": counts("node-g", 5, 500, 500, 0, 0)}
    after = {"a": counts("node-a" * 4, 14, 1300, 1600, 300, 120), "b": counts("node-b", 6, 900, 900, 0, 0)}
    out = load_summary(before, after)
    assert out["replicas"] == [  # busiest first; a replica new since the first read counts from 0
        {"node": "node-b", "max_num_seqs": 16, "requests": 6, "prefill_tokens": 900, "hit_rate": 0.0,
         "local_hit_rate": 0.0},
        {"node": "node-anode-a", "max_num_seqs": 16, "requests": 4, "prefill_tokens": 300, "hit_rate": 0.5,
         "local_hit_rate": 0.2}]
    assert out["busiest_share"] == 0.75
    assert load_summary(after, after)["busiest_share"] is None  # nothing computed


def test_a_run_with_a_failed_request_keeps_serves_logs(tmp_path, monkeypatch):
    """The simulated cluster's logs go with its temp dir; a run with an error keeps a copy of
    Serve's (the traceback behind "the request failed") under TIDE_HOME and says where."""
    from types import SimpleNamespace

    from deploy.bench.fleet_events import keep_serve_logs

    monkeypatch.setenv("TIDE_HOME", str(tmp_path / "home"))
    serve_logs = tmp_path / "sim" / "session_latest" / "logs" / "serve"
    serve_logs.mkdir(parents=True)
    (serve_logs / "proxy.log").write_text("Traceback (most recent call last): ...")
    sim = SimpleNamespace(temp_dir=str(tmp_path / "sim"))
    assert keep_serve_logs({"errors": 0}, sim, "clean") == {"errors": 0}
    kept = keep_serve_logs({"errors": 2}, sim, "cluster-skew-shared-0")["logs_kept"]
    assert kept.startswith(str(tmp_path / "home" / "bench-logs" / "cluster-skew-shared-0-"))
    assert (Path(kept) / "proxy.log").read_text().startswith("Traceback")
    night = keep_serve_logs({"errors": 0, "morning": {"errors": 1}}, sim, "night-lend-0")
    assert Path(night["logs_kept"]).is_dir()
    assert "logs_kept" not in keep_serve_logs({"errors": 1}, None, "no-cluster")  # nothing to copy


def test_the_night_compares_the_morning_node_with_its_fleet_in_all_hits_and_in_its_own():
    """A node that fetched its hits from other nodes is close to its fleet on hits, far on local
    hits (what warming puts on the node); runs without the node's figures are left out."""
    from deploy.bench.night_bench import _morning_node

    fleet = {"token_hit_rate": 0.30, "hit_rate_by_source": {"ram": 0.10, "local_ssd": 0.05, "remote": 0.15}}
    runs = [{"morning_node_hit_rate": 0.28, "morning_node_local_hit_rate": 0.02},
            {"morning_node_hit_rate": 0.26, "morning_node_local_hit_rate": 0.12},
            {"morning_node_hit_rate": None, "morning_node_local_hit_rate": None}]
    out = _morning_node([fleet] * 3, runs)
    assert out["morning_node_gap_points"] == {"median": 3.0, "range": [2.0, 4.0]}
    assert out["morning_node_local_hit_rate"] == {"median": 0.07, "range": [0.02, 0.12]}
    assert out["morning_node_local_gap_points"] == {"median": 8.0, "range": [3.0, 13.0]}


def test_the_pressure_scenario_sizes_caches_from_the_working_set(tmp_path):
    from deploy.bench.cluster_bench import unit_bytes, working_set_units
    from model.config import NAMED_CONFIGS

    a, b = list(range(200)), [7] * 64 + list(range(100))
    # a: 3 units before its last token; b shares none of them: 2 more; a again adds nothing
    assert working_set_units([(a, 4), (b, 4), (a[:129], 4)]) == 5
    assert unit_bytes(None) == 4 * 64 * (64 + 16) * 4  # the tiny model: 4 layers, latent 64 + rope 16, float32
    v4 = tmp_path / "v4"
    v4.mkdir()
    (v4 / "config.json").write_text(json.dumps(NAMED_CONFIGS["tiny-v4"].to_hf_dict()))
    with pytest.raises(ValueError, match="deepseek_v4"):  # its units are not per-token rows
        unit_bytes(v4)


def test_the_skew_scenario_puts_most_requests_on_a_few_hot_prefixes():
    from deploy.bench.cluster_bench import HOT_PREFIX_TOKENS, skewed

    work = [([k % 250] * (1 + k % 300), 4) for k in range(400)]
    out = skewed(work, block_tokens=8, share=0.6, hot=3, hot_tokens=6400)  # 100 tokens at 64x
    hot = {}
    for (ids, _), (own, _) in zip(out, work, strict=True):
        assert ids[len(ids) - len(own):] == own  # each request keeps its own prompt, after the prefix
        if len(ids) > len(own):
            assert len(ids) - len(own) == 100
            hot[tuple(ids[:100])] = hot.get(tuple(ids[:100]), 0) + 1
    counts = sorted(hot.values(), reverse=True)
    assert len(counts) == 3 and 0.5 < sum(counts) / 400 < 0.7  # about 60% on them
    assert counts[0] > counts[2]  # Zipf: the first hottest
    assert skewed(work, 8) == skewed(work, 8)  # seeded
    # the default prefix is scaled like the prompts: 4,096 trace tokens are 64 at 64x, 256 at 16x
    assert {len(ids) - len(own) for (ids, _), (own, _) in zip(skewed(work, 8), work, strict=True)} == {0, 64}
    assert max(len(a) - len(b) for (a, _), (b, _) in zip(skewed(work, 32), work, strict=True)) == HOT_PREFIX_TOKENS // 16


def test_cluster_bench_verdicts_need_a_margin_and_the_affinity_key_scales_like_the_prompts():
    from deploy.bench.cluster_bench import scaled_affinity_tokens, verdict

    def spread(lo, hi):
        return {"median": (lo + hi) / 2, "range": [lo, hi]}

    assert verdict(spread(0.30, 0.35), spread(0.20, 0.25), higher=True) == "beats"
    assert verdict(spread(0.24, 0.35), spread(0.20, 0.25), higher=True) == "no_margin"  # ranges overlap
    assert verdict(spread(10.0, 20.0), spread(25.0, 30.0), higher=False) == "beats"  # a TTFT: lower wins
    assert verdict(spread(31.0, 40.0), spread(25.0, 30.0), higher=False) == "loses"
    assert verdict({}, spread(1, 2), higher=True) == "unknown"
    one = {"median": 0.3, "range": [0.3, 0.3], "runs": 1}
    assert verdict(one, spread(0.1, 0.2), higher=True) == "single_run"  # one run has no spread
    # 256 tokens of the trace: at 8 tokens a 512-token block (64x), 4 tokens of the replay
    assert (scaled_affinity_tokens(8), scaled_affinity_tokens(512), scaled_affinity_tokens(1)) == (4, 256, 1)


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.fault
def test_bench_soak_json_with_faults():
    r = tide("bench", "soak", "--minutes", "0.3", "--concurrency", "2", "--fault-every-s", "6", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [f["kind"] for f in out["faults"]][:2] == ["redis_restart", "agent_kill"]
    assert out["errors"] == 0 and out["wrong_outputs"] == 0, out
    assert out["ok"] > 0 and out["checked_outputs"] == out["ok"]
    assert out["requests"] == out["ok"] + out["unavailable_in_windows"]
    assert out["rss_start_mb"] > 0 and out["rss_end_mb"] > 0 and "rss_growth_mb" in out


@pytest.mark.parametrize("args, message", [
    (["--minutes", "0"], "--minutes"),
    (["--fault-every-s", "1"], "--fault-every-s"),
    (["--checkpoint", "/nonexistent"], "/nonexistent"),
])
def test_bench_soak_bad_arguments(args, message):
    r = tide_here("bench", "soak", *args)
    assert r.returncode == 2 and message in r.stderr


@pytest.mark.slow  # a whole benchmark against transformers (~35 s); its parts are tested below
def test_bench_model_json_on_a_checkpoint(tmp_path):
    from model.checkpoint import random_state_dict, save_checkpoint
    from model.config import named_config

    cfg = named_config("tiny")
    ckpt = save_checkpoint(tmp_path / "tiny", cfg, random_state_dict(cfg, seed=0))
    r = tide_here("bench", "model", "--checkpoint", str(ckpt), "--steps", "2", "--repeats", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["statistic"] == "median" and out["repeats"] == 3
    assert out["prefill_tokens_per_s"] > 0 and out["hf_prefill_tokens_per_s"] > 0
    for key in ("decode_tokens_per_s", "engine_decode_tokens_per_s", "hf_decode_tokens_per_s",
                "decode_speedup_vs_hf", "engine_decode_speedup_vs_hf"):
        assert set(out[key]) == {"1", "8", "32"} and all(v > 0 for v in out[key].values())
    for key in ("decode_mixed_tokens_per_s", "engine_decode_mixed_tokens_per_s", "hf_decode_mixed_tokens_per_s",
                "decode_mixed_speedup_vs_hf"):  # a batch of 8 with contexts from 32 to 480 tokens
        assert set(out[key]) == {"8"} and out[key]["8"] > 0
    assert out["decode_mixed_context_tokens"]["8"][0] == 32
    assert out["prefill_speedup_vs_hf"] == round(out["prefill_tokens_per_s"] / out["hf_prefill_tokens_per_s"], 2)
    for key in ("decode_tokens_per_s", "engine_decode_tokens_per_s"):  # each median lies in its range
        for b, median in out[key].items():
            slow, fast = out["range"][key][b]
            assert slow <= median <= fast
    # the roofline: the step's bytes at the measured step rate over the measured read bandwidth
    assert out["stream_read_gb_per_s"] > 0
    need = out["decode_step_bytes"]
    assert need["1"] < need["8"] < need["32"]
    for kind in ("decode", "engine_decode"):
        for b, frac in out["roofline_fraction"][kind].items():
            want = need[b] * out[f"{kind}_tokens_per_s"][b] / int(b) / (out["stream_read_gb_per_s"] * 1e9)
            assert frac == pytest.approx(want, rel=0.02)
    # int8 weights: the same cases, their speedups over fp32, and under a third of the bytes
    int8 = out["int8"]
    assert set(int8["decode_tokens_per_s"]) == {"1", "8", "32"} and int8["engine_decode_mixed_tokens_per_s"]["8"] > 0
    assert int8["speedup_vs_fp32"]["decode_tokens_per_s"]["8"] == pytest.approx(
        int8["decode_tokens_per_s"]["8"] / out["decode_tokens_per_s"]["8"], abs=0.01)
    assert int8["weight_bytes"] < int8["fp32_weight_bytes"] / 3
    assert out["mtp"]["available"] is False and "no MTP layers" in out["mtp"]["why"]


def test_bench_model_mtp_only_decodes_with_and_without_drafts_in_turn(tmp_path):
    import dataclasses

    from model.checkpoint import random_state_dict, save_checkpoint
    from model.config import named_config

    cfg = dataclasses.replace(named_config("tiny"), num_nextn_predict_layers=1)
    ckpt = save_checkpoint(tmp_path / "mtp", cfg, random_state_dict(cfg, seed=0))
    r = tide_here("bench", "model", "--checkpoint", str(ckpt), "--mtp-only", "--repeats", "3", "--mtp-tokens", "8",
                  "--mtp-batches", "1,3", "--json")
    assert r.returncode == 0, r.stderr
    mtp = json.loads(r.stdout)["mtp"]
    assert mtp["available"] and mtp["drafts_per_step"] == 1 and mtp["statistic"] == "median"
    assert (mtp["device"], mtp["dtype"]) == ("cpu", "float32") and "2" not in mtp
    for b in ("1", "3"):
        case = mtp[b]
        for kind in ("without", "with"):
            slow, fast = case[f"range_{kind}"]
            assert 0 < slow <= case[f"tokens_per_s_{kind}"] <= fast
        assert case["speedup"] == pytest.approx(case["tokens_per_s_with"] / case["tokens_per_s_without"], abs=0.01)
        assert len(case["acceptance_per_position"]) == 1 and 1 <= case["tokens_per_step_with"] <= 2
        # where a step's time goes: the model's call is part of the step, and a drafting step's cost
        # in plain steps is what its tokens must exceed
        for kind in ("without", "with"):
            assert 0 < case[f"pass_us_{kind}"] < case[f"step_us_{kind}"]
        assert case["step_cost_ratio"] == pytest.approx(case["step_us_with"] / case["step_us_without"], abs=0.01)


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu", "--mtp-only"], "tpu"),
    (["--device", "cuda"], "--mtp-only"),
    (["--mtp-only", "--dtype", "int3"], "int3"),
    (["--mtp-only", "--mtp-batches", "1,0"], "--mtp-batches"),
])
def test_bench_model_mtp_options_name_the_bad_value(args, message):
    r = tide_here("bench", "model", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer where there is no CUDA device")
def test_bench_model_mtp_on_cuda_without_a_device_says_so():
    r = tide_here("bench", "model", "--mtp-only", "--device", "cuda")
    assert r.returncode == 2 and "no CUDA device" in r.stderr, r.stderr


def test_decode_step_bytes_counts_each_weight_once_and_the_experts_a_batch_touches(tmp_path):
    from safetensors.torch import load_file

    from deploy.bench.model_bench import decode_step_bytes
    from model.checkpoint import random_state_dict, save_checkpoint
    from model.config import named_config

    cfg = named_config("tiny")
    ckpt = save_checkpoint(tmp_path / "tiny", cfg, random_state_dict(cfg, seed=0))
    sd = {}
    for f in ckpt.glob("*.safetensors"):
        sd.update(load_file(f))
    experts = sum(t.numel() for n, t in sd.items() if ".mlp.experts." in n)
    dense = sum(t.numel() for n, t in sd.items() if ".mlp.experts." not in n and "embed_tokens" not in n)
    kv_per_token = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    for batch in (1, 4):
        touched = 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch
        want = (dense + experts * touched + batch * cfg.hidden_size + batch * 100 * kv_per_token) * 4
        assert decode_step_bytes(ckpt, batch, 100, 4) == pytest.approx(want, abs=4)


def test_bench_model_engines_take_turns_and_the_median_counts():
    from deploy.bench.model_bench import _interleaved, _rates

    calls = []
    times = {"ours": iter([9.0, 3.0, 2.0, 7.0]), "hf": iter([9.0, 5.0, 6.0, 4.0])}

    def case(engine):
        return lambda: calls.append(engine) or next(times[engine])

    runs = _interleaved([{"prefill": case("ours"), "engine_decode_1": lambda: 1.0}, {"prefill": case("hf")}], repeats=3)
    assert calls == ["ours", "hf"] * 4  # a warm-up each, then turns; a case one engine lacks runs alone
    assert runs[0]["prefill"] == [3.0, 2.0, 7.0] and runs[1] == {"prefill": [5.0, 6.0, 4.0]}
    from deploy.bench.model_bench import PREFILL_TOKENS

    rate, spread = _rates(runs[1], steps=1)["prefill"]
    assert rate == round(PREFILL_TOKENS / 5.0, 1) and spread == [round(PREFILL_TOKENS / 6.0, 1), round(PREFILL_TOKENS / 4.0, 1)]


def test_engine_decode_case_times_whole_batch_steps():
    """The engine case times steps in which every request decodes (none prefills, none ends)."""
    from deploy.bench.model_bench import _engine_decode
    from model.checkpoint import build_model, random_state_dict
    from model.config import named_config

    cfg = named_config("tiny")
    model = build_model(cfg, random_state_dict(cfg, seed=0))
    for ctx_lens in ([256] * 3, [32, 100, 480]):  # equal and mixed contexts
        run = _engine_decode(model, ctx_lens, steps=4)
        assert run() > 0  # it raises if a timed step decoded fewer than the 3 requests


def test_mixed_contexts_keep_the_mean_and_spread_out():
    from deploy.bench.model_bench import DECODE_CONTEXT, contexts

    mixed = contexts(8, True)
    assert len(mixed) == 8 and sum(mixed) == 8 * DECODE_CONTEXT and mixed[0] == 32 < mixed[-1]
    assert contexts(8, False) == [DECODE_CONTEXT] * 8


def test_bench_structured_json():
    r = tide_here("bench", "structured", "--vocab", "3000", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["vocab"] == "synthetic" and out["vocab_size"] == 3000 and out["engine"] == "xgrammar"
    for grammar in ("json_object", "json_schema"):
        row = out[grammar]
        assert row["steps"] > 50 and row["compile_ms"] > 0 and 0 < row["fill_us_per_step"] <= 1e3 * row["fill_max_ms"]
    assert set(out["compile_ms"]) == {"schema_1000_enum_properties", "choice_of_1024"}
    assert out["tokenizer_info_s"] > 0 and out["apply_batch_32_ms"] > 0


def test_bench_engine_json(tmp_path):
    r = tide_here("bench", "engine", "--batches", "1,4", "--contexts", "64,256", "--steps", "5", "--no-itl",
             "--plot", str(tmp_path / "engine.svg"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (tmp_path / "engine.svg").read_text().lstrip().startswith("<?xml") and out["plot"].endswith("engine.svg")
    grid = out["host_ms_per_step"]
    assert set(grid) == {"batch_1", "batch_4"} and all(set(row) == {"ctx_64", "ctx_256"} for row in grid.values())
    assert all(c["steps"] == 5 and c["rounds"] == 3 and c["p90_ms"] >= c["median_ms"] for row in grid.values() for c in row.values())
    assert set(out["context_growth"]) == {"batch_1", "batch_4"} and "targets" not in out  # no batch 64 asked
    bad = tide_here("bench", "engine", "--batches", "0")
    assert bad.returncode == 2 and "--batches" in bad.stderr


def test_itl_bench_measures_both_chunkings_on_the_same_work():
    from deploy.bench.engine_bench import run_itl_bench

    out = run_itl_bench(running=2, prompt_tokens=300, warm_steps=4, factors=(2.0,), small_prompt_tokens=200)
    sized, fixed = out["sized_chunks_2"], out["fixed_2048_chunks"]
    assert sized["itl_factor"] == 2.0 and fixed["itl_factor"] == 0.0
    small = out["small_model"]
    assert (small["config"], small["running"], small["prompt_tokens"]) == ("tiny", 1, 200)
    assert small["serving_default"]["itl_floor_ms"] > 0 and small["no_floor"]["itl_floor_ms"] == 0
    assert small["fixed_2048_chunks"]["steps"] == 1 and small["no_floor"]["prefill_s"] > 0
    assert fixed["steps"] == 1  # the whole 300-token prompt in one chunk
    assert sized["steps"] >= 1 and all(v > 0 for v in (sized["alone_p50_ms"], fixed["under_prefill_p99_ms"]))
    assert sized["alone_p99_ms"] >= sized["alone_p90_ms"] >= sized["alone_p50_ms"]
    assert "targets" not in out  # judged only at the serving default


def test_the_itl_target_is_judged_at_the_serving_default():
    from deploy.app import AppArgs
    from deploy.bench.engine_bench import ITL_FACTORS, SERVING_ITL_FACTOR, SERVING_ITL_FLOOR_MS

    assert AppArgs().itl_factor == SERVING_ITL_FACTOR in ITL_FACTORS
    assert AppArgs().itl_floor_ms == SERVING_ITL_FLOOR_MS


def test_bench_ep_wire_only_counts_bytes_per_round_and_step():
    """``tide bench ep --wire-only``: BF16 rows against FP8 dispatch (1 byte per channel plus a
    float32 scale per 128) at the bench config's and DeepSeek-V3's dimensions; combine stays BF16."""
    r = tide_here("bench", "ep", "--wire-only", "--nodes", "4", "--batch", "16")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    v3 = out["deepseek_v3"]
    assert (v3["hidden"], v3["top_k"], v3["shards"], v3["batch"]) == (7168, 8, 4, 16)
    bf16, fp8 = v3["bf16"], v3["fp8"]
    assert bf16["rows"] == fp8["rows"] <= 16 * 4 < bf16["pairs"] == 16 * 8  # one row per token and shard
    assert bf16["dispatch_bytes_per_round"] - fp8["dispatch_bytes_per_round"] == fp8["rows"] * (7168 - 56 * 4)
    assert fp8["combine_bytes_per_round"] == bf16["combine_bytes_per_round"] == fp8["rows"] * 7168 * 2
    assert fp8["bytes_per_step"] == 58 * (fp8["dispatch_bytes_per_round"] + fp8["combine_bytes_per_round"])
    assert out["bench"]["fp8_dispatch_over_bf16"] < 0.6


def test_bench_serve_alternates_which_case_goes_first_and_reports_medians():
    from deploy.bench.serve_bench import case_orders, summarize

    orders = case_orders(3)
    assert [o[0][0] for o in orders] == ["with_cache", "without_cache", "with_cache"]
    assert all(sorted(o) == sorted(orders[0]) for o in orders)  # every run has both cases
    runs = [{"requests_per_s": v, "ttft_p50_ms": 10 * v, "ttft_p99_ms": None, "token_hit_rate": 0.5, "errors": e,
             "first_error": "boom" if e else None} for v, e in ((1.0, 0), (3.0, 1), (2.0, 0))]
    out = summarize(runs)
    assert (out["requests_per_s"], out["ttft_p50_ms"], out["ttft_p99_ms"]) == (2.0, 20.0, None)
    assert out["errors"] == 1 and out["first_error"] == "boom" and out["runs"] == runs


@pytest.mark.ray
@pytest.mark.slow
def test_bench_serve_json():
    r = tide("bench", "serve", "--requests", "4", "--concurrency", "2", "--system-tokens", "128", "--max-tokens", "2",
              "--repeats", "1")  # (which case goes first in each repeat: tested above)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for label in ("with_cache", "without_cache"):
        case = out[label]
        assert case["errors"] == 0 and len(case["runs"]) == 1
    assert out["without_cache"]["token_hit_rate"] == 0 < out["with_cache"]["token_hit_rate"]


@pytest.mark.ray
@pytest.mark.slow
def test_bench_stream_json():
    """Both cases stream every token; the serving default's batching sends fewer outputs than
    tokens (a tiny-model step takes a millisecond or two, the interval 50 ms), one per step without it."""
    r = tide("bench", "stream", "--streams", "2", "--max-tokens", "24", "--repeats", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    batched, per_step = out["batched"], out["per_step"]
    assert batched["errors"] == per_step["errors"] == 0 and out["stream_batching_interval_ms"]["per_step"] == 0
    assert out["stream_batching_interval_ms"]["batched"] > 0 and out["speedup"] > 0
    assert batched["outputs_per_request"] < per_step["outputs_per_request"] <= 24
    assert all(case["tokens_per_s"] > 0 and case["ttft_p50_ms"] > 0 for case in (batched, per_step))


def test_bench_all_runs_in_order_keeps_errors_and_skips_past_the_budget(monkeypatch):
    from deploy.bench import all_bench

    now = [0.0]
    ran = []

    def bench(name, seconds, fail=False):
        def run():
            ran.append(name)
            now[0] += seconds
            if fail:
                raise RuntimeError("no disk")
            return {"figure": name}
        return run

    monkeypatch.setattr(all_bench, "BENCHMARKS", {"a": bench("a", 30), "b": bench("b", 50, fail=True),
                                                  "c": bench("c", 10), "d": bench("d", 1)})
    report = all_bench.run_all(["a", "b", "c", "d"], budget_s=80, clock=lambda: now[0])
    runs = report["benchmarks"]
    assert ran == ["a", "b"]  # c would start at 80 s: the budget is spent
    assert runs["a"] == {"result": {"figure": "a"}, "seconds": 30.0}
    assert runs["b"]["error"] == "RuntimeError: no disk" and runs["b"]["seconds"] == 50.0
    assert "budget" in runs["c"]["skipped"] and "budget" in runs["d"]["skipped"]
    assert report["seconds"] == 80.0 and report["torch"]


def test_bench_all_json_is_each_benchmarks_own_output(tmp_path):
    out = tmp_path / "report.json"
    r = tide_here("bench", "all", "--only", "structured", "--out", str(out))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert json.loads(out.read_text()) == report
    own = json.loads(tide_here("bench", "structured", "--vocab", "3000").stdout)  # the same fields, sooner
    assert set(report["benchmarks"]["structured"]["result"]) == set(own)
    bad = tide_here("bench", "all", "--only", "structured,trace")
    assert bad.returncode == 2 and "--trace" in bad.stderr


@pytest.mark.redis
def test_bench_ttft_json():
    """Computed and loaded through the local agent's RAM and SSD and a remote agent: every path
    loads the same units (the whole units of a prompt that does not end on one) and the loads
    alone report their bandwidth, also for DeepSeek-V3-sized units."""
    r = tide("bench", "ttft", "--prompt-tokens", "200", "--repeats", "1", "--v3-prompt-tokens", "128", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    paths = ("local_agent_ram", "local_agent_ssd", "remote_agent_ssd")
    assert out["cached_tokens"] == 192 and out["directory"] == "redis" and out["repeats"] == 1 and out["cpus"] >= 1
    assert set(out["ttft_ms"]) == {"cold", *paths, "local_agent_ssd_layered"} and set(out["load"]) == set(paths)
    assert out["layered_vs_whole"] > 0
    for path in paths:
        load = out["load"][path]
        assert load["gb_per_s"] > 0 and load["tokens_per_s"] > 0 and isinstance(load["beats_prefill"], bool)
    v3 = out["deepseek_v3"]
    assert v3["prompt_bytes"] == 2 * 64 * 61 * 576 * 2 and v3["break_even_gb_per_s"] == pytest.approx(5.18)
    assert set(v3["load"]) == {"local_agent_ssd", "remote_agent_ssd"}
    assert out["prefix_load"]["bytes"] == 3 * out["unit_bytes"]  # whole units of latent rows, nothing else
    # the loads beside the hardware measured in the same run
    assert v3["loopback_tcp_gb_per_s"] > 0
    assert set(v3["pd_handoff_gb_per_s"]) == {"plain", "sealed"} and all(v > 0 for v in v3["pd_handoff_gb_per_s"].values())
    if shutil.which("fio"):
        assert v3["fraction_of_hardware"]["local_agent_ssd"] == pytest.approx(
            v3["load"]["local_agent_ssd"]["gb_per_s"] / v3["fio_read_gb_per_s"], rel=0.02)
    # a hit's parts add up: what is left beside them is what no part names
    parts = out["hit_breakdown"]
    assert parts["suffix_compute_ms"] > 0 and parts["load_ms"] > 0 and parts["page_copies_ms"] > 0
    assert parts["fixed_ms"] < parts["ttft_ms"]


@pytest.mark.redis
def test_bench_ttft_of_the_v4_family_loads_entries_and_one_resume_record():
    """``--family v4``: the bench config of V4; its hit loads every unit's compressed entries and
    the resume record after the last, far fewer bytes a token than V3's latent rows."""
    r = tide("bench", "ttft", "--family", "v4", "--prompt-tokens", "200", "--repeats", "1", "--v3-prompt-tokens",
             "64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    from model.config import named_config
    from model.kv_sizes import PUBLISHED, kv_sizes

    sizes = kv_sizes(named_config("bench-v4"), torch.float32)
    assert out["cached_tokens"] == 192 and out["unit_bytes"] == sizes.unit_bytes
    assert out["prefix_load"]["bytes"] == 3 * sizes.unit_bytes + sizes.resume_bytes
    published = out["prefix_load"]["published_bytes_per_cached_token"]
    assert published["deepseek-v3"] == 61 * 576 * 2
    flash_4k = kv_sizes(PUBLISHED["deepseek-v4-flash"]).prefix_load_bytes(4096) / 4096
    assert flash_4k < 0.15 * published["deepseek-v3"]  # a 4K V4-Flash prefix: under 15% of V3's bytes
    bad = tide("bench", "ttft", "--family", "v5")
    assert bad.returncode == 2 and "'v5'" in bad.stderr
