"""``tide status``: the local cluster's nodes and roles, replicas, expert placement, cache, load, GPUs."""

from __future__ import annotations

import json
import sys

import typer


def status(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Nodes and their roles, replicas, expert placement, cache per tier, current load, GPUs."""
    from actors.gpu import gpu_telemetry
    from deploy.local import cluster_status, read_state

    state = read_state()
    if state is None:
        raise typer.BadParameter("no local cluster is running (start one with `tide up`)")
    report = cluster_status(state)
    report["gpus"] = gpu_telemetry()
    if as_json:
        sys.stdout.write(json.dumps(report, default=str) + "\n")
        return
    from rich.console import Console

    console = Console()
    console.print(f"[bold]tideserve[/bold] at {state['url']}")
    for node in report["nodes"]:
        console.print(f"  node {node['node_id'][:12]}  {node['role']:<8} cpus={node['cpus']:.0f}")
    for r in report["replicas"]:
        pool = f" ({r['pool']})" if "pool" in r else ""
        console.print(f"  replica {r['node_id']}{pool}: running={r['running']} waiting={r['waiting']} "
                      f"cache={r['cache']}")
    gpus = report["gpus"]
    console.print(f"  GPUs: {len(gpus['gpus'])}" if gpus["available"] else f"  GPUs: absent ({gpus['reason']})")
