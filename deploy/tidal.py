"""Day/night on a Ray cluster (the Serve side; ``actors/tidal.py`` has the actors): lend serving nodes to training at night, take them back by day.

How many nodes serve is ``cluster.scaling``'s decision and which ones ``cluster.night``'s plan;
this module carries them out on a running Serve app (``deploy.serve_state`` reads and changes
what Serve runs) whose ``LLMServer`` replicas run one per node (``max_replicas_per_node=1``):

Night (``lend_nodes``)
  1. Choose the nodes to free (``nodes_to_free``: not the head, fewest running requests, least
     unique cache; never a node that hosts a pool's last replica, nor, when the nodes will be
     deleted (a Kubernetes night), one that hosts the app's ingress).
  2. Drain them: their replicas learn the role ``draining`` from the ``TidalState`` actor and
     report it in their routing stats, so the router stops sending them requests; in-flight
     requests finish. Past ``deadline_s`` the role becomes ``migrate``: the replica hands its
     remaining requests back and the ingress continues each one on another replica (prompt +
     tokens so far; greedy output is unchanged). No request fails. Then each node's cache agent
     copies its hot units that no staying node holds to the nodes that stay (``night_keep_bytes``
     within ``night_keep_s``: ``cachedir.keeping``), so the morning's prompts still hit them.
  3. Lease the node (a pinned actor holding the replica's resources, so Serve cannot place a
     serving replica there), stop its replicas, wait until Serve has seen them gone, and lower
     the deployments' replica counts (a P/D app: each pool by what it lost; a node holding a
     pool's last replica is never chosen); the role becomes ``lent``. The redeploy keeps the
     other replicas: deployment versions change only with what replicas are built from
     (``deploy.app.deployment_version``). The node's cache agent keeps serving its units.
  4. Optionally submit a training job through the Ray Jobs API, its driver pinned to the lent
     nodes by the ``ray.io/node-id`` label.

Day (``return_nodes``)
  Stop the training job (SIGTERM: ``tide train run`` checkpoints and exits; after ``deadline_s``
  it is killed), release the leases, let the nodes' agents fetch the hot units they lack (then,
  budget left, the fleet's others), and raise the replicas again (``reload``: a new checkpoint).

Expert-parallel apps (``expert_shards``) lend nodes that host only expert shards when there are
enough. Night: EPLB re-plans the experts onto the shards that stay (``EPControl.resize``; weights
move while every replica keeps decoding), the left-out shards drop their weights, and the nodes are
leased and lent. Replicas on the chosen nodes are drained and removed after the experts moved off.
Day: the experts are re-planned onto every shard and the replicas come back to the configured count.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.cache_agent import keep_units_of, warm_nodes
from actors.tidal import (
    lease_node,
    release_lease,
    stop_training,
    submit_training,
    tidal_state,
)
from cluster.night import Drain, Fleet, ReplicaReport, plan_night, shard_only_nodes, unique_units
from cluster.scaling import NodeLoad, nodes_to_free
from deploy.app_args import AppArgs
from deploy.serve_state import (
    deploy_counts,
    deployment_of,
    fresh_reports,
    model_deployments,
    running_replicas,
    serve_models,
    serve_replicas,
    stopping_unplaced,
    wait_for,
)

__all__ = ["lend_nodes", "lend_pods", "node_pods", "return_nodes"]

log = logging.getLogger(__name__)
def _unique_units(a: AppArgs, nodes: list[str]) -> dict[str, int]:
    """Units held by each node and no other (a maintenance read of the directory)."""
    if not a.directory_url:
        return dict.fromkeys(nodes, 0)
    from cachedir.directory import open_directory

    password = os.environ.get(a.directory_password_env) if a.directory_password_env else None
    d = open_directory(a.directory_url, a.directory_namespace, password=password, ssl_ca_certs=a.directory_tls_ca_file)
    try:
        return unique_units(d, nodes)
    except Exception as e:  # noqa: BLE001 - no directory: every node looks the same
        log.warning("directory unreadable (%s): choosing nodes to lend without their unique units", e)
        return dict.fromkeys(nodes, 0)


def _fleet(state, a: AppArgs, app_name: str, redeploy: bool, timeout_s: float) -> Fleet:
    """The cluster as the night finds it: roles (nodes gone since are dropped: pods deleted on a
    Kubernetes night), the serving replicas' fresh reports, Serve's targets, the ingress's node."""
    alive = [x for x in ray.nodes() if x["Alive"]]
    roles = ray.get(state.roles.remote())
    gone = [x for x in roles if x not in {a["NodeID"] for a in alive}]
    if gone:
        ray.get(state.drop.remote(gone))
        roles = {x: r for x, r in roles.items() if x not in gone}
    targets, running = serve_models(app_name, a)
    reports = fresh_reports(state, running, min(timeout_s, 15.0))  # actor name -> report, fresh ones
    head = next((x["NodeID"] for x in alive if x.get("Resources", {}).get("node:__internal_head__")), None)
    # a night that deletes its nodes (KubeRay's: redeploy=False) must not take the ingress's node:
    # every stream passes there. A local night keeps the node up, and the ingress serves on
    ingress = frozenset() if redeploy else frozenset(
        node for name, (_, node) in serve_replicas(app_name).items() if "#OpenAIIngress#" in name)
    replicas = {name: ReplicaReport(deployment_of(name), r["node_id"], r.get("running", 0))
                for name, r in reports.items()}
    return Fleet(head, roles, replicas, model_deployments(a), targets, ingress)


def _drain(state, leaving: list[str], lend: list[str], deadline_s: float) -> bool:
    """Drain the leaving replicas (the routers stop sending them work; in-flight requests
    finish, or past ``deadline_s`` move elsewhere). Whether any had to move."""
    ray.get(state.set_roles.remote(dict.fromkeys(lend, "draining")))
    drain, migrated = Drain(leaving, deadline_s), False
    while (phase := drain.state(ray.get(state.replica_reports.remote()))) != "drained":
        if phase == "stuck":
            raise TimeoutError(f"timed out after {deadline_s + drain.grace_s:.0f} s: the lent nodes kept requests")
        if phase == "migrate" and not migrated:
            ray.get(state.set_roles.remote(dict.fromkeys(lend, "migrate")))
            migrated = True
        time.sleep(0.25)
    ray.get(state.record_night.remote(time.time() - drain.started, migrated))
    return migrated


def _remove_replicas(app_name: str, leaving: list[str], timeout_s: float, expert_parallel: bool = False) -> None:
    """Stop the leaving replicas and wait until Serve has seen them gone: else, when the counts
    drop, it stops other running replicas to meet them, then replaces the killed ones. It notices
    at its next health check of each (every 10 s), later when its controller is busy. The killed
    replicas are named: a count taken before the kill races with replicas Serve starts meanwhile."""
    for name in leaving:
        with contextlib.suppress(ValueError):  # already gone
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    seen: dict[str, tuple[str, str | None]] = {}

    def noticed() -> bool:
        seen.clear()
        seen.update(serve_replicas(app_name))
        return not any(seen.get(a, ("",))[0] == "RUNNING" for a in leaving)

    try:
        wait_for(noticed, timeout_s, "Serve to notice the lent nodes' replicas are gone")
    except TimeoutError as e:
        raise TimeoutError(f"{e}; Serve's replicas (state, node): {seen}; killed: {leaving}") from None
    if expert_parallel:  # the control stops waiting for them (their id is their actor name)
        from deploy.ep_admin import find_ep_control

        control = find_ep_control()
        if control is not None:
            ray.get([control.leave.remote(name) for name in leaving], timeout=timeout_s)


def lend_nodes(
    app_args: AppArgs | dict[str, Any], n: int, app_name: str = "tideserve", route_prefix: str = "/",
    deadline_s: float = 60.0, train: dict[str, Any] | None = None, timeout_s: float = 300.0,
    among: list[str] | None = None, redeploy: bool = True,
) -> dict[str, Any]:
    """Lend ``n`` serving nodes (see the module docstring). ``train``: ``entrypoint`` (a shell
    command) and optionally ``runtime_env``, ``submission_id``; ``dashboard`` (the Jobs API
    address, default the local one). ``among``: lend only these nodes. ``redeploy=False``: stop
    after removing the nodes' replicas and leave the lower counts (``replicas`` in the result)
    to whoever owns the app's config (KubeRay's ``serveConfigV2``). Returns the lent nodes,
    serving replicas (per deployment in ``replicas``) and the job id."""
    a = _app_args(app_args)
    state = tidal_state()
    fleet = _fleet(state, a, app_name, redeploy, timeout_s)
    shards, where = _shard_nodes(a, timeout_s)
    shard_only = shard_only_nodes(fleet, where, among)
    if shards and 1 <= n <= len(shard_only):
        return _lend_shard_nodes(a, n, app_name, train, timeout_s, shard_only, shards, where, fleet.head,
                                 set(fleet.on_node()))
    plan = plan_night(fleet, n, lambda nodes: _unique_units(a, nodes), among)
    log.info("lending %s", plan.lend)
    resized = _experts_off(shards, where, plan.lend, timeout_s) if shards else None
    migrated = _drain(state, plan.leaving, plan.lend, deadline_s)
    kept = keep_units_of(plan.lend, a.night_keep_bytes, a.night_keep_s, timeout_s)  # (no agents: none)
    leases = [lease_node(x, a.replica_cpus) for x in plan.lend]
    _remove_replicas(app_name, plan.leaving, timeout_s, expert_parallel=bool(shards))
    if redeploy:
        with stopping_unplaced(app_name) as unplaced:
            deploy_counts(app_name, route_prefix, a, plan.target)
        if unplaced:
            log.info("stopped %d replacement replica(s) that had no node: %s", len(unplaced), unplaced)
    ray.get([lease.ready.remote() for lease in leases], timeout=timeout_s)
    if redeploy:
        _wait_serving(app_name, plan.target, timeout_s)
    ray.get(state.set_roles.remote(dict.fromkeys(plan.lend, "lent")))
    out = {"lent": plan.lend, "serving_replicas": plan.target["LLMServer"], "replicas": plan.target,
           "nodes": plan.nodes, "migrated": migrated, "kept": kept, "job_id": _train(state, plan.lend, train)}
    if "LLMDecode" in plan.target:
        out["decode_replicas"] = plan.target["LLMDecode"]
    if resized is not None:
        out["expert_shards"] = resized
    return out


def _wait_serving(app_name: str, target: dict[str, int], timeout_s: float) -> None:
    wait_for(lambda: all(running_replicas(app_name, d) == t for d, t in target.items()), timeout_s,
          f"serving replicas {target}")


def _train(state, nodes: list[str], train: dict[str, Any] | None) -> str | None:
    """Submit the night's training job on the lent nodes (None: no job)."""
    if train is None:
        return None
    job_id = submit_training(nodes, train)
    ray.get(state.set_job.remote(job_id))
    return job_id


def _app_args(app_args: AppArgs | dict[str, Any]) -> AppArgs:
    return app_args if isinstance(app_args, AppArgs) else AppArgs(**app_args)


def return_nodes(
    app_args: AppArgs | dict[str, Any], app_name: str = "tideserve", route_prefix: str = "/", deadline_s: float = 60.0,
    reload: str | None = None, timeout_s: float = 300.0, dashboard: str | None = None,
) -> dict[str, Any]:
    """Stop the night's training, release the leases and serve on every node again."""
    a = _app_args(app_args)
    state = tidal_state()
    job_id = ray.get(state.job.remote())
    job_status = stop_training(job_id, deadline_s, dashboard) if job_id else None
    roles = ray.get(state.roles.remote())
    lent = [x for x, r in roles.items() if r != "serving"]
    for x in lent:
        release_lease(x)
    warmed = warm_nodes(lent, a.night_keep_bytes, a.night_keep_s, timeout_s)
    ray.get(state.set_roles.remote(dict.fromkeys(lent, "serving")))
    ray.get(state.set_job.remote(None))
    out: dict[str, Any] = {"returned": lent, "job_id": job_id, "job_status": job_status, "warmed": warmed}
    if a.expert_shards:
        out["expert_shards"] = (_resize_experts(_shards(a), timeout_s) if lent else {}).get("shards")
    if a.expert_shards or a.decode_replicas:
        # every pool back to its configured size (lent nodes that hosted only a shard had no replica)
        target = {"LLMServer": a.replicas}
        if a.decode_replicas:
            target["LLMDecode"] = a.decode_replicas
    else:
        target = {"LLMServer": running_replicas(app_name) + len(lent)}
    if reload or any(running_replicas(app_name, d) != t for d, t in target.items()):
        deploy_counts(app_name, route_prefix, a.model_copy(update={"checkpoint": reload}) if reload else a, target)
        _wait_serving(app_name, target, timeout_s)
    out["serving_replicas"] = target["LLMServer"]
    if "LLMDecode" in target:
        out["decode_replicas"] = target["LLMDecode"]
    return out


# -- Kubernetes: nodes are pods --------------------------------------------------------------------
@ray.remote(num_cpus=0)
def _pod_name() -> str:
    return os.environ.get("RAY_CLOUD_INSTANCE_ID") or socket.gethostname()


def node_pods(timeout_s: float = 60.0) -> dict[str, str]:
    """Each alive node's pod: ``RAY_CLOUD_INSTANCE_ID``, which KubeRay sets to the pod's name
    in every Ray container (elsewhere the node's hostname)."""
    nodes = [x["NodeID"] for x in ray.nodes() if x["Alive"]]
    refs = [_pod_name.options(scheduling_strategy=NodeAffinitySchedulingStrategy(x, soft=False)).remote()
            for x in nodes]
    return dict(zip(nodes, ray.get(refs, timeout=timeout_s), strict=True))


def lend_pods(app_args: AppArgs | dict[str, Any], pods: list[str], n: int, deadline_s: float = 60.0,
              timeout_s: float = 300.0) -> dict[str, Any]:
    """The Ray side of a Kubernetes night: drain ``n`` of ``pods``' nodes and stop their replicas,
    leaving the lower counts to ``serveConfigV2`` (``lend_nodes(redeploy=False)``). Adds the
    freed pods' names (``lent_pods``), which the caller deletes."""
    by_node = node_pods()
    among = [node for node, pod in by_node.items() if pod in pods]
    if not among:
        raise ValueError(f"none of the pods {pods} is a node of this Ray cluster (its pods: {sorted(by_node.values())})")
    out = lend_nodes(app_args, n, deadline_s=deadline_s, timeout_s=timeout_s, among=among, redeploy=False)
    # a node without replicas drains its HTTP proxy (KubeRay's serve Service stops sending it
    # connections); deleting the pod before that would cut requests passing through it
    try:
        wait_for(lambda: _proxies_drained(out["lent"]), deadline_s + 60.0, "the lent nodes' HTTP proxies to drain",
              every_s=1.0)
    except TimeoutError as e:
        log.warning("%s; their pods go anyway", e)
    return {**out, "lent_pods": [by_node[x] for x in out["lent"]]}


def _proxies_drained(nodes: list[str]) -> bool:
    from ray import serve

    proxies = serve.status().proxies  # node -> ProxyStatus, a str enum; a drained proxy is removed
    return all(proxies.get(x) in (None, "DRAINED") for x in nodes)


# -- expert-parallel apps --------------------------------------------------------------------------
def _shards(a: AppArgs) -> list:
    from deploy.app import EXPERT_SHARD_NAME

    return [ray.get_actor(EXPERT_SHARD_NAME.format(i), namespace="tideserve") for i in range(a.expert_shards)]


def _shard_nodes(a: AppArgs, timeout_s: float) -> tuple[list, list[str]]:
    """An expert-parallel app's shards and each one's node (none for another app)."""
    if not a.expert_shards:
        return [], []
    shards = _shards(a)
    return shards, [info["node_id"] for info in ray.get([s.info.remote() for s in shards], timeout=timeout_s)]


def _experts_off(shards: list, where: list[str], nodes: list[str], timeout_s: float) -> int:
    """Move the experts off ``nodes`` (DP attention replicas live there too; every replica
    switches while serving) before their replicas drain: the shards that stay."""
    keep = [s for s, w in zip(shards, where, strict=True) if w not in nodes]
    if not keep:
        raise ValueError(f"cannot lend {nodes}: every expert shard lives there")
    return _resize_experts(keep, timeout_s)["shards"]


def _resize_experts(shards: list, timeout_s: float) -> dict[str, Any]:
    """Re-plan the experts onto ``shards``: every replica follows (weights move while they serve)."""
    from deploy.app import expert_shard_nodes
    from deploy.ep_admin import find_ep_control

    control = find_ep_control()
    if control is None:
        raise ValueError("the app's expert-parallel control is not running (no replica has joined it)")
    nodes = {info["node_id"] for info in ray.get([s.info.remote() for s in shards], timeout=timeout_s)}
    return ray.get(control.resize.remote(shards, expert_shard_nodes(len(nodes), len(shards)), timeout_s),
                   timeout=timeout_s + 60)


def _lend_shard_nodes(a: AppArgs, n: int, app_name: str, train: dict[str, Any] | None,
                      timeout_s: float, lendable: list[str], shards: list, where: list[str],
                      head: str | None, replica_nodes: set[str]) -> dict[str, Any]:
    """Night for an expert-parallel app: lend ``n`` of the ``lendable`` nodes, which host expert
    shards but no replica (``where``: each shard's node; ``replica_nodes``: the nodes with one)."""
    state = tidal_state()
    unique = _unique_units(a, lendable)
    chosen = nodes_to_free([NodeLoad(x, 0, unique[x], x == head) for x in lendable], n)
    log.info("lending %s (expert shards move to the other nodes)", chosen)
    keep = [s for s, w in zip(shards, where, strict=True) if w not in chosen]
    resized = _resize_experts(keep, timeout_s)
    leases = [lease_node(x, a.replica_cpus) for x in chosen]
    ray.get([lease.ready.remote() for lease in leases], timeout=timeout_s)
    ray.get(state.set_roles.remote(dict.fromkeys(chosen, "lent")))
    job_id = _train(state, chosen, train)
    replicas = {d: running_replicas(app_name, d) for d in model_deployments(a)}
    return {"lent": chosen, "serving_replicas": replicas["LLMServer"], "replicas": replicas,
            "expert_shards": resized["shards"],
            "nodes": len(set(where) | replica_nodes), "migrated": False, "job_id": job_id}
