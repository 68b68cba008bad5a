"""``tide bench cluster --scenario night``: what a night's scale-down costs the cache, with and
without keeping (``cachedir/keeping.py``).

On a simulated cluster with the shared directory, each case replays the trace's first half (the
day), then the second half (the night) and reports the night's hit rate and TTFT:

* ``stay`` — no node leaves: the baseline;
* ``lend`` — before the night one node is lent (``deploy.tidal.lend_nodes``) with keeping off,
  and the node is then removed, as a Kubernetes night deletes its pod: its units go with it;
* ``lend_keep`` — the same with keeping on: the node's hot units that no staying node holds are
  copied to the nodes that stay before it goes.

The cases take turns over ``repeats`` runs, each on empty caches with the removed node replaced
for the next; figures are medians with their range. The target: ``lend_keep``'s night hit rate
within 2 points of ``stay``'s.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from cachedir.trace import BLOCK_TOKENS
from deploy.bench.cluster_bench import (
    _medians,
    _replay,
    _source_tokens,
    _summary,
    stop_agents,
    trace_prompts,
)
from deploy.bench.machine import machine
from deploy.bench.serve_bench import simulated_cluster
from deploy.redis_proc import wait_healthy

__all__ = ["NIGHT_CASES", "run_night_bench"]

NIGHT_CASES = ("stay", "lend", "lend_keep")


def _run(url: str, app_args: dict[str, Any], work: list, concurrency: int, case: str, sim) -> dict[str, Any]:
    """One case: the day replayed, the node lent and removed (unless ``stay``), the night
    replayed; the night's figures, and what was kept."""
    from ray import serve

    from deploy.app import build_app
    from deploy.tidal import lend_nodes

    serve.run(build_app(app_args), name="bench", route_prefix="/", blocking=False)
    wait_healthy(url)
    half = len(work) // 2
    asyncio.run(_replay(url, work[:half], concurrency))
    kept: dict = {}
    if case != "stay":
        night = lend_nodes(app_args, 1, app_name="bench", deadline_s=30, timeout_s=300)
        kept = night.get("kept", {})
        (lent,) = night["lent"]
        node = next(n for n in sim.worker_nodes if n.node_id == lent)
        sim.remove_node(node)  # its pod deleted: its agent and its units go
    before = _source_tokens(url)
    t0 = time.perf_counter()
    results = asyncio.run(_replay(url, work[half:], concurrency))
    wall = time.perf_counter() - t0
    after = _source_tokens(url)
    out = _summary(results, {s: after.get(s, 0) - before.get(s, 0) for s in after}, wall)
    out["kept_units"] = sum(k.get("kept", 0) for k in kept.values())
    return out


def run_night_bench(trace: Path, nodes: int = 3, requests: int = 600, concurrency: int = 4, block_tokens: int = 8,
                    max_prompt_tokens: int = 2048, max_tokens: int = 4, checkpoint: Path | None = None,
                    repeats: int = 2) -> dict[str, Any]:
    import ray
    from ray import serve

    from deploy.local import agent_token_file

    work = trace_prompts(trace, requests, block_tokens, max_prompt_tokens, max_tokens)
    out: dict[str, Any] = {**machine(), "scenario": "night", "trace": str(trace), "nodes": nodes,
                           "requests": len(work), "night_requests": len(work) - len(work) // 2,
                           "scale_factor": BLOCK_TOKENS / block_tokens, "repeats": repeats}
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in NIGHT_CASES}
    with tempfile.TemporaryDirectory() as tmp, simulated_cluster(nodes, Path(tmp)) as (redis, url, sim):
        for rep in range(repeats):
            for case in NIGHT_CASES if rep % 2 == 0 else tuple(reversed(NIGHT_CASES)):
                app_args = {
                    "checkpoint": str(checkpoint) if checkpoint else None, "replicas": nodes, "replica_cpus": 1,
                    "max_replicas_per_node": 1, "cache_dir": str(Path(tmp) / f"{case}-{rep}" / "{node}"),
                    "directory_url": redis.url, "directory_namespace": f"night-{case}-{uuid.uuid4().hex[:8]}",
                    "max_num_seqs": max(4, concurrency), "num_pages": 2048, "agent_token_file": agent_token_file(),
                    "night_keep_bytes": (8 << 30) if case == "lend_keep" else 0,
                }
                runs[case].append(_run(url, app_args, work, concurrency, case, sim))
                serve.delete("bench")
                stop_agents()  # the next run starts from empty caches
                while len([n for n in ray.nodes() if n["Alive"]]) < nodes:  # the removed node replaced
                    sim.add_node(num_cpus=1)
                    sim.wait_for_nodes()
    for case in NIGHT_CASES:
        out[case] = {**_medians(runs[case]), "kept_units": [r["kept_units"] for r in runs[case]]}
    hit = {c: out[c]["token_hit_rate"].get("median") for c in NIGHT_CASES}
    if all(v is not None for v in hit.values()):
        out["keeping_gap_points"] = round(100 * (hit["stay"] - hit["lend_keep"]), 2)
        out["lending_gap_points"] = round(100 * (hit["stay"] - hit["lend"]), 2)
        out["within_2_points"] = out["keeping_gap_points"] <= 2.0
    return out
