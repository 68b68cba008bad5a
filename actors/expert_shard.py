"""``ExpertShard``: the routed-expert weights of one shard's slots, serving EP groups.

A plain class; ``actors.ep_group.expert_shard_actor`` wraps it with ``ray.remote`` (restarted by
Ray when it dies; the app's ``EPControl`` then reloads its slots and every replica re-forms its
group). It holds weights per placement version (``cluster.ep.ShardExperts``), loads a new version
beside the serving ones, and runs one serve thread per attention replica's group
(``cluster.ep_comm``). Each version records its owner (the ``EPControl`` that placed it) and its
checkpoint: while a redeploy rolls replicas over to a new checkpoint, two controls place versions
on the same shards, and weights are shared only between versions of the same checkpoint.
With ``device="cuda"`` the weights live on the actor's GPU and the experts run there (the Triton
grouped GEMM); over an NCCL group rows arrive and leave on that GPU (over gloo, through host
memory), and weights travel between shards (``export``) as host tensors.
"""

from __future__ import annotations

import logging
import os
import threading

import ray

from cluster.ep import ShardExperts, Wire
from cluster.ep_comm import form_group, group_device, serve_shard
from model.checkpoint import DTYPES, load_expert_slots
from model.config import load_config
from model.moe import ExpertWeights
from model.weights_id import keeps_fp8

__all__ = ["ExpertShard"]

log = logging.getLogger(__name__)

# A shard waits in a collective between requests; only a replica gone quiet this long (not dead:
# a dead one closes the connection) makes it leave the group.
IDLE_TIMEOUT_S = 7 * 24 * 3600.0


class ExpertShard:
    def __init__(self, dtype: str = "float32", device: str = "cpu") -> None:
        self.dtype = dtype
        self.experts = ShardExperts(device)
        self.device = self.experts.device
        self.slot_maps: dict[int, dict[int, list[int]]] = {}  # version -> model layer -> experts
        self.meta: dict[int, tuple[str, str, list[int]]] = {}  # version -> owner, checkpoint, MoE layers
        self.groups: dict[str, threading.Thread] = {}
        self.ended: dict[str, str] = {}

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "pid": os.getpid(), "versions": self.experts.versions(),
                "owners": sorted({o for o, _, _ in self.meta.values()}), "device": str(self.device)}

    def load(
        self, version: int, slot_map: dict[int, list[int]], moe_layers: list[int], checkpoint: str,
        owner: str = "", peers: dict | None = None,
    ) -> dict:
        """Hold ``version`` (placed by ``owner``): for each model layer, the experts of this
        shard's slots, in slot order. Each expert's weights come from this shard's own held
        versions of ``checkpoint``, else from ``peers`` (model layer -> object refs of other
        shards' ``export``), else the checkpoint. Returns how many experts came from where."""
        if self.slot_maps.get(version) == slot_map and self.meta[version][:2] == (owner, checkpoint):
            return {"local": 0, "peer": 0, "checkpoint": 0}
        moe_layers = list(moe_layers)
        fetched: dict[tuple[int, int], tuple] = {}
        for layer, refs in (peers or {}).items():
            for part in ray.get(list(refs)):
                fetched.update({(layer, e): w for e, w in part.items()})
        counts = {"local": 0, "peer": 0, "checkpoint": 0}
        tensors: dict[tuple[int, int], tuple] = {}
        missing: dict[int, list[int]] = {}
        same: dict[int, ExpertWeights] = {}  # layers whose slots are unchanged: share the tensors
        for layer, experts in slot_map.items():
            held = next((v for v, m in self.slot_maps.items()
                         if m.get(layer) == experts and self.meta[v][1] == checkpoint), None)
            if held is not None:
                same[layer] = self.experts.layer(held, self.meta[held][2].index(layer))
                counts["local"] += len(experts)
                continue
            for e in experts:
                held = self._held(layer, e, checkpoint)
                if held is not None:
                    tensors[(layer, e)], counts["local"] = held, counts["local"] + 1
                elif (layer, e) in fetched:
                    tensors[(layer, e)], counts["peer"] = fetched[(layer, e)], counts["peer"] + 1
                else:
                    missing.setdefault(layer, []).append(e)
        loaded = load_expert_slots(checkpoint, missing, self.dtype, keeps_fp8(checkpoint, self.device)) if missing else {}
        for layer, stacked in loaded.items():
            for i, e in enumerate(missing[layer]):
                tensors[(layer, e)] = (stacked.gate_up[i], stacked.down[i])
                counts["checkpoint"] += 1
        dev = self.device
        limit = getattr(load_config(checkpoint), "swiglu_limit", None)  # V4's clipped SwiGLU
        weights = {
            moe_layers.index(layer): same.get(layer) or ExpertWeights.stack(
                [tensors[(layer, e)][0].to(dev) for e in experts], [tensors[(layer, e)][1].to(dev) for e in experts],
                limit)
            for layer, experts in slot_map.items()
        }
        self.experts.put(version, weights)
        self.slot_maps[version] = dict(slot_map)
        self.meta[version] = (owner, checkpoint, moe_layers)
        return counts

    def _held(self, layer: int, expert: int, checkpoint: str) -> tuple | None:
        """(gate_up, down) of ``expert`` at model layer ``layer`` from any version of
        ``checkpoint`` held here."""
        for version, layers in self.slot_maps.items():
            experts = layers.get(layer, [])
            _, ckpt, moe_layers = self.meta[version]
            if ckpt == checkpoint and expert in experts:
                w = self.experts.layer(version, moe_layers.index(layer))
                i = experts.index(expert)
                return w.gate_up[i], w.down[i]
        return None

    def export(self, layer: int, experts: list[int], checkpoint: str) -> dict[int, tuple]:
        """Weights of those ``experts`` of model layer ``layer`` of ``checkpoint`` that this shard
        holds (for a peer loading a new placement; travels through the object store)."""
        out = {}
        for e in experts:
            held = self._held(layer, e, checkpoint)
            if held is not None:
                out[e] = (held[0].to("cpu", copy=True), held[1].to("cpu", copy=True))
        return out

    def drop_except(self, keep: list[int], owner: str | None = None) -> None:
        """Drop the versions of ``owner`` (None: of every owner) not in ``keep``."""
        drop = {v for v, (o, _, _) in self.meta.items() if v not in keep and (owner is None or o == owner)}
        self.experts.drop_except(set(self.slot_maps) - drop)
        self.slot_maps = {v: m for v, m in self.slot_maps.items() if v not in drop}
        self.meta = {v: m for v, m in self.meta.items() if v not in drop}

    def join(
        self, group_id: str, host: str, port: int, rank: int, world: int, timeout_s: float, hidden: int,
        key: bytes | None = None, wire: Wire = Wire(), backend: str = "gloo",
    ) -> None:
        """Serve group ``group_id`` as ``rank`` for rows of ``hidden`` features (returns at once;
        the serve thread forms the group); ``key``: the group's membership key; ``wire``: how
        its rows travel; ``backend``: the group's, as the replica chose it (gloo | nccl)."""
        torch_dtype = DTYPES[self.dtype]

        def run() -> None:
            try:
                device = group_device(backend, self.device)
                pg = form_group(host, port, rank, world, timeout_s, op_timeout_s=IDLE_TIMEOUT_S,
                                bind=ray.util.get_node_ip_address(), key=key, group_id=group_id, backend=backend,
                                device=device)
            except Exception as e:  # noqa: BLE001 - the replica times out and re-forms
                self.ended[group_id] = f"join failed: {e}"
                return
            self.ended[group_id] = serve_shard(pg, rank, world, hidden, torch_dtype, self.experts.compute, wire,
                                               device)
            del pg  # closing our side lets the other ranks fail fast

        thread = threading.Thread(target=run, name=f"ep-{group_id}", daemon=True)
        self.groups[group_id] = thread
        thread.start()

    def stats(self) -> dict:
        return {
            **self.info(),
            "groups": {g: ("serving" if t.is_alive() else self.ended.get(g, "ended")) for g, t in self.groups.items()},
        }
