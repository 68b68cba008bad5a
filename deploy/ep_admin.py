"""Names and lookup of the expert-parallel app's control actor (``actors.ep_control.EPControl``),
for the app builder and the admin commands (no torch here: ``tide status`` imports this)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

__all__ = ["EP_CONTROL_PREFIX", "ep_control_name", "find_ep_control", "find_ep_control_info"]

EP_CONTROL_PREFIX = "tideserve-ep-control-"  # detached, in the "tideserve" namespace


def ep_control_name(checkpoint: str) -> str:
    """The ``EPControl`` of the app serving ``checkpoint`` (one per checkpoint: while a redeploy
    rolls the replicas over to a new one, both controls place experts on the same shards)."""
    return EP_CONTROL_PREFIX + hashlib.sha256(os.path.abspath(checkpoint).encode()).hexdigest()[:12]


def find_ep_control(timeout_s: float = 30.0):
    """The running app's control (the one most replicas follow, during a roll-over), or None
    when the app does not use expert shards. Needs a connected Ray driver."""
    found = find_ep_control_info(timeout_s)
    return found[0] if found is not None else None


def find_ep_control_info(timeout_s: float = 30.0) -> tuple[Any, dict] | None:
    """``find_ep_control``'s control with the ``info`` it was chosen by, or None."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "tideserve" and a["name"].startswith(EP_CONTROL_PREFIX)]
    best = None
    for name in names:
        try:
            control = ray.get_actor(name, namespace="tideserve")
            info = ray.get(control.info.remote(), timeout=timeout_s)
        except (ValueError, ray.exceptions.RayError):  # gone meanwhile
            continue
        if best is None or len(info["replicas"]) > len(best[1]["replicas"]):
            best = (control, info)
    return best


def placement_imbalance(info: dict, load) -> float | None:
    """Max over mean shard load of the control's placement (``info``) on the load its replicas
    measured (``EPControl.load``: [layers, experts]); None before any load was measured."""
    import torch

    from cluster.eplb import Placement, imbalance

    if info.get("version") is None or float(load.sum()) <= 0:
        return None
    phy2log = torch.tensor(info["phy2log"])
    return round(imbalance(Placement.from_phy2log(phy2log, load.shape[1], info["num_shards"]), load), 4)
