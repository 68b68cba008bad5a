"""``tide bench cluster``'s scenarios in which the fleet changes mid-replay, and the per-replica
load every run reports.

The replay is cut into windows at the events; between two windows (no request in flight) the
event happens, and each window's figures are those of the requests after it:

* ``scale`` — a third of the way in one node is lent (``deploy.tidal.lend_nodes``: its replica
  drains and goes, the router's set of replicas shrinks; on Ray its cache agent stays and serves
  its units), two thirds in it comes back (``return_nodes``): windows ``after_lend`` (the night)
  and ``after_return`` (the morning);
* ``failure`` — half way one worker node is removed from the cluster (its replica, its agent and
  its units gone; Serve cannot place the replica again): window ``after_failure``.

``run_scenarios`` replays several scenarios (these, the others and the night) on one cluster.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from deploy.bench.arrivals import rebase

__all__ = ["EVENTS", "replay", "replica_load", "restore_nodes", "run_scenarios"]

# scenario -> (event, where in the replay it happens, as a share of the requests)
EVENTS: dict[str, tuple[tuple[str, float], ...]] = {
    "scale": (("lend", 1 / 3), ("return", 2 / 3)),
    "failure": (("kill", 1 / 2),),
}
WINDOW = {"lend": "after_lend", "return": "after_return", "kill": "after_failure"}
REPORT_S = 1.0  # replicas report twice a second
COUNTERS = ("finished", "prefill_tokens", "decode_tokens", "finished_prompt_tokens", "finished_cached_tokens",
            "finished_local_tokens")


def replica_load() -> dict[str, dict[str, Any]]:
    """Each serving replica's node, sequences it runs at once and engine counters now
    (``COUNTERS``), by actor name, from the replicas' heartbeats."""
    import ray

    from actors.tidal import tidal_state

    time.sleep(REPORT_S)  # the last requests' counts reach the heartbeats
    reports = ray.get(tidal_state().replica_reports.remote(), timeout=30)
    out = {}
    for name, r in reports.items():
        stats = r.get("stats") or {}
        engine = stats.get("engine") or {}
        out[name] = {"node": r.get("node_id", ""), "max_num_seqs": stats.get("max_num_seqs"),
                     **{k: int(engine.get(k, 0)) for k in COUNTERS}}
    return out


def load_summary(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What each replica did between two ``replica_load`` reads, busiest first: its node, its
    ``max_num_seqs``, requests finished, prefill tokens computed, its hit rate (cached of its
    finished requests' prompt tokens) and its local hit rate (those from its own node's pool,
    RAM or SSD, not fetched from another node); ``busiest_share``: the busiest replica's share
    of the prefill tokens computed (1/replicas is even)."""
    done = []
    for name, counts in after.items():
        grew = {k: counts.get(k, 0) - before.get(name, {}).get(k, 0) for k in COUNTERS}
        prompt = grew["finished_prompt_tokens"]
        done.append({"node": counts["node"][:12], "max_num_seqs": counts.get("max_num_seqs"), "requests": grew["finished"],
                     "prefill_tokens": grew["prefill_tokens"],
                     "hit_rate": round(grew["finished_cached_tokens"] / prompt, 4) if prompt else None,
                     "local_hit_rate": round(grew["finished_local_tokens"] / prompt, 4) if prompt else None})
    done.sort(key=lambda d: -d["prefill_tokens"])
    total = sum(d["prefill_tokens"] for d in done)
    return {"replicas": done, "busiest_share": round(done[0]["prefill_tokens"] / total, 3) if total else None}


def keep_serve_logs(run: dict[str, Any], sim, name: str) -> dict[str, Any]:
    """``run``, with ``logs_kept`` (where Serve's logs were copied: the ingress's and the
    replicas' tracebacks) when a request of it failed; the simulated cluster's own copy goes
    with its temp dir when the bench ends."""
    import shutil

    from model.default import cache_root

    failed = run.get("errors") or (run.get("morning") or {}).get("errors")
    temp_dir = getattr(sim, "temp_dir", None)  # every simulated node's logs are under the head's
    src = Path(temp_dir) / "session_latest" / "logs" / "serve" if temp_dir else None
    if not failed or src is None or not src.is_dir():
        return run
    dest = cache_root() / "bench-logs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    shutil.copytree(src, dest, dirs_exist_ok=True)
    return {**run, "logs_kept": str(dest)}


def _apply(event: str, app_args: dict[str, Any], sim, app_name: str) -> dict[str, Any]:
    """Make ``event`` happen to the running app; what it did (the nodes lent, returned, killed)."""
    from deploy.serve_state import running_replicas
    from deploy.tidal import lend_nodes, return_nodes

    if event == "lend":
        return {"lent": lend_nodes(app_args, 1, app_name=app_name, deadline_s=30, timeout_s=300)["lent"]}
    if event == "return":
        return {"returned": return_nodes(app_args, app_name=app_name, timeout_s=300)["returned"]}
    if event == "kill":
        node = sim.worker_nodes[0]
        serving = running_replicas(app_name)
        sim.remove_node(node)
        deadline = time.monotonic() + 60
        while running_replicas(app_name) >= serving and time.monotonic() < deadline:  # Serve saw it go
            time.sleep(0.5)
        return {"killed": node.node_id}
    raise ValueError(f"unknown event {event!r}")


def replay(url: str, app_args: dict[str, Any], work: list, concurrency: int, scenario: str = "trace", sim=None,
           app_name: str = "bench", done=lambda n: None, arrivals: list[float] | None = None) -> dict[str, Any]:
    """One run of ``work`` with the scenario's events (none for a scenario without): the whole
    replay's summary, and each window's, with its per-replica load, under ``windows`` (without
    events, the replay's per-replica load). ``arrivals``: each request's, in an open loop (each
    window from its first), else ``concurrency`` clients."""
    from deploy.bench.cluster_bench import _replay, _source_tokens, _summary

    events = EVENTS.get(scenario, ())
    cuts = [0, *(int(share * len(work)) for _, share in events), len(work)]
    results: list[dict] = []
    sources: dict[str, float] = {}
    windows: dict[str, Any] = {}
    wall = 0.0
    for i in range(len(cuts) - 1):
        what = _apply(events[i - 1][0], app_args, sim, app_name) if i else None
        before, load = _source_tokens(url), replica_load()
        t0 = time.perf_counter()
        got = asyncio.run(_replay(url, work[cuts[i]:cuts[i + 1]], concurrency,
                                  done=lambda n, o=cuts[i]: done(o + n), arrivals=rebase(arrivals, cuts[i], cuts[i + 1])))
        took = time.perf_counter() - t0
        grew = {s: v - before.get(s, 0) for s, v in _source_tokens(url).items()}
        load = load_summary(load, replica_load())
        if what is not None:
            windows[WINDOW[events[i - 1][0]]] = {**_summary(got, grew, took), "event": what, "replica_load": load}
        results += got
        wall += took
        sources = {s: sources.get(s, 0) + grew.get(s, 0) for s in {*sources, *grew}}
    out = _summary(results, sources, wall)
    if windows:
        out["windows"] = windows
    else:  # (with events, a replica that went took its counts with it: the windows have theirs)
        out["replica_load"] = load
    return out


def restore_nodes(sim, nodes: int) -> None:
    """Add simulated nodes until ``nodes`` are alive (a run that removed one leaves the next the
    fleet it started with)."""
    import ray

    while len([n for n in ray.nodes() if n["Alive"]]) < nodes:
        sim.add_node(num_cpus=1)
        sim.wait_for_nodes()


def run_scenarios(trace: Path, scenarios: tuple[str, ...], nodes: int = 3, **kwargs: Any) -> dict[str, Any]:
    """Each of ``scenarios`` (``SCENARIOS`` and ``night``) replayed in turn on one simulated
    cluster, as ``run_cluster_bench`` or ``deploy.bench.night_bench.run_night_bench`` replays it
    alone (``kwargs`` are theirs; ``night`` takes no ``modes`` or ``progress``): their outputs by
    scenario."""
    from deploy.bench.cluster_bench import run_cluster_bench
    from deploy.bench.night_bench import run_night_bench
    from deploy.bench.serve_bench import on_cluster

    out: dict[str, Any] = {}
    with on_cluster(nodes, None) as (_, cluster):
        for scenario in scenarios:
            if scenario == "night":
                night = {k: v for k, v in kwargs.items() if k not in ("modes", "progress")}
                out[scenario] = run_night_bench(trace, nodes, cluster=cluster, **night)
            else:
                out[scenario] = run_cluster_bench(trace, nodes, scenario=scenario, cluster=cluster, **kwargs)
    return {"scenarios": out}
