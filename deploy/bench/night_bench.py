"""``tide bench cluster --scenario night``: what a night's scale-down costs the cache, with and
without keeping and warming (``cachedir/keeping.py``).

On a simulated cluster with the shared directory, each case replays the trace's first 40% (the
day), its next 30% (the night) and the rest (the morning), and reports the night's hit rate and
TTFT, and the morning's:

* ``stay`` — no node leaves: the baseline;
* ``lend`` — before the night one node is lent (``deploy.tidal.lend_nodes``) with keeping off,
  and the node is then removed, as a Kubernetes night deletes its pod: its units go with it; in
  the morning a new node joins and serves (``return_nodes``), cold;
* ``lend_keep`` — the same with keeping on: the node's units that no staying node holds, the hot
  ones first, are copied to the nodes that stay before it goes (``cachedir.keeping.keep_units``),
  and the morning's node fetches the hot units it lacks, then the fleet's others, before its
  replica serves (``cachedir.keeping.warm_units``).

The cases take turns over ``repeats`` runs, each on empty caches with the removed node replaced
for the next; figures are medians with their range. The targets: ``lend_keep``'s night hit rate
within 2 points of ``stay``'s, and the morning node's hit rate within 5 points of its fleet's
(``morning_node_gap_points``; ``morning_node_local_gap_points`` the same for the hits from the
node's own RAM or SSD, which warming fills, not fetched from another node).
"""

from __future__ import annotations

import asyncio
import statistics
import uuid
from pathlib import Path
from typing import Any

from cachedir.trace import BLOCK_TOKENS
from deploy.bench.arrivals import rebase, trace_arrivals
from deploy.bench.cluster_bench import _medians, _replay, replica_seats, stop_agents, trace_prompts
from deploy.bench.fleet_events import keep_serve_logs, replay, restore_nodes
from deploy.bench.machine import machine
from deploy.bench.serve_bench import on_cluster
from deploy.redis_proc import wait_healthy

__all__ = ["NIGHT_CASES", "run_night_bench"]

NIGHT_CASES = ("stay", "lend", "lend_keep")
CUTS = (0.4, 0.7)  # the day is the trace's first 40%, the night the next 30%, the morning the rest


def _run(url: str, app_args: dict[str, Any], work: list, concurrency: int, case: str, sim,
         arrivals: list[float] | None = None) -> dict[str, Any]:
    """One case: the day replayed; the node lent and removed (unless ``stay``); the night
    replayed; a new node in its place serving again (``return_nodes``); the morning replayed.
    The night's figures, the morning's, the returned node's morning hit rate, what was kept.
    ``arrivals``: each request's in an open loop (each part from its first), else ``concurrency``
    clients."""
    from ray import serve

    from deploy.app import build_app
    from deploy.tidal import lend_nodes, return_nodes

    serve.run(build_app(app_args), name="bench", route_prefix="/", blocking=False)
    wait_healthy(url)
    day, night = (int(share * len(work)) for share in CUTS)
    asyncio.run(_replay(url, work[:day], concurrency, arrivals=rebase(arrivals, 0, day)))
    kept: dict = {}
    if case != "stay":
        lent = lend_nodes(app_args, 1, app_name="bench", deadline_s=30, timeout_s=300)
        kept = lent.get("kept", {})
        sim.remove_node(next(n for n in sim.worker_nodes if n.node_id in lent["lent"]))  # its pod deleted
    out = replay(url, app_args, work[day:night], concurrency, arrivals=rebase(arrivals, day, night))
    out["kept_units"] = sum(k.get("kept", 0) for k in kept.values())
    morning_node = None
    if case != "stay":  # a new pod in the morning: its agent warms (keeping on) before its replica serves
        morning_node = sim.add_node(num_cpus=1).node_id
        sim.wait_for_nodes()
        return_nodes(app_args, app_name="bench", timeout_s=300)
    out["morning"] = replay(url, app_args, work[night:], concurrency, arrivals=rebase(arrivals, night, len(work)))
    if morning_node is not None:
        mine = [r for r in out["morning"]["replica_load"]["replicas"] if r["node"] == morning_node[:12]]
        out["morning_node_hit_rate"] = mine[0]["hit_rate"] if mine else None
        out["morning_node_local_hit_rate"] = mine[0]["local_hit_rate"] if mine else None
    return out


def run_night_bench(trace: Path, nodes: int = 3, requests: int = 600, concurrency: int = 4, block_tokens: int = 8,
                    max_prompt_tokens: int = 2048, max_tokens: int = 4, checkpoint: Path | None = None,
                    repeats: int = 2, skip: int = 0, cluster: tuple | None = None,
                    rate: float | None = None, max_num_seqs: int | None = None,
                    pace: dict[str, float] | None = None) -> dict[str, Any]:
    """The night's cases over ``repeats`` runs (module docstring); ``cluster``: a running
    ``simulated_cluster``'s (redis, url, sim) to replay on, else one is started and stopped;
    ``rate``: requests a second in an open loop at the trace's arrival times, else
    ``concurrency`` clients in a closed loop; ``max_num_seqs``: each replica's running sequences
    (``replica_seats``); ``pace``: each replica's emulated device (``AppArgs.pace``)."""
    from ray import serve

    from deploy.local import agent_token_file

    work = trace_prompts(trace, requests, block_tokens, max_prompt_tokens, max_tokens, skip=skip)
    arrivals = trace_arrivals(trace, requests, rate, skip=skip) if rate else None
    seats = replica_seats(max_num_seqs, concurrency)
    out: dict[str, Any] = {**machine(), "scenario": "night", "trace": str(trace), "skip": skip, "nodes": nodes,
                           "concurrency": None if rate else concurrency, "rate": rate, "max_num_seqs": seats,
                           "pace": pace, "requests": len(work), "night_requests": int(CUTS[1] * len(work)) - int(CUTS[0] * len(work)),
                           "morning_requests": len(work) - int(CUTS[1] * len(work)),
                           "scale_factor": BLOCK_TOKENS / block_tokens, "repeats": repeats}
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in NIGHT_CASES}
    with on_cluster(nodes, cluster) as (tmp, (redis, url, sim)):
        for rep in range(repeats):
            for case in NIGHT_CASES if rep % 2 == 0 else tuple(reversed(NIGHT_CASES)):
                app_args = {
                    "checkpoint": str(checkpoint) if checkpoint else None, "replicas": nodes, "replica_cpus": 1,
                    "max_replicas_per_node": 1, "cache_dir": str(tmp / f"{case}-{rep}" / "{node}"),
                    "directory_url": redis.url, "directory_namespace": f"night-{case}-{uuid.uuid4().hex[:8]}",
                    "max_num_seqs": seats, "num_pages": 2048, "agent_token_file": agent_token_file(),
                    "night_keep_bytes": (8 << 30) if case == "lend_keep" else 0, "pace": pace,
                }
                runs[case].append(keep_serve_logs(_run(url, app_args, work, concurrency, case, sim, arrivals), sim,
                                                  f"night-{case}-{rep}"))
                serve.delete("bench")
                stop_agents()  # the next run starts from empty caches
                restore_nodes(sim, nodes)
    for case in NIGHT_CASES:
        mornings = [r["morning"] for r in runs[case]]
        out[case] = {**_medians(runs[case]), "kept_units": [r["kept_units"] for r in runs[case]],
                     "morning": {k: v for k, v in _medians(mornings).items() if k != "runs"}}
        if case != "stay":
            out[case] |= _morning_node(mornings, runs[case])
        # the same gap for the replica with the lowest hit rate: with no node lent (stay), how far
        # apart a cache-aware router leaves replicas that all were there the day before
        rates = [[r["hit_rate"] for r in m["replica_load"]["replicas"] if r["hit_rate"] is not None] for m in mornings]
        lowest = [100 * (m["token_hit_rate"] - min(rs)) for m, rs in zip(mornings, rates, strict=True) if rs]
        out[case]["morning_lowest_replica_gap_points"] = _spread(lowest)
    hit = {c: out[c]["token_hit_rate"].get("median") for c in NIGHT_CASES}
    if all(v is not None for v in hit.values()):
        out["keeping_gap_points"] = round(100 * (hit["stay"] - hit["lend_keep"]), 2)
        out["lending_gap_points"] = round(100 * (hit["stay"] - hit["lend"]), 2)
        out["within_2_points"] = out["keeping_gap_points"] <= 2.0
    morning = out["lend_keep"]["morning_node_gap_points"]
    if morning:
        out["morning_within_5_points"] = morning["median"] <= 5.0
    return out


def _morning_node(mornings: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The new node's morning against its fleet's, in points: its hit rate (``morning_node_gap_points``;
    a request it fetches from another node hits too) and its local hit rate (from its own RAM or
    SSD: what warming put there; ``morning_node_local_gap_points``, and the rate itself)."""
    def local(m: dict[str, Any]) -> float:
        return m["hit_rate_by_source"].get("ram", 0.0) + m["hit_rate_by_source"].get("local_ssd", 0.0)

    pairs = [(m, r) for m, r in zip(mornings, runs, strict=True) if r.get("morning_node_hit_rate") is not None]
    return {"morning_node_gap_points": _spread([100 * (m["token_hit_rate"] - r["morning_node_hit_rate"])
                                                for m, r in pairs]),
            "morning_node_local_hit_rate": _spread([r["morning_node_local_hit_rate"] for _, r in pairs]),
            "morning_node_local_gap_points": _spread([100 * (local(m) - r["morning_node_local_hit_rate"])
                                                      for m, r in pairs])}


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 2), "range": [round(min(values), 2), round(max(values), 2)]} \
        if values else {}
