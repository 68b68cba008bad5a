"""``tide cache``: the prompt cache of the running cluster, through every node's cache agent."""

from __future__ import annotations

import json
import sys

import typer

from deploy.connect import ADDRESS_HELP

cache_app = typer.Typer(help="The prompt cache on every node (through the cache agents).", no_args_is_help=True)
ADDRESS = typer.Option(None, "--address", envvar="RAY_ADDRESS", help=ADDRESS_HELP)

TOTALS = ("ssd_units", "ssd_bytes", "ssd_pinned", "ram_units", "ram_bytes", "ssd_hits", "ssd_misses",
          "ssd_corrupt", "ssd_evictions", "fetch_units", "fetch_remote_units", "push_accepted",
          "push_refused", "replication_pushed")


def _connect(address: str | None):
    from deploy.connect import find_target, serve_handle

    return serve_handle(find_target(address))  # connects this process to the cluster


def cache_stats() -> dict:
    """Per-node agent stats and their totals (also used by ``tide status``)."""
    from actors.cache_agent import agents_stats

    nodes = agents_stats()
    totals = {k: sum(int(s.get(k, 0)) for s in nodes.values()) for k in TOTALS}
    return {"nodes": nodes, "totals": totals}


def _which(key: list[str] | None, prompt: str | None, prompt_ids: str | None) -> list[int] | None:
    """Check the unit options before connecting (a usage error needs no cluster): exactly one,
    keys of 32 hex digits, ids as integers; returns the parsed ids."""
    given = sum(x is not None and x != [] for x in (key, prompt, prompt_ids))
    if given != 1:
        raise typer.BadParameter("give exactly one of --key, --prompt, --prompt-ids")
    for k in key or ():
        try:
            if len(bytes.fromhex(k)) != 16:
                raise ValueError
        except ValueError:
            raise typer.BadParameter(f"--key {k!r} is not a unit key (32 hex digits)") from None
    if prompt_ids is None:
        return None
    try:
        return [int(x) for x in prompt_ids.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--prompt-ids {prompt_ids!r} must be comma-separated integers") from None


def _keys(server, key: list[str] | None, prompt: str | None, ids: list[int] | None, tenant: str) -> list[str]:
    """The unit keys the options name (a prompt's, as the replicas hash it)."""
    if key:
        return list(key)
    keys = server.unit_keys.remote(ids, tenant=tenant, text=prompt).result(timeout_s=60)
    if not keys:
        raise typer.BadParameter("the prompt is shorter than one 64-token cache unit")
    return keys


def _per_node(title: str, counts: dict[str, int], verb: str) -> None:
    """A one-line-per-node summary of an evict or pin."""
    from rich.table import Table

    from deploy.term import stdout_console

    table = Table(title=title, title_justify="left", box=None)
    table.add_column("node")
    table.add_column(verb, justify="right")
    for node, n in sorted(counts.items()):
        table.add_row(node[:12], f"{n:,}")
    table.add_row("[bold]all[/bold]", f"{sum(counts.values()):,}")
    stdout_console().print(table)


@cache_app.command("stats")
def stats(as_json: bool = typer.Option(False, "--json", help="print JSON"), address: str = ADDRESS) -> None:
    """Units, bytes and pins per tier on every node, hits, remote fetches, replication."""
    _connect(address)
    out = cache_stats()
    if as_json:
        sys.stdout.write(json.dumps(out) + "\n")
        return
    from rich.table import Table

    from deploy.term import stdout_console

    table = Table(box=None)
    for col in ("node", "agent", "ssd units", "ssd MB", "pinned", "ram units", "ram MB", "hits", "fetched",
                "remote", "replicated"):
        table.add_column(col, justify="left" if col in ("node", "agent") else "right")

    def row(name: str, address: str, s: dict) -> None:
        table.add_row(name, address, f"{s.get('ssd_units', 0):,}", f"{s.get('ssd_bytes', 0) / 1e6:,.1f}",
                      f"{s.get('ssd_pinned', 0):,}", f"{s.get('ram_units', 0):,}", f"{s.get('ram_bytes', 0) / 1e6:,.1f}",
                      f"{s.get('ssd_hits', 0):,}", f"{s.get('fetch_units', 0):,}", f"{s.get('fetch_remote_units', 0):,}",
                      f"{s.get('replication_pushed', 0):,}")

    for node, s in sorted(out["nodes"].items()):
        row(node[:12], str(s.get("address", "")), s)
    row("[bold]all[/bold]", "", out["totals"])
    stdout_console().print(table)


@cache_app.command("evict")
def evict(
    all_units: bool = typer.Option(False, "--all", help="every unit on every node (pinned ones too)"),
    key: list[str] = typer.Option(None, "--key", help="a unit key (hex); repeatable"),
    prompt: str = typer.Option(None, "--prompt", help="the units of this prompt text"),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="the units of these token ids (comma-separated)"),
    tenant: str = typer.Option("", "--tenant", help="the tenant whose units (--prompt, --prompt-ids)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    address: str = ADDRESS,
) -> None:
    """Drop units from every node (both tiers); the directory forgets them at the next sync."""
    if all_units and (key or prompt is not None or prompt_ids is not None):
        raise typer.BadParameter("--all takes no --key, --prompt or --prompt-ids")
    ids = None if all_units else _which(key, prompt, prompt_ids)
    server = _connect(address)  # before `import ray`: it sets the cluster's auth mode
    import ray

    from actors.cache_agent import agent_handles

    keys = None if all_units else _keys(server, key, prompt, ids, tenant)
    handles = agent_handles()
    removed = dict(zip(handles, ray.get([h.evict.remote(keys) for h in handles.values()], timeout=120), strict=True))
    if as_json:
        sys.stdout.write(json.dumps({"evicted": removed, "total": sum(removed.values())}) + "\n")
    else:
        _per_node("units evicted", removed, "evicted")


@cache_app.command("pin")
def pin(
    key: list[str] = typer.Option(None, "--key", help="a unit key (hex); repeatable"),
    prompt: str = typer.Option(None, "--prompt", help="the units of this prompt text (e.g. a shared system prompt)"),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="the units of these token ids (comma-separated)"),
    tenant: str = typer.Option("", "--tenant", help="the tenant whose units (--prompt, --prompt-ids)"),
    unpin: bool = typer.Option(False, "--unpin", help="make them evictable again"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    address: str = ADDRESS,
) -> None:
    """Keep units on every node that holds them, whatever the eviction policy (also across
    restarts). A prompt's units exist once it has been served."""
    ids = _which(key, prompt, prompt_ids)
    server = _connect(address)  # before `import ray`: it sets the cluster's auth mode
    import ray

    from actors.cache_agent import agent_handles

    keys = _keys(server, key, prompt, ids, tenant)
    handles = agent_handles()
    verb = "unpinned" if unpin else "pinned"
    counts = dict(zip(handles, ray.get([h.pin.remote(keys, unpin) for h in handles.values()], timeout=120), strict=True))
    if as_json:
        sys.stdout.write(json.dumps({"units": len(keys), verb: counts}) + "\n")
    else:
        _per_node(f"{len(keys)} units of the prompt, {verb} on each node that holds them", counts, verb)
