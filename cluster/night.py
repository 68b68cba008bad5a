"""A night's plan, pure: which serving nodes to lend and what serves after (``plan_night``), and
the drain of the leaving replicas on an injected clock (``Drain``). ``deploy.tidal`` reads the
cluster into a ``Fleet``, carries the plan out and polls the drain."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from cluster.scaling import NodeLoad, nodes_to_free

__all__ = ["Drain", "Fleet", "NightPlan", "ReplicaReport", "plan_night", "shard_only_nodes", "unique_units"]


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """A serving replica as its last heartbeat reported it."""

    deployment: str  # "LLMServer", or "LLMDecode" (P/D's decode pool)
    node: str
    running: int = 0


@dataclass(frozen=True)
class Fleet:
    """The cluster as the night found it. ``roles``: node -> serving, draining, lent (a node
    missing is serving); ``replicas``: actor name -> its report; ``targets``: Serve's target
    replica count per deployment (missing: the reports' count); ``ingress``: the nodes that must
    stay (a night that deletes its nodes must not take the ingress's)."""

    head: str | None
    roles: Mapping[str, str]
    replicas: Mapping[str, ReplicaReport]
    deployments: Sequence[str] = ("LLMServer",)
    targets: Mapping[str, int] = field(default_factory=dict)
    ingress: frozenset[str] = frozenset()

    def on_node(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, r in self.replicas.items():
            out.setdefault(r.node, []).append(name)
        return out

    def serving(self) -> list[str]:
        """The nodes with a replica whose role is serving."""
        return [node for node in self.on_node() if self.roles.get(node, "serving") == "serving"]

    def pools(self) -> dict[str, int]:
        """Each deployment's size: Serve's target (a replica being replaced counts), else the reports'."""
        return {d: self.targets.get(d, sum(1 for r in self.replicas.values() if r.deployment == d))
                for d in self.deployments}


@dataclass(frozen=True)
class NightPlan:
    lend: list[str]  # the nodes to lend
    leaving: list[str]  # the replicas (actor names) on them
    target: dict[str, int]  # replicas per deployment after the night
    nodes: int  # nodes serving or lent before the night


def shard_only_nodes(fleet: Fleet, shard_nodes: Sequence[str], among: Sequence[str] | None) -> list[str]:
    """Serving nodes that host expert shards and no replica (an expert-parallel app lends those first)."""
    on_node = fleet.on_node()
    return sorted({w for w in shard_nodes if w not in on_node and w not in fleet.ingress
                   and fleet.roles.get(w, "serving") == "serving" and (among is None or w in among)})


def unique_units(directory, nodes: Sequence[str]) -> dict[str, int]:
    """Units each of ``nodes`` holds and no other live node does (``directory``: the cache
    directory's client; its errors are the caller's). Reads those nodes' units and their
    holders, not the fleet's."""
    out = {}
    for n in nodes:
        keys = list(directory.node_keys(n))
        out[n] = sum(1 for held in directory.holders(keys) if [h.node_id for h in held] == [n])
    return out


def plan_night(fleet: Fleet, n: int, unique_units: Callable[[list[str]], Mapping[str, int]],
               among: Sequence[str] | None = None) -> NightPlan:
    """Lend ``n`` serving nodes (of ``among``): never the ingress's, never one that hosts every
    replica of a pool; of the rest, fewest running requests and least unique cache first
    (``cluster.scaling.nodes_to_free``; ``unique_units(nodes)``: units held by each and no other)."""
    serving = fleet.serving()
    if n < 1 or n >= len(serving):
        raise ValueError(f"cannot lend {n} of {len(serving)} serving nodes (at least one keeps serving)")
    candidates = [x for x in serving if _lendable(fleet, x, among)]
    unique = unique_units(candidates)
    loads = [NodeLoad(x, _running(fleet, x), unique.get(x, 0), x == fleet.head) for x in candidates]
    lend = nodes_to_free(loads, min(n, len(loads)))
    if len(lend) < n or not _keeps_pools(fleet, lend):
        stay = "s stay" if len(fleet.ingress) > 1 else " stays"
        raise ValueError(f"cannot lend {n} nodes: each pool ({', '.join(fleet.deployments)}) must keep a replica "
                         f"on a serving node, and the ingress's node{stay}")
    leaving = [a for x in lend for a in fleet.on_node()[x]]
    lent_before = sum(1 for r in fleet.roles.values() if r == "lent")
    return NightPlan(lend, leaving, _left(fleet, leaving), len(serving) + lent_before)


def _lendable(fleet: Fleet, node: str, among: Sequence[str] | None) -> bool:
    return (among is None or node in among) and node not in fleet.ingress and _keeps_pools(fleet, [node])


def _left(fleet: Fleet, leaving: Sequence[str]) -> dict[str, int]:
    """Each pool's replicas once ``leaving`` are gone."""
    gone = [fleet.replicas[a].deployment for a in leaving]
    return {d: size - gone.count(d) for d, size in fleet.pools().items()}


def _keeps_pools(fleet: Fleet, nodes: Sequence[str]) -> bool:
    """Whether every pool keeps a replica once ``nodes`` are lent."""
    on_node = fleet.on_node()
    return min(_left(fleet, [a for x in nodes for a in on_node[x]]).values()) >= 1


def _running(fleet: Fleet, node: str) -> int:
    return sum(fleet.replicas[a].running for a in fleet.on_node()[node])


class Drain:
    """The leaving replicas' drain: their requests finish until ``deadline_s``; then they hand
    the rest back (``migrate``) and must be empty within ``grace_s``. ``state(reports)`` with
    the replicas' latest heartbeats (actor name -> {time, draining, running}): a replica that
    stopped reporting is gone, with nothing to finish."""

    def __init__(self, leaving: Sequence[str], deadline_s: float, grace_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.leaving, self.deadline_s, self.grace_s, self.clock = list(leaving), deadline_s, grace_s, clock
        self.started = clock()

    def drained(self, reports: Mapping[str, Mapping]) -> bool:
        return all(a not in reports or (reports[a]["time"] > self.started + 1.0 and reports[a].get("draining")
                                        and reports[a].get("running", 0) == 0) for a in self.leaving)

    def state(self, reports: Mapping[str, Mapping]) -> Literal["drained", "draining", "migrate", "stuck"]:
        if self.drained(reports):
            return "drained"
        waited = self.clock() - self.started
        if waited < self.deadline_s:
            return "draining"
        return "migrate" if waited < self.deadline_s + self.grace_s else "stuck"
