"""What Serve runs of the app, read and changed from outside it (the day/night shell,
``deploy.tidal``): its replicas and their states, their heartbeats, redeploys with other counts."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import ray

from deploy.app_args import AppArgs

__all__ = ["app_details", "deployment_of", "fresh_reports", "model_deployments", "deploy_counts", "running_replicas",
           "serve_models", "serve_replicas", "stopping_unplaced", "wait_for"]

log = logging.getLogger(__name__)


def wait_for(cond, timeout_s: float, what: str, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def running_replicas(app_name: str, deployment: str = "LLMServer") -> int:
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        return 0
    dep = app.deployments.get(deployment)
    return dep.replica_states.get("RUNNING", 0) if dep else 0


def app_details(app_name: str):
    """Serve's details of the app (``ray.serve.schema.ApplicationDetails``), None without it."""
    from ray.serve._private.api import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    return ServeInstanceDetails(**client.get_serve_details()).applications.get(app_name)


def serve_replicas(app_name: str) -> dict[str, tuple[str, str | None]]:
    """Serve's own view of the app's replicas: actor name -> (state, node id)."""
    app = app_details(app_name)
    if app is None:
        return {}
    return {r.actor_name: (str(r.state.value), r.node_id)
            for d in app.deployments.values() for r in d.replicas if r.actor_name}


def serve_models(app_name: str, a: AppArgs) -> tuple[dict[str, int], set[str]]:
    """Serve's view of the app's model deployments: the target replica count of each, and the
    actor names of the replicas it runs (empty when there is no Serve)."""
    app = app_details(app_name)
    if app is None:
        return {}, set()
    models = {d: app.deployments[d] for d in model_deployments(a) if d in app.deployments}
    return ({d: dep.target_num_replicas for d, dep in models.items()},
            {r.actor_name for dep in models.values() for r in dep.replicas
             if r.actor_name and str(r.state.value) == "RUNNING"})


def fresh_reports(state, running: set[str], within_s: float) -> dict[str, dict]:
    """The fresh heartbeats, once every replica in ``running`` has one: a replica that has just
    started, or one on a busy node, can be a few seconds late. After ``within_s`` the late ones
    are left out (a node without a report is not chosen to lend)."""
    reports: dict[str, dict] = {}

    def all_in() -> bool:
        reports.clear()
        reports.update(ray.get(state.replica_reports.remote()))
        return running <= set(reports)

    try:
        wait_for(all_in, within_s, "every serving replica's heartbeat")
    except TimeoutError:
        log.warning("no heartbeat from %s: their nodes are not lent", sorted(running - set(reports)))
    return reports


def model_deployments(a: AppArgs) -> list[str]:
    """The app's model deployments: the replicas, and the decode pool under P/D."""
    return ["LLMServer", "LLMDecode"] if a.decode_replicas else ["LLMServer"]


def deployment_of(actor_name: str) -> str:
    """A Serve replica actor's deployment (its name is ``SERVE_REPLICA::app#deployment#id``)."""
    return "LLMDecode" if "#LLMDecode#" in actor_name else "LLMServer"


def deploy_counts(app_name: str, route_prefix: str, a: AppArgs, counts: dict[str, int]) -> None:
    """Redeploy with ``counts`` replicas per deployment."""
    from ray import serve

    from deploy.app import build_app

    update = {"replicas": counts["LLMServer"]}
    if "LLMDecode" in counts:
        update["decode_replicas"] = counts["LLMDecode"]
    serve.run(build_app(a.model_copy(update=update)), name=app_name, route_prefix=route_prefix, blocking=False)


@contextlib.contextmanager
def stopping_unplaced(app_name: str, every_s: float = 0.2) -> Iterator[list[str]]:
    """While the block runs, kill the replicas Serve is stopping that were never placed on a
    node (their names are yielded). Serve replaced the lent nodes' replicas before the counts
    dropped; the replacements cannot be placed (the leases hold the CPUs), and Serve waits its
    graceful-shutdown period (20 s) on each before it kills it. They hold no request."""
    killed: list[str] = []
    done = threading.Event()

    def run() -> None:
        while not done.wait(every_s):
            try:
                for name, (state, node) in serve_replicas(app_name).items():
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
