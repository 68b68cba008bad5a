"""`tide up`'s Ray head: its token, its failure message, and stopping exactly its processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deploy.ray_head import (
    CLUSTER_ID_ENV,
    ChildFailed,
    auth_token_source,
    ensure_auth_token,
    marked_processes,
    start_head,
    stop_marked,
    temp_dir_for,
)
from deploy.redis_proc import free_port


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_a_missing_token_is_made_private_and_an_existing_one_is_kept(home, monkeypatch):
    assert auth_token_source() is None
    path = Path(ensure_auth_token())
    assert path == home / ".ray" / "auth_token" and path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o077 == 0 and len(path.read_text()) == 64
    first = path.read_text()
    assert ensure_auth_token() == str(path) and path.read_text() == first  # never replaced
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(home / "missing"))
    with pytest.raises(RuntimeError, match="names no file"):  # a named file that is not there is not invented
        ensure_auth_token()
    monkeypatch.setenv("RAY_AUTH_TOKEN", "abc")
    assert ensure_auth_token() == "RAY_AUTH_TOKEN"


def test_the_temp_dir_is_short_and_one_per_home(tmp_path):
    a, b = temp_dir_for(tmp_path / "x" / ("deep" * 20)), temp_dir_for(tmp_path / "y")
    assert a != b and a == temp_dir_for(tmp_path / "x" / ("deep" * 20))
    assert len(str(a)) + len("/session_2026-12-01_20-59-50_494504_4862/sockets/plasma_store") < 107


def _sleeper(marker: str | None) -> subprocess.Popen:
    env = {**os.environ, CLUSTER_ID_ENV: marker} if marker else {k: v for k, v in os.environ.items()
                                                                  if k != CLUSTER_ID_ENV}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)


def test_stop_signals_exactly_the_marked_processes():
    ours, child_of_ours, other, unmarked = _sleeper("c1"), _sleeper("c1"), _sleeper("c2"), _sleeper(None)
    try:
        assert sorted(marked_processes("c1")) == sorted([ours.pid, child_of_ours.pid])
        assert stop_marked("c1", timeout_s=10) == 2
        assert ours.wait(10) is not None and child_of_ours.wait(10) is not None
        assert other.poll() is None and unmarked.poll() is None  # another cluster's, and nobody's
        assert marked_processes("c1") == [] and marked_processes("c2") == [other.pid]
    finally:
        for p in (ours, child_of_ours, other, unmarked):
            p.kill()
            p.wait()


def test_rays_renamed_agents_are_found_by_the_files_they_hold_in_the_clusters_temp_dir(tmp_path):
    """A Ray agent's title overwrites the environment /proc shows, marker included: it is the
    cluster's when it is a ``ray::`` process holding a file under the cluster's temp dir. A
    ``ray::`` process of another temp dir, and any other process reading a file there (a user's
    ``tail -f`` of a log), are not."""
    ours_dir, other_dir = tmp_path / "tide-0-ours", tmp_path / "tide-0-other"
    for d in (ours_dir, other_dir):
        (d / "logs").mkdir(parents=True)
        (d / "logs" / "dashboard_agent.out").write_text("")

    def renamed(title: str, holding: Path) -> subprocess.Popen:
        return subprocess.Popen(["bash", "-c", f"exec -a {title} sleep 600 < {holding}"], env={"PATH": os.environ["PATH"]})

    agent = renamed("ray::DashboardAgent", ours_dir / "logs" / "dashboard_agent.out")
    others = [renamed("ray::DashboardAgent", other_dir / "logs" / "dashboard_agent.out"),
              renamed("tail", ours_dir / "logs" / "dashboard_agent.out")]
    try:
        deadline = time.monotonic() + 60
        while not all(Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith((b"ray::", b"tail"))
                      for p in (agent, *others)):  # bash has exec'd them
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert marked_processes("c4", ours_dir) == [agent.pid]
        assert marked_processes("c4") == []  # without the temp dir: the environment alone
        assert stop_marked("c4", timeout_s=10, temp_dir=ours_dir) == 1
        assert agent.wait(10) == -signal.SIGTERM and all(p.poll() is None for p in others)
    finally:
        for p in (agent, *others):
            p.kill()
            p.wait()


@pytest.mark.parametrize("title", ["/opt/ray/raylet/raylet", "ray::RuntimeEnvAgent"])
def test_a_daemon_deaf_to_sigterm_is_killed_once_the_rest_has_exited(title):
    """Ray's raylet and gcs_server ignore SIGTERM, and its runtime-env agent leaves only with its
    raylet: when only they are left, they are killed then, not at the (here hour-long) timeout."""
    env = {**os.environ, CLUSTER_ID_ENV: "c3"}
    deaf = subprocess.Popen(["bash", "-c", f"trap '' TERM; exec -a {title} sleep 600"], env=env)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
    try:
        deadline = time.monotonic() + 60
        # bash has exec'd it (its own command line names the daemon too, before the trap is set)
        while not Path(f"/proc/{deaf.pid}/cmdline").read_bytes().startswith(title.encode()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stopper = threading.Thread(target=stop_marked, args=("c3", 3600.0), daemon=True)
        stopper.start()
        stopper.join(120)
        assert not stopper.is_alive()
        assert deaf.wait(10) == -signal.SIGKILL and worker.wait(10) == -signal.SIGTERM
    finally:
        for p in (deaf, worker):
            p.kill()
            p.wait()


@pytest.mark.ray
def test_a_failing_ray_start_is_one_error_with_rays_own_last_lines(home, tmp_path):
    ensure_auth_token()
    # a client-server port inside Ray's worker port range: Ray refuses it, naming the port
    ports = {"gcs": free_port(), "dashboard": free_port(), "client": 10500, "agent": free_port()}
    with pytest.raises(ChildFailed) as e:
        start_head("t-fail", Path(f"/tmp/tide-t-{os.getpid()}"), ports, True, 1, timeout_s=120)
    msg = str(e.value)
    assert msg.startswith("ray start exited with status 1") and "10500" in msg, msg
    assert "\x1b[" not in msg and len(msg.splitlines()) <= 13  # Ray's last lines, without colour codes
    assert marked_processes("t-fail") == []  # nothing left running


_LATE = subprocess.CompletedProcess([], 1, "", "Exception: The current node timed out during startup. ...")
_OTHER = subprocess.CompletedProcess([], 1, "", "ValueError: port 10500 is taken")
_OK = subprocess.CompletedProcess([], 0, "started", "")


@pytest.mark.parametrize("answers, fails", [([_LATE, _OK], False), ([_LATE, _LATE], True), ([_OTHER, _OK], True)])
def test_a_ray_start_whose_raylet_registered_late_is_stopped_and_tried_again_once(answers, fails, monkeypatch,
                                                                                   tmp_path):
    """Ray gives a raylet a fixed 30 s to register; on a busy machine `ray start` can fail so.
    What that start left is stopped (by the cluster's mark) and it is tried once more; another
    failure, or a second late one, is the error."""
    from deploy import ray_head

    runs, stops = list(answers), []
    monkeypatch.setattr(ray_head.subprocess, "run", lambda cmd, **kw: runs.pop(0))
    monkeypatch.setattr(ray_head, "stop_marked", lambda cid, **kw: stops.append((cid, kw["temp_dir"])) or 0)
    ports = {"gcs": 1, "dashboard": 2, "client": 3, "agent": 4}
    if fails:
        with pytest.raises(ChildFailed):
            start_head("c1", tmp_path, ports, True, 1)
    else:
        assert start_head("c1", tmp_path, ports, True, 1).gcs_address == "127.0.0.1:1"
    late = answers[0] is _LATE
    assert runs == ([] if late else [_OK])  # a failure of another kind is not tried again
    assert stops == ([("c1", tmp_path)] if late else [])


def test_the_driver_settings_reach_ray_even_when_it_was_imported_first():
    """`tide up` imports Ray (checking GPUs) before it connects: token authentication and the
    loopback switch must still take effect (127.0.0.1 rewritten to the machine's address, where
    no GCS listens, hung `tide up` for 10 minutes; without the token mode the GCS refuses it)."""
    code = (
        "import ray, ray._private.services as s\n"
        "from ray._private.authentication.authentication_utils import is_token_auth_enabled\n"
        "from deploy.ray_head import configure_driver\n"
        "assert not is_token_auth_enabled()\n"
        "configure_driver(loopback=True, token_auth=True)\n"
        "print(s.resolve_ip_for_localhost('127.0.0.1'), is_token_auth_enabled())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "127.0.0.1 True"


def test_nothing_of_the_cluster_is_left_when_stop_returns_even_what_a_dying_process_forked():
    """A process that ignores SIGTERM and keeps starting children (as a raylet starts workers)
    until it is killed: a child forked after the last look would outlive a single SIGKILL round;
    stop returns only once no process of the cluster is left."""
    env = {**os.environ, CLUSTER_ID_ENV: "c5"}
    spawner = subprocess.Popen(["bash", "-c", "trap '' TERM; while true; do sleep 600 & sleep 0.002; done"], env=env,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(marked_processes("c5")) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stop_marked("c5", timeout_s=0.5)
        assert marked_processes("c5") == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(spawner.pid, signal.SIGKILL)
        spawner.wait()
