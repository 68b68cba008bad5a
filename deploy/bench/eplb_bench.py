"""``tide bench eplb``: placement quality of each EPLB policy on Zipf-skewed expert loads.

Each layer's expert loads follow a Zipf law (load of the r-th hottest expert ~ r^-s) with the
ranks shuffled per layer; the drift for ``moved_slots`` multiplies every load by (1 + 5% noise).

In-sample figures (``imbalance_after``) score a plan on the load it was planned from. Out of
sample: the load drifts between windows (each expert's load times exp(``window_drift`` x a
standard normal) per window); a plan made on one window is scored on the next
(``imbalance_next_window``) and on sampled batches of that next window: tokens routed to 8
distinct experts each, ``rows_per_shard`` (token, expert) pairs per shard on average, each pair's
copy chosen as the executor chooses it (``imbalance_sampled_batch``: realized max/mean, averaged
over layers and batches). A batch spread over shards uniformly at random has noise of its own:
``imbalance_sampled_floor`` is that floor for the same pairs.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from cluster.ep import choose_slots
from cluster.eplb import EplbConfig, Placement, imbalance, moved_slots, plan, spill_fraction
from deploy.bench.machine import machine

POLICIES = ("global", "hierarchical", "spill")
BATCHES = 16  # sampled batches per score
TOP_K = 8  # experts per token (DeepSeek-V3)


def zipf_load(layers: int, experts: int, exponent: float, seed: int, tokens: float = 1e6) -> torch.Tensor:
    """[L, E] tokens per expert, Zipf(``exponent``) over a per-layer random ranking."""
    gen = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1, dtype=torch.double) ** exponent
    base = base / base.sum() * tokens
    return torch.stack([base[torch.randperm(experts, generator=gen)] for _ in range(layers)])


def next_window(load: torch.Tensor, drift: float, seed: int) -> torch.Tensor:
    """The load one window later: each expert's load times exp(``drift`` x N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    return load * torch.exp(drift * torch.randn(load.shape, generator=gen, dtype=torch.double))


def sampled_imbalance(placement: Placement, load: torch.Tensor, rows_per_shard: int, batches: int,
                      seed: int, top_k: int = TOP_K) -> float:
    """Realized max/mean (token, expert) pairs per shard of sampled batches: ``rows_per_shard`` x
    shards pairs per layer, from tokens that each route to ``top_k`` distinct experts drawn from
    ``load``, every pair's copy chosen as the executor chooses it (``cluster.ep.choose_slots``)."""
    gen = torch.Generator().manual_seed(seed)
    layers, _ = load.shape
    shards, per = placement.num_shards, placement.slots_per_shard
    tokens = max(1, rows_per_shard * shards // top_k)
    ratios = []
    for _ in range(batches):
        for layer in range(layers):
            ids = torch.multinomial(load[layer].float().expand(tokens, -1), top_k, replacement=False, generator=gen)
            slots = choose_slots(ids, placement.log2phy[layer], placement.logcnt[layer])
            counts = torch.bincount((slots // per).reshape(-1), minlength=shards)
            ratios.append(float(counts.max()) / (tokens * top_k / shards))
    return sum(ratios) / len(ratios)


def sampled_floor(shards: int, rows_per_shard: int, batches: int, layers: int, seed: int) -> float:
    """max/mean of the same rows spread over shards uniformly at random (sampling noise alone)."""
    gen = torch.Generator().manual_seed(seed)
    rows = rows_per_shard * shards
    counts = torch.stack([torch.bincount(torch.randint(0, shards, (rows,), generator=gen), minlength=shards)
                          for _ in range(batches * layers)])
    return float((counts.max(1).values.double() / rows_per_shard).mean())


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
    window_drift: float = 0.2,
    rows_per_shard: int = 32,
) -> dict[str, Any]:
    results = []
    for s in exponents:
        load = zipf_load(layers, experts, s, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        drifted = load * (1 + drift * torch.randn(load.shape, generator=gen, dtype=torch.double)).clamp_min(0)
        later = next_window(load, window_drift, seed + 2)
        in_order = Placement.in_order(layers, experts, shards)
        before = imbalance(in_order, load)
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
                "imbalance_next_window": round(imbalance(placement, later), 4),
                "imbalance_next_window_before": round(imbalance(in_order, later), 4),
                "imbalance_sampled_batch": round(sampled_imbalance(placement, later, rows_per_shard, BATCHES, seed + 3), 4),
                "imbalance_sampled_batch_before": round(
                    sampled_imbalance(in_order, later, rows_per_shard, BATCHES, seed + 3), 4),
            })
    return {
        **machine(),
        "experts": experts, "groups": groups, "shards": shards, "nodes": nodes, "slots": slots,
        "layers": layers, "drift": drift, "total_slots": layers * slots, "window_drift": window_drift,
        "rows_per_shard": rows_per_shard, "sampled_batches": BATCHES,
        "imbalance_sampled_floor": round(sampled_floor(shards, rows_per_shard, BATCHES, layers, seed + 4), 4),
        "results": results,
    }
