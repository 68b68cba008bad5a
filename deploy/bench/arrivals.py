"""Open-loop load for the trace replays: each request sent at its arrival time, whatever is still
in flight, as a deployment's users send them (``vllm bench serve --request-rate`` does the same).

A closed loop of N clients never lets more than N requests queue, so a replica that attracts more
than its share of the traffic only slows its own clients down; in an open loop its queue grows
while the others idle, and the time a request waits there counts in its TTFT. Arrival times are
the trace's own timestamps, stretched or squeezed to a chosen mean rate (the trace's bursts and
lulls kept).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from cachedir.trace import read_trace
from deploy.bench.serve_bench import stream_completion

__all__ = ["open_loop", "rebase", "replay_one", "trace_arrivals"]


async def replay_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One replayed request (greedy, EOS ignored): ``stream_completion``'s result, or its
    transport error as ``{"error": ...}``."""
    try:
        return await stream_completion(client, url, "tiny", prompt, max_tokens, ignore_eos=True)
    except httpx.HTTPError as e:
        return {"error": repr(e)}


def trace_arrivals(path: str | Path, requests: int, rate: float, skip: int = 0) -> list[float]:
    """Seconds from the first request to each of ``requests`` records of the trace after its first
    ``skip`` (``trace_prompts``'s records), their timestamps scaled so that they arrive ``rate``
    a second on average; records that share one timestamp (or a single record) are spaced evenly."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    stamps = [r.timestamp_ms / 1000 for r in list(read_trace(path, limit=skip + requests))[skip:]]
    if not stamps:
        return []
    span = max(stamps) - min(stamps)
    if span <= 0:
        return [i / rate for i in range(len(stamps))]
    scale = (len(stamps) - 1) / (rate * span)  # seconds of the replay per second of the trace
    first = stamps[0]
    return [max(0.0, (t - first) * scale) for t in stamps]


def rebase(arrivals: list[float] | None, start: int, end: int) -> list[float] | None:
    """The arrivals of requests ``start..end-1``, from the first of them (a window of a replay)."""
    if arrivals is None:
        return None
    part = arrivals[start:end]
    return [t - part[0] for t in part] if part else []


async def open_loop(url: str, work: list[tuple[list[int], int]], arrivals: list[float],
                    done=lambda n: None) -> list[dict]:
    """Every request of ``work`` sent at its arrival (seconds from now), none waiting for another;
    a request the client sends late (its event loop busy) counts the lateness in its TTFT, so the
    figures are from the arrival. ``done(n)`` after each finishes."""
    if len(arrivals) != len(work):
        raise ValueError(f"{len(arrivals)} arrival times for {len(work)} requests")
    results: list[dict] = [{}] * len(work)
    finished = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def send(i: int, prompt: list[int], max_tokens: int) -> None:
            late = max(0.0, time.perf_counter() - start - arrivals[i])
            result = await replay_one(client, url, prompt, max_tokens)
            if result.get("ttft") is not None:
                result["ttft"] += late
            results[i] = result
            nonlocal finished
            finished += 1
            done(finished)

        tasks = []
        for i, (prompt, max_tokens) in enumerate(work):
            wait = start + arrivals[i] - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(send(i, prompt, max_tokens)))
        await asyncio.gather(*tasks)
    return results
