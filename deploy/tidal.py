"""Day/night on a Ray cluster (the Serve side; ``actors/tidal.py`` has the actors): lend serving nodes to training at night, take them back by day.

The decision (how many nodes serve) is ``cluster.scaling``'s; this module carries it out on a
running Serve app whose ``LLMServer`` replicas run one per node (``max_replicas_per_node=1``):

Night (``lend_nodes``)
  1. Choose the nodes to free (``nodes_to_free``: not the head, fewest running requests, least
     unique cache; never a node that hosts a pool's last replica, nor, when the nodes will be
     deleted (a Kubernetes night), one that hosts the app's ingress).
  2. Drain them: their replicas learn the role ``draining`` from the ``TidalState`` actor and
     report it in their routing stats, so the router stops sending them requests; in-flight
     requests finish. Past ``deadline_s`` the role becomes ``migrate``: the replica hands its
     remaining requests back and the ingress continues each one on another replica (prompt +
     tokens so far; greedy output is unchanged). No request fails.
  3. Lease the node (a pinned actor holding the replica's resources, so Serve cannot place a
     serving replica there), stop its replicas, wait until Serve has seen them gone, and lower
     the deployments' replica counts (a P/D app: each pool by what it lost; a node holding a
     pool's last replica is never chosen); the role becomes ``lent``. The redeploy keeps the
     other replicas: deployment versions change only with what replicas are built from
     (``deploy.app.deployment_version``). The node's cache agent keeps running: its units stay
     fetchable.
  4. Optionally submit a training job through the Ray Jobs API, its driver constrained to the
     lent nodes by the ``ray.io/node-id`` label.

Day (``return_nodes``)
  Stop the training job (SIGTERM: ``tide train run`` checkpoints and exits; after ``deadline_s``
  it is killed), release the leases, and raise the replicas again (``reload``: serve a new
  checkpoint, a rolling update).

Expert-parallel apps (``expert_shards``: attention replicas, routed experts on shard actors
spread over the nodes) lend nodes that host only expert shards when there are enough. Night: EPLB
re-plans the experts onto the shards that stay (``EPControl.resize``; weights move between shards
while every replica keeps decoding, no request fails), the left-out shards drop their weights, and
the nodes are leased and lent as above. When replicas run on the chosen nodes too, the experts move
off first and the replicas are then drained and removed as for any app. Day: the experts are
re-planned onto every shard again and the replicas come back to the configured count.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.tidal import (
    lease_node,
    release_lease,
    stop_training,
    submit_training,
    tidal_state,
)
from cluster.scaling import NodeLoad, nodes_to_free

__all__ = ["lend_nodes", "lend_pods", "node_pods", "return_nodes"]

log = logging.getLogger(__name__)


def _wait(cond, timeout_s: float, what: str, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _running_replicas(app_name: str, deployment: str = "LLMServer") -> int:
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        return 0
    dep = app.deployments.get(deployment)
    return dep.replica_states.get("RUNNING", 0) if dep else 0


def _app_details(app_name: str):
    """Serve's details of the app (``ray.serve.schema.ApplicationDetails``), None without it."""
    from ray.serve._private.api import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    return ServeInstanceDetails(**client.get_serve_details()).applications.get(app_name)


def _serve_replicas(app_name: str) -> dict[str, tuple[str, str | None]]:
    """Serve's own view of the app's replicas: actor name -> (state, node id)."""
    app = _app_details(app_name)
    if app is None:
        return {}
    return {r.actor_name: (str(r.state.value), r.node_id)
            for d in app.deployments.values() for r in d.replicas if r.actor_name}


def _serve_models(app_name: str, app_args: dict[str, Any]) -> tuple[dict[str, int], set[str]]:
    """Serve's view of the app's model deployments: the target replica count of each, and the
    actor names of the replicas it runs (empty when there is no Serve)."""
    app = _app_details(app_name)
    if app is None:
        return {}, set()
    models = {d: app.deployments[d] for d in _deployments(app_args) if d in app.deployments}
    return ({d: dep.target_num_replicas for d, dep in models.items()},
            {r.actor_name for dep in models.values() for r in dep.replicas
             if r.actor_name and str(r.state.value) == "RUNNING"})


def _reports_of(state, running: set[str], within_s: float) -> dict[str, dict]:
    """The fresh heartbeats, once every replica in ``running`` has one: a replica that has just
    started, or one on a busy node, can be a few seconds late. After ``within_s`` the late ones
    are left out (a node without a report is not chosen to lend)."""
    reports: dict[str, dict] = {}

    def all_in() -> bool:
        reports.clear()
        reports.update(ray.get(state.replica_reports.remote()))
        return running <= set(reports)

    try:
        _wait(all_in, within_s, "every serving replica's heartbeat")
    except TimeoutError:
        log.warning("no heartbeat from %s: their nodes are not lent", sorted(running - set(reports)))
    return reports


def _deployments(app_args: dict[str, Any]) -> list[str]:
    """The app's model deployments: the replicas, and the decode pool under P/D."""
    return ["LLMServer", "LLMDecode"] if app_args.get("decode_replicas") else ["LLMServer"]


def _deployment_of(actor_name: str) -> str:
    """A Serve replica actor's deployment (its name is ``SERVE_REPLICA::app#deployment#id``)."""
    return "LLMDecode" if "#LLMDecode#" in actor_name else "LLMServer"


def _unique_units(app_args: dict[str, Any], nodes: list[str]) -> dict[str, int]:
    """Units held by each node and no other (a maintenance read of the directory)."""
    if not app_args.get("directory_url"):
        return dict.fromkeys(nodes, 0)
    from cachedir.directory import open_directory

    password_env = app_args.get("directory_password_env")
    d = open_directory(app_args["directory_url"], app_args.get("directory_namespace", "tideserve"),
                       password=os.environ.get(password_env) if password_env else None,
                       ssl_ca_certs=app_args.get("directory_tls_ca_file"))
    try:
        keys = {n: d.node_keys(n) for n in d.live_nodes()}
    except Exception as e:  # noqa: BLE001 - no directory: every node looks the same
        log.warning("directory unreadable (%s): choosing nodes to lend without their unique units", e)
        return dict.fromkeys(nodes, 0)
    out = {}
    for n in nodes:
        others = set().union(*(k for m, k in keys.items() if m != n)) if len(keys) > 1 else set()
        out[n] = len(keys.get(n, set()) - others)
    return out


def _deploy(app_name: str, route_prefix: str, app_args: dict, replicas: int | dict[str, int]) -> None:
    """Redeploy with ``replicas`` (a count of LLMServer, or per deployment)."""
    from ray import serve

    from deploy.app import build_app

    counts = replicas if isinstance(replicas, dict) else {"LLMServer": replicas}
    args = {**app_args, "replicas": counts["LLMServer"]}
    if "LLMDecode" in counts:
        args["decode_replicas"] = counts["LLMDecode"]
    serve.run(build_app(args), name=app_name, route_prefix=route_prefix, blocking=False)


@contextlib.contextmanager
def _stopping_unplaced(app_name: str, every_s: float = 0.2) -> Iterator[list[str]]:
    """While the block runs, kill the replicas Serve is stopping that were never placed on a
    node (their names are yielded). Serve replaced the lent nodes' replicas before the counts
    dropped; the replacements cannot be placed (the leases hold the CPUs), and Serve waits its
    graceful-shutdown period (20 s) on each before it kills it. They hold no request."""
    killed: list[str] = []
    done = threading.Event()

    def run() -> None:
        while not done.wait(every_s):
            try:
                for name, (state, node) in _serve_replicas(app_name).items():
                    if state == "STOPPING" and not node and name not in killed:
                        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                        killed.append(name)
            except Exception as e:  # noqa: BLE001 - Serve busy or the actor gone meanwhile: the next round
                log.debug("stopping unplaced replicas: %s", e)  # (at worst Serve's own grace period)

    thread = threading.Thread(target=run, name="stop-unplaced", daemon=True)
    thread.start()
    try:
        yield killed
    finally:
        done.set()
        thread.join()


def lend_nodes(
    app_args: dict[str, Any], n: int, app_name: str = "tideserve", route_prefix: str = "/",
    deadline_s: float = 60.0, train: dict[str, Any] | None = None, timeout_s: float = 300.0,
    among: list[str] | None = None, redeploy: bool = True,
) -> dict[str, Any]:
    """Lend ``n`` serving nodes (see the module docstring). ``train``: ``entrypoint`` (a shell
    command) and optionally ``runtime_env``, ``submission_id``; ``dashboard`` (the Jobs API
    address, default the local one). ``among``: lend only these nodes. ``redeploy=False``: stop
    after removing the nodes' replicas and leave the lower counts (``replicas`` in the result)
    to whoever owns the app's config (KubeRay's ``serveConfigV2``). Returns the lent nodes,
    serving replicas (per deployment in ``replicas``) and the job id."""
    state = tidal_state()
    alive = [x for x in ray.nodes() if x["Alive"]]
    roles = ray.get(state.roles.remote())
    gone = [x for x in roles if x not in {a["NodeID"] for a in alive}]  # pods deleted on a Kubernetes night
    if gone:
        ray.get(state.drop.remote(gone))
        roles = {x: r for x, r in roles.items() if x not in gone}
    targets, running = _serve_models(app_name, app_args)
    replicas = _reports_of(state, running, min(timeout_s, 15.0))  # actor name -> report, fresh ones
    on_node: dict[str, list[str]] = {}
    for name, r in replicas.items():
        on_node.setdefault(r["node_id"], []).append(name)
    head = next((x["NodeID"] for x in alive if x.get("Resources", {}).get("node:__internal_head__")), None)
    serving = [node for node in on_node if roles.get(node, "serving") == "serving"]
    lendable = [x for x in serving if among is None or x in among]
    # a night that deletes its nodes (KubeRay's: redeploy=False) must not take the ingress's node:
    # every stream passes there. A local night keeps the node up, and the ingress serves on
    ingress = set() if redeploy else {
        node for name, (_, node) in _serve_replicas(app_name).items() if "#OpenAIIngress#" in name}
    resized = None
    if app_args.get("expert_shards"):
        shards = _shards(app_args)
        where = [info["node_id"] for info in ray.get([s.info.remote() for s in shards], timeout=timeout_s)]
        shard_only = sorted({w for w in where if w not in on_node and w not in ingress
                             and roles.get(w, "serving") == "serving" and (among is None or w in among)})
        if 1 <= n <= len(shard_only):
            return _lend_shard_nodes(app_args, n, app_name, train, timeout_s, shard_only, shards, where, head,
                                     set(on_node))
    if n < 1 or n >= len(serving):
        raise ValueError(f"cannot lend {n} of {len(serving)} serving nodes (at least one keeps serving)")
    # a node that hosts every replica of a pool (P/D: the prefill or the decode pool) stays. A
    # pool's size is Serve's target for it (a replica being replaced counts), else the reports'
    pools = {d: targets.get(d, sum(1 for a in replicas if _deployment_of(a) == d)) for d in _deployments(app_args)}
    candidates = [x for x in lendable if x not in ingress
                  and all(pools[d] - sum(1 for a in on_node[x] if _deployment_of(a) == d) >= 1 for d in pools)]
    unique = _unique_units(app_args, candidates)
    loads = [NodeLoad(node, sum(replicas[a].get("running", 0) for a in on_node[node]), unique[node], node == head)
             for node in candidates]
    chosen = nodes_to_free(loads, min(n, len(loads)))
    leaving = [a for x in chosen for a in on_node[x]]
    target = {d: count - sum(1 for a in leaving if _deployment_of(a) == d) for d, count in pools.items()}
    if len(chosen) < n or min(target.values()) < 1:
        raise ValueError(f"cannot lend {n} nodes: each pool ({', '.join(pools)}) must keep a replica on a "
                         f"serving node, and the ingress's node{'s' if len(ingress) > 1 else ''} stay"
                         f"{'' if len(ingress) > 1 else 's'}")
    log.info("lending %s", chosen)
    if app_args.get("expert_shards"):
        # 1b. DP attention replicas live on these nodes too: move the experts off them first
        # (every replica switches while serving), then drain their replicas as below
        keep = [s for s, w in zip(shards, where, strict=True) if w not in chosen]
        if not keep:
            raise ValueError(f"cannot lend {chosen}: every expert shard lives there")
        resized = _resize_experts(keep, timeout_s)["shards"]

    # 2. drain: the routers stop sending them work; in-flight requests finish or move
    ray.get(state.set_roles.remote(dict.fromkeys(chosen, "draining")))
    started = time.time()

    def drained() -> bool:  # a replica that stopped reporting is gone, with nothing to finish
        now = ray.get(state.replica_reports.remote())
        return all(a not in now or (now[a]["time"] > started + 1.0 and now[a].get("draining")
                                    and now[a].get("running", 0) == 0) for a in leaving)

    try:
        _wait(drained, deadline_s, "the lent nodes' requests to finish")
        migrated = False
    except TimeoutError:
        ray.get(state.set_roles.remote(dict.fromkeys(chosen, "migrate")))
        _wait(drained, 60.0, "the lent nodes to hand their requests back")
        migrated = True
    ray.get(state.record_night.remote(time.time() - started, migrated))

    # 3. lease, stop the replicas, fewer replicas
    cpus = float(app_args.get("replica_cpus", 1.0))
    leases = [lease_node(x, cpus) for x in chosen]
    for name in leaving:
        try:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        except ValueError:
            pass  # already gone
    # Serve must see them gone before the counts drop: else it stops other running replicas to
    # meet the lower count, then replaces the killed ones. It notices at its next health check
    # of each (every 10 s), later when its controller is busy. The killed replicas are named:
    # a count taken before the kill races with replicas that Serve starts or replaces meanwhile
    seen: dict[str, tuple[str, str | None]] = {}

    def noticed() -> bool:
        seen.clear()
        seen.update(_serve_replicas(app_name))
        return not any(seen.get(a, ("",))[0] == "RUNNING" for a in leaving)

    try:
        _wait(noticed, timeout_s, "Serve to notice the lent nodes' replicas are gone")
    except TimeoutError as e:
        raise TimeoutError(f"{e}; Serve's replicas (state, node): {seen}; killed: {leaving}") from None
    if app_args.get("expert_shards"):  # the control stops waiting for them (their id is their actor name)
        from deploy.ep_admin import find_ep_control

        control = find_ep_control()
        if control is not None:
            ray.get([control.leave.remote(name) for name in leaving], timeout=timeout_s)
    total = len(serving) + sum(1 for r in roles.values() if r == "lent")
    if redeploy:
        with _stopping_unplaced(app_name) as unplaced:
            _deploy(app_name, route_prefix, app_args, target)
        if unplaced:
            log.info("stopped %d replacement replica(s) that had no node: %s", len(unplaced), unplaced)
    ray.get([lease.ready.remote() for lease in leases], timeout=timeout_s)
    if redeploy:
        _wait(lambda: all(_running_replicas(app_name, d) == t for d, t in target.items()), timeout_s,
              f"serving replicas {target}")
    ray.get(state.set_roles.remote(dict.fromkeys(chosen, "lent")))

    job_id = None
    if train is not None:
        job_id = submit_training(chosen, train)
        ray.get(state.set_job.remote(job_id))
    out = {"lent": chosen, "serving_replicas": target["LLMServer"], "replicas": target, "nodes": total,
           "migrated": migrated, "job_id": job_id}
    if "LLMDecode" in target:
        out["decode_replicas"] = target["LLMDecode"]
    if resized is not None:
        out["expert_shards"] = resized
    return out


def return_nodes(
    app_args: dict[str, Any], app_name: str = "tideserve", route_prefix: str = "/", deadline_s: float = 60.0,
    reload: str | None = None, timeout_s: float = 300.0, dashboard: str | None = None,
) -> dict[str, Any]:
    """Stop the night's training, release the leases and serve on every node again."""
    state = tidal_state()
    job_id = ray.get(state.job.remote())
    job_status = stop_training(job_id, deadline_s, dashboard) if job_id else None
    roles = ray.get(state.roles.remote())
    lent = [x for x, r in roles.items() if r != "serving"]
    for x in lent:
        release_lease(x)
    ray.get(state.set_roles.remote(dict.fromkeys(lent, "serving")))
    ray.get(state.set_job.remote(None))
    out: dict[str, Any] = {"returned": lent, "job_id": job_id, "job_status": job_status}
    if app_args.get("expert_shards"):
        out["expert_shards"] = (_resize_experts(_shards(app_args), timeout_s) if lent else {}).get("shards")
    if app_args.get("expert_shards") or app_args.get("decode_replicas"):
        # every pool back to its configured size (lent nodes that hosted only a shard had no replica)
        target = {"LLMServer": int(app_args.get("replicas", 1))}
        if app_args.get("decode_replicas"):
            target["LLMDecode"] = int(app_args["decode_replicas"])
    else:
        target = {"LLMServer": _running_replicas(app_name) + len(lent)}
    if reload or any(_running_replicas(app_name, d) != t for d, t in target.items()):
        _deploy(app_name, route_prefix, {**app_args, "checkpoint": reload} if reload else app_args, target)
        _wait(lambda: all(_running_replicas(app_name, d) == t for d, t in target.items()), timeout_s,
              f"serving replicas {target}")
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


def lend_pods(app_args: dict[str, Any], pods: list[str], n: int, deadline_s: float = 60.0,
              timeout_s: float = 300.0) -> dict[str, Any]:
    """The Ray side of a Kubernetes night: drain ``n`` of ``pods``' nodes and stop their replicas,
    leaving the lower counts to ``serveConfigV2`` (``lend_nodes(redeploy=False)``). Adds the
    freed pods' names (``lent_pods``), which the caller deletes."""
    by_node = node_pods()
    among = [node for node, pod in by_node.items() if pod in pods]
    if not among:
        raise ValueError(f"none of the pods {pods} is a node of this Ray cluster "
                         f"(its nodes' pods: {sorted(by_node.values())})")
    out = lend_nodes(app_args, n, deadline_s=deadline_s, timeout_s=timeout_s, among=among, redeploy=False)
    # a node without replicas drains its HTTP proxy (its readiness fails, so KubeRay's serve
    # Service stops sending it connections); deleting the pod before that would cut requests
    # passing through it
    try:
        _wait(lambda: _proxies_drained(out["lent"]), deadline_s + 60.0, "the lent nodes' HTTP proxies to drain",
              every_s=1.0)
    except TimeoutError as e:
        log.warning("%s; their pods go anyway", e)
    return {**out, "lent_pods": [by_node[x] for x in out["lent"]]}


def _proxies_drained(nodes: list[str]) -> bool:
    from ray import serve

    proxies = serve.status().proxies  # node -> ProxyStatus, a str enum; a drained proxy is removed
    return all(proxies.get(x) in (None, "DRAINED") for x in nodes)


# -- expert-parallel apps --------------------------------------------------------------------------
def _shards(app_args: dict[str, Any]) -> list:
    from deploy.app import EXPERT_SHARD_NAME

    return [ray.get_actor(EXPERT_SHARD_NAME.format(i), namespace="tideserve")
            for i in range(int(app_args["expert_shards"]))]


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


def _lend_shard_nodes(app_args: dict[str, Any], n: int, app_name: str, train: dict[str, Any] | None,
                      timeout_s: float, lendable: list[str], shards: list, where: list[str],
                      head: str | None, replica_nodes: set[str]) -> dict[str, Any]:
    """Night for an expert-parallel app: lend ``n`` of the ``lendable`` nodes, which host expert
    shards but no replica (``where``: each shard's node; ``replica_nodes``: the nodes with one)."""
    state = tidal_state()
    unique = _unique_units(app_args, lendable)
    chosen = nodes_to_free([NodeLoad(x, 0, unique[x], x == head) for x in lendable], n)
    log.info("lending %s (expert shards move to the other nodes)", chosen)
    keep = [s for s, w in zip(shards, where, strict=True) if w not in chosen]
    resized = _resize_experts(keep, timeout_s)
    leases = [lease_node(x, float(app_args.get("replica_cpus", 1.0))) for x in chosen]
    ray.get([lease.ready.remote() for lease in leases], timeout=timeout_s)
    ray.get(state.set_roles.remote(dict.fromkeys(chosen, "lent")))
    job_id = None
    if train is not None:
        job_id = submit_training(chosen, train)
        ray.get(state.set_job.remote(job_id))
    replicas = {d: _running_replicas(app_name, d) for d in _deployments(app_args)}
    return {"lent": chosen, "serving_replicas": replicas["LLMServer"], "replicas": replicas,
            "expert_shards": resized["shards"],
            "nodes": len(set(where) | replica_nodes), "migrated": False, "job_id": job_id}

