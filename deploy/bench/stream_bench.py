"""``tide bench stream``: how many tokens a second concurrent streams get through HTTP, with the
stream batching of the serving default (``stream_batching_interval_ms``) and with an output per
engine step (0).

Each of ``repeats`` runs deploys the app once per case on a local Ray (the order alternating
between runs) and streams ``streams`` greedy completions of ``max_tokens`` tokens at once
(``ignore_eos``). Per case: the output tokens a second over the wall time, the outputs (SSE
chunks) a request took, time to first token, and the p99 gap between a stream's outputs (what
the batching adds to delivery). Medians over runs, each run's figures beside them."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from deploy.bench.machine import machine
from deploy.bench.serve_bench import case_orders, deployed, local_serve, summarize

FIGURES = ("tokens_per_s", "outputs_per_request", "ttft_p50_ms", "gap_p99_ms")


async def _stream(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int) -> dict:
    """One streamed completion: its tokens, the times its outputs came (from the request's start)."""
    body = {"model": model, "prompt": f"story {i}: once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0, times, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("choices"):
                times.append(time.perf_counter() - t0)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"times": times, "tokens": tokens}


async def _load(url: str, model: str, streams: int, max_tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, url, model, i, max_tokens) for i in range(streams)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r and r["times"]]
    gaps = sorted(b - a for r in ok for a, b in itertools.pairwise(r["times"]))
    return {
        "errors": len(results) - len(ok), "first_error": next((r["error"] for r in results if "error" in r), None),
        "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 1),
        "outputs_per_request": round(statistics.mean(len(r["times"]) for r in ok), 1) if ok else None,
        "ttft_p50_ms": round(statistics.median(r["times"][0] for r in ok) * 1000, 1) if ok else None,
        "gap_p99_ms": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1000, 1) if gaps else None,
    }


def run_stream_bench(checkpoint: Path | None, streams: int = 8, max_tokens: int = 400,
                     repeats: int = 2) -> dict[str, Any]:
    from deploy.app_args import AppArgs

    cases = {"batched": AppArgs().stream_batching_interval_ms, "per_step": 0.0}
    out: dict[str, Any] = {**machine(), "streams": streams, "max_tokens": max_tokens, "repeats": repeats,
                           "stream_batching_interval_ms": cases,
                           "statistic": "median over repeats (the order alternates)"}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in cases}
    with local_serve() as url:
        for order in case_orders(repeats, tuple(cases)):
            for label in order:
                args = {"checkpoint": str(checkpoint) if checkpoint else None, "enable_cache": False,
                        "replica_cpus": 1, "max_num_seqs": streams, "stream_batching_interval_ms": cases[label]}
                with deployed(url, args) as model:
                    runs[label].append({"order": order.index(label),
                                        **asyncio.run(_load(url, model, streams, max_tokens))})
    out.update({label: summarize(case_runs, FIGURES) for label, case_runs in runs.items()})
    per_step = out["per_step"]["tokens_per_s"]
    out["speedup"] = round(out["batched"]["tokens_per_s"] / per_step, 2) if per_step else None
    return out
