"""``tide bench neighbour``: what a hostile tenant's requests cost another tenant's streams.

One local app (the default model unless ``--checkpoint``) with two API keys. The neighbour runs
greedy streams alone, then again while the hostile tenant sends ``HOSTILE_REQUESTS`` over and
over; the runs alternate over repeats. Reported: the neighbour's inter-token latency (p50, p99:
the gaps between a stream's token events) in each case and their ratio (the target: p99 within
3x of alone), whether its text was the same both times, the statuses the hostile requests got
(each must be a 4xx or a bounded 200), and the app's replicas' peak resident memory in each case
(sampled every 100 ms), and the replica's own high-water mark beside its memory bound
(``cluster.memory_bound``: what its configuration lets it hold).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from deploy.bench.machine import machine, rss_mb
from deploy.bench.serve_bench import case_orders, deployed, local_serve

__all__ = ["HOSTILE_REQUESTS", "run_neighbour_bench"]

HOSTILE_KEY, NEIGHBOUR_KEY = "sk-bench-hostile", "sk-bench-neighbour"
PROMPTS = ["The tide comes in", "Ships wait in the harbour", "At night the nodes train", "Units land on the SSD"]


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


# (route, body, the status a bounded answer has): the request classes the security review found
# could hurt other tenants, and others like them
HOSTILE_REQUESTS: list[tuple[str, dict[str, Any], int]] = [
    ("completions", {"prompt": "x", "max_tokens": 4, "temperature": 1e-300}, 200),
    ("completions", {"prompt": "x", "max_tokens": 4, "top_p": 1e-300, "temperature": 1.0}, 200),
    ("completions", {"prompt": "x", "max_tokens": 4, "logit_bias": {"1" * 4300: 1}}, 400),
    ("completions", {"prompt": "x", "max_tokens": 10**30}, 400),
    ("completions", {"prompt": "x", "seed": 2**64}, 400),
    ("completions", {"prompt": [[1] * 64] * 64, "n": 8, "prompt_logprobs": 20, "max_tokens": 4}, 200),  # within cost
    ("completions", {"prompt": [[1] * 1000] * 64, "n": 8, "prompt_logprobs": 20, "max_tokens": 4}, 400),
    # the most scored tokens one request may have (limits.max_scored_tokens: 64 x 512): the heaviest
    # accepted request for a replica's memory
    ("completions", {"prompt": [[1] * 512] * 64, "prompt_logprobs": 20, "max_tokens": 1}, 200),
    ("completions", {"prompt": "x", "max_tokens": 4, "guided_choice": ["c" * 1000 + str(i) for i in range(100)]}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "guided_regex": "(a|"}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "guided_grammar": "root ::= root root"}, 400),
    ("completions", {"prompt": "x", "max_tokens": 4, "guided_grammar": 'root ::= "a" x\nx ::= x'}, 400),  # dead end
    ("completions", {"prompt": "x", "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
        "name": "wide", "schema": {"type": "object", "properties": {
            f"p{i}": {"enum": [f"v{i}a", f"v{i}b"]} for i in range(1000)}}}}}, 200),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "tool_choice": "required",
                          "tools": [{"type": "function", "function": {"name": "f", "parameters": deep_schema(250)}}]},
     400),
    ("responses", {"input": "x", "max_output_tokens": 4, "tool_choice": "required",
                   "tools": [{"type": "function", "name": "f", "parameters": deep_schema(250)}]}, 400),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 100_000}], "max_tokens": 4}, 400),
]


async def neighbour_stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, list[float]]:
    """A greedy stream of the neighbour's: its text and the times its token events came."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, times = "", []
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {NEIGHBOUR_KEY}"}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                times.append(time.perf_counter())
    return text, times


async def hostile(client: httpx.AsyncClient, route: str, body: dict) -> httpx.Response:
    return await client.post(f"/v1/{route}", json={"model": "tiny", **body},
                             headers={"Authorization": f"Bearer {HOSTILE_KEY}"})


def _replica_pids() -> list[int]:
    """The processes whose title is one of the bench app's replicas (Ray's ``ray::ServeReplica:bench:...``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(b"ray::ServeReplica:bench:"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


async def _peak_rss(stop: asyncio.Event, peak: list[float]) -> None:
    """The bench app's replicas' resident memory, sampled every 100 ms until ``stop``: its peak."""
    pids = await asyncio.to_thread(_replica_pids)
    while not stop.is_set():
        peak[0] = max(peak[0], await asyncio.to_thread(rss_mb, pids))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


async def _run(url: str, max_tokens: int, beside: bool) -> dict[str, Any]:
    stop, peak = asyncio.Event(), [0.0]
    sampler = asyncio.create_task(_peak_rss(stop, peak))
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        streams = [asyncio.create_task(neighbour_stream(client, p, max_tokens)) for p in PROMPTS]
        statuses: dict[int, int] = {}
        while beside and not all(s.done() for s in streams):
            for r in await asyncio.gather(*(hostile(client, route, body) for route, body, _ in HOSTILE_REQUESTS)):
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        done = await asyncio.gather(*streams)
    stop.set()
    await sampler
    gaps = sorted(b - a for _, times in done for a, b in zip(times, times[1:], strict=False))
    return {"texts": [t for t, _ in done], "itl_p50_ms": round(1e3 * statistics.median(gaps), 2),
            "itl_p99_ms": round(1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 2), "hostile_statuses": statuses,
            "replicas_rss_peak_mb": round(peak[0], 1)}


def run_neighbour_bench(checkpoint: Path | None = None, max_tokens: int = 128, repeats: int = 2) -> dict[str, Any]:
    from deploy.local import agent_token_file

    cases = ("alone", "beside_hostile")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    args = {"checkpoint": str(checkpoint) if checkpoint else None, "replica_cpus": 1, "enable_cache": False,
            "api_keys": {HOSTILE_KEY: "hostile", NEIGHBOUR_KEY: "neighbour"}, "agent_token_file": agent_token_file()}
    with local_serve() as url, deployed(url, args, NEIGHBOUR_KEY):
        for order in case_orders(repeats, cases):
            for case in order:
                runs[case].append(asyncio.run(_run(url, max_tokens, case == "beside_hostile")))
        memory = _replica_memory()
    out: dict[str, Any] = {**machine(), "streams": len(PROMPTS), "max_tokens": max_tokens, "repeats": repeats,
                           "hostile_kinds": len(HOSTILE_REQUESTS), "statistic": "median over repeats"}
    for case in cases:
        out[case] = {k: round(statistics.median(r[k] for r in runs[case]), 2)
                     for k in ("itl_p50_ms", "itl_p99_ms", "replicas_rss_peak_mb")}
    statuses: dict[str, int] = {}
    for r in runs["beside_hostile"]:
        for code, n in r["hostile_statuses"].items():
            statuses[str(code)] = statuses.get(str(code), 0) + n
    out["hostile_statuses"] = statuses
    out["p99_ratio"] = round(out["beside_hostile"]["itl_p99_ms"] / out["alone"]["itl_p99_ms"], 2)
    out["p99_within_3x"] = out["p99_ratio"] <= 3.0
    texts = {json.dumps(r["texts"]) for case in cases for r in runs[case]}
    out["neighbour_tokens_equal"] = len(texts) == 1
    out["only_4xx_or_200"] = all(code == "200" or code.startswith("4") for code in statuses)
    out["replica_memory"] = memory
    return out


def _replica_memory() -> dict[str, Any]:
    """The replica's own peak resident memory over every run (the kernel's high-water mark, not a
    sample) beside the bound its configuration gives it (``cluster.memory_bound``)."""
    from ray import serve

    mem = serve.get_deployment_handle("LLMServer", app_name="bench").stats.remote(False).result()["memory"]
    bound = mem["bound"]
    return {"peak_rss_mb": mem.get("peak_rss_mb"), "bound_mb": bound["total_mb"], "bound": bound,
            "within_bound": mem.get("peak_rss_mb", float("inf")) <= bound["total_mb"]}
