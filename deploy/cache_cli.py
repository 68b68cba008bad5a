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


def _connect(address: str | None, server: bool = False):
    """Connect this process to the cluster that runs the app; ``server``: return a handle to
    its replicas too (which imports Ray Serve: only where a prompt must be hashed as they do)."""
    from deploy.connect import find_target, require_app, serve_handle

    target = find_target(address)
    if server:
        return serve_handle(target)
    require_app(target)
    return None


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
    """The unit keys the options name (a prompt's, as the replicas hash it: ``server``)."""
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
    # before `import ray`: it sets the cluster's auth mode
    server = _connect(address, server=not all_units and not key)
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
    server = _connect(address, server=not key)  # before `import ray`: it sets the cluster's auth mode
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


# what became of each whole unit of a prompt (``tide cache explain``), in the order they are tested
EXPLAIN_CLASSES = {
    "found": "the directory lists a live node that holds it: a request now can load it",
    "stale": "the directory lists nodes that no longer hold it: a load would miss and compute it",
    "unlisted": "a node holds it but the directory did not list it (registration pending, or past the "
                "first unit it found missing): computed unless routed to that node",
    "evicted": "no node holds it; a node dropped it for capacity or age",
    "removed": "no node holds it; removed with `tide cache evict`",
    "damaged": "no node holds it; its file was found damaged and dropped",
    "never seen": "no node holds it or dropped it recently: never computed here, or long ago",
    "no resume point": "found, but no node holds a resume record after it or a later found unit (a model "
                       "whose window state is kept apart, DeepSeek-V4): computed from the last unit with one",
}


def explain_units(info: dict, nodes: dict[str, dict[str, list[str]]]) -> dict:
    """Classify each whole unit before a prompt's last token from the directory's answer
    (``LLMServer.explain``: keys, cacheable, listed; ``resume_keys``, one a cacheable unit, for a
    model that needs a resume record after the units it loads) and every node's
    (``CacheAgent.explain`` of the cacheable keys, then the resume keys: tiers held, why dropped),
    as ``EXPLAIN_CLASSES`` names them."""
    from cluster.request import UNIT_TOKENS

    units = []
    for i in range(info["cacheable"]):
        listed = [tuple(h) for h in info["listed"][i]] if i < len(info["listed"]) else []
        held = {node: a["tiers"][i] for node, a in nodes.items() if a["tiers"][i]}
        gone = {node: a["gone"][i] for node, a in nodes.items() if a["gone"][i] and not a["tiers"][i]}
        if listed:
            cls = "found" if any(node in held for node, _ in listed) else "stale"
        elif held:
            cls = "unlisted"
        else:
            cls = next((why for why in ("evicted", "removed", "damaged") if why in gone.values()), "never seen")
        units.append({"index": i, "key": info["keys"][i], "tokens": [i * UNIT_TOKENS, (i + 1) * UNIT_TOKENS],
                      "class": cls, "listed": [{"node": n, "tier": t} for n, t in listed], "held": held, "gone": gone})
    resume = info.get("resume_keys")
    if resume:  # a found run is loadable up to its last unit that a resume record follows
        run = next((i for i, u in enumerate(units) if u["class"] != "found"), len(units))
        after = [any(a["tiers"][len(info["keys"][: info["cacheable"]]) + i] for a in nodes.values())
                 for i in range(run)]
        loadable = max((i + 1 for i in range(run) if after[i]), default=0)
        for i, u in enumerate(units[:run]):
            u["resume_record"] = after[i]
            if i >= loadable:
                u["class"] = "no resume point"
    summary = {cls: sum(u["class"] == cls for u in units) for cls in EXPLAIN_CLASSES}
    return {"whole_units": len(info["keys"]), "cacheable": info["cacheable"], "directory": info.get("directory", True),
            "directory_error": info.get("directory_error"), "summary": summary, "units": units}


@cache_app.command("explain")
def explain(
    prompt: str = typer.Option(None, "--prompt", help="the prompt text (tokenized as the completions API does)"),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="the prompt's token ids (comma-separated)"),
    tenant: str = typer.Option("", "--tenant", help="the tenant whose cache"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
    address: str = ADDRESS,
) -> None:
    """What the cache holds of one prompt and why the rest would be computed: each whole unit
    before its last token, what the directory lists for it, which nodes hold it, and its class
    (found, stale, unlisted, evicted, removed, damaged, never seen)."""
    ids = _which(None, prompt, prompt_ids)
    server = _connect(address, server=True)  # before `import ray`: it sets the cluster's auth mode
    import ray

    from actors.cache_agent import agent_handles

    info = server.explain.remote(ids, tenant=tenant, text=prompt).result(timeout_s=60)
    if not info["cacheable"]:
        raise typer.BadParameter("the prompt has no whole 64-token cache unit before its last token")
    keys = info["keys"][: info["cacheable"]] + info.get("resume_keys", [])
    handles = agent_handles()
    nodes = dict(zip(handles, ray.get([h.explain.remote(keys) for h in handles.values()], timeout=120), strict=True))
    out = explain_units(info, nodes)
    if as_json:
        sys.stdout.write(json.dumps(out) + "\n")
        return
    from rich.table import Table

    from deploy.term import stdout_console

    table = Table(title=f"{out['cacheable']} whole units before the prompt's last token", title_justify="left", box=None)
    for col in ("unit", "tokens", "class", "directory lists", "held by"):
        table.add_column(col)
    for u in out["units"]:
        table.add_row(str(u["index"]), f"{u['tokens'][0]}-{u['tokens'][1]}", u["class"],
                      ", ".join(f"{h['node'][:12]} ({h['tier']})" for h in u["listed"]) or "-",
                      ", ".join(f"{n[:12]} ({t})" for n, t in u["held"].items()) or "-")
    console = stdout_console()
    console.print(table)
    for cls, n in out["summary"].items():
        if n:
            console.print(f"{n:>5} {cls}: {EXPLAIN_CLASSES[cls]}")
    if out["directory_error"]:
        console.print(f"the directory did not answer: {out['directory_error']}")
