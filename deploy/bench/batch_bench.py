"""``tide bench batch``: what a running batch (``/v1/batches``) costs the interactive requests beside it.

One local app (the default model unless ``--checkpoint``), or a server already up (``--url``,
with ``--api-key`` where it has keys; the model it lists first). An interactive load — ``clients``
clients, each sending greedy streamed chats one after another — runs alone, then again while a
batch of ``batch_lines`` lines runs (submitted as OpenAI's client does, cancelled once the load
ends); the two alternate over repeats. Reported, medians over repeats: the interactive time to
first token (p50, p99) and inter-token latency (p50, p99: the gaps between a stream's token
events) in each case, their ratios (the target: both p99 within 1.10x of alone), and the batch
lines done while the load ran (the batch did run beside it).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

import httpx

from deploy.bench.machine import machine
from deploy.bench.serve_bench import case_orders, deployed, local_serve, served_model

__all__ = ["run_batch_bench"]

CASES = ("alone", "beside_batch")


def _quantile(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, int(q * len(ranked)))]


async def _stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """One greedy streamed chat: its time to first token and the gaps between its token events."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    start, times = time.perf_counter(), []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return times[0] - start, [b - a for a, b in zip(times, times[1:], strict=False)]


async def _client(client: httpx.AsyncClient, model: str, worker: int, requests: int,
                  max_tokens: int) -> list[tuple[float, list]]:
    return [await _stream(client, model, f"Client {worker}, question {i}: tell me about the tides.", max_tokens)
            for i in range(requests)]


async def _submit(client: httpx.AsyncClient, model: str, lines: int, max_tokens: int) -> str:
    data = "".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": model, "prompt": f"Batch document {i}: summarize the night shift.", "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True}}) + "\n" for i in range(lines))
    f = await client.post("/v1/files", files={"file": ("bench.jsonl", data.encode())}, data={"purpose": "batch"})
    f.raise_for_status()
    fid = f.json()["id"]
    b = await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                               "completion_window": "24h"})
    if b.status_code != 200:  # no batch to cancel later: its file goes now
        await client.delete(f"/v1/files/{fid}")
    b.raise_for_status()
    return b.json()["id"]


async def _completed(client: httpx.AsyncClient, bid: str) -> int:
    """The lines the batch has completed so far."""
    return (await client.get(f"/v1/batches/{bid}")).json()["request_counts"]["completed"]


async def _until_running(client: httpx.AsyncClient, bid: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while await _completed(client, bid) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {bid} ran no line within {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


async def _stop(client: httpx.AsyncClient, bid: str) -> None:
    """Cancel the batch, wait until it ended, and delete its files (on a server of the user's, the
    bench leaves nothing behind)."""
    await client.post(f"/v1/batches/{bid}/cancel")
    while True:
        b = (await client.get(f"/v1/batches/{bid}")).json()
        if b["status"] in ("cancelled", "completed", "failed", "expired"):
            break
        await asyncio.sleep(0.2)
    for key in ("input_file_id", "output_file_id", "error_file_id"):
        if b.get(key):
            await client.delete(f"/v1/files/{b[key]}")


async def _run(url: str, auth: dict[str, str], model: str, clients: int, requests: int, max_tokens: int,
               batch_lines: int, beside: bool) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=auth) as client:
        bid = await _submit(client, model, batch_lines, 4 * max_tokens) if beside else None
        try:
            if bid is not None:
                await _until_running(client, bid)
            done_before = await _completed(client, bid) if bid else 0
            per_client = await asyncio.gather(*(_client(client, model, w, requests, max_tokens)
                                                for w in range(clients)))
            lines_beside = await _completed(client, bid) - done_before if bid else 0
        finally:  # also when the load failed: no batch of the bench's goes on running
            if bid is not None:
                await _stop(client, bid)
    ttft = [t for runs in per_client for t, _ in runs]
    gaps = [g for runs in per_client for _, gs in runs for g in gs]
    return {"ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p99_ms": 1e3 * _quantile(ttft, 0.99),
            "itl_p50_ms": 1e3 * statistics.median(gaps), "itl_p99_ms": 1e3 * _quantile(gaps, 0.99),
            "batch_lines_done": lines_beside}


def server_root(url: str) -> str:
    """A server's root URL from what a user may give: its root or its OpenAI base (``.../v1``)."""
    return url.rstrip("/").removesuffix("/v1")


def _runs(url: str, auth: dict[str, str], model: str, clients: int, requests: int, max_tokens: int,
          batch_lines: int, repeats: int) -> dict[str, list[dict]]:
    """Each case's runs against the server at ``url``, after a warm-up (kernels, first passes)."""
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    asyncio.run(_run(url, auth, model, 1, 1, max_tokens, 0, False))
    for order in case_orders(repeats, CASES):
        for case in order:
            runs[case].append(asyncio.run(_run(url, auth, model, clients, requests, max_tokens, batch_lines,
                                               case == "beside_batch")))
    return runs


def run_batch_bench(checkpoint=None, clients: int = 2, requests: int = 32, max_tokens: int = 32,
                    batch_lines: int = 400, repeats: int = 3, background_share: float | None = None,
                    url: str | None = None, api_key: str | None = None) -> dict[str, Any]:
    """``url``: measure the server there (``api_key`` its key, where it has keys) instead of a
    local app of ``checkpoint`` and ``background_share`` (which has none: ``api_key`` is unused)."""
    auth = {"Authorization": f"Bearer {api_key}"} if api_key and url is not None else {}
    if url is not None:
        url = server_root(url)
        runs = _runs(url, auth, served_model(url, auth), clients, requests, max_tokens, batch_lines, repeats)
    else:
        with tempfile.TemporaryDirectory() as tmp, local_serve() as local:
            args = {"checkpoint": str(checkpoint) if checkpoint else None, "replica_cpus": 1, "enable_cache": False,
                    "files_dir": tmp}
            if background_share is not None:
                args["background_share"] = background_share
            with deployed(local, args) as model:
                runs = _runs(local, auth, model, clients, requests, max_tokens, batch_lines, repeats)
    out: dict[str, Any] = {**machine(), "url": url, "clients": clients, "requests_per_client": requests, "max_tokens": max_tokens,
                           "batch_lines": batch_lines, "batch_line_max_tokens": 4 * max_tokens, "repeats": repeats,
                           "background_share": background_share, "statistic": "median over repeats (order alternates)"}
    for case in CASES:
        out[case] = {k: round(statistics.median(r[k] for r in runs[case]), 2)
                     for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "batch_lines_done")}
        out[case]["ranges"] = {k: [round(min(r[k] for r in runs[case]), 2), round(max(r[k] for r in runs[case]), 2)]
                               for k in ("ttft_p99_ms", "itl_p99_ms")}
    for key in ("ttft_p99_ms", "itl_p99_ms"):
        out[f"{key[:-3]}_ratio"] = round(out["beside_batch"][key] / out["alone"][key], 3)
    out["within_10pct"] = out["ttft_p99_ratio"] <= 1.10 and out["itl_p99_ratio"] <= 1.10
    return out
