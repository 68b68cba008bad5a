"""``tide status``: the cluster's nodes and roles, replicas, expert placement, cache, load, GPUs."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import typer

from deploy.connect import ADDRESS_HELP, Target, app_args, require_app, serve_handle


def status(
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    address: str = typer.Option(None, "--address", envvar="RAY_ADDRESS", help=ADDRESS_HELP),
) -> None:
    """Nodes and their roles, replicas, expert placement, cache per node and tier, load, GPUs."""
    from actors.gpu import gpu_telemetry
    from deploy.connect import find_target

    report = cluster_status(find_target(address))
    report["gpus"] = gpu_telemetry()
    if as_json:
        sys.stdout.write(json.dumps(report, default=str) + "\n")
        return
    from deploy.term import stdout_console

    print_report(stdout_console(), report)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _acceptance(spec: dict | None) -> str:
    """MTP drafts accepted, per draft position ("-": the replica does not draft)."""
    if not spec:
        return "-"
    return " ".join(f"{a:,}/{d:,} ({a / d:.0%})" if d else "0/0" for a, d in
                    zip(spec["accepted_tokens"], spec["draft_tokens"], strict=True))


def print_report(console, report: dict) -> None:
    """The human form of ``tide status``: one table per section."""
    from rich.table import Table

    console.print(f"[bold]tideserve[/bold] at {report['url'] or 'an unknown URL'}  (Ray at {report['address']})")
    nodes = Table(title="nodes", title_justify="left", box=None)
    for col in ("node", "role", "CPUs"):
        nodes.add_column(col)
    for n in report["nodes"]:
        nodes.add_row(n["node_id"][:12], n["role"], f"{n['cpus']:.0f}")
    console.print(nodes)

    replicas = Table(title="replicas", title_justify="left", box=None)
    for col in ("replica", "node", "pool", "threads", "running", "waiting", "prefill tok", "decode tok", "MTP accepted"):
        replicas.add_column(col, justify="right" if col not in ("replica", "node", "pool") else "left")
    for r in report["replicas"]:
        engine = r.get("engine", {})
        name = r.get("actor_name") or r.get("replica_id") or "?"
        replicas.add_row(name.split("#")[-1], str(r.get("node_id", "?"))[:12], r.get("pool", "both"),
                         str(r.get("threads", "?")), str(r.get("running", 0)), str(r.get("waiting", 0)), f"{engine.get('prefill_tokens', 0):,}",
                         f"{engine.get('decode_tokens', 0):,}", _acceptance(r.get("spec_decode")))
    console.print(replicas)

    cache = Table(title="prompt cache", title_justify="left", box=None)
    for col in ("node", "tier", "units", "bytes", "pinned", "hits"):
        cache.add_column(col, justify="left" if col in ("node", "tier") else "right")
    for node, s in sorted(report["cache"]["nodes"].items()):
        cache.add_row(node[:12], "ssd", f"{s.get('ssd_units', 0):,}", _mb(s.get("ssd_bytes", 0)),
                      f"{s.get('ssd_pinned', 0):,}", f"{s.get('ssd_hits', 0):,}")
        cache.add_row("", "ram", f"{s.get('ram_units', 0):,}", _mb(s.get("ram_bytes", 0)), "", f"{s.get('ram_hits', 0):,}")
    t = report["cache"]["totals"]
    cache.add_row("[bold]all[/bold]", "ssd", f"{t['ssd_units']:,}", _mb(t["ssd_bytes"]), f"{t['ssd_pinned']:,}",
                  f"{t['ssd_hits']:,}")
    console.print(cache)

    ep = report["expert_placement"]
    if ep:
        console.print(f"expert placement: version {ep['version']} over {ep['shards']} shards; "
                      f"replicas serving it: {len(ep['replicas'])}")
    gpus = report["gpus"]
    console.print(f"GPUs: {len(gpus['gpus'])}" if gpus["available"] else f"GPUs: none ({gpus['reason']})")


def _replica_stats(state_actor, target: Target, pd: bool) -> list[dict]:
    """Every replica's stats from its heartbeat (prefill pool first under P/D, marked ``pool``);
    one replica's, asked through the app (a Serve handle: ``ray.serve``'s import, ~0.6 s), when
    none has reported yet."""
    import ray

    reports = ray.get(state_actor.replica_reports.remote(), timeout=30)
    out = []
    for name, r in sorted(reports.items(), key=lambda item: ("LLMDecode" in item[0], item[0])):
        if "stats" not in r:
            continue
        entry = {**r["stats"], "actor_name": name}
        if pd:
            entry["pool"] = "decode" if "LLMDecode" in name else "prefill"
        out.append(entry)
    return out or [serve_handle(target).stats.remote().result(timeout_s=30)]


def cluster_status(target: Target) -> dict[str, Any]:
    """Nodes (role: serving, lent, idle), the replicas' engine and cache stats, expert placement."""
    require_app(target)
    import ray

    from actors.tidal import tidal_state
    from deploy.ep_admin import find_ep_control

    state_actor = tidal_state()
    roles, reports = ray.get(state_actor.roles.remote()), ray.get(state_actor.reports.remote())
    replicas = _replica_stats(state_actor, target, bool(app_args(target).get("decode_replicas")))
    control = find_ep_control()
    ep = ray.get(control.info.remote(), timeout=30) if control is not None else None
    serving = {n for n, r in reports.items() if time.time() - r["time"] < 10}

    def role(n: dict) -> str:
        if not n["Alive"]:
            return "gone"
        r = roles.get(n["NodeID"], "serving")
        if r == "serving" and n["NodeID"] not in serving:
            return "idle"  # no replica there
        return r

    nodes = [{"node_id": n["NodeID"], "alive": n["Alive"], "cpus": n["Resources"].get("CPU", 0), "role": role(n)}
             for n in ray.nodes()]
    placement = ({"shards": ep["num_shards"], "version": ep["version"], "replicas": ep["replicas"]}
                 if ep else None)
    from deploy.cache_cli import cache_stats

    url = (target.local or {}).get("url") or _serve_url()
    return {"url": url, "address": target.address, "nodes": nodes, "replicas": replicas, "expert_placement": placement,
            "cache": cache_stats()}


def _serve_url() -> str | None:
    """The HTTP address Serve listens on (a cluster `tide up` did not start)."""
    try:
        from ray.serve.context import _get_global_client

        http = _get_global_client().http_config
        host = "127.0.0.1" if http.host in ("0.0.0.0", "::") else http.host
        return f"http://{host}:{http.port}/v1"
    except Exception:  # noqa: BLE001 - shown as unknown
        return None
