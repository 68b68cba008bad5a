"""``tide scale`` in Kubernetes mode: the night and the morning of a KubeRay RayService.

Who owns what: worker counts belong to ``tide scale`` (the RayService turns the Ray autoscaler
off), Serve's replica counts to the RayService's ``serveConfigV2`` (KubeRay applies a change in
place), the training run to a RayJob created suspended.

Night (``night``)
  1. ``drain`` (the Ray side, ``deploy.tidal.lend_nodes`` run on the serving cluster) chooses
     ``n`` of the lendable group's pods, drains them (in-flight requests finish or move) and
     stops their replicas; it answers the pods it freed and the replica counts left serving.
  2. ``serveConfigV2`` gets those counts (the day's counts are kept in an annotation).
  3. The live RayCluster's group loses exactly those pods: ``replicas`` drops by their number
     and ``scaleStrategy.workersToDelete`` names them in the same patch (KubeRay deletes the
     named pods first; with the autoscaler off it would delete random ones otherwise). The
     RayService gets the same replicas: changing them there alone does not reach the running
     cluster (KubeRay issue 2331), but it is what a re-created cluster starts from.
  4. The training RayJob is unsuspended (re-created from its spec when last night's run ended).

Morning (``day``)
  The training run is stopped through its cluster's Jobs API (SIGTERM: ``tide train run``
  checkpoints and exits; killed after the deadline), the RayJob suspended (KubeRay deletes its
  cluster: the GPUs are free), the group raised to its maximum with no pod named for deletion,
  and ``serveConfigV2`` given the day's counts back.

Every write is a JSON merge patch carrying the ``resourceVersion`` it was computed from: a
concurrent writer makes it fail with 409 and it is computed again from a fresh read.
``custom`` and ``core`` are the official client's ``CustomObjectsApi`` and ``CoreV1Api``.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from typing import Any

import yaml

__all__ = ["DAY_REPLICAS", "K8sScaleError", "KubeRay", "day", "night"]

log = logging.getLogger(__name__)

GROUP, VERSION = "ray.io", "v1"
DAY_REPLICAS = "tideserve.io/day-serve-replicas"  # annotation: Serve's counts before the night
SERVE_COUNTS = {"LLMServer": "replicas", "LLMDecode": "decode_replicas"}  # deployment -> AppArgs field
JOB_ACTIVE = ("New", "Initializing", "Running", "Waiting", "Retrying")  # RayJob jobDeploymentStatus
JOB_TERMINAL = ("Complete", "Failed")


class K8sScaleError(RuntimeError):
    """A KubeRay object is missing, or does not have what ``tide scale`` needs."""


def _status(e: Exception) -> int | None:
    return getattr(e, "status", None)  # kubernetes.client.ApiException


class KubeRay:
    """The RayService ``rayservice`` in ``namespace``, its live RayCluster, pods and RayJobs."""

    def __init__(self, custom: Any, core: Any, namespace: str, rayservice: str, attempts: int = 5) -> None:
        self.custom, self.core = custom, core
        self.namespace, self.rayservice, self.attempts = namespace, rayservice, attempts

    # -- reads -----------------------------------------------------------------------------------
    def get(self, plural: str, name: str) -> dict:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, plural, name)
        except Exception as e:  # the client raises ApiException; its text says 404 / 403
            raise K8sScaleError(f"cannot read {plural[:-1]} {self.namespace}/{name}: {_reason(e)}") from e

    def service(self) -> dict:
        return self.get("rayservices", self.rayservice)

    def live_cluster(self) -> str:
        """The RayCluster serving now (KubeRay names it ``<rayservice>-<random>``)."""
        name = ((self.service().get("status") or {}).get("activeServiceStatus") or {}).get("rayClusterName")
        if not name:
            raise K8sScaleError(f"RayService {self.namespace}/{self.rayservice} has no active RayCluster yet")
        return name

    def group(self, plural: str, name: str, group: str) -> dict:
        obj = self.get(plural, name)
        return _group(_worker_groups(obj), group)

    def pods(self, cluster: str, group: str) -> list[str]:
        """The group's pods, by name (KubeRay labels them with their cluster and group)."""
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"ray.io/cluster={cluster},ray.io/group={group}")
        return sorted(p.metadata.name for p in pods.items if not p.metadata.deletion_timestamp)

    # -- writes ----------------------------------------------------------------------------------
    def update(self, plural: str, name: str, change: Callable[[dict], dict | None]) -> dict | None:
        """Merge-patch what ``change`` computes from a fresh read (None: nothing to change),
        guarded by the read's resourceVersion; a conflict reads and computes again."""
        for attempt in range(self.attempts):
            obj = self.get(plural, name)
            patch = change(copy.deepcopy(obj))
            if patch is None:
                return None
            patch.setdefault("metadata", {})["resourceVersion"] = obj["metadata"]["resourceVersion"]
            try:
                return self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, plural, name, patch)
            except Exception as e:
                if _status(e) != 409 or attempt == self.attempts - 1:
                    raise K8sScaleError(f"cannot patch {plural[:-1]} {self.namespace}/{name}: {_reason(e)}") from e
                log.info("%s/%s changed under us; reading it again", plural, name)
        raise AssertionError("unreachable")

    def set_group(self, group: str, replicas: int, delete: list[str] = ()) -> None:
        """``group`` runs ``replicas`` pods, ``delete`` (its pods) being the ones that go: the
        RayService's spec and the live RayCluster's."""

        def service(obj: dict) -> dict:
            groups = _with_group(_worker_groups(obj), group, replicas, None)
            return {"spec": {"rayClusterConfig": {"workerGroupSpecs": groups}}}

        def cluster(obj: dict) -> dict:
            return {"spec": {"workerGroupSpecs": _with_group(_worker_groups(obj), group, replicas, list(delete))}}

        live = self.live_cluster()
        self.update("rayservices", self.rayservice, service)
        self.update("rayclusters", live, cluster)

    def serve_replicas(self) -> dict[str, int]:
        """Serve's replica counts in ``serveConfigV2`` (the app's ``replicas`` and ``decode_replicas``)."""
        return _serve_counts(_app_args(self.service()))

    def set_serve_replicas(self, counts: dict[str, int], night: bool) -> None:
        """Write ``counts`` into ``serveConfigV2``. The night keeps the day's counts in an
        annotation (the first night only: a second night keeps the first's); the day removes it."""

        def change(obj: dict) -> dict | None:
            config = yaml.safe_load(obj["spec"]["serveConfigV2"])
            args = _app_args(obj, config)
            before = _serve_counts(args)
            annotations = obj["metadata"].get("annotations") or {}
            patch: dict[str, Any] = {}
            if night and DAY_REPLICAS not in annotations:
                patch["metadata"] = {"annotations": {DAY_REPLICAS: json.dumps(before, sort_keys=True)}}
            elif not night and DAY_REPLICAS in annotations:
                patch["metadata"] = {"annotations": {DAY_REPLICAS: None}}  # merge patch: null deletes
            for deployment, n in counts.items():
                if deployment in before:
                    args[SERVE_COUNTS[deployment]] = int(n)
            if _serve_counts(args) != before:
                patch["spec"] = {"serveConfigV2": yaml.safe_dump(config, sort_keys=False)}
            return patch or None

        self.update("rayservices", self.rayservice, change)

    def day_serve_replicas(self) -> dict[str, int] | None:
        """The counts the first night recorded, or None when no night is in progress."""
        raw = (self.service()["metadata"].get("annotations") or {}).get(DAY_REPLICAS)
        return json.loads(raw) if raw else None

    def start_job(self, name: str) -> str:
        """Unsuspend the RayJob; a run that already ended is created again from its spec (a
        RayJob runs once). Returns what was done."""
        job = self.get("rayjobs", name)
        state = (job.get("status") or {}).get("jobDeploymentStatus")
        if not job["spec"].get("suspend") and state in JOB_ACTIVE:
            return "running"
        if state in JOB_TERMINAL:
            spec = {**copy.deepcopy(job["spec"]), "suspend": False}
            meta = {k: v for k, v in job["metadata"].items() if k in ("name", "namespace", "labels", "annotations")}
            try:
                self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, "rayjobs", name)
                self.custom.create_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, "rayjobs",
                    {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RayJob", "metadata": meta, "spec": spec})
            except Exception as e:
                raise K8sScaleError(f"cannot re-create RayJob {self.namespace}/{name}: {_reason(e)}") from e
            return f"re-created (last run: {state})"
        self.update("rayjobs", name, lambda obj: {"spec": {"suspend": False}})
        return "unsuspended"

    def stop_job(self, name: str, stop_run: Callable[[str, str], str] | None) -> dict[str, Any]:
        """Stop the RayJob's run with ``stop_run(job_id, dashboard_url)`` (a checkpoint, then
        its status) and suspend it: KubeRay deletes its cluster."""
        job = self.get("rayjobs", name)
        status = job.get("status") or {}
        out: dict[str, Any] = {"job": name, "state": status.get("jobDeploymentStatus"), "run": None}
        if job["spec"].get("suspend"):
            return out
        if stop_run is not None and status.get("jobId") and status.get("dashboardURL") \
                and status.get("jobStatus") in ("PENDING", "RUNNING"):
            out["run"] = stop_run(status["jobId"], _http(status["dashboardURL"]))
        if status.get("jobDeploymentStatus") in JOB_TERMINAL:
            return out  # it ended by itself: KubeRay already shut its cluster down
        self.update("rayjobs", name, lambda obj: {"spec": {"suspend": True}})
        out["suspended"] = True
        return out


# -- the night and the morning ----------------------------------------------------------------------
Drain = Callable[[list[str], int], dict[str, Any]]  # (candidate pods, how many) -> {"lent_pods", "replicas", ...}


def night(kube: KubeRay, group: str, lendable: int, drain: Drain, job: str | None = None) -> dict[str, Any]:
    """Serve on ``lendable`` pods of ``group`` (fewer than now): see the module docstring."""
    cluster = kube.live_cluster()
    now = kube.group("rayclusters", cluster, group).get("replicas", 0)
    out: dict[str, Any] = {"raycluster": cluster, "group": group, "replicas_before": now, "replicas": now}
    if lendable >= now:
        return {**out, "changed": False}
    pods = kube.pods(cluster, group)
    drained = drain(pods, now - lendable)
    lent = list(drained["lent_pods"])
    if not set(lent) <= set(pods):
        raise K8sScaleError(f"the drain freed pods outside group {group!r}: {sorted(set(lent) - set(pods))}")
    kube.set_serve_replicas(drained["replicas"], night=True)
    kube.set_group(group, now - len(lent), delete=lent)
    out.update(replicas=now - len(lent), workers_to_delete=lent, serve_replicas=drained["replicas"],
               migrated=drained.get("migrated", False), changed=True)
    if job:
        out["job"] = kube.start_job(job)
    return out


def day(kube: KubeRay, group: str, job: str | None = None,
        stop_run: Callable[[str, str], str] | None = None) -> dict[str, Any]:
    """Stop the training run, give its GPUs back to ``group`` (all of its pods) and Serve its
    day counts."""
    out: dict[str, Any] = {"training": kube.stop_job(job, stop_run) if job else None}
    cluster = kube.live_cluster()
    spec = kube.group("rayclusters", cluster, group)
    target = spec.get("maxReplicas", spec.get("replicas", 0))
    if spec.get("replicas", 0) != target or (spec.get("scaleStrategy") or {}).get("workersToDelete"):
        kube.set_group(group, target)
    out.update(raycluster=cluster, group=group, replicas_before=spec.get("replicas", 0), replicas=target)
    counts = kube.day_serve_replicas()
    if counts is not None:
        kube.set_serve_replicas(counts, night=False)
    out["serve_replicas"] = counts or kube.serve_replicas()
    out["changed"] = counts is not None or spec.get("replicas", 0) != target
    return out


# -- helpers --------------------------------------------------------------------------------------
def _reason(e: Exception) -> str:
    status, reason = _status(e), getattr(e, "reason", None)
    return f"({status}) {reason}" if status is not None else str(e)


def _http(url: str) -> str:
    return url if url.startswith("http") else f"http://{url}"


def _worker_groups(obj: dict) -> list[dict]:
    spec = obj["spec"]
    return (spec["rayClusterConfig"] if "rayClusterConfig" in spec else spec).get("workerGroupSpecs", [])


def _group(groups: list[dict], name: str) -> dict:
    for g in groups:
        if g.get("groupName") == name:
            return g
    raise K8sScaleError(f"no worker group {name!r}; groups: {[g.get('groupName') for g in groups]}")


def _with_group(groups: list[dict], name: str, replicas: int, delete: list[str] | None) -> list[dict]:
    """``groups`` with ``name`` at ``replicas``; ``delete`` (a RayCluster's): the pods named in
    ``scaleStrategy.workersToDelete`` (an empty list clears it)."""
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    out = copy.deepcopy(groups)
    g = _group(out, name)
    if replicas > g.get("maxReplicas", replicas):
        raise K8sScaleError(f"worker group {name!r} allows at most {g['maxReplicas']} replicas, asked {replicas}")
    g["replicas"] = replicas
    g["minReplicas"] = min(g.get("minReplicas", 0), replicas)
    if delete is not None:
        g["scaleStrategy"] = {**(g.get("scaleStrategy") or {}), "workersToDelete": delete}
    return out


def _app_args(svc: dict, config: dict | None = None) -> dict:
    config = config if config is not None else yaml.safe_load(svc["spec"]["serveConfigV2"])
    apps = config.get("applications") or []
    app = next((a for a in apps if a.get("import_path") == "deploy.app:build_app"), None)
    if app is None:
        raise K8sScaleError("serveConfigV2 has no application built by deploy.app:build_app")
    return app.setdefault("args", {})


def _serve_counts(args: dict) -> dict[str, int]:
    out = {"LLMServer": int(args.get("replicas", 1))}
    if args.get("decode_replicas"):
        out["LLMDecode"] = int(args["decode_replicas"])
    return out

