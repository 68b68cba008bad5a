"""``tide bench soak``: a bounded soak through HTTP while faults are injected.

A simulated multi-node Ray cluster (``ray.cluster_utils.Cluster``: one Serve replica and one
cache agent per node, a real redis-server directory) serves ``concurrency`` closed-loop clients
for ``minutes``. Half of the requests share one of a few system prompts (repeated prompts and
shared prefixes: cache hits, local and remote), half are unique. Every ``fault_every_s`` one fault
is injected, in turn: Redis killed and restarted empty, then a cache agent SIGKILLed (Ray restarts
it from its files). A fault's window runs from its injection until it has recovered plus
``grace_s``; a 503 with Retry-After inside a window is expected ("unavailable"), any other failure
anywhere is an error.

After the soak every answered prompt is checked against a reference computed by the model alone
(``model.generate``, no engine, no cache): ``wrong_outputs`` must be 0. ``rss_growth_mb`` is the
growth of the serving processes' resident memory (replicas, ingress, HTTP proxy) from the end of
the warm-up to the end of the soak.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from deploy.bench.machine import rss_mb
from deploy.bench.serve_bench import simulated_cluster, stream_completion
from deploy.connect import alive_actors
from deploy.redis_proc import RedisServer, wait_healthy

__all__ = ["run_soak"]

SERVING_CLASSES = ("LLMServer", "OpenAIIngress", "ProxyActor")
UNIT = 64


@dataclass
class _Window:
    kind: str
    start_s: float
    end_s: float | None = None  # recovered at (plus grace)


@dataclass
class _Results:
    answers: list[tuple[tuple[int, ...], str]] = field(default_factory=list)  # prompt, text
    failures: list[tuple[float, int, str]] = field(default_factory=list)  # time, HTTP status (0: none), detail
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    hit_tokens: int = 0


class _Workload:
    """Prompts of token ids: a few system prompts (3 units) with recurring suffixes, and unique ones."""

    def __init__(self, seed: int, vocab: int = 256) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.systems = [self._ids(3 * UNIT) for _ in range(4)]
        self.suffixes = [self._ids(self.rng.randrange(8, 40)) for _ in range(16)]
        self.unique = 0

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def next(self) -> tuple[int, ...]:
        if self.rng.random() < 0.5:
            return (*self.rng.choice(self.systems), *self.rng.choice(self.suffixes))
        self.unique += 1
        return tuple(self._ids(self.rng.randrange(UNIT, 4 * UNIT)))


def _rss_mb() -> float:
    """Resident memory of the serving processes (replicas, ingress, HTTP proxy), in MB."""
    return rss_mb([a.pid for a in alive_actors(detail=True)
                   if any(c in (a.class_name or "") for c in SERVING_CLASSES) and a.pid])


def _agent_pids() -> dict[str, int]:
    return {a.node_id: a.pid for a in alive_actors(detail=True)
            if "CacheAgent" in (a.class_name or "") and a.pid}


def _inject(kind: str, redis: RedisServer, rng: random.Random, timeout_s: float = 60.0) -> None:
    """Inject one fault and return once it has recovered (Redis serving again, the agent back)."""
    if kind == "redis_restart":
        redis.kill()
        time.sleep(2.0)
        redis.start()  # empty, same address: the nodes re-register their units
        return
    before = _agent_pids()
    if not before:
        return
    node = rng.choice(sorted(before))
    os.kill(before[node], signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _agent_pids().get(node, before[node]) != before[node]:
            return
        time.sleep(0.5)


async def _soak(url: str, work: _Workload, seconds: float, concurrency: int, max_tokens: int,
                fault_every_s: float, grace_s: float, redis: RedisServer, rss: dict,
                progress=None) -> tuple[_Results, list[_Window]]:
    res, windows = _Results(), []
    start = time.monotonic()
    stop = start + seconds
    warmup_end = start + min(60.0, seconds / 10)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            prompt = work.next()
            at = time.monotonic() - start
            try:
                r = await stream_completion(client, url, "tiny", list(prompt), max_tokens, ignore_eos=True)
            except httpx.HTTPError as e:
                res.failures.append((at, 0, repr(e)))
                continue
            if r["status"] != 200:
                res.failures.append((at, r["status"], f"{r['error']} (Retry-After: {r.get('retry_after')})"))
                continue
            res.answers.append((prompt, r["text"]))
            if progress is not None:
                progress.update(min(seconds, time.monotonic() - start),
                                description=f"soak: {len(res.answers)} answers, {len(res.failures)} failures")
            if r["ttft"] is not None:
                res.ttfts.append(r["ttft"])
            if r["usage"]:
                res.prompt_tokens += r["usage"]["prompt_tokens"]
                res.hit_tokens += r["usage"]["prompt_cache_hit_tokens"]

    async def faults() -> None:
        rng = random.Random(1)
        kinds = ["redis_restart", "agent_kill"]
        n = 0
        while True:
            wait = min(fault_every_s, stop - time.monotonic())
            if wait <= 0:
                return
            await asyncio.sleep(wait)
            if time.monotonic() >= stop - 1:
                return
            w = _Window(kinds[n % 2], time.monotonic() - start)
            windows.append(w)
            await asyncio.to_thread(_inject, w.kind, redis, rng)
            w.end_s = time.monotonic() - start + grace_s
            n += 1

    async def memory() -> None:
        await asyncio.sleep(max(0.0, warmup_end - time.monotonic()))
        rss["start_mb"] = await asyncio.to_thread(_rss_mb)

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)), faults(), memory())
    rss["end_mb"] = await asyncio.to_thread(_rss_mb)
    return res, windows


def _in_window(at_s: float, windows: list[_Window]) -> bool:
    return any(w.start_s <= at_s <= (w.end_s if w.end_s is not None else float("inf")) for w in windows)


def _check(answers: list[tuple[tuple[int, ...], str]], checkpoint: Path, max_tokens: int) -> tuple[int, int, str | None]:
    """(checked, wrong, first wrong prompt) against the model alone."""
    from model.checkpoint import load_model
    from model.generate import generate
    from model.tokenizer import load_tokenizer

    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    reference: dict[tuple[int, ...], str] = {}
    wrong, first = 0, None
    for prompt, text in answers:
        if prompt not in reference:
            reference[prompt] = tok.decode(generate(model, list(prompt), max_tokens, eos_id=None))
        if text != reference[prompt]:
            wrong += 1
            first = first or f"prompt of {len(prompt)} tokens: {text!r} != {reference[prompt]!r}"
    return len(answers), wrong, first


def run_soak(minutes: float, concurrency: int = 4, nodes: int = 2, fault_every_s: float = 60.0,
             grace_s: float = 5.0, max_tokens: int = 8, checkpoint: Path | None = None,
             progress=None) -> dict[str, Any]:
    """``progress``: an object with ``update(completed, total, description)`` (``deploy.term``),
    told the seconds of load run so far."""
    from ray import serve

    from deploy.app import build_app
    from deploy.local import agent_token_file
    from model.default import default_checkpoint

    checkpoint = Path(checkpoint) if checkpoint else default_checkpoint()
    rss: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, simulated_cluster(nodes, Path(tmp)) as (redis, url, _):
        serve.run(build_app({
            "checkpoint": str(checkpoint), "replicas": nodes, "replica_cpus": 1, "max_replicas_per_node": 1,
            "cache_dir": str(Path(tmp) / "cache" / "{node}"), "usage_dir": str(Path(tmp) / "usage"),
            "directory_url": redis.url, "directory_namespace": f"soak-{uuid.uuid4().hex[:8]}",
            "max_num_seqs": max(4, concurrency), "num_pages": 2048, "agent_token_file": agent_token_file(),
        }), name="soak", route_prefix="/", blocking=False)
        wait_healthy(url)
        t0 = time.perf_counter()
        res, windows = asyncio.run(_soak(url, _Workload(seed=0), minutes * 60, concurrency, max_tokens,
                                         fault_every_s, grace_s, redis, rss, progress))
        wall = time.perf_counter() - t0
    checked, wrong, first_wrong = _check(res.answers, checkpoint, max_tokens)
    expected = [f for f in res.failures if f[1] == 503 and "Retry-After: None" not in f[2] and _in_window(f[0], windows)]
    errors = [f for f in res.failures if f not in expected]
    ttfts = sorted(res.ttfts)
    return {
        "minutes": minutes, "concurrency": concurrency, "nodes": nodes, "wall_s": round(wall, 1),
        "requests": len(res.answers) + len(res.failures), "ok": len(res.answers),
        "errors": len(errors), "unavailable_in_windows": len(expected),
        "wrong_outputs": wrong, "checked_outputs": checked,
        "faults": [{"kind": w.kind, "at_s": round(w.start_s, 1), "window_end_s": round(w.end_s or 0, 1)} for w in windows],
        "rss_start_mb": round(rss.get("start_mb", 0.0), 1), "rss_end_mb": round(rss.get("end_mb", 0.0), 1),
        "rss_growth_mb": round(rss.get("end_mb", 0.0) - rss.get("start_mb", 0.0), 1),
        "token_hit_rate": round(res.hit_tokens / max(1, res.prompt_tokens), 4),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "ttft_p99_ms": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1000, 1) if ttfts else None,
        "first_error": errors[0][2] if errors else None, "first_wrong_output": first_wrong,
    }
