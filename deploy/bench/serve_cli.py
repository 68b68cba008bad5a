"""``tide bench`` against one local Serve app (or, for ``batch``, a server at ``--url``): the prompt
cache through HTTP, hostile neighbours, batch work beside interactive load, streams."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import typer

from deploy.bench.cli_common import emit
from deploy.options import check_checkpoint


def bench_serve(
    checkpoint: Path = typer.Option(None, "--checkpoint", help="HF checkpoint dir; default: the built-in 'tiny' model"),
    requests: int = typer.Option(64, "--requests", min=1),
    concurrency: int = typer.Option(8, "--concurrency", min=1),
    system_tokens: int = typer.Option(2048, "--system-tokens", min=0, help="shared system prompt (half the requests)"),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1),
    repeats: int = typer.Option(2, "--repeats", min=1, help="runs of both cases, the order alternating (medians reported)"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """A bounded load through HTTP (streaming, half the requests sharing a system prompt) against
    a local Ray Serve app, with the prompt cache and without, the order alternating over repeats."""
    from deploy.bench.serve_bench import run_serve_bench

    check_checkpoint(checkpoint)
    with contextlib.redirect_stdout(sys.stderr):  # Ray's shutdown messages must not precede the JSON
        result = run_serve_bench(checkpoint, requests, concurrency, system_tokens, max_tokens, repeats)
    emit(result)


def bench_neighbour(
    checkpoint: Path = typer.Option(None, "--checkpoint", help="HF checkpoint dir; default: the built-in 'tiny' model"),
    max_tokens: int = typer.Option(128, "--max-tokens", min=2, help="tokens each neighbour stream generates"),
    repeats: int = typer.Option(2, "--repeats", min=1, help="runs of both cases, the order alternating (medians reported)"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """A tenant's greedy streams alone, then beside another tenant's hostile requests (sampling
    extremes, oversized numbers, deep nesting, heavy or empty grammars, costly batches) on one
    local replica: the streams' inter-token latency p50/p99 in each case and their ratio (target:
    p99 within 3x), whether their tokens stayed the same, and the statuses the hostile requests got."""
    from deploy.bench.neighbour_bench import run_neighbour_bench

    check_checkpoint(checkpoint)
    with contextlib.redirect_stdout(sys.stderr):  # Ray's shutdown messages must not precede the JSON
        result = run_neighbour_bench(checkpoint, max_tokens, repeats)
    emit(result)


def bench_batch(
    checkpoint: Path = typer.Option(None, "--checkpoint", help="HF checkpoint dir; default: the built-in 'tiny' model"),
    clients: int = typer.Option(2, "--clients", min=1, help="interactive clients, each streaming chats one after another"),
    requests: int = typer.Option(32, "--requests", min=1,
                                 help="streamed chats per client per run (their TTFTs' p99 is a run's; fewer than 50 make it the max)"),
    max_tokens: int = typer.Option(32, "--max-tokens", min=2, help="tokens per interactive chat (a batch line: 4x)"),
    batch_lines: int = typer.Option(400, "--batch-lines", min=1, help="lines of the batch beside the load"),
    background_share: float = typer.Option(None, "--background-share", min=0.0, max=1.0,
                                           help="the replica's share of seats and pages for batch lines (default: the app's)"),
    repeats: int = typer.Option(3, "--repeats", min=1, help="runs of both cases, the order alternating (medians reported)"),
    url: str = typer.Option(None, "--url", help="measure a server already up (e.g. `tide up`'s http://127.0.0.1:8000/v1) "
                                                "instead of starting a local app; its first listed model"),
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="with --url: the server's API key"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """An interactive load of greedy streamed chats alone, then beside a running batch
    (/v1/batches) on one local replica, or on the server at --url: the load's time to first token
    and inter-token latency (p50, p99) in each case, their p99 ratios (target: within 1.10x) and
    the batch lines done. The batch is cancelled and its files deleted when the load ends."""
    import httpx

    from deploy.bench.batch_bench import run_batch_bench, server_root

    check_checkpoint(checkpoint)
    if url is not None:
        for given, option in ((checkpoint, "--checkpoint"), (background_share, "--background-share")):
            if given is not None:
                raise typer.BadParameter(f"{option} sets up the local app; the server at --url {url} runs as it was started")
        if not server_root(url).startswith(("http://", "https://")):
            raise typer.BadParameter(f"--url {url!r} must be an http:// or https:// URL")
    try:
        with contextlib.redirect_stdout(sys.stderr):  # Ray's shutdown messages must not precede the JSON
            result = run_batch_bench(checkpoint, clients, requests, max_tokens, batch_lines, repeats,
                                     background_share, url=url, api_key=api_key)
    except (RuntimeError, httpx.HTTPError) as e:
        if url is None:
            raise
        typer.echo(f"error: the server at --url {url}: {e}", err=True)
        raise typer.Exit(1) from None
    emit(result)


def bench_stream(
    checkpoint: Path = typer.Option(None, "--checkpoint", help="HF checkpoint dir; default: the built-in 'tiny' model"),
    streams: int = typer.Option(8, "--streams", min=1, help="concurrent streamed completions"),
    max_tokens: int = typer.Option(400, "--max-tokens", min=2, help="tokens each stream generates (ignore_eos)"),
    repeats: int = typer.Option(2, "--repeats", min=1, help="runs of both cases, the order alternating (medians reported)"),
    as_json: bool = typer.Option(True, "--json/--no-json", help="JSON output (always JSON)"),
) -> None:
    """Output tokens a second of concurrent streams through HTTP against a local Ray Serve app,
    with the serving default's stream batching (stream_batching_interval_ms) and with an output
    per engine step; the outputs a request took, time to first token, the p99 gap between
    outputs."""
    from deploy.bench.stream_bench import run_stream_bench

    check_checkpoint(checkpoint)
    with contextlib.redirect_stdout(sys.stderr):  # Ray's shutdown messages must not precede the JSON
        result = run_stream_bench(checkpoint, streams, max_tokens, repeats)
    emit(result)
