"""DeepSeek's daily report for this cluster: tokens, cache hits, speed, nodes, theoretical revenue.

DeepSeek published one for a day of V3/R1 serving: input tokens and how many hit the disk cache,
output tokens, average output speed per request, average KV length, peak and average serving
nodes, and the revenue the tokens would bring at list prices against the cost of the node-hours.
This module computes the same from this cluster's records, pure (records in, numbers out):

* ``UsageRecord`` per finished request (appended to a JSONL usage log by every replica),
* ``NodeSample`` whenever the number of serving nodes changes (appended by the scaler).

Revenue = cache-hit input x hit price + cache-miss input x miss price + output x output price, all
per million tokens, with an optional discount for requests that finish in a night window (as
DeepSeek's off-peak pricing) and one for batch lines (``/v1/batches``, as OpenAI's Batch API:
half price by default). Cost = serving node-hours x ``node_hour_cost``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from cachedir.layout import tighten
from cluster.scaling import Schedule

__all__ = ["NodeSample", "Prices", "JsonlLog", "UsageRecord", "daily_report", "log_files", "read_jsonl", "timeline"]


@dataclass(frozen=True, slots=True)
class UsageRecord:
    end_s: float  # Unix time the request finished
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from a cache
    completion_tokens: int
    decode_s: float  # first to last output token
    tenant: str = ""
    batch: bool = False  # a batch line's (/v1/batches): priced at Prices.batch_discount

    def __post_init__(self) -> None:
        if not 0 <= self.cached_tokens <= self.prompt_tokens or self.completion_tokens < 0:
            raise ValueError(f"inconsistent usage record {self}")


@dataclass(frozen=True, slots=True)
class NodeSample:
    now_s: float
    serving_nodes: int
    lent_nodes: int = 0  # nodes lent to training (the night's)


@dataclass(frozen=True, slots=True)
class Prices:
    """Per million tokens (default: DeepSeek-V3's list prices in USD) and per node-hour (8 GPUs
    at 2 USD/GPU-hour, the figure DeepSeek used)."""

    cache_hit_input: float = 0.07
    cache_miss_input: float = 0.27
    output: float = 1.10
    node_hour_cost: float = 16.0
    night_discount: float = 0.0  # 0.5 = half price for requests finishing at night
    night: Schedule | None = None
    batch_discount: float = 0.5  # batch lines' price off the list (OpenAI's Batch API: half)

    def __post_init__(self) -> None:
        for name in ("cache_hit_input", "cache_miss_input", "output", "node_hour_cost"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("night_discount", "batch_discount"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


class JsonlLog:
    """Append-only JSONL of records (``UsageRecord`` per finished request, ``NodeSample`` per
    change), readable by its owner alone, bounded: past ``max_bytes`` the file becomes ``<name>.1`` (``.1`` becomes ``.2``, ...)
    and the oldest beyond ``keep`` rotated files is deleted. ``log_files`` lists them all."""

    def __init__(self, path: str | Path, max_bytes: int = 64 << 20, keep: int = 8) -> None:
        if max_bytes <= 0 or keep < 1:
            raise ValueError(f"max_bytes must be > 0 and keep >= 1, got {max_bytes}, {keep}")
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tighten(self.path, 0o600)  # one an older version made 0644
        self.max_bytes, self.keep = max_bytes, keep

    def append(self, record: UsageRecord) -> None:
        line = json.dumps(asdict(record)) + "\n"
        try:
            if self.path.stat().st_size + len(line) > self.max_bytes:
                self._rotate()
        except FileNotFoundError:
            pass
        with os.fdopen(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as f:
            f.write(line)  # 0600: records name tenants

    def _rotate(self) -> None:
        rotated = lambda i: self.path.with_name(f"{self.path.name}.{i}")  # noqa: E731
        rotated(self.keep).unlink(missing_ok=True)
        for i in range(self.keep - 1, 0, -1):
            if rotated(i).exists():
                rotated(i).replace(rotated(i + 1))
        self.path.replace(rotated(1))


def log_files(directory: Path, pattern: str = "*.jsonl") -> list[Path]:
    """The logs matching ``pattern`` in ``directory`` and their rotated files, oldest first."""
    out = []
    for current in sorted(directory.glob(pattern)):
        olds = [p for p in directory.glob(current.name + ".*") if p.suffix[1:].isdigit()]
        out += sorted(olds, key=lambda p: -int(p.suffix[1:])) + [current]
    return out


def read_jsonl(paths: Iterable[str | Path], kind: type) -> list:
    """Records of ``kind`` from JSONL files; a torn last line (a writer killed mid-line) is skipped."""
    out = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            try:
                out.append(kind(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue
    return out


def daily_report(
    usage: list[UsageRecord],
    nodes: list[NodeSample],
    window_s: float,
    now_s: float,
    prices: Prices = Prices(),
) -> dict:
    """The report over ``[now_s - window_s, now_s]``. Serving nodes are a step function of
    ``nodes`` (the last sample before the window carries in); with no sample they are unknown."""
    start = now_s - window_s
    rows = [u for u in usage if start <= u.end_s <= now_s]
    input_tokens = sum(u.prompt_tokens for u in rows)
    hit = sum(u.cached_tokens for u in rows)
    output_tokens = sum(u.completion_tokens for u in rows)
    speeds = [u.completion_tokens / u.decode_s for u in rows if u.decode_s > 0 and u.completion_tokens > 1]
    revenue = batch_revenue = 0.0
    for u in rows:
        r = (u.cached_tokens * prices.cache_hit_input + (u.prompt_tokens - u.cached_tokens) * prices.cache_miss_input
             + u.completion_tokens * prices.output) / 1e6
        if u.batch:  # a batch line has the batch price, whenever it finished
            r *= 1.0 - prices.batch_discount
            batch_revenue += r
        elif prices.night is not None and prices.night_discount and prices.night.is_night(u.end_s):
            r *= 1.0 - prices.night_discount
        revenue += r
    batch = [u for u in rows if u.batch]
    peak, avg, node_hours = _node_stats(nodes, start, now_s)
    lent_hours = _node_stats([NodeSample(n.now_s, n.lent_nodes) for n in nodes], start, now_s)[2]
    cost = node_hours * prices.node_hour_cost if node_hours is not None else None
    return {
        "window_start": datetime.fromtimestamp(start, ZoneInfo("UTC")).isoformat(),
        "window_end": datetime.fromtimestamp(now_s, ZoneInfo("UTC")).isoformat(),
        "requests": len(rows),
        "input_tokens": input_tokens,
        "cache_hit_tokens": hit,
        "cache_miss_tokens": input_tokens - hit,
        "cache_hit_rate": round(hit / input_tokens, 4) if input_tokens else 0.0,
        "output_tokens": output_tokens,
        "avg_output_tokens_per_s": round(sum(speeds) / len(speeds), 2) if speeds else 0.0,
        "avg_kv_length": round(sum(u.prompt_tokens + u.completion_tokens for u in rows) / len(rows), 1) if rows else 0.0,
        "serving_nodes_peak": peak,
        "serving_nodes_avg": round(avg, 3) if avg is not None else None,
        "node_hours": round(node_hours, 3) if node_hours is not None else None,
        "lent_node_hours": round(lent_hours, 3) if lent_hours is not None else None,
        "batch_requests": len(batch),
        "batch_input_tokens": sum(u.prompt_tokens for u in batch),
        "batch_output_tokens": sum(u.completion_tokens for u in batch),
        "revenue": round(revenue, 6),
        "batch_revenue": round(batch_revenue, 6),
        "cost": round(cost, 6) if cost is not None else None,
        "margin": round((revenue - cost) / revenue, 4) if cost is not None and revenue else None,
        "prices": {k: v for k, v in asdict(prices).items() if k != "night"},
    }


def _node_stats(nodes: list[NodeSample], start: float, end: float) -> tuple[int | None, float | None, float | None]:
    samples = sorted(nodes, key=lambda n: n.now_s)
    before = [n for n in samples if n.now_s <= start]
    inside = [n for n in samples if start < n.now_s <= end]
    steps = ([NodeSample(start, before[-1].serving_nodes)] if before else []) + inside
    if not steps:
        return None, None, None
    area = 0.0
    for a, b in zip(steps, steps[1:] + [NodeSample(end, steps[-1].serving_nodes)], strict=True):
        area += a.serving_nodes * (b.now_s - a.now_s)
    span = end - steps[0].now_s
    return max(n.serving_nodes for n in steps), (area / span if span > 0 else float(steps[-1].serving_nodes)), area / 3600


def timeline(usage: list[UsageRecord], nodes: list[NodeSample], window_s: float, now_s: float,
             bins: int = 24) -> dict:
    """The window in ``bins`` equal slices (DeepSeek's daily chart): per slice its start (Unix
    time), input, cache-hit and output tokens of the requests that finished in it and of those
    the batch lines among them (``batch_*``), the cache hit rate (None without input), and the
    serving and lent (training) nodes at its start (None before the first sample)."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    start, width = now_s - window_s, window_s / bins
    input_tokens, hit, output, batch_in, batch_out = ([0] * bins for _ in range(5))
    for u in usage:
        if start <= u.end_s <= now_s:
            i = min(bins - 1, int((u.end_s - start) // width))
            input_tokens[i] += u.prompt_tokens
            hit[i] += u.cached_tokens
            output[i] += u.completion_tokens
            if u.batch:
                batch_in[i] += u.prompt_tokens
                batch_out[i] += u.completion_tokens
    samples = sorted(nodes, key=lambda n: n.now_s)
    starts = [start + i * width for i in range(bins)]
    at = []
    for t in starts:
        before = [n for n in samples if n.now_s <= t]
        at.append(before[-1] if before else None)
    return {"start_s": starts, "width_s": width, "input_tokens": input_tokens, "cache_hit_tokens": hit,
            "output_tokens": output, "batch_input_tokens": batch_in, "batch_output_tokens": batch_out,
            "cache_hit_rate": [h / i if i else None for h, i in zip(hit, input_tokens, strict=True)],
            "serving_nodes": [None if n is None else n.serving_nodes for n in at],
            "lent_nodes": [None if n is None else n.lent_nodes for n in at]}

