"""``tide bench cluster``: a Mooncake-format trace replayed through HTTP against a simulated
multi-node Ray cluster (``ray.cluster_utils.Cluster``, one Serve replica and one cache agent per
node, a real redis-server directory), in these modes:

* ``shared`` — the cache directory is shared and the cache-aware prefill router places requests;
* ``prefix_affinity`` — no directory: prompts whose first 256 tokens agree go to the same replica
  (rendezvous hashing, as SGLang's router and Ray Serve's prefix-aware router approximate, with
  a bounded load: a queue twice the shortest plus 2 is passed over; 256 tokens of the trace,
  scaled like the prompts: ``affinity_tokens``): the baseline a user would pick instead of a
  shared directory;
* ``prefix_affinity_sglang`` — the same balanced as SGLang's and vLLM's routers are by default:
  a replica is passed over only when its queue is 64 requests and 1.5 times longer than the
  shortest one (below that the prefix alone decides);
* ``per_node`` — no directory: each node hits only its own cache (the router balances load);
* ``round_robin`` — the shared directory, but cache-unaware round-robin placement.

Each mode runs ``repeats`` times, the modes taking turns (a run of every mode, then the next), each
run on empty caches; figures are medians over the runs with their range, and every request's TTFT
is also counted under where most of its prompt's KV came from (``compute`` when nothing hit).
``shared_vs_<mode>``: whether the directory's mode beats another on hit rate and TTFT p50/p99 by
a margin (their ranges do not overlap), loses by one, or neither (``no_margin``).

The trace is scaled down so it runs on a small machine: each 512-token ``hash_id`` block becomes
``block_tokens`` tokens (the scale factor 512 / block_tokens is printed) whose ids are derived
from the hash id, so equal blocks are equal token runs and prefixes are shared exactly as in the
trace; prompts are capped at ``max_prompt_tokens`` and outputs at ``max_tokens``. Requests are
replayed in trace order by ``concurrency`` clients (closed loop), or with a ``rate`` each at its
arrival time (open loop, ``deploy.bench.arrivals``). Token sources come from the
ingress's ``tide:prompt_tokens_total`` counters; TTFT is measured by the client (streaming).
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import uuid
from pathlib import Path
from typing import Any

import httpx

from cachedir.hashing import chain_keys
from cachedir.trace import BLOCK_TOKENS, read_trace
from cluster.prefix_affinity import AFFINITY_TOKENS, SGLANG_QUEUE_GAP, SGLANG_QUEUE_RATIO
from cluster.units import UNIT_TOKENS
from deploy.bench.arrivals import open_loop, replay_one, trace_arrivals
from deploy.bench.machine import machine
from deploy.bench.serve_bench import on_cluster
from deploy.redis_proc import wait_healthy

__all__ = ["HOT_PREFIX_TOKENS", "MODES", "SCENARIOS", "replica_seats", "run_cluster_bench", "scaled_affinity_tokens",
           "scaled_tokens", "skewed", "stop_agents", "trace_prompts", "verdict"]

MODES = {
    "shared": {"router": "cache-aware", "directory": True},
    "prefix_affinity": {"router": "prefix-affinity", "directory": False},
    "prefix_affinity_sglang": {"router": "prefix-affinity", "directory": False,
                               "args": {"affinity_queue_ratio": SGLANG_QUEUE_RATIO, "affinity_queue_gap": SGLANG_QUEUE_GAP}},
    "per_node": {"router": "cache-aware", "directory": False},
    "round_robin": {"router": "round-robin", "directory": True},
}


def trace_prompts(path: str | Path, requests: int, block_tokens: int, max_prompt_tokens: int,
                  max_tokens: int, vocab: int = 256, skip: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max tokens) for ``requests`` records of the trace after its first ``skip``,
    scaled down (a block's tokens depend on its hash id only, wherever it is read)."""
    scale = BLOCK_TOKENS / block_tokens
    blocks: dict[int, list[int]] = {}
    out = []
    for req in list(read_trace(path, limit=skip + requests))[skip:]:
        n = min(max_prompt_tokens, max(1, math.ceil(req.input_length / scale)))
        ids: list[int] = []
        for h in req.hash_ids:
            if len(ids) >= n:
                break
            if h not in blocks:
                rng = random.Random(h)
                blocks[h] = [rng.randrange(vocab) for _ in range(block_tokens)]
            ids += blocks[h]
        ids = ids[:n] or [0]
        out.append((ids, max(1, min(max_tokens, math.ceil(req.output_length / scale)))))
    return out


SCENARIOS = ("trace", "skew", "scale", "failure", "pressure")
PRESSURE_SHARE = 0.25  # ``pressure``: each node's SSD holds this share of the working set's unit bytes
HOT_PREFIX_TOKENS = 4096  # ``skew``: a hot prefix's trace tokens (a long system prompt with its tools)


def working_set_units(work: list[tuple[list[int], int]], unit_tokens: int = UNIT_TOKENS) -> int:
    """Distinct cache units the prompts of ``work`` make (a unit is its whole prefix)."""
    seen: set[bytes] = set()
    for ids, _ in work:  # the units before the prompt's last token, keyed as the cache keys them
        seen.update(chain_keys(b"", ids[:-1], unit_tokens))
    return len(seen)


def unit_bytes(checkpoint: Path | None) -> int:
    """Bytes of one cache unit of the model the bench serves (float32 KV on the CPU); a
    ``ValueError`` for a model whose units are not per-token rows (V4)."""
    from model.config import load_config
    from model.default import default_checkpoint

    cfg = load_config(checkpoint or default_checkpoint())
    if not hasattr(cfg, "kv_dim"):
        raise ValueError(f"the pressure scenario sizes caches from per-token KV rows; {cfg.model_type} has none")
    return cfg.num_hidden_layers * UNIT_TOKENS * cfg.kv_dim * 4


def skewed(work: list[tuple[list[int], int]], block_tokens: int, share: float = 0.6, hot: int = 3,
           hot_tokens: int = HOT_PREFIX_TOKENS, vocab: int = 256, seed: int = 0) -> list[tuple[list[int], int]]:
    """The ``skew`` scenario: ``share`` of the requests (chosen at random, seeded) get one of
    ``hot`` prefixes of ``hot_tokens`` trace tokens (scaled like the prompts) in front of their
    own prompt, as a shared system prompt is (Zipf: the first twice as likely as the second); the
    others stay as they were. A few hot prefixes carry most of the traffic; each prompt computes."""
    rng = random.Random(seed)
    n = scaled_tokens(hot_tokens, block_tokens)
    prefixes = [[random.Random(f"hot-{k}").randrange(vocab) for _ in range(n)] for k in range(hot)]
    weights = [1 / (k + 1) for k in range(hot)]
    out = []
    for ids, max_tokens in work:
        if rng.random() < share:
            ids = rng.choices(prefixes, weights)[0] + ids
        out.append((ids, max_tokens))
    return out


async def _replay(url: str, work: list[tuple[list[int], int]], concurrency: int,
                  done=lambda n: None, arrivals: list[float] | None = None) -> list[dict]:
    """Every request of ``work``, ``concurrency`` at a time; or, given their ``arrivals``, each at
    its own (``deploy.bench.arrivals.open_loop``). ``done(n)`` after each finishes."""
    if arrivals is not None:
        return await open_loop(url, work, arrivals, done)
    queue: asyncio.Queue = asyncio.Queue()
    finished = 0
    for i, item in enumerate(work):
        queue.put_nowait((i, item))
    results: list[dict] = [{}] * len(work)
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker() -> None:
            while not queue.empty():
                i, (prompt, max_tokens) = queue.get_nowait()
                results[i] = await replay_one(client, url, prompt, max_tokens)
                nonlocal finished
                finished += 1
                done(finished)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def _source_tokens(url: str) -> dict[str, float]:
    out = {}
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "tide:prompt_tokens_total":
                out[sample.labels["source"]] = out.get(sample.labels["source"], 0.0) + sample.value
    return out


def _source_of(usage: dict) -> str:
    """Where most of a request's prompt KV came from: ``compute`` when nothing hit."""
    sources = usage.get("prompt_cache_hit_sources") or {}
    if not usage.get("prompt_cache_hit_tokens") or not any(sources.values()):
        return "compute"
    best = max(sources, key=lambda k: sources[k])
    return {"ssd": "local_ssd"}.get(best, best)


def _p(values: list[float], q: float) -> float | None:
    return round(sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000, 1) if values else None


def _summary(results: list[dict], sources: dict[str, float], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r and r.get("ttft") is not None and r.get("usage")]
    ttfts = [r["ttft"] for r in ok]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    hits = sum(r["usage"]["prompt_cache_hit_tokens"] for r in ok)
    share = lambda n: round(n / max(1, prompt), 4)  # noqa: E731
    by_source: dict[str, list[float]] = {}
    for r in ok:
        by_source.setdefault(_source_of(r["usage"]), []).append(r["ttft"])
    return {
        "requests": len(results), "errors": len(results) - len(ok), "prompt_tokens": prompt,
        "token_hit_rate": share(hits),
        "hit_rate_by_source": {"ram": share(sources.get("ram", 0)), "local_ssd": share(sources.get("ssd", 0)),
                               "remote": share(sources.get("remote", 0))},
        "ttft_p50_ms": _p(ttfts, 0.5), "ttft_p99_ms": _p(ttfts, 0.99),
        "ttft_by_source": {k: {"requests": len(v), "p50_ms": _p(v, 0.5), "p99_ms": _p(v, 0.99)}
                           for k, v in sorted(by_source.items())},
        "wall_s": round(wall_s, 1),
        "first_error": next((r["error"] for r in results if "error" in r), None),
    }


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's figures over its runs: medians with their ranges; every run as it came."""
    def spread(get) -> dict[str, Any]:
        values = [v for v in (get(r) for r in runs) if v is not None]
        return {"median": round(statistics.median(values), 4), "range": [min(values), max(values)], "runs": len(values)} \
            if values else {}

    out = {
        "token_hit_rate": spread(lambda r: r["token_hit_rate"]),
        "hit_rate_by_source": {k: spread(lambda r, k=k: r["hit_rate_by_source"][k]) for k in ("ram", "local_ssd", "remote")},
        "ttft_p50_ms": spread(lambda r: r["ttft_p50_ms"]), "ttft_p99_ms": spread(lambda r: r["ttft_p99_ms"]),
        "busiest_replica_share": spread(lambda r: (r.get("replica_load") or {}).get("busiest_share")),
        "errors": sum(r["errors"] for r in runs), "runs": runs,
    }
    windows = [name for name in runs[0].get("windows", {}) if all(name in r.get("windows", {}) for r in runs)]
    if windows:  # each window's figures over the runs (their runs are inside the runs')
        out["windows"] = {name: {k: v for k, v in _medians([r["windows"][name] for r in runs]).items() if k != "runs"}
                          for name in windows}
    return out


def run_cluster_bench(
    trace: Path, nodes: int = 3, requests: int = 4000, concurrency: int = 4, block_tokens: int = 8,
    max_prompt_tokens: int = 2048, max_tokens: int = 4, checkpoint: Path | None = None,
    modes: tuple[str, ...] = tuple(MODES), progress=None, repeats: int = 3, scenario: str = "trace", skip: int = 0,
    cluster: tuple | None = None, rate: float | None = None, max_num_seqs: int | None = None,
    pace: dict[str, float] | None = None,
) -> dict[str, Any]:
    """``progress``: an object with ``update(completed, total, description)`` (``deploy.term``);
    ``scenario``: one of ``SCENARIOS``; ``skip``: trace records passed over before the replay's;
    ``rate``: requests a second in an open loop at the trace's arrival times (``trace_arrivals``),
    else ``concurrency`` clients in a closed loop; ``max_num_seqs``: each replica's running
    sequences (``replica_seats``); ``pace``: each replica's emulated device (``AppArgs.pace``);
    ``cluster``: a running ``simulated_cluster``'s (redis, url, sim) to replay on (``nodes`` of
    them alive), else one is started and stopped."""
    from ray import serve

    from deploy.app import build_app
    from deploy.bench.fleet_events import keep_serve_logs, replay, restore_nodes
    from deploy.local import agent_token_file

    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    work = trace_prompts(trace, requests, block_tokens, max_prompt_tokens, max_tokens, skip=skip)
    seats = replica_seats(max_num_seqs, concurrency)
    if scenario == "skew":
        work = skewed(work, block_tokens)
    arrivals = trace_arrivals(trace, requests, rate, skip=skip) if rate else None
    affinity = scaled_affinity_tokens(block_tokens)
    capacity: dict[str, Any] = {}
    if scenario == "pressure":  # each node's SSD holds a share of the working set; no RAM tier, and no
        # finished prompt's pages kept in a replica's pool: every hit comes from the nodes' caches
        working_set = working_set_units(work) * unit_bytes(checkpoint)
        capacity = {"ssd_gb": PRESSURE_SHARE * working_set / 1e9, "ram_mb": 0, "prefix_sharing": False}
    out: dict[str, Any] = {
        **machine(), "trace": str(trace), "skip": skip, "nodes": nodes, "requests": len(work),
        "concurrency": None if rate else concurrency, "rate": rate, "max_num_seqs": seats, "pace": pace,
        "scenario": scenario, "scale_factor": BLOCK_TOKENS / block_tokens, "block_tokens": block_tokens,
        "affinity_tokens": affinity,
        "max_prompt_tokens": max_prompt_tokens, "max_tokens": max_tokens, "repeats": repeats,
        "prompt_tokens": sum(len(p) for p, _ in work),
        **({"node_cache_share": PRESSURE_SHARE, "node_ssd_bytes": int(capacity["ssd_gb"] * 1e9)} if capacity else {}),
    }
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    total = len(work) * len(modes) * repeats
    with on_cluster(nodes, cluster) as (tmp, (redis, url, sim)):
        for rep in range(repeats):
            for k, mode in enumerate(modes):
                spec = MODES[mode]
                app_args = {
                    "checkpoint": str(checkpoint) if checkpoint else None, "replicas": nodes, "replica_cpus": 1,
                    "max_replicas_per_node": 1, "cache_dir": str(tmp / f"{mode}-{rep}" / "{node}"),
                    "directory_url": redis.url if spec["directory"] else None,
                    "directory_namespace": f"bench-{mode}-{uuid.uuid4().hex[:8]}", "router": spec["router"],
                    "affinity_tokens": affinity,
                    "max_num_seqs": seats, "num_pages": 2048, "agent_token_file": agent_token_file(), "pace": pace,
                    **capacity, **spec.get("args", {}),
                }
                serve.run(build_app(app_args), name="bench", route_prefix="/", blocking=False)
                wait_healthy(url)
                offset = (rep * len(modes) + k) * len(work)
                run = replay(url, app_args, work, concurrency, scenario, sim, arrivals=arrivals, done=lambda n, m=mode, o=offset: (
                    progress and progress.update(o + n, total, f"{m}: request {n}/{len(work)}")))
                runs[mode].append(keep_serve_logs(run, sim, f"cluster-{scenario}-{mode}-{rep}"))
                serve.delete("bench")
                stop_agents()  # the next run starts from empty caches
                restore_nodes(sim, nodes)
    for mode in modes:
        out[mode] = _medians(runs[mode])
    for baseline in MODES:
        if "shared" in out and baseline in out and baseline != "shared":
            out[f"shared_vs_{baseline}"] = _verdicts(out["shared"], out[baseline])
    return out


def _verdicts(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """``verdict`` on hit rate and TTFT p50/p99, for the whole replay and for each window."""
    out: dict[str, Any] = {
        "hit_rate": verdict(mine["token_hit_rate"], theirs["token_hit_rate"], higher=True),
        "ttft_p50": verdict(mine["ttft_p50_ms"], theirs["ttft_p50_ms"], higher=False),
        "ttft_p99": verdict(mine["ttft_p99_ms"], theirs["ttft_p99_ms"], higher=False)}
    for name, window in mine.get("windows", {}).items():
        if name in theirs.get("windows", {}):
            out[name] = _verdicts(window, theirs["windows"][name])
    return out


def stop_agents() -> None:
    """Stop every node's cache agent (the next app starts them afresh, on empty caches)."""
    import ray

    from actors.cache_agent import NAMESPACE, agent_name

    for node in ray.nodes():
        try:
            ray.kill(ray.get_actor(agent_name(node["NodeID"]), namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass


def replica_seats(max_num_seqs: int | None, concurrency: int) -> int:
    """The sequences each bench replica runs at once: ``max_num_seqs``, by default as many as
    the closed loop's clients, at least 4."""
    return max_num_seqs or max(4, concurrency)


def scaled_tokens(trace_tokens: int, block_tokens: int) -> int:
    """How many replay tokens ``trace_tokens`` of the trace are, scaled like the prompts (>= 1)."""
    return max(1, round(trace_tokens * block_tokens / BLOCK_TOKENS))


def scaled_affinity_tokens(block_tokens: int) -> int:
    """The prefix-affinity key scaled like the prompts: ``AFFINITY_TOKENS`` real tokens of the trace."""
    return scaled_tokens(AFFINITY_TOKENS, block_tokens)


def verdict(mine: dict[str, Any], theirs: dict[str, Any], higher: bool) -> str:
    """``beats`` or ``loses`` when the two modes' ranges over the runs do not overlap (the margin),
    else ``no_margin``; ``single_run`` when either has one run; ``unknown`` without figures."""
    if not mine.get("range") or not theirs.get("range"):
        return "unknown"
    if min(mine.get("runs", 2), theirs.get("runs", 2)) < 2:
        return "single_run"
    (lo, hi), (tlo, thi) = mine["range"], theirs["range"]
    if (lo > thi) if higher else (hi < tlo):
        return "beats"
    if (hi < tlo) if higher else (lo > thi):
        return "loses"
    return "no_margin"
