"""``tide logs``: the app's logs (requests at the ingress, replicas, optionally Serve's own), from
every node, through Ray's log API; ``--follow`` keeps printing new lines."""

from __future__ import annotations

import sys
import threading

import typer

from deploy.connect import ADDRESS_HELP

# Serve writes one log per replica: serve/replica_<app>_<deployment>_<id>.log
_COMPONENTS = {"ingress": ("OpenAIIngress",), "replicas": ("LLMServer", "LLMDecode"),
               "serve": ("controller_", "proxy_")}


def _wanted(name: str, components: tuple[str, ...]) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.endswith(".log") and any(m in base for c in components for m in _COMPONENTS[c])


def logs(
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines (Ctrl-C stops)"),
    lines: int = typer.Option(50, "--lines", "-n", min=0, help="lines of each log to show first"),
    component: list[str] = typer.Option(None, "--component", help="ingress | replicas | serve (repeatable; default: ingress and replicas)"),
    address: str = typer.Option(None, "--address", envvar="RAY_ADDRESS", help=ADDRESS_HELP),
) -> None:
    """Show the app's logs: each request's line at the ingress and the replicas' logs."""
    chosen = tuple(component or ("ingress", "replicas"))
    bad = [c for c in chosen if c not in _COMPONENTS]
    if bad:
        raise typer.BadParameter(f"--component {bad[0]!r} is not one of {', '.join(_COMPONENTS)}")
    from deploy.connect import TideError, connect, find_target

    target = find_target(address)
    ray = connect(target)
    from ray.util.state import get_log, list_logs

    api = target.address  # the state API finds the dashboard through the GCS
    files = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        listed = list_logs(address=api, node_id=node["NodeID"], glob_filter="serve/*")
        files += [(node["NodeID"], f) for fs in listed.values() for f in fs if _wanted(f, chosen)]
    if not files:
        raise TideError("no logs of the app yet (is it deployed?)")
    lock = threading.Lock()

    def show(node_id: str, name: str) -> None:
        label = name.rsplit("/", 1)[-1].removeprefix("replica_").removesuffix(".log")
        try:
            for chunk in get_log(address=api, node_id=node_id, filename=name, tail=lines, follow=follow):
                with lock:
                    for line in chunk.splitlines():
                        sys.stdout.write(f"[{label}] {line}\n")
                    sys.stdout.flush()
        except Exception as e:  # noqa: BLE001 - a log that went away (its replica stopped)
            with lock:
                sys.stderr.write(f"[{label}] log ended: {e}\n")

    if not follow:
        for node_id, name in files:
            show(node_id, name)
        return
    threads = [threading.Thread(target=show, args=f, daemon=True) for f in files]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        pass
