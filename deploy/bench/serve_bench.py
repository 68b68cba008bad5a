"""``tide bench serve``: a bounded HTTP load against the Serve app, with and without the cache.

Each of ``repeats`` runs deploys both apps in turn, the order alternating between runs (the case
that goes first meets a colder machine); each app starts with an empty cache. Figures are the
medians over runs, each run's figures beside them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from deploy.bench.machine import machine
from deploy.redis_proc import RedisServer, free_port, wait_healthy


def _prompts(n: int, system_chars: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["tide", "moon", "shore", "wave", "salt", "reef", "gull", "foam", "drift", "sand"]

    def text(chars: int) -> str:
        out = []
        while sum(len(w) + 1 for w in out) < chars:
            out.append(rng.choice(words))
        return " ".join(out)[:chars]

    system = text(system_chars)
    return [(system + " " + text(120)) if i % 2 == 0 else text(system_chars + 120) for i in range(n)]


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, prompt: str | list[int],
                            max_tokens: int, ignore_eos: bool = False) -> dict:
    """One streamed greedy completion: ``status`` 200 with the text, client-side TTFT and the
    usage; or an ``error`` with its ``status`` and ``retry_after`` (a failure after the status
    line arrives as an error event: 503 when the server calls it retryable, else 500)."""
    t0 = time.perf_counter()
    ttft = None
    usage = None
    text: list[str] = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "retry_after": r.headers.get("retry-after"),
                    "error": f"HTTP {r.status_code}: {r.text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                retryable = chunk["error"].get("code") == "service_unavailable"
                return {"status": 503 if retryable else 500, "retry_after": "mid-stream" if retryable else None,
                        "error": chunk["error"]["message"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"]:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(chunk["choices"][0]["text"])
    return {"status": 200, "text": "".join(text), "ttft": ttft, "usage": usage}


@contextlib.contextmanager
def simulated_cluster(nodes: int, tmp: Path) -> Iterator[tuple[RedisServer, str, Any]]:
    """A redis-server and a simulated cluster of ``nodes`` one-CPU nodes with Serve listening on
    a free loopback port (one HTTP proxy, on the head: the nodes share 127.0.0.1): yields
    (redis, url, the ``deploy.sim_cluster.SimulatedCluster``); everything stops on exit."""
    import ray
    from ray import serve

    from deploy.sim_cluster import SimulatedCluster

    port = free_port()
    redis = RedisServer(tmp / "redis").start()
    cluster = SimulatedCluster(num_cpus=1)  # its own ports and temp dir: other Rays may run here
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        yield redis, f"http://127.0.0.1:{port}", cluster
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        redis.kill()


@contextlib.contextmanager
def on_cluster(nodes: int, cluster: tuple | None) -> Iterator[tuple[Path, tuple]]:
    """A scratch directory and ``cluster`` (a ``simulated_cluster``'s (redis, url, sim)), or a
    new simulated cluster of ``nodes`` nodes, stopped on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        if cluster is not None:
            yield Path(tmp), cluster
            return
        with simulated_cluster(nodes, Path(tmp)) as started:
            yield Path(tmp), started


async def _load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def run(p: str) -> dict:
            async with sem:
                try:
                    return await stream_completion(client, url, model, p, max_tokens)
                except httpx.HTTPError as e:
                    return {"error": repr(e)}

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r and r["ttft"] is not None and r["usage"]]
    ttfts = sorted(r["ttft"] for r in ok)
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in ok)
    hits = sum(r["usage"]["prompt_cache_hit_tokens"] for r in ok)
    return {
        "requests": len(prompts), "errors": len(prompts) - len(ok),
        "requests_per_s": round(len(ok) / wall, 2),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "ttft_p99_ms": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1000, 1) if ttfts else None,
        "token_hit_rate": round(hits / max(1, prompt_tokens), 4),
        "first_error": next((r["error"] for r in results if "error" in r), None),
    }


CASES = (("with_cache", True), ("without_cache", False))
FIGURES = ("requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "token_hit_rate")


def case_orders(repeats: int, cases: tuple = CASES) -> list[list]:
    """The cases of each run: in their order in even runs, reversed in odd ones (by default with
    the cache first, then without it)."""
    return [list(cases) if r % 2 == 0 else list(reversed(cases)) for r in range(repeats)]


def summarize(runs: list[dict[str, Any]], figures: tuple[str, ...] = FIGURES) -> dict[str, Any]:
    """One case's runs: the median of each figure (None when a run had none), errors summed."""
    out: dict[str, Any] = {}
    for key in figures:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    out["errors"] = sum(r["errors"] for r in runs)
    out["first_error"] = next((r["first_error"] for r in runs if r.get("first_error")), None)
    out["runs"] = runs
    return out


@contextlib.contextmanager
def local_serve() -> Iterator[str]:
    """A Ray of its own on this machine (never a running cluster) with Serve on a free loopback
    port: yields the URL; both stop on exit."""
    import ray
    from ray import serve

    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def deployed(url: str, app_args: dict[str, Any], api_key: str | None = None) -> Iterator[str]:
    """The app of ``app_args`` serving at ``url`` (``local_serve``'s) until the block ends:
    yields the model id it serves (asked with ``api_key`` where the app has keys)."""
    from ray import serve

    from deploy.app import build_app
    from deploy.local import agent_token_file

    serve.run(build_app({"agent_token_file": agent_token_file(), **app_args}), name="bench", route_prefix="/",
              blocking=False)
    try:
        wait_healthy(url)
        yield served_model(url, {"Authorization": f"Bearer {api_key}"} if api_key else {})
    finally:
        serve.delete("bench")


def served_model(url: str, auth: dict[str, str]) -> str:
    """The first model the server at ``url`` lists; a RuntimeError saying why when it lists none."""
    try:
        r = httpx.get(url + "/v1/models", timeout=30, headers=auth)
    except httpx.HTTPError as e:
        raise RuntimeError(f"{url} does not answer: {e}") from None
    if r.status_code != 200:
        raise RuntimeError(f"{url}/v1/models answered {r.status_code}: {r.text[:300]}")
    models = r.json().get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return models[0]["id"]


def run_serve_bench(checkpoint: Path | None, requests: int = 64, concurrency: int = 8,
                    system_tokens: int = 2048, max_tokens: int = 16, repeats: int = 2) -> dict[str, Any]:
    out: dict[str, Any] = {**machine(), "requests": requests, "concurrency": concurrency, "repeats": repeats,
                           "shared_system_prompt_tokens": system_tokens, "max_tokens": max_tokens,
                           "statistic": "median over repeats (the order alternates)"}
    prompts = _prompts(requests, system_tokens)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in CASES}
    with tempfile.TemporaryDirectory() as tmp, local_serve() as url:
        for r, order in enumerate(case_orders(repeats)):
            for label, enable in order:
                args = {"checkpoint": str(checkpoint) if checkpoint else None,
                        "cache_dir": str(Path(tmp) / f"{label}-{r}"), "enable_cache": enable,
                        "replica_cpus": 1, "max_num_seqs": concurrency}
                with deployed(url, args) as model:
                    runs[label].append({"order": order.index((label, enable)),
                                        **asyncio.run(_load(url, model, prompts, concurrency, max_tokens))})
    out.update({label: summarize(case_runs) for label, case_runs in runs.items()})
    return out
