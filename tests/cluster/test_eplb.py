"""EPLB: invariants under randomized loads, balance against the in-order layout, stable re-plans."""

from __future__ import annotations

import random

import pytest
import torch

from cluster.eplb import (
    EplbConfig,
    Placement,
    imbalance,
    moved_slots,
    plan,
    shard_loads,
    spill_fraction,
)


def zipf_load(layers: int, experts: int, exponent: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1, dtype=torch.double) ** exponent
    return torch.stack([base[torch.randperm(experts, generator=gen)] for _ in range(layers)]) * 1e4


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", ["global", "hierarchical", "spill"])
def test_invariants_under_random_loads(seed, policy):
    rng = random.Random(seed)
    nodes = rng.choice([1, 2, 4])
    shards = nodes * rng.choice([1, 2, 3])
    groups = nodes * rng.choice([1, 2])
    experts = groups * rng.choice([2, 3, 5])
    per_shard = min(-(-experts // shards) + rng.choice([0, 1, 2]), experts // nodes)
    cfg = EplbConfig(per_shard * shards, groups, nodes, shards, policy)
    gen = torch.Generator().manual_seed(seed)
    kind = rng.choice(["uniform", "zipf", "sparse"])
    if kind == "zipf":
        load = zipf_load(3, experts, rng.choice([0.5, 1.0, 2.0]), seed)
    else:
        load = torch.rand(3, experts, generator=gen, dtype=torch.double) * 100
        if kind == "sparse":
            load[load < 60] = 0.0  # idle experts still get a copy
    p = plan(load, cfg)
    p.check_integrity()
    assert p.phy2log.shape == (3, cfg.num_slots) and p.log2phy.shape[:2] == (3, experts)
    assert int(p.logcnt.max()) <= shards
    loads = shard_loads(p, load)
    torch.testing.assert_close(loads.sum(1), load.sum(1))  # every token is served somewhere
    if policy == "hierarchical" and nodes > 1:
        assert spill_fraction(p, load, groups, nodes) < 1e-12  # groups stay on their node
    # re-planning after a drift keeps the invariants too
    drift = load * (1 + 0.1 * torch.randn(load.shape, generator=gen, dtype=torch.double)).clamp_min(0)
    again = plan(drift, cfg, previous=p)
    again.check_integrity()


def test_balancing_beats_the_in_order_layout_and_global_reaches_its_target():
    load = zipf_load(6, 64, 1.0, seed=1)
    cfg = EplbConfig(num_slots=72, num_groups=8, num_nodes=2, num_shards=8, policy="global")
    before = imbalance(Placement.in_order(6, 64, 8), load)
    after = imbalance(plan(load, cfg), load)
    assert before > 2.0 and after < 1.05


def test_spill_balances_what_whole_groups_cannot():
    load = zipf_load(4, 256, 1.0, seed=2)
    kw = dict(num_slots=288, num_groups=8, num_nodes=4, num_shards=32)
    hier = plan(load, EplbConfig(**kw, policy="hierarchical"))
    spill = plan(load, EplbConfig(**kw, policy="spill"))
    assert imbalance(spill, load) < imbalance(hier, load) - 0.1
    assert 0.0 < spill_fraction(spill, load, 8, 4) < 0.3


def test_replan_keeps_a_placement_that_still_balances():
    load = zipf_load(4, 32, 1.0, seed=3)
    cfg = EplbConfig(num_slots=40, num_groups=4, num_nodes=2, num_shards=4, policy="hierarchical")
    first = plan(load, cfg)
    assert moved_slots(first, plan(load * 1.5, cfg, previous=first)) == 0  # same shape, same plan


def test_replan_after_drift_moves_few_slots_and_stays_balanced():
    load = zipf_load(8, 64, 1.0, seed=4)
    cfg = EplbConfig(num_slots=72, num_groups=8, num_nodes=2, num_shards=8, policy="global")
    first = plan(load, cfg)
    gen = torch.Generator().manual_seed(9)
    drift = load * (1 + 0.05 * torch.randn(load.shape, generator=gen, dtype=torch.double))
    fresh, again = plan(drift, cfg), plan(drift, cfg, previous=first)
    assert moved_slots(first, again) < moved_slots(first, fresh) / 2
    assert imbalance(again, drift) <= imbalance(fresh, drift) + cfg.keep_tolerance + 1e-9


def test_replan_onto_fewer_shards_plans_afresh():
    load = zipf_load(2, 16, 1.0, seed=5)
    big = plan(load, EplbConfig(24, 4, 2, 4))
    small = plan(load, EplbConfig(18, 4, 1, 2), previous=big)
    small.check_integrity()
    assert small.phy2log.shape == (2, 18)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_slots=10, num_groups=2, num_nodes=2, num_shards=3), "num_shards 3"),
        (dict(num_slots=10, num_groups=2, num_nodes=1, num_shards=4), "num_slots 10"),
        (dict(num_slots=8, num_groups=2, num_nodes=1, num_shards=4, policy="random"), "'random'"),
        (dict(num_slots=8, num_groups=0, num_nodes=1, num_shards=4), "num_groups"),
    ],
)
def test_config_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EplbConfig(**kwargs)


def test_auto_policy():
    assert EplbConfig(288, 8, 4, 32).resolve_policy(256) == "hierarchical"
    assert EplbConfig(18, 4, 3, 3).resolve_policy(16) == "global"  # groups do not divide over nodes
    assert EplbConfig(18, 4, 2, 2).resolve_policy(16) == "global"  # 9 slots per shard > 8 experts per node


def test_plan_errors_name_the_value():
    with pytest.raises(ValueError, match="num_slots 8 < 16"):
        plan(torch.ones(1, 16), EplbConfig(8, 4, 1, 4))
    with pytest.raises(ValueError, match="num_groups 3"):
        plan(torch.ones(1, 16), EplbConfig(16, 3, 1, 4))
    with pytest.raises(ValueError, match="finite"):
        plan(torch.tensor([[1.0, -1.0]]), EplbConfig(2, 1, 1, 2))
    with pytest.raises(ValueError, match="3 slots per shard exceed the 2 experts"):
        plan(torch.ones(1, 4), EplbConfig(12, 2, 2, 4, policy="hierarchical"))
    with pytest.raises(ValueError, match="'global'"):
        plan(torch.ones(1, 12), EplbConfig(12, 3, 2, 2, policy="hierarchical"))
