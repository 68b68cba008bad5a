"""``tide up`` / ``tide down``: a local cluster — redis-server, a Ray head, the Serve app.

State (addresses, the Redis pid) lives in ``$TIDE_HOME/run/state.json`` so ``tide down`` and
``tide status`` find what ``tide up`` started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from deploy.redis_proc import free_port
from model.default import cache_root

__all__ = ["down", "read_state", "up"]


def state_path() -> Path:
    return cache_root() / "run" / "state.json"


def read_state() -> dict[str, Any] | None:
    p = state_path()
    return json.loads(p.read_text()) if p.is_file() else None


def _start_redis(workdir: Path) -> tuple[int, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it), or pass --redis-url")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = open(workdir / "redis.log", "ab")  # noqa: SIM115 - handed to the daemon
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "60 1000",
         "--appendonly", "no"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    log.close()
    deadline = time.monotonic() + 10
    import socket

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}; see {workdir / 'redis.log'}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc.pid, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start within 10 s")


def _ray_cli() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else "ray"


def up(app_args: dict[str, Any], host: str, port: int, redis_url: str | None, num_cpus: int | None,
       step=lambda msg: None) -> dict[str, Any]:
    """Start everything; returns the state written for ``tide down``."""
    if read_state() is not None:
        raise RuntimeError(f"a local cluster is already up (state in {state_path()}); run `tide down` first")
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
        gcs_port = free_port()
        cmd = [_ray_cli(), "start", "--head", f"--port={gcs_port}", "--disable-usage-stats",
               "--include-dashboard=false"]
        if num_cpus is not None:
            cmd.append(f"--num-cpus={num_cpus}")
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        state["ray_address"] = f"127.0.0.1:{gcs_port}"
        step("building the model and starting Serve")
        import ray
        from ray import serve

        from deploy.app import build_app

        ray.init(address=state["ray_address"], log_to_driver=False)
        serve.start(http_options={"host": host, "port": port})
        app_args = {**app_args, "directory_url": app_args.get("directory_url") or redis_url}
        serve.run(build_app(app_args), name="tideserve", route_prefix="/", blocking=False)
        url = f"http://{host}:{port}"
        step("waiting for the app to be healthy")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("the app did not become healthy within 300 s (see `serve status`)")
        state["url"] = url + "/v1"
        state_path().parent.mkdir(parents=True, exist_ok=True)
        state_path().write_text(json.dumps(state, indent=2))
        return state
    except BaseException:
        _teardown(state)
        raise


def _teardown(state: dict[str, Any]) -> None:
    os.environ["RAY_AUTH_MODE"] = "token"
    if "ray_address" in state:
        try:
            import ray
            from ray import serve

            if not ray.is_initialized():
                ray.init(address=state["ray_address"], log_to_driver=False)
            serve.shutdown()
            ray.shutdown()
        except Exception as e:  # noqa: BLE001 - tearing down as much as possible
            print(f"warning: serve shutdown: {e}", file=sys.stderr)
        subprocess.run([_ray_cli(), "stop", "--force"], capture_output=True)
    pid = state.get("redis_pid")
    if pid:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def down() -> bool:
    """Stop what ``tide up`` started. False when nothing was up."""
    state = read_state()
    if state is None:
        return False
    _teardown(state)
    state_path().unlink(missing_ok=True)
    return True
