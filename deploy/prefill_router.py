"""Ray Serve request routers for ``LLMServer`` replicas (``AppArgs.router`` picks one).

``CacheAwareRouter`` applies the prefill load balancer (``cluster/prefill_lb.py``): the ingress
has hashed the prompt and looked its units up in the directory (one round trip) and put the
``plan`` (``cluster.request.PrefixPlan``) into the request; the router ranks the replicas by the
TTFT the balancer estimates for that plan on each, and the chosen replica makes the same
estimate's choice of how many units to load (``cluster.prefill_lb.load_units``: fewer when
loading is slower than computing) without hashing or asking the directory again. The router
never changes the request it routes. Every replica
reports its node, queue and measured cost model through ``record_routing_stats`` (polled every
``request_routing_stats_period_s``). Requests this router sent after a replica's report was
taken are added to the queue it scores, so a burst between two polls does not all land on one
replica; when a request finished there after the report, the report is stale and the requests
this router has in flight there are its queue. The chosen replica is
ranked first and the rest by estimated TTFT, so Serve falls back in that order when one is full.

``CacheAwareRouter`` and ``PrefixAffinityRouter`` do not use Serve's ``FIFOMixin``: it hands
the replica found for one request to the oldest request waiting, whose prefix may live on another
node (or hash to another replica); without it each request gets the replica ranked for its own
prompt.

Why a router rather than the ingress picking a replica: Serve owns replica membership, queue
limits, retries and back-pressure; a router keeps all of that and only supplies the ranking.

``RoundRobinRouter`` ignores the cache, and ``PrefixAffinityRouter`` sends prompts that share
their first tokens to one replica without asking a directory (``cluster/prefix_affinity.py``):
the benchmark's baselines. All skip replicas that report ``draining`` (their node is being lent
to training: ``actors/tidal.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from cluster.prefill_lb import CostModel, PrefixInfo, ReplicaState, choose, estimate, prefix_info
from cluster.prefix_affinity import AFFINITY_TOKENS, QUEUE_RATIO, rank_by_prefix
from cluster.request import GenerationRequest, PrefixPlan
from cluster.routing_stats import RoutingStats

__all__ = ["CacheAwareRouter", "PrefixAffinityRouter", "RoundRobinRouter", "plan_prefix"]

MIN_SAMPLES = 8  # prefill chunks a replica must have timed before its fit counts


def plan_prefix(prompt_tokens: int, plan: PrefixPlan | None) -> PrefixInfo:
    """What the balancer needs of a plan (none: only the prompt's length)."""
    return prefix_info(prompt_tokens, plan.holders if plan is not None else ())


def _serving(replicas: list[RunningReplica]) -> list[tuple[RunningReplica, RoutingStats]]:
    """Each replica with its stats (read once), of those whose node is not being lent to training
    (all of them if every one is)."""
    read = [(r, RoutingStats.of(r.routing_stats)) for r in replicas]
    return [(r, st) for r, st in read if not st.draining] or read


def _request(pending: PendingRequest | None) -> GenerationRequest | None:
    """The ``generate`` call's request (None for the replicas' other methods)."""
    if pending is None or not pending.args:
        return None
    req = pending.args[0]
    return req if isinstance(req, GenerationRequest) else None


class CacheAwareRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._planned: dict[str, tuple[int, int]] = {}  # request id -> (new, cached) tokens
        # request id -> (replica, sent: wall time, as the replicas' reports are stamped, new, cached)
        self._inflight: dict[str, tuple[str, float, int, int]] = {}
        self._done_at: dict[str, float] = {}  # replica -> wall time of its last finished request

    def _state(self, replica: RunningReplica, st: RoutingStats) -> ReplicaState:
        rid = replica.replica_id.unique_id
        mine = [(sent, new, cached) for r, sent, new, cached in self._inflight.values() if r == rid]
        if st.time >= self._done_at.get(rid, 0.0):
            # the report is current: add what was sent after it was taken (not in its queue)
            queued = list(st.queued) + [(n, c) for sent, n, c in mine if sent > st.time]
        else:  # a request finished after the report: its queue is stale; count what is in flight
            queued = [(n, c) for _, n, c in mine]
        return ReplicaState(rid, st.node or replica.node_id, queued, st.running)

    @staticmethod
    def _pooled_cost(stats: list[RoutingStats]) -> CostModel:
        """One cost model for all replicas (same hardware): the median of what the replicas with
        enough measurements report. Each replica's own fit would make a replica that has measured
        little look faster than one that has measured much."""
        reported = [st for st in stats if st.cost is not None]
        costs = [dataclasses.asdict(st.cost) for st in reported if st.samples >= MIN_SAMPLES]
        if not costs:
            return reported[0].cost if reported else CostModel()
        pooled = {k: statistics.median(c[k] for c in costs) for k in costs[0]}
        pooled["unit_bytes"], pooled["unit_tokens"] = int(pooled["unit_bytes"]), int(pooled["unit_tokens"])
        return CostModel(**pooled)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        req = _request(pending_request)
        if req is None or not candidate_replicas:
            return [candidate_replicas]
        # replicas whose node is being lent to training get no new work (unless all are)
        serving = _serving(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r, _ in serving}
        states = [self._state(r, st) for r, st in serving]
        prefix = plan_prefix(len(req.prompt_ids), req.plan)
        cost = self._pooled_cost([st for _, st in serving])
        best = choose(states, prefix, cost)  # the chosen replica decides its load itself (the same estimate)
        cached = best.load_units * 64
        self._planned[pending_request.metadata.internal_request_id] = (prefix.prompt_tokens - cached, cached)
        rest = sorted((s for s in states if s.replica != best.replica), key=lambda s: estimate(s, prefix, cost).ttft_s)
        return [[by_id[best.replica]], [by_id[s.replica] for s in rest]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        rid = pending_request.metadata.internal_request_id
        req = _request(pending_request)
        new, cached = self._planned.pop(rid, (len(req.prompt_ids) if req is not None else 0, 0))
        self._inflight[rid] = (replica_id.unique_id, time.time(), new, cached)
        if len(self._inflight) > 4096:  # completions that never came (a dead replica): forget old ones
            now = time.time()
            self._inflight = {k: v for k, v in self._inflight.items() if now - v[1] < 60}

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._inflight.pop(internal_request_id, None)
        self._done_at[replica_id.unique_id] = time.time()


class RoundRobinRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._counter = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return [candidate_replicas]
        ordered = sorted((r for r, _ in _serving(candidate_replicas)), key=lambda r: r.replica_id.unique_id)
        i = next(self._counter) % len(ordered)
        return [[ordered[i]], ordered[i + 1 :] + ordered[:i]]  # ranks: this one, then the rest


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, affinity_tokens: int = AFFINITY_TOKENS, affinity_queue_ratio: float = QUEUE_RATIO,
                         affinity_queue_gap: int = 0, **kwargs) -> None:
        """AppArgs': ``affinity_tokens``, how many of a prompt's first tokens decide its replica;
        ``affinity_queue_ratio`` and ``affinity_queue_gap``, its bounded load
        (``cluster.prefix_affinity``)."""
        self.affinity_tokens = affinity_tokens
        self.queue_ratio, self.queue_gap = affinity_queue_ratio, affinity_queue_gap

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        req = _request(pending_request)
        if req is None or not candidate_replicas:
            return [candidate_replicas]
        pairs = _serving(candidate_replicas)
        serving = [r for r, _ in pairs]
        queued = [len(st.queued) + st.running for _, st in pairs]
        order = rank_by_prefix(req.prompt_ids, [r.replica_id.unique_id for r in serving], queued,
                               getattr(self, "affinity_tokens", AFFINITY_TOKENS), getattr(self, "queue_ratio", QUEUE_RATIO),
                               min_gap=getattr(self, "queue_gap", 0))
        return [[serving[order[0]]], [serving[i] for i in order[1:]]]
