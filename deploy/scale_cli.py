"""``tide scale``: day/night serving size. The decision is ``cluster.scaling``'s; Kubernetes mode
applies it to the KubeRay RayService (``deploy.k8s_scale``)."""

from __future__ import annotations

import json
import sys
import time

import typer

from cluster.scaling import LoadSample, ScalingConfig, ScalingPolicy, Schedule
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
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Scale serving for the day (all nodes) or the night (lend nodes to training, never below
    what the current load needs), or to --serve-nodes N."""
    if (mode is None) == (serve_nodes is None):
        raise typer.BadParameter("give day, night or --serve-nodes N (exactly one)")
    if mode is not None and mode not in ("day", "night"):
        raise typer.BadParameter(f"mode {mode!r} is not day or night")
    if not k8s:
        from deploy.local import read_state

        if read_state() is None:
            raise typer.BadParameter("no local cluster is running (start one with `tide up`), and --k8s was not given")
        _emit({"mode": mode, "serve_nodes": 1, "note": "a local `tide up` cluster has one node: nothing to lend"}, as_json)
        return
    try:
        from kubernetes import client, config
    except ImportError:
        raise typer.BadParameter("--k8s needs the kubernetes client: pip install 'tideserve[k8s]'") from None

    from deploy.k8s_scale import K8sScaleError, scale_worker_group

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.CustomObjectsApi()
    try:
        svc = api.get_namespaced_custom_object("ray.io", "v1", namespace, "rayservices", rayservice)
    except client.ApiException as e:
        raise typer.BadParameter(f"cannot read RayService {namespace}/{rayservice}: {e.reason}") from None
    groups = {g["groupName"]: g for g in svc["spec"]["rayClusterConfig"].get("workerGroupSpecs", [])}
    if group not in groups:
        raise typer.BadParameter(f"--group {group!r} is not a worker group of {rayservice}: {sorted(groups)}")
    fixed = fixed_nodes if fixed_nodes is not None else sum(g.get("replicas", 0) for n, g in groups.items() if n != group)
    lendable_max = groups[group].get("maxReplicas", groups[group].get("replicas", 0))
    current = fixed + groups[group].get("replicas", 0)
    if serve_nodes is not None:
        target, reason = serve_nodes, "asked"
    else:
        total = fixed + lendable_max
        saved = load_schedule()
        cfg = ScalingConfig(total_nodes=total, min_nodes=max(1, min(fixed, total)),
                            night_nodes=min(total, max(1, night_nodes or saved["night_nodes"])),
                            node_tokens_per_s=node_tokens_per_s,
                            min_dwell_s=0)
        policy = ScalingPolicy(cfg, Schedule.parse(saved["day"], saved["night"], saved["timezone"]))
        now = time.time()
        policy.observe(LoadSample(now, tokens_per_s, kv_occupancy=kv_occupancy, serving_nodes=current))
        goal = cfg.total_nodes if mode == "day" else max(cfg.night_nodes, policy.needed(cfg.headroom))
        target, reason = goal, f"{mode}: load {tokens_per_s:.0f} tok/s needs {policy.needed(cfg.headroom)} nodes"
    lendable = min(lendable_max, max(0, target - fixed))
    try:
        result = scale_worker_group(api, namespace, rayservice, group, lendable, dry_run)
    except K8sScaleError as e:
        raise typer.BadParameter(str(e)) from None
    if not dry_run:
        from deploy.local import record_serving_nodes

        record_serving_nodes(fixed + lendable)
    _emit({**result, "serve_nodes": fixed + lendable, "reason": reason}, as_json)


def _emit(result: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
