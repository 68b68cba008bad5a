"""The Ray head that ``tide up`` starts, and stopping exactly it.

Every process of the head (gcs_server, raylet, dashboard, workers, Serve replicas) carries the
cluster's id in its environment (``TIDE_CLUSTER_ID``), which Ray hands down to every process it
starts; ``stop`` signals the processes that carry it and nothing else, so other Ray clusters on
the machine survive. The head keeps its own temp directory (sessions, logs, sockets), so it
never becomes the machine's "current" Ray cluster that a bare ``ray.init()`` or ``serve run``
attaches to. On loopback every Ray listener binds to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CLUSTER_ID_ENV",
    "ChildFailed",
    "HeadProcess",
    "SERVE_ENV",
    "auth_token_source",
    "ensure_auth_token",
    "loopback_env",
    "serve_env",
    "configure_driver",
    "marked_processes",
    "processes_with",
    "start_head",
    "stop_marked",
    "temp_dir_for",
]

CLUSTER_ID_ENV = "TIDE_CLUSTER_ID"
# Ray resolves a loopback --node-ip-address to the machine's address (so other nodes can join)
# and then listens on every interface. Its single-machine mode (the default on macOS/Windows)
# keeps the node on 127.0.0.1 and binds every gRPC server, agent and worker there.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Ray gives a new node's raylet a fixed 30 s to register with the GCS; a start on a busy machine
# can miss that, and only that failure (Ray's words for it) is tried again
RAYLET_LATE = "timed out during startup"
RAY_START_TRIES = 2
log = logging.getLogger(__name__)


class ChildFailed(RuntimeError):
    """A child process (``ray start``, redis-server) failed; the message ends with its last lines."""

    def __init__(self, what: str, returncode: int, output: str, lines: int = 12) -> None:
        tail = [ln for ln in _ANSI.sub("", output).splitlines() if ln.strip()][-lines:]
        super().__init__(f"{what} exited with status {returncode}:\n  " + "\n  ".join(tail))


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def loopback_env(loopback: bool) -> dict[str, str]:
    """The environment a process needs to start or join a loopback-only Ray cluster."""
    return dict(LOOPBACK_ENV) if loopback else {}


def configure_driver(loopback: bool, token_auth: bool) -> None:
    """Set this process's Ray switches before it connects: token authentication, and reaching a
    loopback-only cluster at 127.0.0.1 (Ray otherwise rewrites 127.0.0.1 to the machine's
    address, where nothing listens). Ray reads both once, when it is first imported; when it is
    already loaded the module constant and Ray's config are refreshed too."""
    changed = False
    if token_auth and os.environ.get("RAY_AUTH_MODE") != "token":
        os.environ["RAY_AUTH_MODE"] = "token"
        changed = True
    if loopback:
        os.environ.update(LOOPBACK_ENV)
        constants = sys.modules.get("ray._private.ray_constants")
        if constants is not None:
            constants.ENABLE_RAY_CLUSTER = False
    raylet = sys.modules.get("ray._raylet")
    if changed and raylet is not None:
        raylet.Config.initialize("")  # re-reads RAY_AUTH_MODE
        raylet.AuthenticationTokenLoader.instance().reset_cache()


# -- Ray's token ------------------------------------------------------------------------------
def auth_token_source() -> str | None:
    """Where Ray would read its token from (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, or
    ``~/.ray/auth_token``), or None when there is none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return path if Path(path).is_file() else None
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def ensure_auth_token() -> str:
    """Ray's token source, creating ``~/.ray/auth_token`` (mode 0600, in a 0700 directory) when
    there is none. ``RAY_AUTH_TOKEN_PATH`` naming a missing file is an error, not a new token."""
    found = auth_token_source()
    if found is not None:
        return found
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        raise RuntimeError(f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']} names no file")
    import secrets

    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it meanwhile: use theirs
        return str(path)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return str(path)


# -- the head ---------------------------------------------------------------------------------
def temp_dir_for(home: Path) -> Path:
    """The head's Ray temp directory: one per ``$TIDE_HOME``, short enough for Ray's socket
    paths (a Unix socket path has at most 107 bytes), private to this user."""
    key = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"tide-{os.getuid()}-{key}"


@dataclass(frozen=True, slots=True)
class HeadProcess:
    cluster_id: str
    gcs_address: str  # host:port
    dashboard_url: str
    temp_dir: str


def _ray_cli() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else "ray"


# Serve kills an HTTP proxy that is not ready 5 s after its actor was created (and starts
# another), failing the ``serve.start`` that waits for it: on a busy node starting a worker
# process alone can take longer. Given to every Ray this project starts (``serve_env``).
SERVE_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}


def serve_env() -> dict[str, str]:
    """What a Ray started now adds to this process's environment: ``SERVE_ENV``'s variables the
    environment does not set (a value set there wins)."""
    return {k: v for k, v in SERVE_ENV.items() if k not in os.environ}


def start_head(
    cluster_id: str, temp_dir: Path, ports: dict[str, int], loopback: bool, num_cpus: int | None,
    timeout_s: float = 180.0,
) -> HeadProcess:
    """``ray start --head`` with token authentication, marked with ``cluster_id``. ``ports``:
    gcs, dashboard, client (Ray client server), agent (dashboard agent's HTTP port); fixed ports
    so that two clusters on one machine do not both take Ray's defaults. A start whose raylet
    registered too late (``RAYLET_LATE``) is stopped and tried again; ``ChildFailed`` with Ray's
    own last lines when it fails otherwise, or again."""
    temp_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    host = "127.0.0.1"
    cmd = [
        _ray_cli(), "start", "--head", f"--port={ports['gcs']}", "--disable-usage-stats",
        f"--temp-dir={temp_dir}", "--include-dashboard=true", f"--dashboard-host={host}",
        f"--dashboard-port={ports['dashboard']}", f"--ray-client-server-port={ports['client']}",
        f"--dashboard-agent-listen-port={ports['agent']}",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    env = {**os.environ, **serve_env(), CLUSTER_ID_ENV: cluster_id, "RAY_AUTH_MODE": "token", **loopback_env(loopback)}
    for attempt in range(RAY_START_TRIES):
        try:
            # its own session: a Ctrl-C at the terminal reaches `tide up`, which tears down in order
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                               start_new_session=True)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            raise ChildFailed("ray start (timed out)", -1, out) from None
        if r.returncode == 0:
            break
        out = r.stdout + r.stderr
        if RAYLET_LATE not in out or attempt + 1 == RAY_START_TRIES:
            raise ChildFailed("ray start", r.returncode, out)
        # what the failed start left running (its GCS, the raylet) goes before the next try
        log.warning("ray start: the raylet did not register within Ray's 30 s (a busy machine?); trying again")
        stop_marked(cluster_id, temp_dir=temp_dir)
    # the GCS listens on loopback in either mode: drivers on this machine connect there
    return HeadProcess(cluster_id, f"{host}:{ports['gcs']}", f"http://{host}:{ports['dashboard']}", str(temp_dir))


# -- stopping exactly what we started ---------------------------------------------------------
def marked_processes(cluster_id: str, temp_dir: str | Path | None = None) -> list[int]:
    """Pids of the live processes of cluster ``cluster_id``: ``processes_with`` its marker,
    ``TIDE_CLUSTER_ID=cluster_id``."""
    return processes_with(f"{CLUSTER_ID_ENV}={cluster_id}", temp_dir)


def processes_with(env_entry: str, temp_dir: str | Path | None = None) -> list[int]:
    """Pids of the live processes whose environment carries ``env_entry`` (NAME=value) and, given
    a cluster's ``temp_dir``, of Ray's renamed processes (``ray::...``) that hold a file open
    under it. A Ray agent renaming itself writes its title over the environment ``/proc`` shows."""
    marker = env_entry.encode()
    under = str(temp_dir).rstrip("/") + "/" if temp_dir else None
    own = os.getpid()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                ours = marker in f.read().split(b"\0")
            if not ours and under is not None:
                ours = _renamed_ray_process_under(int(entry.name), under)
        except OSError:  # gone, or not ours to read
            continue
        if ours and _alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def _renamed_ray_process_under(pid: int, under: str) -> bool:
    """Whether ``pid`` is a ``ray::`` process with a file open under the directory ``under``."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        if not f.read().startswith(b"ray::"):
            return False
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(under):
                return True
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


# Ray's daemons that do not exit on SIGTERM: once the rest of a cluster has, they are killed. The
# runtime-env agent leaves only with its raylet (tide down waited out its whole SIGTERM timeout).
_DEAF_TO_SIGTERM = ("gcs_server", "raylet", "monitor.py", "ray::RuntimeEnvAgent")


def _deaf_to_sigterm(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return any(os.path.basename(a.decode(errors="replace")) in _DEAF_TO_SIGTERM for a in argv[:3])


KILL_WAIT_S = 10.0  # how long SIGKILL is repeated while processes of the cluster are left


def stop_marked(cluster_id: str, timeout_s: float = 3.0, temp_dir: str | Path | None = None) -> int:
    """SIGTERM every process of the cluster (``marked_processes``) and SIGKILL what is left once
    only Ray's daemons that ignore SIGTERM (gcs_server, raylet, the autoscaler monitor) remain,
    or after ``timeout_s`` (Serve was shut down in order before), again until none is left (a
    process may start another until it is killed; at most ``KILL_WAIT_S``); returns how many
    there were. Processes of other clusters are never signalled."""
    pids = marked_processes(cluster_id, temp_dir)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if all(_deaf_to_sigterm(p) for p in left):
            break
        time.sleep(0.1)
    deadline = time.monotonic() + KILL_WAIT_S
    while (left := marked_processes(cluster_id, temp_dir)) and time.monotonic() < deadline:
        for pid in left:  # stragglers, and anything started meanwhile
            _signal(pid, signal.SIGKILL)
        time.sleep(0.02)
    return len(pids)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
