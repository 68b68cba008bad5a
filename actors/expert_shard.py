"""``ExpertShard``: the routed-expert weights of one shard's slots, serving EP groups.

A plain class; ``actors.ep_group.expert_shard_actor`` wraps it with ``ray.remote`` (restarted by
Ray when it dies; the replica's ``EPGroup`` then reloads its slots and re-forms the group). It
holds weights per placement version (``cluster.ep.ShardExperts``), loads a new version beside the
serving one, and runs one serve thread per attention replica's group (``cluster.ep_gloo``).
"""

from __future__ import annotations

import logging
import os
import threading

import ray

from cluster.ep import ShardExperts
from cluster.ep_gloo import form_group, serve_shard
from model.checkpoint import DTYPES, load_expert_slots
from model.config import load_config

__all__ = ["ExpertShard"]

log = logging.getLogger(__name__)


class ExpertShard:
    def __init__(self, checkpoint: str, dtype: str = "float32") -> None:
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.hidden = load_config(checkpoint).hidden_size
        self.experts = ShardExperts()
        self.slot_maps: dict[int, dict[int, list[int]]] = {}  # version -> model layer -> experts
        self.groups: dict[str, threading.Thread] = {}
        self.ended: dict[str, str] = {}

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "pid": os.getpid(), "versions": self.experts.versions()}

    def load(self, version: int, slot_map: dict[int, list[int]], moe_layers: list[int]) -> int:
        """Hold ``version``: for each model layer, the experts of this shard's slots, in slot
        order. Layers whose slots match an already-held version reuse those tensors. Returns the
        number of layers read from the checkpoint."""
        if version in self.slot_maps:
            return 0
        reuse, fresh = {}, {}
        for layer, experts in slot_map.items():
            held = next((v for v, m in self.slot_maps.items() if m.get(layer) == experts), None)
            (reuse if held is not None else fresh)[layer] = held if held is not None else experts
        weights = load_expert_slots(self.checkpoint, fresh, self.dtype) if fresh else {}
        for layer, held in reuse.items():
            weights[layer] = self.experts.layer(held, moe_layers.index(layer))
        self.experts.put(version, {moe_layers.index(layer): w for layer, w in weights.items()})
        self.slot_maps[version] = dict(slot_map)
        return len(fresh)

    def drop_except(self, keep: list[int]) -> None:
        self.experts.drop_except(set(keep))
        self.slot_maps = {v: m for v, m in self.slot_maps.items() if v in keep}

    def join(self, group_id: str, host: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        """Serve group ``group_id`` as ``rank`` (returns at once; the serve thread forms the group)."""
        torch_dtype = DTYPES[self.dtype]

        def run() -> None:
            try:
                pg = form_group(host, port, rank, world, timeout_s)
            except Exception as e:  # noqa: BLE001 - the replica times out and re-forms
                self.ended[group_id] = f"join failed: {e}"
                return
            self.ended[group_id] = serve_shard(pg, rank, world, self.hidden, torch_dtype, self.experts.compute)
            del pg  # closing our side lets the other ranks fail fast

        thread = threading.Thread(target=run, name=f"ep-{group_id}", daemon=True)
        self.groups[group_id] = thread
        thread.start()

    def stats(self) -> dict:
        return {
            **self.info(),
            "groups": {g: ("serving" if t.is_alive() else self.ended.get(g, "ended")) for g, t in self.groups.items()},
        }
