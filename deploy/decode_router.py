"""``DecodeRouter``: the Ray Serve request router of the decode pool (P/D disaggregation).

It applies the decode load balancer (``cluster/decode_lb.py``): every decode replica reports its
KV capacity through ``record_routing_stats``; a prefilled request reserves the KV it can grow to
(prompt + max_tokens, whole pages) on the replica it is sent to until it finishes, and goes to the
replica with the lowest KV occupancy after placing, then the fewest running requests. When no
replica has room the request waits in Serve's queue (the router asks again, backing off) instead
of overfilling a replica. A request no replica could ever hold goes to the replicas as usual, whose
engine refuses it with a clear error.

No ``FIFOMixin``: a replica found for one request must serve that request (Serve's default
exact matching), not the oldest one waiting, whose KV was not reserved there.

The reservations are this router's: one per handle, i.e. per ingress replica. With several
ingress replicas each reserves for its own requests (the engine still never overfills: it queues).
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.decode_lb import DecodeBalancer
from cluster.request import GenerationRequest
from cluster.routing_stats import RoutingStats

__all__ = ["DecodeRouter"]


class DecodeRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._balancer: DecodeBalancer | None = None
        self._planned: dict[str, tuple[str, int]] = {}  # request id -> (replica, KV tokens), before routing
        self._placed: dict[str, tuple[str, int]] = {}  # request id -> (replica, KV tokens)

    def _sync(self, replicas: list[RunningReplica]) -> DecodeBalancer | None:
        """Track the replicas that reported their KV capacity; forget the ones that are gone."""
        for r in replicas:
            st = RoutingStats.of(r.routing_stats)
            if not st.kv_tokens:
                continue
            if self._balancer is None:
                self._balancer = DecodeBalancer({}, st.page_size)
            if r.replica_id.unique_id not in self._balancer.replicas:
                self._balancer.add(r.replica_id.unique_id, st.kv_tokens)
        if self._balancer is not None:
            alive = {r.replica_id.unique_id for r in replicas}
            for rid in [rid for rid in self._balancer.replicas if rid not in alive]:
                self._balancer.remove(rid)
        return self._balancer

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        req = pending_request.args[0] if pending_request is not None and pending_request.args else None
        # replicas whose node is being lent to training get no new work (unless all are)
        serving = [r for r in candidate_replicas if not RoutingStats.of(r.routing_stats).draining]
        candidate_replicas = serving or candidate_replicas
        balancer = self._sync(candidate_replicas)
        if not isinstance(req, GenerationRequest) or balancer is None or not balancer.replicas:
            return [candidate_replicas]  # not a generate call, or no capacity reported yet
        need = len(req.prompt_ids) + req.max_tokens
        request_id = pending_request.metadata.internal_request_id
        self._unplan(request_id)  # asked again (the replicas it was offered were busy)
        ranked = balancer.rank(need)
        if not ranked:
            if not balancer.fits_anywhere(need):
                return [candidate_replicas]  # too big for any replica: its engine says so
            pending_request.routing_context.should_backoff = True  # wait for room (Serve retries)
            return [[]]
        # Reserve on the first choice now, so that requests routed meanwhile see it taken.
        balancer.reserve(ranked[0], need)
        self._planned[request_id] = (ranked[0], need)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rid]] for rid in ranked]

    def _unplan(self, request_id: str) -> None:
        planned = self._planned.pop(request_id, None)
        if planned is not None and self._balancer is not None:
            self._balancer.release(*planned)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        planned = self._planned.pop(request_id, None)
        if planned is None or self._balancer is None:
            return
        chosen, need = planned
        if replica_id.unique_id != chosen:  # Serve took a later choice (the first was full)
            self._balancer.release(chosen, need)
            if replica_id.unique_id not in self._balancer.replicas:
                return
            self._balancer.reserve(replica_id.unique_id, need)
        self._placed[request_id] = (replica_id.unique_id, need)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        placed = self._placed.pop(internal_request_id, None)
        if placed is not None and self._balancer is not None:
            self._balancer.release(*placed)

    def stats(self) -> dict:
        """KV tokens reserved and requests running per decode replica (for tests and debugging)."""
        if self._balancer is None:
            return {}
        return {rid: {"reserved_tokens": r.reserved_tokens, "running": r.running, "capacity_tokens": r.capacity_tokens}
                for rid, r in self._balancer.replicas.items()}
