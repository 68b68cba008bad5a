"""``tide up`` / ``tide down``: a local cluster — redis-server, a Ray head, the Serve app.

State (addresses, the Redis pid) lives in ``$TIDE_HOME/run/state.json`` so ``tide down`` and
``tide status`` find what ``tide up`` started. Every control path needs a credential: the Ray
head runs with token authentication, the cache agents with a token, and the local redis-server
with a password (``$TIDE_HOME/run/redis.password``, mode 0600); all bind to loopback.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cluster.daily_report import JsonlLog, NodeSample
from deploy.redis_proc import RedisServer, free_port, wait_healthy
from model.default import cache_root

__all__ = ["ClusterUnreachable", "down", "read_state", "up", "write_state"]


class ClusterUnreachable(RuntimeError):
    """The local cluster's Ray head does not answer: it stopped or crashed since `tide up`."""


def state_path() -> Path:
    return cache_root() / "run" / "state.json"


def read_state() -> dict[str, Any] | None:
    p = state_path()
    return json.loads(p.read_text()) if p.is_file() else None


def write_state(state: dict[str, Any]) -> None:
    state_path().parent.mkdir(parents=True, exist_ok=True)
    state_path().write_text(json.dumps(state, indent=2))


REDIS_PASSWORD_ENV = "TIDE_REDIS_PASSWORD"  # how the app's processes get the local Redis password


def _redis_password_path() -> Path:
    return cache_root() / "run" / "redis.password"


def _start_redis(workdir: Path) -> tuple[int, str]:
    """A redis-server on loopback that requires a fresh password. The password is kept in a
    file only this user can read (never in the URL, the state file or the Serve config) and put
    in this process's environment, which `ray start` passes on to the app's processes."""
    password = secrets.token_urlsafe(24)
    server = RedisServer(workdir, password=password, detach=True, save="60 1000").start()
    path = _redis_password_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password)
    os.environ[REDIS_PASSWORD_ENV] = password
    return server.proc.pid, f"redis://127.0.0.1:{server.port}/0"


def _load_redis_password() -> None:
    """Give this process the local Redis password (a CLI command acting on a `tide up` cluster)."""
    path = _redis_password_path()
    if REDIS_PASSWORD_ENV not in os.environ and path.is_file():
        os.environ[REDIS_PASSWORD_ENV] = path.read_text().strip()


def _ray_cli() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else "ray"


def up(app_args: dict[str, Any], host: str, port: int, redis_url: str | None, num_cpus: int | None,
       step=lambda msg: None) -> dict[str, Any]:
    """Start everything; returns the state written for ``tide down``."""
    if read_state() is not None:
        raise RuntimeError(f"a local cluster is already up (state in {state_path()}); run `tide down` first")
    _check_port_free(host, port)
    state: dict[str, Any] = {}
    try:
        if redis_url is None:
            step("starting redis-server")
            pid, redis_url = _start_redis(cache_root() / "run" / "redis")
            state["redis_pid"] = pid
        state["redis_url"] = redis_url
        step("starting the Ray head")
        # Token authentication on (Ray keeps the token in ~/.ray/auth_token); a driver that
        # connects to an existing cluster only sends it when the mode is set explicitly.
        os.environ["RAY_AUTH_MODE"] = "token"
        gcs_port, dashboard_port = free_port(), free_port()
        # the dashboard serves the Ray Jobs API (`tide train submit` runs night training through it)
        cmd = [_ray_cli(), "start", "--head", f"--port={gcs_port}", "--disable-usage-stats",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
        if num_cpus is not None:
            cmd.append(f"--num-cpus={num_cpus}")
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        state["ray_address"] = f"127.0.0.1:{gcs_port}"
        state["dashboard"] = f"http://127.0.0.1:{dashboard_port}"
        step("building the model and starting Serve")
        import ray
        from ray import serve

        from deploy.app import AppArgs, build_app, gpus_needed

        ray.init(address=state["ray_address"], log_to_driver=False)
        # A replica or shard asking for a GPU the cluster lacks would wait forever (no autoscaler here)
        need, have = gpus_needed(AppArgs(**app_args)), int(ray.cluster_resources().get("GPU", 0))
        if need > have:
            raise ValueError(f"--device cuda needs {need} GPU(s) (one per replica, one per expert shard); "
                             f"this machine's Ray cluster has {have}")
        serve.start(http_options={"host": host, "port": port})
        app_args = {**app_args, "directory_url": app_args.get("directory_url") or redis_url}
        if "redis_pid" in state and not app_args.get("directory_password_env"):
            app_args["directory_password_env"] = REDIS_PASSWORD_ENV
        state["app_args"] = app_args  # `tide scale` redeploys with another replica count
        serve.run(build_app(app_args), name="tideserve", route_prefix="/", blocking=False)
        url = f"http://{host}:{port}"
        step("waiting for the app to be healthy")
        wait_healthy(url)
        state["url"] = url + "/v1"
        write_state(state)
        record_serving_nodes(1)
        return state
    except BaseException:
        _teardown(state)
        raise


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
    if "ray_address" in state:
        try:
            ray = _connect(state)
            from ray import serve

            serve.shutdown()
            ray.shutdown()
        except ClusterUnreachable:
            print("warning: the Ray head does not answer; stopping what is left of the cluster", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - tearing down as much as possible
            print(f"warning: serve shutdown: {e}", file=sys.stderr)
        subprocess.run([_ray_cli(), "stop", "--force"], capture_output=True)
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


def check_reachable(state: dict[str, Any], timeout_s: float = 3.0) -> None:
    """Raise ``ClusterUnreachable`` unless the Ray head accepts a connection (``ray.init`` would
    retry a dead head's address for minutes)."""
    host, port = state["ray_address"].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ClusterUnreachable(
            f"the local cluster's Ray head at {state['ray_address']} does not answer ({e.strerror or e}): it "
            "stopped or crashed since `tide up`; run `tide down` to clean up, then `tide up`"
        ) from None


def _connect(state: dict[str, Any]):
    """Connect this process to the running cluster (once); returns the ``ray`` module.
    ``ClusterUnreachable`` when the head is gone."""
    os.environ["RAY_AUTH_MODE"] = "token"  # set before ray is imported
    import ray

    if not ray.is_initialized():
        check_reachable(state)
        ray.init(address=state["ray_address"], log_to_driver=False)
    return ray


def serve_handle(state: dict[str, Any]):
    """A handle to the running app's ``LLMServer`` deployment (connects this process to Ray)."""
    _load_redis_password()  # a redeploy (`tide scale`) and the directory reads need it
    _connect(state)
    from ray import serve

    return serve.get_deployment_handle("LLMServer", app_name="tideserve")


def _replica_stats(state_actor, handle, pd: bool) -> list[dict]:
    """Every replica's stats from its heartbeat (prefill pool first under P/D, marked ``pool``);
    one replica's, asked through the app, when none has reported yet."""
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
    return out or [handle.stats.remote().result(timeout_s=30)]


def cluster_status(state: dict[str, Any]) -> dict[str, Any]:
    """Nodes (role: serving, lent, idle), the replicas' engine and cache stats, expert placement."""
    handle = serve_handle(state)  # sets RAY_AUTH_MODE before ray is imported
    import ray

    from actors.tidal import tidal_state
    from deploy.ep_admin import find_ep_control

    state_actor = tidal_state()
    roles, reports = ray.get(state_actor.roles.remote()), ray.get(state_actor.reports.remote())
    replicas = _replica_stats(state_actor, handle, bool((state.get("app_args") or {}).get("decode_replicas")))
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

    return {"url": state["url"], "nodes": nodes, "replicas": replicas, "expert_placement": placement,
            "cache": cache_stats()}


def record_serving_nodes(n: int) -> None:
    """Append to the serving-node log that ``tide stats`` integrates into node-hours."""
    JsonlLog(cache_root() / "nodes.jsonl").append(NodeSample(time.time(), n))
