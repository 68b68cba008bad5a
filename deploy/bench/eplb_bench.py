"""``tide bench eplb``: placement quality of each EPLB policy on Zipf-skewed expert loads.

Each layer's expert loads follow a Zipf law (load of the r-th hottest expert ~ r^-s) with the
ranks shuffled per layer; the drift for ``moved_slots`` multiplies every load by (1 + 5% noise).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from cluster.eplb import EplbConfig, Placement, imbalance, moved_slots, plan, spill_fraction

POLICIES = ("global", "hierarchical", "spill")


def zipf_load(layers: int, experts: int, exponent: float, seed: int, tokens: float = 1e6) -> torch.Tensor:
    """[L, E] tokens per expert, Zipf(``exponent``) over a per-layer random ranking."""
    gen = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1, dtype=torch.double) ** exponent
    base = base / base.sum() * tokens
    return torch.stack([base[torch.randperm(experts, generator=gen)] for _ in range(layers)])


def run_eplb_bench(
    exponents: tuple[float, ...] = (0.5, 1.0, 1.5),
    experts: int = 256,
    groups: int = 8,
    shards: int = 32,
    nodes: int = 4,
    slots: int = 288,
    layers: int = 58,
    drift: float = 0.05,
    seed: int = 0,
) -> dict[str, Any]:
    results = []
    for s in exponents:
        load = zipf_load(layers, experts, s, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        drifted = load * (1 + drift * torch.randn(load.shape, generator=gen, dtype=torch.double)).clamp_min(0)
        before = imbalance(Placement.in_order(layers, experts, shards), load)
        for policy in POLICIES:
            cfg = EplbConfig(slots, groups, nodes, shards, policy)
            t0 = time.perf_counter()
            placement = plan(load, cfg)
            runtime = time.perf_counter() - t0
            t0 = time.perf_counter()
            replanned = plan(drifted, cfg, previous=placement)
            replan_runtime = time.perf_counter() - t0
            results.append({
                "exponent": s,
                "policy": policy,
                "imbalance_before": round(before, 4),
                "imbalance_after": round(imbalance(placement, load), 4),
                "spill_fraction": round(spill_fraction(placement, load, groups, nodes), 4),
                "runtime_ms": round(runtime * 1e3, 1),
                "moved_slots": moved_slots(placement, replanned),
                "moved_slots_fresh_plan": moved_slots(placement, plan(drifted, cfg)),
                "imbalance_after_drift": round(imbalance(replanned, drifted), 4),
                "replan_runtime_ms": round(replan_runtime * 1e3, 1),
            })
    return {
        "experts": experts, "groups": groups, "shards": shards, "nodes": nodes, "slots": slots,
        "layers": layers, "drift": drift, "total_slots": layers * slots, "results": results,
    }
