"""``tide up`` / ``tide down``: a local cluster — redis-server, a Ray head, the Serve app.

State (addresses, pids, the cluster's id) lives in ``$TIDE_HOME/run/state.json`` (0600) so
``tide down`` and the admin commands find what ``tide up`` started; ``tide down`` stops exactly
those processes (``deploy.ray_head``), never another Ray cluster on the machine. Every control
path needs a credential: the Ray head runs with token authentication (``~/.ray/auth_token`` is
made, 0600, when there is none), the cache agents with a token (``$TIDE_HOME/run/agent.token``,
0600, which signs their calls), and the local redis-server with a password
(``$TIDE_HOME/run/redis.password``, 0600). With the default ``--host`` every listener
binds to loopback.
"""

from __future__ import annotations

import importlib
import os
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.daily_report import JsonlLog, NodeSample
from deploy.connect import (
    REDIS_PASSWORD_ENV,
    ClusterUnreachable,
    Target,
    TideError,
    connect,
    read_state,
    state_path,
    write_state,
)
from deploy.ray_head import ensure_auth_token, is_loopback, start_head, stop_marked, temp_dir_for
from deploy.redis_proc import RedisServer, free_port, wait_healthy
from model.default import cache_root

__all__ = ["agent_token_file", "down", "record_serving_nodes", "up"]


def _redis_password_path() -> Path:
    return cache_root() / "run" / "redis.password"


def _cache_secret_file() -> str:
    """This cluster's cache secret (``AppArgs.cache_secret_file``): made once, in a file only this
    user can read, kept across `tide up`s so the units on disk stay valid."""
    return _run_secret("cache.secret")


def agent_token_file() -> str:
    """The cache agents' token (``AppArgs.agent_token_file``), kept like the cache secret, so
    agents still running from an earlier `tide up` on this cluster's nodes agree."""
    return _run_secret("agent.token")


def _run_secret(name: str) -> str:
    path = cache_root() / "run" / name
    if not path.is_file():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    return str(path)


def _start_redis(workdir: Path) -> tuple[int, str]:
    """A redis-server on loopback that requires a fresh password. The password is kept in a
    file only this user can read (never in the URL, the state file or the Serve config) and put
    in this process's environment, which `ray start` passes on to the app's processes."""
    password = secrets.token_urlsafe(24)
    # batch jobs and stored responses live here too: every write is logged, not only snapshots
    server = RedisServer(workdir, password=password, detach=True, save="60 1000", appendonly=True).start()
    path = _redis_password_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password)
    os.environ[REDIS_PASSWORD_ENV] = password
    return server.proc.pid, f"redis://127.0.0.1:{server.port}/0"


def up(app_args: dict[str, Any], host: str, port: int, redis_url: str | None, num_cpus: int | None,
       step: Callable[[str], None] = lambda msg: None,
       startup: Callable[[dict[str, dict]], None] = lambda replicas: None) -> dict[str, Any]:
    """Start everything; returns the state written for ``tide down``. ``step`` hears each
    stage, ``startup`` each replica's start-up progress while the app comes up."""
    if read_state() is not None:
        raise TideError(f"a local cluster is already up (state in {state_path()}); run `tide down` first")
    _check_port_free(host, port)
    _check_gpus(app_args)
    loopback = is_loopback(host)
    state: dict[str, Any] = {"cluster_id": uuid.uuid4().hex, "loopback": loopback}
    # the app's modules (torch, Ray Serve, the replica: ~2 s) load while Redis and the Ray head start
    preload = threading.Thread(target=_preload, args=("deploy.app",), name="tide-up-preload", daemon=True)
    preload.start()
    try:
        ensure_auth_token()
        if redis_url is None:
            step("starting redis-server")
            pid, redis_url = _start_redis(cache_root() / "run" / "redis")
            state["redis_pid"] = pid
        state["redis_url"] = redis_url
        step("starting the Ray head")
        ports = {"gcs": free_port(), "dashboard": free_port(), "client": free_port(), "agent": free_port()}
        head = start_head(state["cluster_id"], temp_dir_for(cache_root()), ports, loopback, num_cpus)
        # the dashboard serves the Ray Jobs API (`tide train submit` runs night training through it)
        state.update(ray_address=head.gcs_address, dashboard=head.dashboard_url, ray_temp_dir=head.temp_dir)
        write_state(state)  # from here on `tide down` can stop what was started, even if this process dies
        step("building the model and starting Serve")
        ray = connect(Target(state["ray_address"], state))
        from ray import serve

        from actors.startup import clear_startup, read_startup
        from deploy.app import build_app
        from deploy.app_args import AppArgs, gpus_needed

        # A replica or shard asking for a GPU the cluster lacks would wait forever (no autoscaler here)
        resources = ray.cluster_resources()
        need, have = gpus_needed(AppArgs(**app_args)), int(resources.get("GPU", 0))
        if need > have:
            raise ValueError(f"--device cuda needs {need} GPU(s) (one per replica, one per expert shard); "
                             f"this machine's Ray cluster has {have}")
        serve.start(http_options={"host": host, "port": port})
        app_args = served_args(app_args, resources.get("CPU", 1.0), redis_url, own_redis="redis_pid" in state)
        state["app_args"] = app_args  # `tide scale` redeploys with another replica count (the file is 0600)
        clear_startup()
        # deployed without waiting for it to run: the wait below shows the replicas' progress
        # (loading a real checkpoint takes minutes) and gives up at once on a failed deploy
        serve.run_many([serve.RunTarget(build_app(app_args), name="tideserve", route_prefix="/")],
                       wait_for_applications_running=False)
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        step("waiting for the replicas")
        wait_healthy(url, timeout_s=1800, on_wait=_watch(serve, lambda: startup(read_startup())))
        state["url"] = url + "/v1"
        write_state(state)
        record_serving_nodes(1)
        return state
    except BaseException:
        _teardown(state)
        state_path().unlink(missing_ok=True)
        raise
    finally:
        preload.join()  # not left importing while the interpreter exits


def served_args(app_args: dict[str, Any], cpus: float, redis_url: str, own_redis: bool) -> dict[str, Any]:
    """The app's args as ``tide up`` serves them and saves them for ``tide scale``: what the
    command line left open filled in from this cluster (threads, Redis, the cache secret and
    agent token files) and from this shell (``TIDE_API_KEYS``: a later ``tide scale`` runs in
    another shell, whose environment must not decide whether the API has keys)."""
    from deploy.app import api_keys_from_env

    args = {**app_args, "cpu_threads": shared_cpu_threads(cpus, app_args),
            "directory_url": app_args.get("directory_url") or redis_url,
            "cache_secret_file": app_args.get("cache_secret_file") or _cache_secret_file()}
    if not (args.get("agent_token_file") or args.get("agent_token_env")):
        args["agent_token_file"] = agent_token_file()
    if own_redis and not args.get("directory_password_env"):
        args["directory_password_env"] = REDIS_PASSWORD_ENV
    if not args.get("api_keys"):
        args["api_keys"] = api_keys_from_env()
    return args


def shared_cpu_threads(cpus: float, app_args: dict[str, Any]) -> int | None:
    """The torch threads of each CPU replica on this one machine: its ``cpus`` but one, shared by
    the replicas (decode replicas too), at least one each. The core left over runs the rest of
    the serving path (the HTTP proxy, the ingress, Ray): streaming through them while every core
    computes costs more than the core adds. Ray would give each replica one thread per CPU it
    reserves (AppArgs' ``replica_cpus`` is 1), one core of the machine whatever its size. Where
    ``cpu_threads``, ``replica_cpus`` or ``OMP_NUM_THREADS`` is set, or the replicas use GPUs,
    that stands (the ``cpu_threads`` given, or None)."""
    given = app_args.get("cpu_threads")
    if (given is not None or "replica_cpus" in app_args or os.environ.get("OMP_NUM_THREADS")
            or app_args.get("device", "cpu") != "cpu"):
        return given
    replicas = int(app_args.get("replicas", 1)) + int(app_args.get("decode_replicas", 0))
    return max(1, (int(cpus) - 1) // replicas)


def _preload(module: str) -> None:
    """Import ``module`` ahead of its use; a failure is left to the import where it is used."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001, S110 - raised again, with its traceback, where it is imported
        pass


def _watch(serve, show: Callable[[], None]) -> Callable[[], None]:
    """Between health polls: show the replicas' progress, and give up at once with Serve's own
    reason when the app failed to deploy (a replica's constructor raised, say)."""
    def check() -> None:
        show()
        app = serve.status().applications.get("tideserve")
        if app is None or str(app.status) not in ("DEPLOY_FAILED", "ApplicationStatus.DEPLOY_FAILED"):
            return
        reasons = [d.message for d in app.deployments.values() if d.message] or [app.message]
        tail = [ln for ln in "\n".join(reasons).splitlines() if ln.strip()][-12:]
        raise TideError("the app failed to deploy:\n  " + "\n  ".join(tail))
    return check


def _check_gpus(app_args: dict[str, Any]) -> None:
    """Fail before starting anything when this machine has fewer GPUs than the app takes (a
    replica or shard asking for a GPU the cluster lacks would wait forever: no autoscaler here)."""
    from actors.gpu import gpu_telemetry
    from deploy.app_args import AppArgs, gpus_needed

    need = gpus_needed(AppArgs(**app_args))
    if need:
        have = len(gpu_telemetry()["gpus"])
        if need > have:
            raise ValueError(f"--device cuda needs {need} GPU(s) (one per replica, one per expert shard); "
                             f"this machine has {have}")


def _check_port_free(host: str, port: int) -> None:
    """Fail before starting anything when the HTTP port is taken (Serve's proxy would fail to
    bind only after Redis, Ray and the replicas have started)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"--port {port} on {host} is not free ({e.strerror or e}); pick another port") from None


def _teardown(state: dict[str, Any]) -> None:
    """Stop what ``state`` says this ``tide up`` started, and nothing else."""
    if "ray_address" in state:
        try:
            ray = connect(Target(state["ray_address"], state))
            from ray import serve

            serve.shutdown()  # replicas finish in order before their processes are stopped
            ray.shutdown()
        except ClusterUnreachable:
            print("warning: the Ray head does not answer; stopping what is left of the cluster", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - tearing down as much as possible
            print(f"warning: serve shutdown: {e}", file=sys.stderr)
    if state.get("cluster_id"):
        stop_marked(state["cluster_id"], temp_dir=state.get("ray_temp_dir"))
    pid = state.get("redis_pid")
    if pid:
        stop_process(pid)
        _redis_password_path().unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def stop_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM, wait for the exit, SIGKILL after ``timeout_s``."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while process_alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)


def down() -> bool:
    """Stop what ``tide up`` started. False when nothing was up."""
    state = read_state()
    if state is None:
        return False
    _teardown(state)
    state_path().unlink(missing_ok=True)
    record_serving_nodes(0)
    return True


def record_serving_nodes(n: int, lent: int = 0) -> None:
    """Append to the serving-node log that ``tide stats`` integrates into node-hours (``lent``:
    nodes lent to training meanwhile)."""
    JsonlLog(cache_root() / "nodes.jsonl").append(NodeSample(time.time(), n, lent))
