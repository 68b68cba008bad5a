"""``tide eplb plan`` and ``tide bench eplb`` as a user runs them."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.eplb import Placement
from tests.cli import tide, tide_here


@pytest.fixture
def load_file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    base = 1.0 / torch.arange(1, 33, dtype=torch.double)
    load = torch.stack([base[torch.randperm(32, generator=gen)] * 1000 for _ in range(3)])
    path = tmp_path / "load.json"
    path.write_text(json.dumps(load.tolist()))
    return path, load


def test_plan_prints_a_valid_balanced_placement(load_file, tmp_path):
    path, load = load_file
    r = tide_here("eplb", "plan", "--load", str(path), "--slots", "40", "--groups", "4", "--nodes", "2",
              "--shards", "4", "--policy", "spill", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    p = Placement(torch.tensor(out["phy2log"]), torch.tensor(out["log2phy"]), torch.tensor(out["logcnt"]), 4)
    p.check_integrity()
    assert p.phy2log.shape == (3, 40)
    assert out["imbalance"] < out["imbalance_before"]
    # re-planning the same load from the printed plan moves nothing
    prev = tmp_path / "plan.json"
    prev.write_text(r.stdout)
    r2 = tide_here("eplb", "plan", "--load", str(path), "--slots", "40", "--groups", "4", "--nodes", "2",
               "--shards", "4", "--policy", "spill", "--previous", str(prev))
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["moved_slots"] == 0


@pytest.mark.parametrize("args, message", [
    (["--slots", "10", "--shards", "4"], "num_slots 10"),
    (["--slots", "40", "--shards", "4", "--policy", "best"], "'best'"),
    (["--slots", "16", "--shards", "4"], "num_slots 16 < 32"),
    (["--slots", "40", "--shards", "4", "--groups", "3"], "num_groups 3"),
])
def test_plan_bad_arguments_name_the_value(load_file, args, message):
    path, _ = load_file
    r = tide_here("eplb", "plan", "--load", str(path), *args)
    assert r.returncode == 2
    assert message in r.stderr.replace("\n", " ").replace("│", "")


def test_plan_bad_load_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[[1, 2], [3]]")
    r = tide_here("eplb", "plan", "--load", str(bad), "--slots", "2", "--shards", "1")
    assert r.returncode == 2 and "[layers][experts]" in r.stderr.replace("\n", " ").replace("│", "")


def test_bench_eplb_json(tmp_path):
    r = tide_here("bench", "eplb", "--layers", "2", "--exponents", "1.0", "--json", "--plot", str(tmp_path / "eplb.png"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = {row["policy"]: row for row in out["results"]}
    assert set(rows) == {"global", "hierarchical", "spill"}
    assert out["plot"] == str(tmp_path / "eplb.png") and (tmp_path / "eplb.png").read_bytes()[:4] == b"\x89PNG"
    bad = tide_here("bench", "eplb", "--layers", "2", "--plot", str(tmp_path / "eplb.jpg"))
    assert bad.returncode == 2 and "eplb.jpg" in bad.stderr.replace("\n", "").replace("│", "")
    for row in rows.values():
        assert row["imbalance_after"] < row["imbalance_before"]
        assert {"spill_fraction", "runtime_ms", "moved_slots"} <= set(row)
    assert rows["global"]["imbalance_after"] <= 1.05
    assert rows["spill"]["imbalance_after"] < rows["hierarchical"]["imbalance_after"]
    for row in rows.values():  # out of sample: the next window's load, and batches sampled from it
        assert row["imbalance_next_window"] < row["imbalance_next_window_before"]
        assert row["imbalance_sampled_batch"] < row["imbalance_sampled_batch_before"]
    assert rows["hierarchical"]["spill_fraction"] < 1e-9 < rows["spill"]["spill_fraction"]
    assert out["imbalance_sampled_floor"] > 1.0 and out["rows_per_shard"] == 32


def test_sampled_batches_deal_an_experts_rows_to_its_copies_as_the_executor_does():
    from deploy.bench.eplb_bench import sampled_floor, sampled_imbalance

    shards = 4
    hot = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.double)  # every token goes to expert 0
    alone = Placement.in_order(1, 4, shards)  # one copy: one shard takes them all
    assert sampled_imbalance(alone, hot, 8, 3, seed=0, top_k=1) == shards
    # 5 copies of expert 0, in slots 0, 2, 4, 6 and 7 (two slots per shard): 32 tokens dealt in
    # turn give the copies 7, 7, 6, 6 and 6, so shards 0-3 take 7, 7, 6 and 12
    everywhere = Placement.from_phy2log(torch.tensor([[0, 1, 0, 2, 0, 3, 0, 0]]), 4, shards)
    assert sampled_imbalance(everywhere, hot, 8, 3, seed=0, top_k=1) == 12 / 8
    # top-2 over 4 experts, expert 0 (always picked, always first) with a copy on shards 0 and 2:
    # its tokens split between them (dealt by pair, 2t + 0, every one would go to shard 0)
    always = torch.tensor([[1e6, 1.0, 1.0, 1.0]], dtype=torch.double)
    split = Placement.from_phy2log(torch.tensor([[0, 1, 2, 3, 0, 1, 3, 2]]), 4, shards)
    assert sampled_imbalance(split, always, 8, 3, seed=0, top_k=2) < 1.6
    assert 1.0 < sampled_floor(shards, 8, 4, 2, seed=0) < shards


@pytest.mark.ray
@pytest.mark.slow
def test_bench_ep_json():
    r = tide("bench", "ep", "--nodes", "2", "--batch", "4", "--context", "16", "--steps", "2",
              "--config", "tiny", "--repeats", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["repeats"] == 2 and out["torch"]
    for key in ("single_process", "ep_overlap_off", "ep_overlap_on"):
        lo, hi = out[key]["tokens_per_s_range"]
        assert lo <= out[key]["tokens_per_s"] <= hi and out[key]["step_ms"] > 0
    assert out["single_process"]["blocked_on_experts_ms"] == 0  # no shards in the baseline
    assert out["ep_overlap_off"]["blocked_on_experts_ms"] > 0
    speedup = out["ep_overlap_on"]["tokens_per_s"] / out["ep_overlap_off"]["tokens_per_s"]
    assert out["overlap_speedup"] == pytest.approx(speedup, abs=2e-3)
    assert out["dispatch_hidden_fraction"] == (out["blocked_hidden_fraction"] if speedup > 1 else 0.0)
    assert out["wire"]["tiny"]["fp8"]["rows"] == out["wire"]["tiny"]["bf16"]["rows"]


def test_bench_ep_bad_config():
    r = tide_here("bench", "ep", "--config", "huge")
    assert r.returncode == 2 and "'huge'" in r.stderr
