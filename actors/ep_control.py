"""``EPControl``: the one expert placement that every attention replica of an app follows.

DeepSeek's shape: many data-parallel attention replicas send their MoE rows to the same expert
shards. A placement (which expert sits in which shard slot, ``cluster.eplb``) is therefore the
app's, not a replica's: the control plans it from the load that all replicas measured, loads it
onto the shards as a new *version* beside the serving one, and every replica switches to it
between two of its rounds. A version is dropped from the shards only when no live replica still
serves it, so a replica never routes to weights that are gone.

The replicas' side is ``actors.ep_group.EPGroup``: it joins, polls now and then (reporting the
version it serves and its measured load, learning the version to serve), re-forms its gloo group
when the shard set changes, and asks for its version to be reloaded when a shard restarted. Who
serves which version, and which versions must stay, is ``cluster.ep_versions``' pure state; this
actor adds the shards and the locking.

* Rebalance: plan from the summed loads (or take a given ``phy2log``), load, switch, drop.
* Resize (night: lend a node that hosts only a shard; day: take it back): the same onto a new list
  of shards; replicas form new groups with them.
* Versions are unique across controls (a redeploy with a new checkpoint runs a second control
  beside the first while Serve rolls the replicas over; each drops only its own versions).
* A control that restarted has no state: the first replica that re-joins brings its placement.

``ep_control_actor`` is the ``ray.remote`` shell (threaded: a rebalance waits for the replicas'
polls).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import ray
import torch

from cluster.ep_versions import PlacementVersions, Poll
from cluster.eplb import EplbConfig, Placement, moved_slots, plan
from model.config import load_config

__all__ = ["EPControl", "ep_control_actor", "slot_map"]

log = logging.getLogger(__name__)


def ep_control_actor(**options):
    """The ``ray.remote`` shell of ``EPControl`` (restarted when it dies; the replicas re-join)."""
    return ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=16, **options)(EPControl)


def slot_map(placement: Placement, moe_layers: list[int], shard_idx: int) -> dict[int, list[int]]:
    """Model layer -> the experts in shard ``shard_idx``'s slots, in slot order."""
    per = placement.slots_per_shard
    rows = placement.phy2log[:, shard_idx * per : (shard_idx + 1) * per].tolist()
    return {layer: rows[i] for i, layer in enumerate(moe_layers)}


def _ids(shards: list) -> list:
    return [s._actor_id for s in shards]


class EPControl:
    def __init__(
        self,
        checkpoint: str,
        shards: list,
        num_slots: int,
        num_nodes: int = 1,
        policy: str = "auto",
        rebalance_s: float = 0.0,
        replica_timeout_s: float = 30.0,
        name: str = "",
        draft_layers: int = 0,
    ) -> None:
        """``rebalance_s``: re-plan from the measured loads this often (0: only when asked);
        ``replica_timeout_s``: a replica that has not polled for this long is gone (its version
        may be dropped); ``draft_layers``: the checkpoint's MTP layers the replicas draft with,
        whose experts the shards hold too."""
        cfg = load_config(checkpoint)
        self.checkpoint = checkpoint
        self.name = name or f"ep-control-{id(self):x}"
        self.moe_layers = [i for i in range(cfg.num_hidden_layers + draft_layers) if cfg.is_moe_layer(i)]
        self.num_experts = cfg.n_routed_experts
        self.eplb = EplbConfig(num_slots, cfg.n_group, num_nodes, len(shards), policy)
        self.shards = list(shards)
        self.replica_timeout_s = replica_timeout_s
        self.versions = PlacementVersions(replica_timeout_s)
        self._lock = threading.Lock()  # the state above
        self._change = threading.Lock()  # one placement change at a time
        self.stats = {"rebalances": 0, "resizes": 0, "moved_slots": 0, "experts_from_peers": 0,
                      "experts_from_checkpoint": 0, "reloads": 0}
        if rebalance_s > 0:
            threading.Thread(target=self._rebalance_loop, args=(rebalance_s,), name="eplb", daemon=True).start()
        threading.Thread(target=self._janitor, name="ep-janitor", daemon=True).start()

    @property
    def version(self) -> int | None:
        """The placement version the replicas serve (or switch to); None before the first."""
        return self.versions.current

    # -- the replicas' side --------------------------------------------------------------------
    def join(self, replica_id: str, serving: tuple[int, Placement, list] | None = None) -> dict:
        """Register a replica; returns the placement to serve (``target``). ``serving``: the
        (version, placement, shards) a replica already serves, when it re-joins a control that
        restarted (the first such replica's placement becomes the control's)."""
        while True:
            if self.version is None:  # (a replica joining during a placement change does not wait for it)
                with self._change:
                    if self.version is None and serving is not None:
                        self._adopt(*serving)
                        log.info("took placement version %d from replica %s", serving[0], replica_id)
                    elif self.version is None:
                        self._first_placement()
            with self._lock:
                if self.version is None:  # the janitor forgot the placement meanwhile
                    continue
                self.versions.join(replica_id, serving[0] if serving else None)
                return self._target()

    def poll(self, replica_id: str, version: int, load: torch.Tensor | None = None) -> dict | None:
        """A replica reports the version it serves and its measured load [L, E]; returns the
        placement to switch to when it should, ``{"rejoin": True}`` when this control does not
        know it (it restarted), else None."""
        with self._lock:
            answer = self.versions.poll(replica_id, version, load)
            if answer == Poll.REJOIN:
                return {"rejoin": True}
            return self._target() if answer == Poll.SWITCH else None

    def leave(self, replica_id: str) -> None:
        with self._lock:
            self.versions.leave(replica_id)

    def ensure_loaded(self, version: int, timeout_s: float = 30.0) -> None:
        """Reload ``version`` where a shard lost it (Ray restarted the shard): called by a
        replica whose round failed, before it re-forms its group. Loads from the checkpoint."""
        with self._lock:
            if self.version is None:  # restarted: the replicas' polls bring the placement back
                raise RuntimeError("the expert-parallel control has no placement yet")
            v = self.versions.get(version)
        if v is None:
            raise ValueError(f"placement version {version} is no longer held; serve version {self.version}")
        self._load(v.placement, version, list(v.shards), timeout_s)
        self.stats["reloads"] += 1

    # -- placement changes ---------------------------------------------------------------------
    def rebalance(self, phy2log: list[list[int]] | None = None, timeout_s: float = 120.0) -> dict:
        """Move to an EPLB plan of the load every replica measured (or to ``phy2log``); weights
        move between shards while the replicas serve. Returns what moved."""
        with self._change:
            self._require_placement()
            old, version = self.versions.target.placement, self.version
            if phy2log is not None:
                placement = Placement.from_phy2log(torch.tensor(phy2log), self.num_experts, len(self.shards))
            else:
                load = self.load()
                if float(load.sum()) == 0.0:
                    return {"moved_slots": 0, "version": version, "reason": "no load measured yet"}
                placement = plan(load, self.eplb, previous=old)
            placement.check_integrity()
            moved = moved_slots(old, placement)
            if moved == 0:
                return {"moved_slots": 0, "version": version}
            out = self._switch(placement, self.shards, timeout_s)
            self.stats["rebalances"] += 1
            self.stats["moved_slots"] += moved
            return {"moved_slots": moved, **out}

    def resize(self, shards: list, num_nodes: int, timeout_s: float = 300.0) -> dict:
        """Serve from ``shards`` (spread over ``num_nodes`` nodes) instead: EPLB re-plans onto
        them (each keeps at least its slot count), weights move, every replica re-forms its group.
        Shards left out drop this control's weights once no replica uses them."""
        if not shards:
            raise ValueError("resize needs at least one expert shard")
        with self._change:
            self._require_placement()
            per = max(self.eplb.slots_per_shard, -(-self.num_experts // len(shards)))
            eplb = dataclasses.replace(self.eplb, num_slots=per * len(shards), num_nodes=num_nodes,
                                       num_shards=len(shards))
            load = self.load()
            placement = plan(load if float(load.sum()) > 0 else torch.ones_like(load), eplb)
            out = self._switch(placement, list(shards), timeout_s)
            self.eplb = eplb
            self.stats["resizes"] += 1
            if out["pending"]:
                raise TimeoutError(f"replicas {out['pending']} did not switch to placement version "
                                   f"{out['version']} in {timeout_s}s")
            return {"shards": len(shards), "slots": eplb.num_slots, "version": out["version"]}

    def load(self) -> torch.Tensor:
        """Tokens per expert [L, E] summed over the live replicas (each decays its own)."""
        with self._lock:
            return self.versions.load(len(self.moe_layers), self.num_experts)

    def info(self) -> dict:
        with self._lock:
            placement = self.versions.target.placement if self.version is not None else None
            return {
                **self.stats, "name": self.name, "version": self.version, "num_shards": len(self.shards),
                "phy2log": placement.phy2log.tolist() if placement is not None else None,
                "replicas": self.versions.live(), "held_versions": self.versions.held(),
            }

    # -- internals -----------------------------------------------------------------------------
    def _first_placement(self) -> None:
        uniform = torch.ones(len(self.moe_layers), self.num_experts, dtype=torch.float64)
        placement = plan(uniform, self.eplb)
        version = time.time_ns() // 1_000_000 << 16  # unique across controls and their restarts
        self._load(placement, version, self.shards, None)
        with self._lock:
            self.versions.add(version, placement, self.shards)

    def _adopt(self, version: int, placement: Placement, shards: list) -> None:
        """Serve what a re-joining replica serves (this control restarted and lost its state)."""
        n = len(shards)
        nodes = self.eplb.num_nodes if n % self.eplb.num_nodes == 0 else 1
        with self._lock:
            self.eplb = dataclasses.replace(self.eplb, num_slots=placement.phy2log.shape[1], num_shards=n,
                                            num_nodes=nodes)
            self.versions.add(version, placement, shards)
            self.shards = list(shards)

    def _require_placement(self) -> None:
        if self.version is None:
            raise ValueError("no replica has joined yet: there is no placement to change")

    def _target(self) -> dict:
        v = self.versions.target
        return {"version": self.version, "placement": v.placement, "shards": list(v.shards),
                "moe_layers": self.moe_layers}

    def _switch(self, placement: Placement, shards: list, timeout_s: float) -> dict:
        """Load ``placement`` on ``shards`` as the next version, make it the target, wait until
        every live replica serves it, then drop what nobody serves."""
        version = self.version + 1
        counts = self._load(placement, version, shards, timeout_s, from_peers=True)
        with self._lock:
            self.versions.add(version, placement, shards)
            self.shards = shards
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                pending = self.versions.pending(version)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        self._drop()
        return {"version": version, "pending": pending, **counts}

    def _load(self, placement: Placement, version: int, shards: list, timeout_s: float | None,
              from_peers: bool = False) -> dict:
        refs = []
        for i, shard in enumerate(shards):
            slots = slot_map(placement, self.moe_layers, i)
            peers = self._peer_refs(slots, shard) if from_peers else None
            refs.append(shard.load.remote(version, slots, self.moe_layers, self.checkpoint, self.name, peers))
        out = {"experts_from_peers": 0, "experts_from_checkpoint": 0}
        for counts in ray.get(refs, timeout=timeout_s):
            out["experts_from_peers"] += counts["peer"]
            out["experts_from_checkpoint"] += counts["checkpoint"]
        for k, n in out.items():
            self.stats[k] += n
        return out

    def _peer_refs(self, slots: dict[int, list[int]], dst) -> dict[int, list]:
        """For each layer, ``export`` calls on the current version's shards that hold the experts
        ``dst`` lacks (object refs; ``dst`` fetches them). Each call is submitted before ``dst``'s
        own load, so no two loads wait on each other."""
        cur = self.versions.target
        per = cur.placement.slots_per_shard
        ids = _ids(cur.shards)
        dst_idx = ids.index(dst._actor_id) if dst._actor_id in ids else None
        out: dict[int, list] = {}
        for layer, experts in slots.items():
            row = self.moe_layers.index(layer)
            have = (set(cur.placement.phy2log[row, dst_idx * per : (dst_idx + 1) * per].tolist())
                    if dst_idx is not None else set())
            by_src: dict[int, list[int]] = {}
            for e in sorted(set(experts) - have):
                by_src.setdefault(int(cur.placement.log2phy[row, e, 0]) // per, []).append(e)
            out[layer] = [cur.shards[src].export.remote(layer, es, self.checkpoint) for src, es in by_src.items()]
        return out

    def _drop(self) -> None:
        """Forget the versions no live replica serves, on every shard that holds them."""
        with self._lock:
            shards = {s._actor_id: s for v in self.versions.held() for s in self.versions.get(v).shards}
            _, unknown = self.versions.droppable()  # unknown: served, placed before a restart
            held = {sid: [v for v in self.versions.held() if sid in _ids(self.versions.get(v).shards)] + unknown
                    for sid in shards}
        for sid, shard in shards.items():
            try:
                ray.get(shard.drop_except.remote(held[sid], self.name), timeout=30)
            except ray.exceptions.RayError as e:  # a shard on a gone node: nothing to free there
                log.warning("could not drop old expert weights on a shard: %s", e)

    def _rebalance_loop(self, every_s: float) -> None:
        while True:
            time.sleep(every_s)
            try:
                if self.version is not None:
                    self.rebalance()
            except Exception:  # noqa: BLE001 - a failed rebalance keeps the current placement
                log.exception("periodic expert rebalance failed; keeping the current placement")

    def _janitor(self) -> None:
        """Free the shards of a control nobody follows any more (the app rolled over to another
        checkpoint, or was deleted): after ``2 * replica_timeout_s`` without a live replica, drop
        this control's weights everywhere and forget the placement (a later join starts afresh)."""
        while True:
            time.sleep(self.replica_timeout_s / 2)
            with self._lock:
                if self.versions.unfollowed_for() < self.replica_timeout_s:
                    continue
            with self._change, self._lock:
                if self.versions.live():
                    continue
                shards = {s._actor_id: s for v in self.versions.forget_all() for s in v.shards}
            log.info("no replica follows %s any more: dropping its expert weights", self.name)
            for shard in shards.values():
                try:
                    ray.get(shard.drop_except.remote([], self.name), timeout=30)
                except ray.exceptions.RayError as e:
                    log.warning("could not drop expert weights on a shard: %s", e)
