"""The prefill load balancer: send a request to the replica whose first token comes soonest.

For each candidate replica the estimated time to first token is

    queue time    pending attention compute of the requests queued there: for each, its new tokens
                  x (cached + new) tokens, plus its new tokens (the linear part of the model)
  + load time     its cached prefix's bytes over the bandwidth of where they live relative to that
                  replica: this node's RAM or SSD (the node's agent holds them) or another node
  + compute time  of the uncached suffix (same cost model)

The balancer may decline a load: it compares loading every cached unit, only the ones on the
replica's own node, and none, and keeps the fastest (a slow network and a short prefix mean
recomputing wins). Ties (within ``tie_tolerance``) go to the least loaded replica.

Bandwidths and compute coefficients are measured by the replicas (``Bandwidth.observe`` on every
load, ``fit_compute`` on recent prefill chunks) and reported with their routing stats; the router
pools them into one cost model (the replicas run on the same hardware, and a per-replica fit
would favour whichever replica has measured least). In Ray Serve,
``deploy/prefill_router.py`` is a custom ``RequestRouter`` that calls ``choose`` with the stats the
replicas report and the prefix the ingress looked up (one directory round trip per request).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Bandwidth", "CostModel", "Estimate", "PrefixInfo", "ReplicaState", "choose", "estimate", "fit_compute",
           "load_units", "prefix_info"]


@dataclass(frozen=True, slots=True)
class CostModel:
    token_s: float = 2e-4  # seconds per new token (projections, MLP, experts)
    attn_s: float = 2e-8  # seconds per (new token x attended token)
    unit_bytes: int = 1 << 20  # bytes of one cache unit of this model
    unit_tokens: int = 64
    local_bps: float = 1.0e9  # this node's agent (RAM or SSD), measured
    remote_bps: float = 0.3e9  # another node's agent, measured
    load_latency_s: float = 2e-3  # per load round trip (a run of units is one batch)

    def compute_s(self, new: int, cached: int) -> float:
        return new * self.token_s + new * (cached + new) * self.attn_s

    def load_s(self, local_units: int, remote_units: int) -> float:
        s = local_units * self.unit_bytes / self.local_bps + remote_units * self.unit_bytes / self.remote_bps
        return s + (self.load_latency_s if local_units + remote_units else 0.0)


@dataclass(frozen=True, slots=True)
class ReplicaState:
    replica: str
    node: str
    queued: Sequence[tuple[int, int]] = ()  # (new, cached) tokens of each request waiting there
    running: int = 0
    cost: CostModel | None = None  # the replica's own measurements (None: the caller's)


@dataclass(frozen=True, slots=True)
class PrefixInfo:
    prompt_tokens: int
    units: int = 0  # leading units that some live node holds
    local_run: Mapping[str, int] = field(default_factory=dict)  # node -> leading units it holds


def prefix_info(prompt_tokens: int, holders: Sequence[Sequence[str]] = ()) -> PrefixInfo:
    """What the balancer needs of a prefix plan's holders (the nodes listed for each leading
    unit): how many leading units some node holds, and per node how many it holds from the start."""
    local_run: dict[str, int] = {}
    for i, nodes in enumerate(holders):
        for node in nodes:
            if local_run.get(node, 0) == i:
                local_run[node] = i + 1
    return PrefixInfo(prompt_tokens, len(holders), local_run)


@dataclass(frozen=True, slots=True)
class Estimate:
    replica: str
    queue_s: float
    load_s: float
    compute_s: float
    load_units: int  # units it would load (declined loads are not counted)

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.load_s + self.compute_s


def estimate(state: ReplicaState, prefix: PrefixInfo, default: CostModel = CostModel()) -> Estimate:
    cost = state.cost or default
    queue = sum(cost.compute_s(new, cached) for new, cached in state.queued)
    # the prompt's last token is always computed, so at most (tokens - 1) // unit tokens load
    n = min(prefix.units, (prefix.prompt_tokens - 1) // cost.unit_tokens)
    local = min(prefix.local_run.get(state.node, 0), n)
    best: tuple[float, float, float, int] | None = None
    for k in sorted({0, local, n}):
        load = cost.load_s(min(k, local), max(0, k - local))
        cached = k * cost.unit_tokens
        compute = cost.compute_s(prefix.prompt_tokens - cached, cached)
        if best is None or load + compute < best[0]:
            best = (load + compute, load, compute, k)
    _, load, compute, k = best
    return Estimate(state.replica, queue, load, compute, k)


def load_units(node: str, prompt_tokens: int, holders: Sequence[Sequence[str]], cost: CostModel) -> int:
    """How many of a plan's leading units a replica on ``node`` loads: the fastest of loading them
    all, only its node's run, or none (``estimate``'s choice, with the replica's own costs)."""
    return estimate(ReplicaState("", node, cost=cost), prefix_info(prompt_tokens, holders)).load_units


def choose(
    states: Iterable[ReplicaState], prefix: PrefixInfo, default: CostModel = CostModel(),
    tie_tolerance: float = 0.02,
) -> Estimate:
    """The replica with the lowest estimated TTFT; within ``tie_tolerance`` (relative) of it, the
    least loaded (queued compute, then running requests)."""
    states = list(states)
    if not states:
        raise ValueError("no replica to choose from")
    scored = [(estimate(s, prefix, default), s) for s in states]
    best = min(e.ttft_s for e, _ in scored)
    near = [(e, s) for e, s in scored if e.ttft_s <= best * (1 + tie_tolerance) + 1e-9]
    return min(near, key=lambda es: (es[0].queue_s, es[1].running, es[0].ttft_s))[0]


class Bandwidth:
    """An exponentially weighted bandwidth estimate (bytes/s) from observed transfers."""

    def __init__(self, initial_bps: float, weight: float = 0.2) -> None:
        self.bps = initial_bps
        self.weight = weight
        self.samples = 0

    def observe(self, nbytes: int, seconds: float) -> float:
        if nbytes > 0 and seconds > 0:
            self.bps += self.weight * (nbytes / seconds - self.bps)
            self.samples += 1
        return self.bps


def fit_compute(samples: Sequence[tuple[int, int, float]], default: CostModel = CostModel()) -> tuple[float, float]:
    """(token_s, attn_s) fitted by least squares to prefill chunks (new, cached, seconds):
    seconds ~ token_s * new + attn_s * new * (cached + new). Falls back to the defaults when the
    samples cannot separate the two terms; never negative."""
    if len(samples) < 2:
        return default.token_s, default.attn_s
    a11 = a12 = a22 = b1 = b2 = 0.0
    for new, cached, secs in samples:
        x1, x2 = float(new), float(new) * (cached + new)
        a11, a12, a22 = a11 + x1 * x1, a12 + x1 * x2, a22 + x2 * x2
        b1, b2 = b1 + x1 * secs, b2 + x2 * secs
    det = a11 * a22 - a12 * a12
    if det <= 1e-9 * a11 * a22:
        token_s = b1 / a11 if a11 else default.token_s
        return max(token_s, 0.0), default.attn_s
    token_s = (b1 * a22 - b2 * a12) / det
    attn_s = (a11 * b2 - a12 * b1) / det
    if token_s < 0 or attn_s < 0:  # clamp to one term, refit the other
        if attn_s < 0:
            return max(b1 / a11, 0.0), 0.0
        return 0.0, max(b2 / a22, 0.0)
    return token_s, attn_s
