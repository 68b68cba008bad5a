"""Day/night scaling policy: how many nodes should serve now.

By day every node serves. At night serving shrinks towards ``night_nodes`` so the freed nodes can
train, but never below what the current load needs: the need is the larger of the token rate
(projected ``lookahead_s`` ahead along its recent trend) over per-node capacity and the KV
occupancy of the serving nodes, both with ``headroom``. A busy night stays served.

Batch work (``/v1/batches``) is demand too: the rate that finishes every batch within its window,
earliest due first (``batch_tokens_per_s``), adds to the interactive load. Batches not due soon
ride in the serving nodes' spare capacity; a window closing brings nodes back from training.

Changes are damped: scaling *up* happens at once (serving comes first), scaling *down* only after
``min_dwell_s`` since the last change and only when the load would fit the smaller size with the
larger ``down_headroom`` (hysteresis: the band between the two headrooms does not flap).

Pure: time comes in as ``now_s`` (Unix seconds), the schedule's timezone is applied here.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from datetime import time as clock
from zoneinfo import ZoneInfo

__all__ = ["BatchDemand", "Decision", "LoadSample", "NodeLoad", "Schedule", "ScalingConfig", "ScalingPolicy",
           "batch_tokens_per_s", "nodes_to_free"]

MIN_WINDOW_S = 600.0  # a window closer than this is planned as if this far (a late batch needs no infinite rate)


@dataclass(frozen=True, slots=True)
class Schedule:
    """Night runs from ``night_start`` to ``day_start`` (may wrap midnight) in ``timezone``."""

    day_start: clock = clock(8, 0)
    night_start: clock = clock(0, 0)
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        if self.day_start == self.night_start:
            raise ValueError(f"day_start and night_start are both {self.day_start}: no night or no day")
        try:
            ZoneInfo(self.timezone)
        except (KeyError, ValueError) as e:
            raise ValueError(f"unknown timezone {self.timezone!r}") from e

    @classmethod
    def parse(cls, day: str, night: str, timezone: str = "UTC") -> Schedule:
        """From ``HH:MM`` strings; a bad value raises ``ValueError`` naming it."""
        return cls(_parse_clock(day, "day"), _parse_clock(night, "night"), timezone)

    def is_night(self, now_s: float) -> bool:
        t = datetime.fromtimestamp(now_s, ZoneInfo(self.timezone)).time()
        if self.night_start < self.day_start:
            return self.night_start <= t < self.day_start
        return t >= self.night_start or t < self.day_start


def _parse_clock(text: str, what: str) -> clock:
    try:
        hh, mm = text.split(":")
        return clock(int(hh), int(mm))
    except ValueError:
        raise ValueError(f"{what} time {text!r} is not HH:MM") from None


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    total_nodes: int
    min_nodes: int = 1
    night_nodes: int = 1  # the night's goal when load allows
    node_tokens_per_s: float = 1000.0  # what one node serves comfortably (measured)
    headroom: float = 1.3  # scale up when load x headroom exceeds capacity
    down_headroom: float = 1.6  # scale down only when load x down_headroom fits
    min_dwell_s: float = 1800.0
    lookahead_s: float = 900.0
    trend_window_s: float = 1800.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.total_nodes:
            raise ValueError(f"min_nodes {self.min_nodes} must be in 1..total_nodes {self.total_nodes}")
        if not self.min_nodes <= self.night_nodes <= self.total_nodes:
            raise ValueError(f"night_nodes {self.night_nodes} must be in {self.min_nodes}..{self.total_nodes}")
        if self.node_tokens_per_s <= 0:
            raise ValueError(f"node_tokens_per_s must be > 0, got {self.node_tokens_per_s}")
        if not 1.0 <= self.headroom <= self.down_headroom:
            raise ValueError(f"need 1 <= headroom ({self.headroom}) <= down_headroom ({self.down_headroom})")
        if self.min_dwell_s < 0 or self.lookahead_s < 0 or self.trend_window_s <= 0:
            raise ValueError("min_dwell_s and lookahead_s must be >= 0, trend_window_s > 0")


@dataclass(frozen=True, slots=True)
class LoadSample:
    now_s: float
    tokens_per_s: float  # input + output tokens processed per second, cluster-wide
    requests_running: int = 0
    kv_occupancy: float = 0.0  # used / capacity over the serving nodes, 0..1
    serving_nodes: int = 0  # nodes that produced this sample (KV occupancy is relative to them)


@dataclass(frozen=True, slots=True)
class BatchDemand:
    """A batch's work left: the tokens its lines not run yet may cost, and when its window closes."""

    tokens: int
    due_s: float  # Unix time


def batch_tokens_per_s(demands: list[BatchDemand], now_s: float) -> float:
    """The steady rate that finishes every batch by its window, earliest due first: the largest,
    over each window, of the tokens due by it over the time left to it."""
    rate, due = 0.0, 0
    for d in sorted(demands, key=lambda d: d.due_s):
        due += d.tokens
        rate = max(rate, due / max(d.due_s - now_s, MIN_WINDOW_S))
    return rate


@dataclass(frozen=True, slots=True)
class Decision:
    target: int
    needed: int  # what the load needs now (with headroom), before the schedule
    night: bool
    reason: str


class ScalingPolicy:
    def __init__(self, cfg: ScalingConfig, schedule: Schedule) -> None:
        self.cfg = cfg
        self.schedule = schedule
        self.samples: deque[LoadSample] = deque()
        self.last_change_s: float | None = None
        self.batch_rate = 0.0  # tokens/s the batches need to meet their windows (``observe_batches``)

    def observe_batches(self, demands: list[BatchDemand], now_s: float) -> None:
        """The batches' work left: demand beside the interactive load."""
        self.batch_rate = batch_tokens_per_s(demands, now_s)

    def observe(self, sample: LoadSample) -> None:
        if sample.tokens_per_s < 0 or not 0.0 <= sample.kv_occupancy <= 1.0:
            raise ValueError(f"bad load sample {sample}")
        self.samples.append(sample)
        while self.samples and sample.now_s - self.samples[0].now_s > self.cfg.trend_window_s:
            self.samples.popleft()

    def projected_tokens_per_s(self) -> float:
        """The latest rate, extended ``lookahead_s`` along the least-squares trend (rising only:
        a falling trend is not trusted to continue)."""
        if not self.samples:
            return 0.0
        latest = self.samples[-1].tokens_per_s
        if len(self.samples) < 2:
            return latest
        ts = [s.now_s for s in self.samples]
        ys = [s.tokens_per_s for s in self.samples]
        mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
        var = sum((t - mt) ** 2 for t in ts)
        slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var else 0.0
        return latest + max(0.0, slope) * self.cfg.lookahead_s

    def needed(self, headroom: float, batches: bool = True) -> int:
        """Nodes for the interactive load with ``headroom`` and (``batches``) the batches' rate
        (batch work needs no headroom: it waits behind interactive requests)."""
        cfg = self.cfg
        batch_rate = self.batch_rate if batches else 0.0
        by_tokens = (self.projected_tokens_per_s() * headroom + batch_rate) / cfg.node_tokens_per_s
        last = self.samples[-1] if self.samples else None
        by_kv = last.kv_occupancy * last.serving_nodes * headroom if last else 0.0
        return min(cfg.total_nodes, max(cfg.min_nodes, math.ceil(max(by_tokens, by_kv) - 1e-9)))

    def decide(self, now_s: float, current: int) -> Decision:
        """The target serving nodes given ``current`` (call after ``observe``); records a change
        when the target differs from ``current``."""
        cfg = self.cfg
        night = self.schedule.is_night(now_s)
        need_up = self.needed(cfg.headroom)
        goal = max(cfg.night_nodes, need_up) if night else cfg.total_nodes
        if goal > current:
            why = "load needs more nodes" if night else "day: serve on all nodes"
            if night and self.batch_rate and need_up > max(cfg.night_nodes, self.needed(cfg.headroom, batches=False)):
                why = "batches due need more nodes"
            return self._change(now_s, goal, need_up, night, why)
        if goal == current:
            return Decision(current, need_up, night, "steady")
        # Shrinking: only after the dwell time and only to what the load fits with the larger headroom.
        dwell = self.last_change_s is not None and now_s - self.last_change_s < cfg.min_dwell_s
        if dwell:
            return Decision(current, need_up, night, f"holding: less than {cfg.min_dwell_s:.0f}s since the last change")
        floor = max(goal, self.needed(cfg.down_headroom))
        if floor >= current:
            return Decision(current, need_up, night, "holding: the load would not fit with hysteresis headroom")
        return self._change(now_s, floor, need_up, night, "night: lend nodes to training")

    def _change(self, now_s: float, target: int, needed: int, night: bool, reason: str) -> Decision:
        self.last_change_s = now_s
        return Decision(target, needed, night, reason)


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """A serving node as the scale-down sees it."""

    node_id: str
    running: int  # requests running or waiting on its replica
    unique_units: int  # cache units no other node holds (its agent keeps serving them while the
    #                    node is lent, but only as remote loads)
    head: bool = False  # the head node (Serve's controller and ingress live there) is lent last


def nodes_to_free(nodes: list[NodeLoad], n: int) -> list[str]:
    """The ``n`` serving nodes to lend: not the head, then the fewest running requests, then the
    least unique cache; ties by node id (deterministic)."""
    if n < 0 or n > len(nodes):
        raise ValueError(f"cannot free {n} of {len(nodes)} serving nodes")
    ranked = sorted(nodes, key=lambda s: (s.head, s.running, s.unique_units, s.node_id))
    return [s.node_id for s in ranked[:n]]
