"""The daily report: totals that add up, time-weighted nodes, revenue at list prices."""

from __future__ import annotations

import pytest

from cluster.daily_report import (
    JsonlLog,
    NodeSample,
    Prices,
    UsageRecord,
    daily_report,
    read_jsonl,
    timeline,
)
from cluster.scaling import Schedule

DAY = 86400.0
T0 = 1_796_000_000.0  # some Unix time


def test_totals_add_up_and_revenue_follows_the_prices():
    usage = [
        UsageRecord(T0 + 10, 1000, 600, 100, 2.0),
        UsageRecord(T0 + 20, 500, 0, 50, 1.0),
        UsageRecord(T0 - 2 * DAY, 999, 999, 999, 1.0),  # outside the window
    ]
    prices = Prices(cache_hit_input=1.0, cache_miss_input=2.0, output=4.0, node_hour_cost=0.0)
    r = daily_report(usage, [], DAY, T0 + 100, prices)
    assert r["requests"] == 2
    assert r["input_tokens"] == 1500 and r["cache_hit_tokens"] == 600 and r["cache_miss_tokens"] == 900
    assert r["cache_hit_tokens"] + r["cache_miss_tokens"] == r["input_tokens"]
    assert r["cache_hit_rate"] == 0.4
    assert r["output_tokens"] == 150
    assert r["avg_output_tokens_per_s"] == 50.0  # (100/2 + 50/1) / 2
    assert r["avg_kv_length"] == (1100 + 550) / 2
    assert r["revenue"] == pytest.approx((600 * 1 + 900 * 2 + 150 * 4) / 1e6)
    assert r["serving_nodes_peak"] is None and r["cost"] is None


def test_serving_nodes_are_time_weighted_and_cost_node_hours():
    nodes = [NodeSample(T0 - 100, 8), NodeSample(T0 + 6 * 3600, 2), NodeSample(T0 + 12 * 3600, 8)]
    r = daily_report([UsageRecord(T0 + 1, 10, 0, 10, 1.0)], nodes, DAY, T0 + DAY, Prices(node_hour_cost=10.0))
    assert r["serving_nodes_peak"] == 8
    assert r["serving_nodes_avg"] == pytest.approx((6 * 8 + 6 * 2 + 12 * 8) / 24)
    assert r["node_hours"] == pytest.approx(6 * 8 + 6 * 2 + 12 * 8)
    assert r["cost"] == pytest.approx(10.0 * r["node_hours"])


def test_night_discount_applies_to_requests_finishing_at_night():
    night = Schedule.parse("08:00", "00:00")
    midnight = 1_796_083_200.0  # a UTC midnight
    usage = [UsageRecord(midnight + 3600, 0, 0, 1_000_000, 1.0), UsageRecord(midnight + 12 * 3600, 0, 0, 1_000_000, 1.0)]
    r = daily_report(usage, [], DAY, midnight + DAY, Prices(output=2.0, night_discount=0.5, night=night))
    assert r["revenue"] == pytest.approx(1.0 + 2.0)


def test_batch_lines_are_priced_and_counted_apart_and_lent_nodes_are_training_use():
    night = Schedule.parse("08:00", "00:00")
    midnight = 1_796_083_200.0
    usage = [UsageRecord(midnight + 3600, 0, 0, 1_000_000, 1.0),  # interactive, at night
             UsageRecord(midnight + 3600, 1000, 0, 1_000_000, 1.0, batch=True),  # batch: its own price
             UsageRecord(midnight + 12 * 3600, 0, 0, 1_000_000, 1.0, batch=True)]
    nodes = [NodeSample(midnight, 4, 0), NodeSample(midnight + 3600, 1, 3), NodeSample(midnight + 7 * 3600, 4, 0)]
    prices = Prices(output=2.0, night_discount=0.5, night=night, batch_discount=0.25)
    r = daily_report(usage, nodes, DAY, midnight + DAY, prices)
    assert r["revenue"] == pytest.approx(1.0 + (2.0 + 0.27e-3) * 0.75 + 2.0 * 0.75)
    assert r["batch_revenue"] == pytest.approx((2.0 + 0.27e-3) * 0.75 + 2.0 * 0.75)
    assert (r["batch_requests"], r["batch_input_tokens"], r["batch_output_tokens"]) == (2, 1000, 2_000_000)
    assert r["lent_node_hours"] == pytest.approx(3 * 6)
    t = timeline(usage, nodes, DAY, midnight + DAY, bins=24)
    assert t["batch_output_tokens"][1] == 1_000_000 and t["batch_output_tokens"][12] == 1_000_000
    assert t["output_tokens"][1] == 2_000_000 and t["lent_nodes"][1] == 3 and t["lent_nodes"][8] == 0
    with pytest.raises(ValueError, match="batch_discount"):
        Prices(batch_discount=1.0)


def test_usage_log_round_trip_skips_a_torn_line(tmp_path):
    log = JsonlLog(tmp_path / "u" / "usage.jsonl")
    log.append(UsageRecord(T0, 10, 5, 3, 0.5, "alpha"))
    with open(log.path, "a") as f:
        f.write('{"end_s": 1, "prompt')  # a writer killed mid-line
    assert read_jsonl([log.path], UsageRecord) == [UsageRecord(T0, 10, 5, 3, 0.5, "alpha")]


@pytest.mark.security
def test_usage_logs_name_tenants_so_only_their_owner_reads_them(tmp_path):
    """Made 0600 in a 0700 directory; one an older version made 0644 is tightened."""
    log = JsonlLog(tmp_path / "usage" / "node.jsonl")
    log.append(UsageRecord(T0, 10, 5, 3, 0.5, "alpha"))
    assert log.path.stat().st_mode & 0o777 == 0o600 and log.path.parent.stat().st_mode & 0o777 == 0o700
    old = tmp_path / "nodes.jsonl"
    old.write_text("")
    old.chmod(0o644)
    JsonlLog(old)
    assert old.stat().st_mode & 0o777 == 0o600


def test_bad_records_and_prices_are_refused():
    with pytest.raises(ValueError, match="inconsistent"):
        UsageRecord(T0, 10, 11, 0, 0.0)
    with pytest.raises(ValueError, match="night_discount"):
        Prices(night_discount=1.5)
    with pytest.raises(ValueError, match="output"):
        Prices(output=-1)


def test_the_usage_log_rotates_within_its_bound_and_reads_back_in_order(tmp_path):
    from cluster.daily_report import log_files

    log = JsonlLog(tmp_path / "replica.jsonl", max_bytes=2000, keep=3)
    records = [UsageRecord(float(i), 10, 5, 2, 0.5, "tenant-a") for i in range(200)]
    for r in records:
        log.append(r)
    files = log_files(tmp_path)
    assert [f.name for f in files] == ["replica.jsonl.3", "replica.jsonl.2", "replica.jsonl.1", "replica.jsonl"]
    assert all(f.stat().st_size <= 2000 for f in files)
    back = read_jsonl(files, UsageRecord)
    assert back == records[-len(back):] and len(back) > 3 * 2000 // 200  # the newest, in order, none lost between files


def test_the_timeline_slices_the_window_and_steps_the_nodes():
    from cluster.daily_report import timeline

    t0 = 1_800_000_000.0
    usage = [UsageRecord(t0 + 10, 100, 60, 5, 1.0), UsageRecord(t0 + 3599, 50, 0, 2, 1.0),
             UsageRecord(t0 + 3 * 3600 - 1, 10, 10, 1, 1.0), UsageRecord(t0 - 5, 999, 0, 9, 1.0)]  # the last before
    nodes = [NodeSample(t0 - 100, 4), NodeSample(t0 + 3600, 2)]
    s = timeline(usage, nodes, 3 * 3600, t0 + 3 * 3600, bins=3)
    assert s["start_s"] == [t0, t0 + 3600, t0 + 7200] and s["width_s"] == 3600
    assert s["input_tokens"] == [150, 0, 10] and s["cache_hit_tokens"] == [60, 0, 10]
    assert s["output_tokens"] == [7, 0, 1]
    assert s["cache_hit_rate"] == [0.4, None, 1.0]
    assert s["serving_nodes"] == [4, 2, 2]
    assert timeline(usage, [], 3600, t0, bins=1)["serving_nodes"] == [None]
    with pytest.raises(ValueError, match="bins"):
        timeline(usage, nodes, 3600, t0, bins=0)
