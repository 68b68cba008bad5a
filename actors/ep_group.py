"""``EPGroup``: an attention replica's expert-parallel group (Ray owns the shards, gloo moves data).

Runs inside the replica's process. It loads the placement's slots onto the expert-shard actors,
forms the gloo group (the replica is rank 0), and hands the model a ``cluster.ep.EPExecutor``.

* Recovery: when a round fails (a shard died or hung), the executor calls ``recover``: wait until
  every shard actor answers again (Ray restarts a dead one), reload the current placement where it
  is missing, re-form the group on a fresh port, and resend the layer.
* Rebalance: plan from the executor's measured loads (``cluster.eplb``), load the new version on
  every shard while serving continues (an expert a shard lacks is copied from a shard that holds
  it, through the object store), switch the executor between two rounds, then drop the old
  version. Routing never points at weights that are not in place.
* Resize (scale-down / scale-up): the same, onto a new list of shards with a new gloo group; the
  executor switches placement and group together, then the old group is stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
import uuid

import ray
import torch

from cluster.ep import EPExecutor, EPTransportError
from cluster.ep_gloo import GlooTransport, form_group
from cluster.eplb import EplbConfig, Placement, moved_slots, plan

__all__ = ["EPGroup", "expert_shard_actor"]

log = logging.getLogger(__name__)


def expert_shard_actor(**options):
    """The ``ray.remote`` shell of ``ExpertShard`` (restarted when it dies)."""
    from actors.expert_shard import ExpertShard

    return ray.remote(max_restarts=-1, max_task_retries=-1, **options)(ExpertShard)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class EPGroup:
    def __init__(
        self,
        shards: list,
        moe_layers: list[int],
        num_experts: int,
        eplb: EplbConfig,
        dtype: torch.dtype,
        timeout_s: float = 30.0,
        recover_deadline_s: float = 180.0,
    ) -> None:
        if eplb.num_shards != len(shards):
            raise ValueError(f"EPLB plans {eplb.num_shards} shards but {len(shards)} shard actors were given")
        self.shards = shards
        self.moe_layers = moe_layers
        self.num_experts = num_experts
        self.eplb = eplb
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.recover_deadline_s = recover_deadline_s
        self.host = ray.util.get_node_ip_address()
        self.executor: EPExecutor | None = None
        self.stats = {"reforms": 0, "rebalances": 0, "resizes": 0, "moved_slots": 0,
                      "experts_from_peers": 0, "experts_from_checkpoint": 0}
        self._transport: GlooTransport | None = None
        self._rebalance_lock = threading.Lock()

    # -- setup ----------------------------------------------------------------------------
    def start(self) -> EPExecutor:
        uniform = torch.ones(len(self.moe_layers), self.num_experts, dtype=torch.float64)
        placement = plan(uniform, self.eplb)
        self._load_everywhere(placement, 0)
        self._transport = self._form()
        self.executor = EPExecutor(placement, self.moe_layers, self._transport, recover=self._recover)
        return self.executor

    def _slot_map(self, placement: Placement, shard_idx: int) -> dict[int, list[int]]:
        per = placement.slots_per_shard
        rows = placement.phy2log[:, shard_idx * per : (shard_idx + 1) * per].tolist()
        return {layer: rows[i] for i, layer in enumerate(self.moe_layers)}

    def _load_everywhere(
        self, placement: Placement, version: int, timeout_s: float | None = None,
        shards: list | None = None, from_peers: bool = False,
    ) -> None:
        shards = self.shards if shards is None else shards
        refs = []
        for i, shard in enumerate(shards):
            slot_map = self._slot_map(placement, i)
            peers = self._peer_refs(slot_map, shard) if from_peers else None
            refs.append(shard.load.remote(version, slot_map, self.moe_layers, peers))
        for counts in ray.get(refs, timeout=timeout_s):
            self.stats["experts_from_peers"] += counts["peer"]
            self.stats["experts_from_checkpoint"] += counts["checkpoint"]

    def _peer_refs(self, slot_map: dict[int, list[int]], dst) -> dict[int, list]:
        """For each layer, ``export`` calls on the current shards that hold the experts ``dst``
        lacks (object refs; ``dst`` fetches them)."""
        cur = self.executor.placement
        per = cur.slots_per_shard
        ids = [s._actor_id for s in self.shards]
        dst_idx = ids.index(dst._actor_id) if dst._actor_id in ids else None
        out: dict[int, list] = {}
        for layer, experts in slot_map.items():
            row = self.moe_layers.index(layer)
            have = set(cur.phy2log[row, dst_idx * per : (dst_idx + 1) * per].tolist()) if dst_idx is not None else set()
            by_src: dict[int, list[int]] = {}
            for e in sorted(set(experts) - have):
                by_src.setdefault(int(cur.log2phy[row, e, 0]) // per, []).append(e)
            out[layer] = [self.shards[src].export.remote(layer, es) for src, es in by_src.items()]
        return out

    def _form(self, shards: list | None = None) -> GlooTransport:
        shards = self.shards if shards is None else shards
        world = len(shards) + 1
        port, group_id = _free_port(), uuid.uuid4().hex[:8]
        for rank, shard in enumerate(shards, start=1):
            shard.join.remote(group_id, self.host, port, rank, world, self.timeout_s)
        pg = form_group(self.host, port, 0, world, self.timeout_s)
        return GlooTransport(pg, world, self.dtype)

    # -- failures ---------------------------------------------------------------------------
    def _recover(self, error: BaseException) -> GlooTransport:
        """Called by the executor (engine thread) when a round fails; returns a new transport."""
        log.warning("expert-parallel round failed (%s); re-forming the group", error)
        self._transport = None  # drop our side of the broken group
        assert self.executor is not None
        deadline = time.monotonic() + self.recover_deadline_s
        while True:
            try:
                self._load_everywhere(self.executor.placement, self.executor.version, timeout_s=30)
                transport = self._form()
                break
            except (ray.exceptions.RayError, RuntimeError) as e:
                if time.monotonic() > deadline:
                    raise EPTransportError(f"expert shards did not recover within {self.recover_deadline_s}s: {e}") from e
                log.info("waiting for expert shards to come back: %s", e)
                time.sleep(1.0)
        self.stats["reforms"] += 1
        self._transport = transport
        return transport

    # -- rebalancing -----------------------------------------------------------------------
    def rebalance(self, placement: Placement | None = None, timeout_s: float = 120.0) -> dict:
        """Move to ``placement`` (default: an EPLB plan of the measured loads). Safe to call from
        any thread while the engine serves; returns what moved."""
        assert self.executor is not None, "start() first"
        with self._rebalance_lock:
            ex = self.executor
            old, old_version = ex.placement, ex.version
            if placement is None:
                load = ex.load.clone()
                if float(load.sum()) == 0.0:
                    return {"moved_slots": 0, "version": old_version, "reason": "no load measured yet"}
                placement = plan(load, self.eplb, previous=old)
            placement.check_integrity()
            moved = moved_slots(old, placement)
            if moved == 0:
                return {"moved_slots": 0, "version": old_version}
            version = old_version + 1
            self._load_everywhere(placement, version, timeout_s, from_peers=True)  # serving continues
            ex.switch_placement(placement, version)
            if self._wait_switched(version, timeout_s):
                ray.get([s.drop_except.remote([version]) for s in self.shards], timeout=timeout_s)
            self.stats["rebalances"] += 1
            self.stats["moved_slots"] += moved
            return {"moved_slots": moved, "version": version}

    def resize(self, shards: list, num_nodes: int, timeout_s: float = 300.0) -> dict:
        """Serve from ``shards`` (spread over ``num_nodes`` nodes) instead: EPLB re-plans onto
        them (each shard keeps at least its slot count), weights move, and the group is re-formed.
        Shards left out stop serving this replica and drop their weights."""
        assert self.executor is not None, "start() first"
        if not shards:
            raise ValueError("resize needs at least one expert shard")
        with self._rebalance_lock:
            ex = self.executor
            per = max(self.eplb.slots_per_shard, -(-self.num_experts // len(shards)))
            eplb = dataclasses.replace(self.eplb, num_slots=per * len(shards), num_nodes=num_nodes,
                                       num_shards=len(shards))
            load = ex.load.clone()
            if float(load.sum()) == 0.0:
                load = torch.ones_like(load)
            placement = plan(load, eplb)
            version = ex.version + 1
            self._load_everywhere(placement, version, timeout_s, shards=shards, from_peers=True)
            transport = self._form(shards)
            old_transport, old_shards = self._transport, self.shards
            ex.switch_placement(placement, version, transport)
            if not self._wait_switched(version, timeout_s):
                raise TimeoutError(f"the executor did not switch to placement version {version} in {timeout_s}s")
            self.shards, self.eplb, self._transport = shards, eplb, transport
            if old_transport is not None:
                old_transport.stop()
            kept = {s._actor_id for s in shards}
            ray.get([s.drop_except.remote([version] if s._actor_id in kept else []) for s in old_shards + shards],
                    timeout=timeout_s)
            self.stats["resizes"] += 1
            return {"shards": len(shards), "slots": eplb.num_slots, "version": version}

    def _wait_switched(self, version: int, timeout_s: float) -> bool:
        """The executor takes a new placement when no round is in flight (at once when idle)."""
        deadline = time.monotonic() + timeout_s
        while self.executor.version != version and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.executor.version == version
