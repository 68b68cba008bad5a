"""``tide cache``: the prompt cache of the running cluster, through every node's cache agent."""

from __future__ import annotations

import json
import sys

import typer

cache_app = typer.Typer(help="The prompt cache on every node (through the cache agents).", no_args_is_help=True)

TOTALS = ("ssd_units", "ssd_bytes", "ssd_pinned", "ram_units", "ram_bytes", "ssd_hits", "ssd_misses",
          "ssd_corrupt", "ssd_evictions", "fetch_units", "fetch_remote_units", "push_accepted",
          "push_refused", "replication_pushed")


def _connect():
    from deploy.local import read_state, serve_handle

    state = read_state()
    if state is None:
        raise typer.BadParameter("no local cluster is running (start one with `tide up`)")
    return serve_handle(state)  # connects this process to the cluster


def agents() -> dict:
    """node id -> the cache agent handle of every alive node that has one."""
    import ray

    from actors.cache_agent import NAMESPACE, agent_name

    out = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        try:
            out[node["NodeID"]] = ray.get_actor(agent_name(node["NodeID"]), namespace=NAMESPACE)
        except ValueError:
            continue
    return out


def cache_stats() -> dict:
    """Per-node agent stats and their totals (also used by ``tide status``)."""
    import ray

    handles = agents()
    nodes = dict(zip(handles, ray.get([h.stats.remote() for h in handles.values()], timeout=60), strict=True))
    totals = {k: sum(int(s.get(k, 0)) for s in nodes.values()) for k in TOTALS}
    return {"nodes": nodes, "totals": totals}


def _keys(server, key: list[str] | None, prompt: str | None, prompt_ids: str | None, tenant: str) -> list[str]:
    given = sum(x is not None and x != [] for x in (key, prompt, prompt_ids))
    if given != 1:
        raise typer.BadParameter("give exactly one of --key, --prompt, --prompt-ids")
    if key:
        for k in key:
            try:
                if len(bytes.fromhex(k)) != 16:
                    raise ValueError
            except ValueError:
                raise typer.BadParameter(f"--key {k!r} is not a unit key (32 hex digits)") from None
        return list(key)
    ids = None
    if prompt_ids is not None:
        try:
            ids = [int(x) for x in prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(f"--prompt-ids {prompt_ids!r} must be comma-separated integers") from None
    keys = server.unit_keys.remote(ids, tenant=tenant, text=prompt).result(timeout_s=60)
    if not keys:
        raise typer.BadParameter("the prompt is shorter than one 64-token cache unit")
    return keys


def _print(out: dict, as_json: bool) -> None:
    sys.stdout.write(json.dumps(out) + "\n" if as_json else "\n".join(f"{k}: {v}" for k, v in out.items()) + "\n")


@cache_app.command("stats")
def stats(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Units, bytes and pins per tier on every node, hits, remote fetches, replication."""
    _connect()
    out = cache_stats()
    if as_json:
        _print(out, True)
        return
    for node, s in out["nodes"].items():
        sys.stdout.write(f"{node[:12]}  {s.get('address')}  ssd {s.get('ssd_units', 0)} units "
                         f"{s.get('ssd_bytes', 0) / 1e6:.1f} MB ({s.get('ssd_pinned', 0)} pinned)  "
                         f"ram {s.get('ram_units', 0)} units  fetched {s.get('fetch_units', 0)} "
                         f"(remote {s.get('fetch_remote_units', 0)})  replicated {s.get('replication_pushed', 0)}\n")
    _print({"total": out["totals"]}, False)


@cache_app.command("evict")
def evict(
    all_units: bool = typer.Option(False, "--all", help="every unit on every node (pinned ones too)"),
    key: list[str] = typer.Option(None, "--key", help="a unit key (hex); repeatable"),
    prompt: str = typer.Option(None, "--prompt", help="the units of this prompt text"),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="the units of these token ids (comma-separated)"),
    tenant: str = typer.Option("", "--tenant", help="the tenant whose units (--prompt, --prompt-ids)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Drop units from every node (both tiers); the directory forgets them at the next sync."""
    server = _connect()  # before `import ray`: it sets the cluster's auth mode
    import ray

    if all_units:
        if key or prompt is not None or prompt_ids is not None:
            raise typer.BadParameter("--all takes no --key, --prompt or --prompt-ids")
        keys = None
    else:
        keys = _keys(server, key, prompt, prompt_ids, tenant)
    handles = agents()
    removed = ray.get([h.evict.remote(keys) for h in handles.values()], timeout=120)
    _print({"evicted": dict(zip(handles, removed, strict=True)), "total": sum(removed)}, as_json)


@cache_app.command("pin")
def pin(
    key: list[str] = typer.Option(None, "--key", help="a unit key (hex); repeatable"),
    prompt: str = typer.Option(None, "--prompt", help="the units of this prompt text (e.g. a shared system prompt)"),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="the units of these token ids (comma-separated)"),
    tenant: str = typer.Option("", "--tenant", help="the tenant whose units (--prompt, --prompt-ids)"),
    unpin: bool = typer.Option(False, "--unpin", help="make them evictable again"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Keep units on every node that holds them, whatever the eviction policy (also across
    restarts). A prompt's units exist once it has been served."""
    server = _connect()  # before `import ray`: it sets the cluster's auth mode
    import ray

    keys = _keys(server, key, prompt, prompt_ids, tenant)
    handles = agents()
    counts = ray.get([h.pin.remote(keys, unpin) for h in handles.values()], timeout=120)
    _print({"units": len(keys), "unpinned" if unpin else "pinned": dict(zip(handles, counts, strict=True))}, as_json)
