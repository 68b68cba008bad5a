"""``tide scale``: day/night serving size. The decision is ``cluster.scaling``'s; on a local Ray
cluster ``deploy.tidal`` carries it out (drain, lend, take back), Kubernetes mode applies it to
the KubeRay RayService (``deploy.k8s_scale``), its drain run on the cluster by ``tide drain``."""

from __future__ import annotations

import json
import sys
import time

import typer

from cluster.scaling import LoadSample, ScalingConfig, ScalingPolicy, Schedule
from deploy.connect import ADDRESS_HELP, TideError
from deploy.schedule_cli import load_schedule


def scale(
    mode: str = typer.Argument(None, help="day | night (or use --serve-nodes)"),
    serve_nodes: int = typer.Option(None, "--serve-nodes", min=0, help="serve on exactly N nodes"),
    dry_run: bool = typer.Option(False, "--dry-run", help="decide and print, change nothing"),
    k8s: bool = typer.Option(False, "--k8s", help="scale the KubeRay RayService (in-cluster or kubeconfig)"),
    rayservice: str = typer.Option("tideserve", "--rayservice"),
    namespace: str = typer.Option("tideserve", "--namespace"),
    group: str = typer.Option("lendable", "--group", help="the worker group lent to training at night"),
    fixed_nodes: int = typer.Option(None, "--fixed-nodes", min=0, help="always-serving nodes (default: from the RayService)"),
    night_nodes: int = typer.Option(None, "--night-nodes", min=1, help="serving nodes the night aims for (default: tide schedule)"),
    tokens_per_s: float = typer.Option(0.0, "--tokens-per-s", min=0.0, help="current cluster load"),
    kv_occupancy: float = typer.Option(0.0, "--kv-occupancy", min=0.0, max=1.0),
    node_tokens_per_s: float = typer.Option(1000.0, "--node-tokens-per-s", min=1.0, help="one node's capacity"),
    batch_tokens_per_s: float = typer.Option(None, "--batch-tokens-per-s", min=0.0,
                                             help="the rate batches need to meet their windows (default: from the "
                                                  "cluster's batches on a Ray cluster, 0 with --k8s)"),
    deadline_s: float = typer.Option(60.0, "--deadline", min=0.0, help="seconds in-flight requests get to finish (then they move) / training gets to checkpoint"),
    reload: str = typer.Option(None, "--reload", help="day: serve this checkpoint (e.g. the night's export)"),
    job: str = typer.Option("tideserve-train", "--job", help="--k8s: the training RayJob, unsuspended at night, stopped with a checkpoint and suspended by day ('' for none)"),
    dashboard: str = typer.Option(None, "--dashboard", help="--k8s: the serving cluster's Jobs API (default http://RAYSERVICE-head-svc.NAMESPACE.svc:8265)"),
    as_json: bool = typer.Option(False, "--json"),
    address: str = typer.Option(None, "--address", envvar="RAY_ADDRESS", help=ADDRESS_HELP),
) -> None:
    """Scale serving for the day (all nodes) or the night (lend nodes to training, never below
    what the current load needs), or to --serve-nodes N."""
    if (mode is None) == (serve_nodes is None):
        raise typer.BadParameter("give day, night or --serve-nodes N (exactly one)")
    if mode is not None and mode not in ("day", "night"):
        raise typer.BadParameter(f"mode {mode!r} is not day or night")
    if not k8s:
        _scale_local(mode, serve_nodes, dry_run, night_nodes, tokens_per_s, kv_occupancy, node_tokens_per_s,
                     deadline_s, reload, as_json, address, batch_tokens_per_s)
        return
    if reload:
        raise typer.BadParameter("--reload is for a Ray cluster; on Kubernetes change the checkpoint in serveConfigV2")
    _scale_k8s(mode, serve_nodes, dry_run, rayservice, namespace, group, fixed_nodes, night_nodes, tokens_per_s,
               kv_occupancy, node_tokens_per_s, deadline_s, job, dashboard, as_json, batch_tokens_per_s or 0.0)


def _scale_k8s(mode, serve_nodes, dry_run, rayservice, namespace, group, fixed_nodes, night_nodes, tokens_per_s,
               kv_occupancy, node_tokens_per_s, deadline_s, job, dashboard, as_json, batch_rate) -> None:
    """The night or morning of a KubeRay RayService (``deploy.k8s_scale``)."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise typer.BadParameter("--k8s needs the kubernetes client: pip install 'tideserve[k8s]'") from None

    from deploy.k8s_scale import K8sScaleError, KubeRay, day, night

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    kube = KubeRay(client.CustomObjectsApi(), client.CoreV1Api(), namespace, rayservice)
    try:
        live = kube.get("rayclusters", kube.live_cluster())
        groups = {g["groupName"]: g for g in live["spec"].get("workerGroupSpecs", [])}
        if group not in groups:
            raise typer.BadParameter(f"--group {group!r} is not a worker group of {rayservice}: {sorted(groups)}")
        fixed = fixed_nodes if fixed_nodes is not None else sum(g.get("replicas", 0) for n, g in groups.items() if n != group)
        lendable_max = groups[group].get("maxReplicas", groups[group].get("replicas", 0))
        now = groups[group].get("replicas", 0)
        target, reason = _target(mode, serve_nodes, fixed + lendable_max, fixed + now, night_nodes, tokens_per_s,
                                 kv_occupancy, node_tokens_per_s, min_nodes=max(1, min(fixed, fixed + lendable_max)),
                                 batch_rate=batch_rate)
        lendable = min(lendable_max, max(0, target - fixed))
        base = {"rayservice": rayservice, "group": group, "serve_nodes": fixed + lendable, "reason": reason}
        if dry_run or lendable == now and mode != "day":
            _emit({**base, "replicas_before": now, "replicas": lendable, "changed": False, "dry_run": dry_run}, as_json)
            return
        if lendable < now:
            serving = dashboard or f"http://{rayservice}-head-svc.{namespace}.svc:8265"
            result = night(kube, group, lendable, _drain_by_job(serving, deadline_s), job=job or None)
        elif lendable == lendable_max:
            from actors.tidal import stop_training

            result = day(kube, group, job=job or None,
                         stop_run=lambda job_id, url: stop_training(job_id, deadline_s, url))
        else:
            raise typer.BadParameter(f"--serve-nodes {target}: taking back only some lent nodes is not supported; "
                                     "use `tide scale day`")
    except K8sScaleError as e:
        raise TideError(str(e)) from None
    from deploy.local import record_serving_nodes

    record_serving_nodes(fixed + result["replicas"], lendable_max - result["replicas"])
    _emit({**base, **result, "serve_nodes": fixed + result["replicas"]}, as_json)


def _drain_by_job(dashboard: str, deadline_s: float, timeout_s: float = 600.0):
    """Drain pods of the serving cluster with ``tide drain`` run there as a Ray job (this process
    is not a Ray node); returns what it printed."""
    import shlex

    from actors.tidal import jobs_client, wait_job
    from deploy.k8s_scale import K8sScaleError

    def drain(pods: list[str], n: int) -> dict:
        client = jobs_client(dashboard)
        cmd = [sys.executable, "-m", "deploy.cli", "drain", "--pods", ",".join(pods), "--count", str(n),
               "--deadline", str(deadline_s), "--json"]
        job_id = client.submit_job(entrypoint=shlex.join(cmd))
        status = wait_job(client, job_id, deadline_s + timeout_s)
        if status in ("PENDING", "RUNNING"):
            client.stop_job(job_id)
            raise K8sScaleError(f"the drain job {job_id} on {dashboard} did not finish in "
                                f"{deadline_s + timeout_s:.0f} s")
        logs = client.get_job_logs(job_id)
        lines = [x for x in logs.splitlines() if x.startswith("{")]
        if status != "SUCCEEDED" or not lines:
            raise K8sScaleError(f"the drain job {job_id} on {dashboard} ended {status}: {logs.strip()[-800:]}")
        return json.loads(lines[-1])

    return drain


def drain(
    pods: str = typer.Option(..., "--pods", help="comma-separated pod names whose nodes may be lent"),
    count: int = typer.Option(..., "--count", min=1, help="how many of them to lend"),
    deadline_s: float = typer.Option(60.0, "--deadline", min=0.0, help="seconds in-flight requests get to finish (then they move)"),
    as_json: bool = typer.Option(False, "--json"),
    address: str = typer.Option(None, "--address", envvar="RAY_ADDRESS", help=ADDRESS_HELP),
) -> None:
    """Drain COUNT of the PODS' Ray nodes and stop their replicas, for a Kubernetes night
    (`tide scale night --k8s` runs this on the serving cluster as a Ray job, then lowers
    serveConfigV2's counts and deletes the pods it names)."""
    from deploy.connect import app_args, find_target, require_app

    names = [p for p in pods.split(",") if p]
    if not names:
        raise typer.BadParameter("--pods names no pod")
    cluster = find_target(address)
    require_app(cluster)
    from deploy.tidal import lend_pods

    try:
        result = lend_pods(app_args(cluster), names, count, deadline_s=deadline_s)
    except ValueError as e:
        raise TideError(str(e)) from None
    _emit({**result, "serve_nodes": result["serving_replicas"], "changed": True}, as_json)


def _target(mode: str | None, serve_nodes: int | None, total: int, current: int, night_nodes: int | None,
            tokens_per_s: float, kv_occupancy: float, node_tokens_per_s: float, min_nodes: int = 1,
            batch_rate: float = 0.0) -> tuple[int, str]:
    """Serving nodes wanted now: ``--serve-nodes``, every node by day, or the night's size (never
    below what the interactive load and the batches due need)."""
    if serve_nodes is not None:
        return serve_nodes, "--serve-nodes"
    saved = load_schedule()
    # the night never goes below the always-serving nodes
    cfg = ScalingConfig(total_nodes=total, min_nodes=min_nodes,
                        night_nodes=min(total, max(min_nodes, night_nodes or saved["night_nodes"])),
                        node_tokens_per_s=node_tokens_per_s, min_dwell_s=0)
    policy = ScalingPolicy(cfg, Schedule.parse(saved["day"], saved["night"], saved["timezone"]))
    policy.observe(LoadSample(time.time(), tokens_per_s, kv_occupancy=kv_occupancy, serving_nodes=current))
    policy.batch_rate = batch_rate
    needed = policy.needed(cfg.headroom)
    goal = total if mode == "day" else max(cfg.night_nodes, needed)
    batches = f" and batches due {batch_rate:.0f} tok/s" if batch_rate else ""
    why = f"{mode}: load {tokens_per_s:.0f} tok/s{batches} needs {needed} nodes"
    if mode == "night" and goal < total:
        why += f"; {total - goal} lent to training"
    return goal, why


def _scale_local(mode, serve_nodes, dry_run, night_nodes, tokens_per_s, kv_occupancy, node_tokens_per_s,
                 deadline_s, reload, as_json, address, batch_rate) -> None:
    """Lend nodes of a Ray cluster (``tide up``'s plus nodes joined with ``ray start``, or the
    one ``--address`` names)."""
    from deploy.connect import app_args, dashboard_url, find_target, require_app, write_state
    from deploy.local import record_serving_nodes

    cluster = find_target(address)
    require_app(cluster)  # connects to the cluster
    import ray

    from actors.tidal import tidal_state
    from deploy.tidal import lend_nodes, return_nodes

    roles = ray.get(tidal_state().roles.remote())
    lent = [n for n, r in roles.items() if r == "lent"]
    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    current = len(alive) - len(lent)
    if batch_rate is None:
        batch_rate = _batch_rate(cluster)
    target, reason = _target(mode, serve_nodes, len(alive), current, night_nodes, tokens_per_s, kv_occupancy,
                             node_tokens_per_s, batch_rate=batch_rate)
    goal = max(1, min(len(alive), target))
    if target > goal:
        reason += f" {target}, capped to the {len(alive)} alive node(s)"
    elif target < goal:
        reason += f" {target}, raised to 1: one node always serves"
    out = {"nodes": len(alive), "serving_before": current, "serve_nodes": goal, "reason": reason,
           "batch_tokens_per_s": round(batch_rate, 3)}
    if dry_run or goal == current:
        _emit({**out, "changed": False, "dry_run": dry_run}, as_json)
        return
    args = app_args(cluster, redeploy=True)
    if goal < current:
        try:
            result = lend_nodes(args, current - goal, deadline_s=deadline_s)
        except ValueError as e:  # nothing this app can lend: say why, change nothing
            raise TideError(str(e)) from None
    else:
        if goal < len(alive):
            raise typer.BadParameter(f"--serve-nodes {goal}: taking back only some lent nodes is not supported; "
                                     "use `tide scale day`")
        result = return_nodes(args, deadline_s=deadline_s, reload=reload, dashboard=dashboard_url(cluster))
        if reload and cluster.local is not None:  # later redeploys (the next night) must serve the new checkpoint too
            write_state({**cluster.local, "app_args": {**args, "checkpoint": reload}})
    record_serving_nodes(goal, len(alive) - goal)  # nodes, not replicas: an EP app serves from every node
    _emit({**out, "changed": True, **result}, as_json)


def _batch_rate(cluster) -> float:
    """The rate the cluster's batches need to meet their windows (``cluster.scaling``), asked of
    its ingress; 0 when it keeps none."""
    from cluster.scaling import BatchDemand, batch_tokens_per_s
    from deploy.connect import serve_handle

    demand = serve_handle(cluster, "OpenAIIngress").batch_admin.remote("demand").result(timeout_s=60)
    return batch_tokens_per_s([BatchDemand(d["tokens"], d["due_s"]) for d in demand], time.time())


def _emit(result: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    changed = result.get("changed", not result.get("dry_run", False))
    head = (f"serving on {result['serve_nodes']} node(s)" + ("" if changed else " (no change)")
            + (" [dry run]" if result.get("dry_run") else ""))
    print(head)
    for k, v in result.items():
        if k not in ("serve_nodes", "changed", "dry_run"):
            print(f"  {k.replace('_', ' ')}: {v}")
