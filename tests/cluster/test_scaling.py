"""Day/night scaling policy over simulated 24-hour load curves."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime

import pytest

from cluster.scaling import (
    BatchDemand,
    LoadSample,
    ScalingConfig,
    ScalingPolicy,
    Schedule,
    batch_tokens_per_s,
)

DAY0 = datetime(2026, 11, 30, tzinfo=UTC).timestamp()  # midnight UTC
STEP_S = 300


def diurnal(hour: float, peak: float, trough: float) -> float:
    """Lowest at 04:00, highest at 16:00."""
    return trough + (peak - trough) * (1 - math.cos(2 * math.pi * (hour - 4) / 24)) / 2


def simulate(policy: ScalingPolicy, load_at, total: int, hours: float = 24.0, start_s: float = DAY0):
    current, trace = total, []
    for i in range(int(hours * 3600 / STEP_S)):
        now = start_s + i * STEP_S
        tokens = load_at(now)
        policy.observe(LoadSample(now, tokens, kv_occupancy=0.0, serving_nodes=current))
        d = policy.decide(now, current)
        trace.append((now, tokens, current, d))
        current = d.target
    return trace


def test_quiet_night_lends_nodes_and_the_day_gets_them_back():
    cfg = ScalingConfig(total_nodes=8, min_nodes=1, night_nodes=2, node_tokens_per_s=1000.0)
    policy = ScalingPolicy(cfg, Schedule.parse("08:00", "00:00"))
    rng = random.Random(0)
    trace = simulate(policy, lambda t: diurnal((t - DAY0) / 3600, 6000, 300) * rng.uniform(0.9, 1.1), 8)
    for now, tokens, _, d in trace:
        hour = (now - DAY0) / 3600
        assert d.target * cfg.node_tokens_per_s >= tokens, (hour, tokens, d)  # never under-served
        if 8 <= hour:
            assert d.target == 8, (hour, d)  # by day everything serves
    night_targets = [d.target for now, _, _, d in trace if (now - DAY0) / 3600 < 8]
    assert min(night_targets) == 2  # the goal is reached once the load allows
    changes = [i for i in range(1, len(trace)) if trace[i][3].target != trace[i][2]]
    assert len(changes) <= 8  # no flapping


def test_a_busy_night_stays_served():
    cfg = ScalingConfig(total_nodes=6, night_nodes=1, node_tokens_per_s=1000.0, min_dwell_s=600)
    policy = ScalingPolicy(cfg, Schedule.parse("08:00", "00:00"))
    trace = simulate(policy, lambda t: 4500.0, 6, hours=8)
    assert all(d.target * 1000 >= 4500 * cfg.headroom for _, _, _, d in trace)
    assert min(d.target for *_, d in trace) == 6  # 4500 x 1.3 needs 6 nodes all night


def test_the_batch_rate_meets_every_window_earliest_due_first():
    now = DAY0
    assert batch_tokens_per_s([], now) == 0.0
    far, near = BatchDemand(3_600_000, now + 10 * 3600), BatchDemand(720_000, now + 3600)
    assert batch_tokens_per_s([far], now) == pytest.approx(100.0)
    assert batch_tokens_per_s([far, near], now) == pytest.approx(200.0)  # the near one alone needs 200/s
    assert batch_tokens_per_s([BatchDemand(60_000, now + 1)], now) == pytest.approx(100.0)  # late: a floor on the time


def test_a_night_lends_the_nodes_batches_do_not_need_and_a_closing_window_takes_them_back():
    """Three uses of spare nodes: a quiet night lends all but night_nodes to training; batch work
    that fits beside the interactive load changes nothing; a window that would close unmet
    brings nodes back from training."""
    cfg = ScalingConfig(total_nodes=8, night_nodes=2, node_tokens_per_s=1000.0, min_dwell_s=0)
    policy = ScalingPolicy(cfg, Schedule.parse("08:00", "00:00"))
    now = DAY0 + 3600  # 01:00, night
    policy.observe(LoadSample(now, 500.0, serving_nodes=8))
    assert policy.decide(now, 8).target == 2  # nothing due: training gets the rest
    policy.observe_batches([BatchDemand(3_000_000, now + 6 * 3600)], now)  # ~139 tok/s: fits beside 650
    assert policy.decide(now, 2).target == 2
    policy.observe_batches([BatchDemand(20_000_000, now + 2 * 3600)], now)  # ~2.8k tok/s due in 2 h
    d = policy.decide(now, 2)
    assert d.target == 4 and d.reason == "batches due need more nodes"
    policy.observe_batches([], now)
    assert policy.decide(now, 4).target == 2  # done: back to training


def test_rising_load_at_night_scales_up_at_once_before_it_arrives():
    cfg = ScalingConfig(total_nodes=8, night_nodes=1, node_tokens_per_s=1000.0, min_dwell_s=3600)
    policy = ScalingPolicy(cfg, Schedule.parse("08:00", "00:00"))
    ramp = lambda t: 200.0 if t < DAY0 + 3 * 3600 else 200.0 + (t - DAY0 - 3 * 3600) * 1.0  # noqa: E731
    trace = simulate(policy, ramp, 8, hours=5)
    for _, tokens, _, d in trace:
        assert d.target * 1000 >= tokens and d.target >= d.needed  # scaling up never waits
    # on the ramp the projection along the trend asks for more than the current rate does
    assert any(d.needed > math.ceil(tokens * cfg.headroom / 1000) for _, tokens, _, d in trace)


def test_hysteresis_and_dwell_damp_a_load_at_the_threshold():
    cfg = ScalingConfig(total_nodes=6, night_nodes=1, node_tokens_per_s=1000.0, min_dwell_s=1800)
    policy = ScalingPolicy(cfg, Schedule.parse("08:00", "00:00"))
    rng = random.Random(3)
    trace = simulate(policy, lambda t: 2300 * rng.uniform(0.95, 1.05), 6, hours=8)
    downs = [trace[i][0] for i in range(1, len(trace)) if trace[i][3].target < trace[i][2]]
    assert all(b - a >= cfg.min_dwell_s for a, b in zip(downs, downs[1:], strict=False))
    changes = sum(1 for _, _, cur, d in trace if d.target != cur)
    assert changes <= 4


def test_kv_occupancy_alone_can_hold_nodes():
    cfg = ScalingConfig(total_nodes=4, night_nodes=1, node_tokens_per_s=1e9, min_dwell_s=0)
    policy = ScalingPolicy(cfg, Schedule.parse("08:00", "00:00"))
    now = DAY0 + 3600
    policy.observe(LoadSample(now, 10.0, requests_running=50, kv_occupancy=0.7, serving_nodes=4))
    d = policy.decide(now, 4)
    assert d.target == 4  # 0.7 x 4 nodes x 1.6 does not fit fewer nodes
    policy.observe(LoadSample(now + 60, 10.0, kv_occupancy=0.2, serving_nodes=4))
    assert policy.decide(now + 60, 4).target == 2  # 0.2 x 4 x 1.6 = 1.28 -> 2


def test_schedule_timezone_and_wrap():
    shanghai = Schedule.parse("08:00", "23:00", "Asia/Shanghai")  # 23:00-08:00 local = 15:00-24:00 UTC
    assert shanghai.is_night(DAY0 + 16 * 3600)
    assert not shanghai.is_night(DAY0 + 3 * 3600)
    early = Schedule.parse("07:30", "01:00")
    assert early.is_night(DAY0 + 2 * 3600) and not early.is_night(DAY0 + 0.5 * 3600)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(total_nodes=4, min_nodes=5), "min_nodes 5"),
        (dict(total_nodes=4, night_nodes=9), "night_nodes 9"),
        (dict(total_nodes=4, headroom=2.0, down_headroom=1.5), "headroom"),
        (dict(total_nodes=4, node_tokens_per_s=0), "node_tokens_per_s"),
    ],
)
def test_config_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScalingConfig(**kwargs)


def test_schedule_errors_name_the_value():
    with pytest.raises(ValueError, match="'25:00'"):
        Schedule.parse("25:00", "00:00")
    with pytest.raises(ValueError, match="'Mars/Base'"):
        Schedule.parse("08:00", "00:00", "Mars/Base")
    with pytest.raises(ValueError, match="both"):
        Schedule.parse("08:00", "08:00")


def test_nodes_to_free_prefers_idle_nodes_with_little_unique_cache_and_never_the_head_first():
    from cluster.scaling import NodeLoad, nodes_to_free

    nodes = [NodeLoad("head", 0, 0, head=True), NodeLoad("a", 3, 10), NodeLoad("b", 0, 50), NodeLoad("c", 0, 5)]
    assert nodes_to_free(nodes, 1) == ["c"]
    assert nodes_to_free(nodes, 2) == ["c", "b"]
    assert nodes_to_free(nodes, 4)[-1] == "head"
    with pytest.raises(ValueError, match="cannot free 5 of 4"):
        nodes_to_free(nodes, 5)
