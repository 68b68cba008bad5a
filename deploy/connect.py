"""Which Ray cluster an admin command acts on, and connecting to it.

``--address`` (or ``RAY_ADDRESS``, as ``ray`` and ``serve`` read it) names any Ray cluster that
runs the tideserve app: one ``tide up`` started, a ``ray start`` cluster running ``serve run
deploy/serve_config.yaml``, or a KubeRay head (``RAY_ADDRESS`` is set in its pods). Without
one, the command acts on the cluster ``tide up`` started (``$TIDE_HOME/run/state.json``).
Token authentication is used when the cluster is ``tide up``'s or a token is available, as
``ray`` does.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.ray_head import auth_token_source, configure_driver
from model.default import cache_root

__all__ = [
    "APP_NAME",
    "ClusterUnreachable",
    "NoCluster",
    "Target",
    "TideError",
    "connect",
    "disconnect",
    "find_target",
    "read_state",
    "require_app",
    "serve_handle",
    "state_path",
    "write_state",
]

APP_NAME = "tideserve"
ADDRESS_HELP = "the Ray cluster (host:port of its GCS; default: $RAY_ADDRESS, else the one `tide up` started)"
REDIS_PASSWORD_ENV = "TIDE_REDIS_PASSWORD"  # how the app's processes get the local Redis password


class TideError(RuntimeError):
    """A runtime condition the CLI reports as one line with exit status 1 (not a usage error)."""


class NoCluster(TideError):
    """No cluster was named and ``tide up`` started none."""


class ClusterUnreachable(TideError):
    """The cluster's Ray head does not answer: it stopped or crashed."""


def state_path() -> Path:
    return cache_root() / "run" / "state.json"


def read_state() -> dict[str, Any] | None:
    p = state_path()
    return json.loads(p.read_text()) if p.is_file() else None


def write_state(state: dict[str, Any]) -> None:
    """The state file holds addresses and API keys: 0600 in a 0700 directory."""
    p = state_path()
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(state, indent=2))
    os.replace(tmp, p)


@dataclass(frozen=True, slots=True)
class Target:
    """A cluster to act on. ``local``: the state of the ``tide up`` that started it."""

    address: str
    local: dict[str, Any] | None = None

    @property
    def loopback(self) -> bool:
        return bool(self.local and self.local.get("loopback"))


def find_target(address: str | None = None) -> Target:
    """``address`` (from ``--address``/``RAY_ADDRESS``), else ``tide up``'s cluster; ``NoCluster``."""
    state = read_state()
    if address:
        if address.startswith("ray://"):
            raise TideError(f"--address {address}: Ray Client addresses are not supported; give the GCS host:port")
        if state is not None and address in (state.get("ray_address"), "auto"):
            return Target(state["ray_address"], state)
        return Target(address)
    if state is None:
        raise NoCluster("no cluster is running: start one with `tide up`, or name one with --address / RAY_ADDRESS")
    return Target(state["ray_address"], state)


def check_reachable(target: Target, timeout_s: float = 3.0) -> None:
    """``ClusterUnreachable`` unless the head accepts a connection (``ray.init`` would retry a
    dead head's address for minutes)."""
    if target.address == "auto":
        return
    host, _, port = target.address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        where = "the cluster `tide up` started" if target.local else "the cluster"
        hint = ("it stopped or crashed since `tide up`; run `tide down` to clean up, then `tide up`" if target.local
                else "is the address right, and is the cluster up?")
        raise ClusterUnreachable(f"{where} at {target.address} does not answer "
                                 f"({getattr(e, 'strerror', None) or e}): {hint}") from None


def _quiet_ray_logs() -> None:
    """Ray's driver prints INFO lines ("Connected to Ray cluster ...") on every connect."""
    import logging

    for name in ("ray", "ray.serve"):
        logging.getLogger(name).setLevel(logging.WARNING)


def connect(target: Target):
    """Connect this process to the cluster (once) and return the ``ray`` module."""
    configure_driver(target.loopback, target.local is not None or auth_token_source() is not None)
    _load_redis_password(target)
    import ray

    if not ray.is_initialized():
        check_reachable(target)
        _quiet_ray_logs()
        _context[:] = [ray.init(address=target.address, log_to_driver=False, logging_level="WARNING")]
    return ray


_context: list = []  # the RayContext of this process's connection


def disconnect() -> None:
    """Leave the cluster ``connect`` joined, if it did: at once, where Ray's exit hook would first
    wait half a second for log lines that a command never forwards (``log_to_driver=False``)."""
    if _context:
        import ray

        _context.clear()
        ray.shutdown()


def _load_redis_password(target: Target) -> None:
    """Give this process the local Redis password (a redeploy and the directory reads need it)."""
    path = cache_root() / "run" / "redis.password"
    if target.local is not None and REDIS_PASSWORD_ENV not in os.environ and path.is_file():
        os.environ[REDIS_PASSWORD_ENV] = path.read_text().strip()


def require_app(target: Target) -> None:
    """Connect this process to the cluster; ``TideError`` unless the tideserve app runs there
    (Serve's controller and a replica of the app are alive: Serve names them
    ``SERVE_CONTROLLER_ACTOR`` and ``SERVE_REPLICA::<app>#...`` in namespace ``serve``). For the
    commands that then talk to the app's own actors: it imports no ``ray.serve``, about a second
    of a command's start."""
    ray = connect(target)
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"}
    if "SERVE_CONTROLLER_ACTOR" not in names:
        raise TideError(f"the cluster at {target.address} runs no Ray Serve")
    if not any(n.startswith(f"SERVE_REPLICA::{APP_NAME}#") for n in names):
        raise TideError(f"the cluster at {target.address} runs no {APP_NAME!r} app")


def serve_handle(target: Target, deployment: str = "LLMServer"):
    """A handle to a deployment of the running app (connects this process; ``require_app``'s
    ``TideError`` when the cluster runs no tideserve app)."""
    require_app(target)
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=APP_NAME)


def app_args(target: Target, redeploy: bool = False) -> dict[str, Any]:
    """The args the running app was built from (``deploy.app_args.AppArgs`` fields): ``tide up``'s
    state, else what ``build_app`` recorded in the cluster. ``redeploy``: they will build the
    app again, so an app with API keys (which the cluster never stores) cannot be redeployed
    from there."""
    if target.local is not None and target.local.get("app_args") is not None:
        return dict(target.local["app_args"])
    from deploy.app import recorded_app_args

    args = recorded_app_args()
    if args is None:
        raise TideError(f"the app on {target.address} recorded no build arguments (was it built by deploy.app?)")
    has_keys = args.pop("has_api_keys", False)
    if redeploy and has_keys:
        raise TideError(f"the app on {target.address} uses API keys, which are not stored in the cluster: "
                        "scale it by redeploying its Serve config")
    return args


def dashboard_url(target: Target) -> str | None:
    """The cluster's dashboard (the Ray Jobs API)."""
    if target.local is not None:
        return target.local.get("dashboard")
    url = getattr(_context[0], "dashboard_url", None) if _context else None
    if url and not url.startswith("http"):
        url = "http://" + url
    return url or None


def alive_actors(detail: bool = False) -> list:
    """The live actors of the Ray this process is connected to (``ray.util.state``, asked of
    its GCS: without an address the state API takes the newest Ray on the machine, which may be
    another one)."""
    import ray
    from ray.util.state import list_actors

    return list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")],
                       limit=10000, detail=detail)
