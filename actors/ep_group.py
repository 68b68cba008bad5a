"""``EPGroup``: an attention replica's expert-parallel group (Ray owns the shards, gloo moves data).

Runs inside the replica's process. It loads the placement's slots onto the expert-shard actors,
forms the gloo group (the replica is rank 0), and hands the model a ``cluster.ep.EPExecutor``.

* Recovery: when a round fails (a shard died or hung), the executor calls ``recover``: wait until
  every shard actor answers again (Ray restarts a dead one), reload the current placement where it
  is missing, re-form the group on a fresh port, and resend the layer.
* Rebalance: plan from the executor's measured loads (``cluster.eplb``), load the new version on
  every shard while serving continues, switch the executor between two layers, then drop the old
  version. Routing never points at weights that are not in place.
"""

from __future__ import annotations

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
        self.stats = {"reforms": 0, "rebalances": 0, "moved_slots": 0}
        self._transport: GlooTransport | None = None
        self._rebalance_lock = threading.Lock()

    # -- setup ----------------------------------------------------------------------------
    def start(self, hidden_size: int) -> EPExecutor:
        uniform = torch.ones(len(self.moe_layers), self.num_experts, dtype=torch.float64)
        placement = plan(uniform, self.eplb)
        self._load_everywhere(placement, 0)
        self.hidden_size = hidden_size
        self._transport = self._form()
        self.executor = EPExecutor(placement, self.moe_layers, self._transport, recover=self._recover)
        return self.executor

    def _slot_map(self, placement: Placement, shard_idx: int) -> dict[int, list[int]]:
        per = placement.slots_per_shard
        rows = placement.phy2log[:, shard_idx * per : (shard_idx + 1) * per].tolist()
        return {layer: rows[i] for i, layer in enumerate(self.moe_layers)}

    def _load_everywhere(self, placement: Placement, version: int, timeout_s: float | None = None) -> None:
        refs = [s.load.remote(version, self._slot_map(placement, i), self.moe_layers) for i, s in enumerate(self.shards)]
        ray.get(refs, timeout=timeout_s)

    def _form(self) -> GlooTransport:
        world = len(self.shards) + 1
        port, group_id = _free_port(), uuid.uuid4().hex[:8]
        for rank, shard in enumerate(self.shards, start=1):
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
            self._load_everywhere(placement, version, timeout_s)  # serving continues meanwhile
            ex.switch_placement(placement, version)
            deadline = time.monotonic() + timeout_s
            while ex.version != version and time.monotonic() < deadline:
                time.sleep(0.01)
            if ex.version == version:
                ray.get([s.drop_except.remote([version]) for s in self.shards], timeout=timeout_s)
            self.stats["rebalances"] += 1
            self.stats["moved_slots"] += moved
            return {"moved_slots": moved, "version": version}

    def close(self) -> None:
        if self._transport is not None:
            self._transport.stop()
            self._transport = None
