"""``tide scale`` in Kubernetes mode: resize the lendable worker group of a KubeRay RayService.

KubeRay issue 2331: changing a worker group's replicas in a RayService spec does not reach the
RayCluster that is already running, so both are patched: the RayService (what survives a
re-deploy) and the live RayCluster named in ``status.activeServiceStatus.rayClusterName``.

``api`` is the official client's ``kubernetes.client.CustomObjectsApi`` (or anything with its
``get_namespaced_custom_object`` / ``patch_namespaced_custom_object``; the tests use an in-memory
object store). Patches are JSON merge patches of the whole ``workerGroupSpecs`` list, which
merge patch replaces as a unit.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["K8sScaleError", "scale_worker_group"]

GROUP, VERSION = "ray.io", "v1"


class K8sScaleError(RuntimeError):
    """The RayService or its cluster is missing or does not have the worker group."""


def _with_replicas(groups: list[dict], name: str, replicas: int) -> list[dict]:
    out = copy.deepcopy(groups)
    for g in out:
        if g.get("groupName") == name:
            if replicas > g.get("maxReplicas", replicas):
                raise K8sScaleError(f"worker group {name!r} allows at most {g['maxReplicas']} replicas, asked {replicas}")
            g["replicas"] = replicas
            g["minReplicas"] = min(g.get("minReplicas", 0), replicas)
            return out
    raise K8sScaleError(f"no worker group {name!r}; groups: {[g.get('groupName') for g in groups]}")


def scale_worker_group(
    api: Any, namespace: str, rayservice: str, group: str, replicas: int, dry_run: bool = False
) -> dict:
    """Set ``group``'s replicas in the RayService and its live RayCluster. Returns what changed."""
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    try:
        svc = api.get_namespaced_custom_object(GROUP, VERSION, namespace, "rayservices", rayservice)
    except Exception as e:  # the client raises ApiException; the message says 404 / 403
        raise K8sScaleError(f"cannot read RayService {namespace}/{rayservice}: {e}") from e
    groups = svc["spec"]["rayClusterConfig"].get("workerGroupSpecs", [])
    before = next((g.get("replicas") for g in groups if g.get("groupName") == group), None)
    new_groups = _with_replicas(groups, group, replicas)
    cluster = (svc.get("status") or {}).get("activeServiceStatus", {}).get("rayClusterName")
    result = {"rayservice": rayservice, "group": group, "replicas_before": before, "replicas": replicas,
              "raycluster": cluster, "dry_run": dry_run}
    if dry_run:
        return result
    api.patch_namespaced_custom_object(GROUP, VERSION, namespace, "rayservices", rayservice,
                                       {"spec": {"rayClusterConfig": {"workerGroupSpecs": new_groups}}})
    if cluster:
        live = api.get_namespaced_custom_object(GROUP, VERSION, namespace, "rayclusters", cluster)
        api.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "rayclusters", cluster,
            {"spec": {"workerGroupSpecs": _with_replicas(live["spec"].get("workerGroupSpecs", []), group, replicas)}},
        )
    return result
