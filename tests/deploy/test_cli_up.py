"""`tide up` / `tide down` as a newcomer runs them, on a fresh HOME (no Ray token, no earlier
cluster) with another Ray cluster on the machine: a real local cluster, then a clean stop of
exactly what it started. And the app on a cluster `tide up` did not start (`serve run`), which
the admin commands reach with --address / RAY_ADDRESS."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from deploy.local import process_alive
from deploy.ray_head import marked_processes, processes_with, stop_marked, temp_dir_for
from deploy.redis_proc import free_port
from tests.cli import tide, tide_here
from tests.listeners import is_loopback, listening

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fresh_home(tmp_path_factory) -> Path:
    """A HOME no Ray ever ran in: no token, no caches (each test's TIDE_HOME is its own)."""
    return tmp_path_factory.mktemp("home")


def _env(home: Path | None, fresh_home: Path, **extra: str) -> dict[str, str]:
    # as a newcomer's shell: no OMP_NUM_THREADS either (the suite's processes get one each)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TIDE_")) and k != "OMP_NUM_THREADS"}
    env.update(HOME=str(fresh_home), **extra)
    if home is not None:
        env["TIDE_HOME"] = str(home)
    return env


def _tide(*args, home, fresh_home=None, timeout=600, env=None):
    return tide(*args, env=env or _env(home, fresh_home or home / "home"), timeout=timeout, replace_env=True)


def _tide_here(*args, home):
    """``tide ARGS`` in this process (``tests.cli.tide_here``), for a usage error found before
    anything starts: without a child's seconds of starting Python."""
    return tide_here(*args, env={"TIDE_HOME": str(home), "HOME": str(home / "home"), "TIDE_API_KEYS": None})


def _ray_head(tmp: Path, env: dict[str, str]) -> tuple[str, str]:
    """Another Ray cluster (its own temp dir, marked so the test can stop exactly it): its
    address and marker."""
    from deploy.ray_head import RAY_START_TRIES, RAYLET_LATE, stop_marked

    marker, port = uuid.uuid4().hex, free_port()
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", f"--port={port}",
           "--disable-usage-stats", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}", "--num-cpus=1", f"--temp-dir={tmp / 'ray'}"]
    for _ in range(RAY_START_TRIES):  # as `tide up` does: a raylet late on a busy machine is tried again
        r = subprocess.run(cmd, env={**env, "TIDE_CLUSTER_ID": marker}, capture_output=True, text=True, timeout=180,
                           start_new_session=True)
        if r.returncode == 0 or RAYLET_LATE not in r.stderr + r.stdout:
            break
        stop_marked(marker, temp_dir=tmp / "ray")
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
    return f"127.0.0.1:{port}", marker


@pytest.fixture
def other_cluster(fresh_home):
    """A Ray cluster someone else runs on this machine (no authentication, as `ray start` makes
    one on a HOME without a token); `tide down` must leave it running. Stopped (with its temp
    dir) when the test ends."""
    tmp = Path(f"/tmp/tide-other-{uuid.uuid4().hex[:8]}")  # short: Ray's socket paths
    address, marker = _ray_head(tmp, _env(None, fresh_home, RAY_AUTH_MODE="disabled"))
    yield address, marker
    stop_marked(marker)
    shutil.rmtree(tmp, ignore_errors=True)


def test_up_serves_then_down_stops_everything(tmp_path, fresh_home, other_cluster):
    port = free_port()
    token = fresh_home / ".ray" / "auth_token"
    assert not token.exists()  # a first run: Ray's token is made by `tide up`
    # P/D (a prefill and a decode replica) over two expert shards that both use
    r = _tide("up", "--port", str(port), "--num-cpus", "2", "--expert-shards", "2", "--decode-replicas", "1",
              home=tmp_path, fresh_home=fresh_home)
    try:
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"http://127.0.0.1:{port}/v1" in r.stdout
        assert token.stat().st_mode & 0o777 == 0o600 and token.parent.stat().st_mode & 0o077 == 0
        state = json.loads((tmp_path / "run" / "state.json").read_text())
        assert (tmp_path / "run" / "state.json").stat().st_mode & 0o777 == 0o600
        # every listener of the cluster (Ray, Serve, replicas, cache agent, expert-parallel
        # store and gloo, Redis) is on loopback
        ours = marked_processes(state["cluster_id"], state["ray_temp_dir"]) + [state["redis_pid"]]
        sockets = listening(ours)
        assert len(sockets) >= 10 and any(p == port for _, _, p in sockets)
        assert [s for s in sockets if not is_loopback(s[1])] == []
        assert all(pid not in ours for pid in marked_processes(other_cluster[1]))
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 4
        # every control path needs a credential: Redis a password (in a 0600 file, nowhere else),
        # the Ray Jobs API (the dashboard) Ray's token
        import redis

        pw_file = tmp_path / "run" / "redis.password"
        password = pw_file.read_text().strip()
        assert pw_file.stat().st_mode & 0o777 == 0o600 and password not in (tmp_path / "run" / "state.json").read_text()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(state["redis_url"]).ping()
        assert redis.Redis.from_url(state["redis_url"], password=password).ping()
        assert httpx.get(state["dashboard"] + "/api/jobs/", timeout=30).status_code in (401, 403)
        again = _tide("up", "--port", str(port), home=tmp_path, fresh_home=fresh_home)
        assert again.returncode == 1 and "already up" in again.stderr
        st = _tide("status", "--json", home=tmp_path, fresh_home=fresh_home)
        assert st.returncode == 0, st.stderr[-2000:]
        report = json.loads(st.stdout)
        assert report["url"] == state["url"] and report["nodes"][0]["role"] == "serving"
        assert [r.get("pool") for r in report["replicas"]] == ["prefill", "decode"]
        assert {r["cpu_kernels"] for r in report["replicas"]} == {"loaded"}  # built before the replica was ready
        # the 2 CPUs but one shared by the two replicas: a thread each (at least), recorded for redeploys
        assert state["app_args"]["cpu_threads"] == 1 and [r["threads"] for r in report["replicas"]] == [1, 1]
        assert report["replicas"][0]["engine"]["prefill_tokens"] >= 1
        assert report["replicas"][1]["engine"]["decode_tokens"] >= 1  # the decode replica generated
        assert report["gpus"]["available"] in (True, False) and "gpus" in report["gpus"]
        assert report["expert_placement"]["shards"] == 2
        show = _tide("eplb", "show", "--json", home=tmp_path, fresh_home=fresh_home)
        assert show.returncode == 0, show.stderr[-2000:]
        placement = json.loads(show.stdout)
        assert placement["shards"] == 2 and list(placement["replicas"].values()) == [placement["version"]] * 2
        assert placement["imbalance"] is not None  # the replica's measured load reached the control
        rebalance = _tide("eplb", "rebalance", "--json", home=tmp_path, fresh_home=fresh_home)
        assert rebalance.returncode == 0, rebalance.stderr[-2000:]
        assert "moved_slots" in json.loads(rebalance.stdout)
        # day/night on a one-node cluster: nothing to lend, no training
        night = _tide("scale", "night", "--json", home=tmp_path, fresh_home=fresh_home)
        assert night.returncode == 0, night.stderr[-2000:]
        assert json.loads(night.stdout)["changed"] is False and json.loads(night.stdout)["serve_nodes"] == 1
        assert json.loads(_tide("train", "status", "--json", home=tmp_path, fresh_home=fresh_home).stdout)["job_id"] is None
        assert "no training job" in _tide("train", "status", home=tmp_path, fresh_home=fresh_home).stdout
        sub = _tide("train", "submit", home=tmp_path, fresh_home=fresh_home)
        assert sub.returncode == 1 and sub.stderr.strip() == "error: no node is lent to training (run `tide scale night` first)"
        capped = _tide("scale", "--serve-nodes", "2", "--dry-run", home=tmp_path, fresh_home=fresh_home)
        assert capped.returncode == 0 and "capped to the 1 alive node" in capped.stdout, capped.stdout
        # the cache through the node's agent: stats, pin a served prompt's units, evict the rest
        text = "the tide comes in and the tide goes out, " * 6  # 246 bytes: 3 whole units
        for _ in range(2):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": text, "max_tokens": 2})
            assert r.status_code == 200
        assert r.json()["usage"]["prompt_cache_hit_tokens"] == 3 * 64
        assert report["cache"]["totals"]["ssd_units"] >= 0 and len(report["cache"]["nodes"]) == 1
        stats = json.loads(_tide("cache", "stats", "--json", home=tmp_path, fresh_home=fresh_home).stdout)
        assert stats["totals"]["ssd_units"] >= 3
        # the served prompt's units: found (the directory lists the node that holds them)
        explained = _tide("cache", "explain", "--prompt", text, "--json", home=tmp_path, fresh_home=fresh_home)
        assert explained.returncode == 0, explained.stderr[-2000:]
        assert json.loads(explained.stdout)["summary"]["found"] == 3, explained.stdout
        # the node's cache agent answers only calls signed with the agent token, a 0600 file like
        # the cache secret; neither is in the state file
        from cachedir.agent.client import AgentClient, AgentError

        run = tmp_path / "run"
        assert {f: (run / f).stat().st_mode & 0o777 for f in ("agent.token", "cache.secret")} == {
            "agent.token": 0o600, "cache.secret": 0o600}
        agent_token = (run / "agent.token").read_text().strip()
        assert agent_token not in (run / "state.json").read_text()
        (agent,) = [n["address"] for n in stats["nodes"].values()]
        with AgentClient(agent, timeout_s=10) as c, pytest.raises(AgentError, match="UNAUTHENTICATED"):
            c.has([bytes(16)])
        with AgentClient(agent, agent_token, timeout_s=10) as c:
            assert c.has([bytes(16)]) == [""]
        human = _tide("status", home=tmp_path, fresh_home=fresh_home)
        assert human.returncode == 0 and "prompt cache" in human.stdout and "{" not in human.stdout  # tables, no dicts
        assert "INFO" not in human.stderr and "worker.py" not in human.stderr  # no Ray connect chatter
        pinned = _tide("cache", "pin", "--prompt", text, "--json", home=tmp_path, fresh_home=fresh_home)
        assert pinned.returncode == 0, pinned.stderr[-2000:]
        assert json.loads(pinned.stdout)["units"] == 3 and sum(json.loads(pinned.stdout)["pinned"].values()) == 3
        assert json.loads(_tide("cache", "stats", "--json", home=tmp_path, fresh_home=fresh_home).stdout)["totals"]["ssd_pinned"] == 3
        bad = _tide("cache", "evict", "--key", "xyz", home=tmp_path, fresh_home=fresh_home)
        assert bad.returncode == 2 and "xyz" in bad.stderr
        ev = _tide("cache", "evict", "--all", home=tmp_path, fresh_home=fresh_home)
        assert ev.returncode == 0 and "units evicted" in ev.stdout and "Started" not in ev.stdout + ev.stderr, ev.stdout
        assert json.loads(_tide("cache", "stats", "--json", home=tmp_path, fresh_home=fresh_home).stdout)["totals"]["ssd_units"] == 0
        gone = _tide("cache", "explain", "--prompt", text, home=tmp_path, fresh_home=fresh_home)
        assert gone.returncode == 0 and "3 removed" in " ".join(gone.stdout.split()), gone.stdout
    finally:
        d = _tide("down", home=tmp_path, fresh_home=fresh_home)
    assert d.returncode == 0, d.stderr[-2000:]
    assert not (tmp_path / "run" / "redis.password").exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=3)
    assert not process_alive(state["redis_pid"])
    # every process it started is gone (Ray's agents too, whose titles hide the marker)...
    assert marked_processes(state["cluster_id"], state["ray_temp_dir"]) == []
    assert marked_processes(other_cluster[1])  # ... and the other cluster on this machine still runs
    assert _tide("down", home=tmp_path, fresh_home=fresh_home).returncode == 1  # nothing left to stop
    gone = _tide("status", home=tmp_path, fresh_home=fresh_home)
    assert gone.returncode == 1 and gone.stderr.startswith("error: no cluster is running"), gone.stderr


@pytest.mark.parametrize("args, message", [(["--device", "tpu"], "tpu"), (["--dtype", "int3"], "int3"),
                                           (["--host", "0.0.0.0"], "without API keys"),
                                           (["--cache-layout", "flat"], "flat"),
                                           (["--cpu-weights", "int4"], "int4"),
                                           (["--cpu-weights", "int8", "--dtype", "bfloat16"], "float32 models"),
                                           (["--fp8-weights", "e5m2"], "e5m2"),
                                           (["--fp8-weights", "keep"], "needs --device cuda"),
                                           (["--checkpoint", "{llama}"], "unsupported model_type 'llama'")])
def test_bad_arguments_name_the_bad_value_and_start_nothing(tmp_path, args, message):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text('{"model_type": "llama"}')
    args = [a.replace("{llama}", str(llama)) for a in args]
    r = _tide_here("up", *args, home=tmp_path)
    assert r.returncode == 2 and message in " ".join(r.stderr.replace("│", " ").split())
    assert not (tmp_path / "run" / "state.json").exists()  # nothing was started


def test_cuda_without_enough_gpus_is_a_clear_error_and_starts_nothing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = _tide("up", "--port", str(free_port()), "--num-cpus", "1", "--device", "cuda", "--expert-shards", "2",
              home=tmp_path, timeout=180)
    assert r.returncode == 1 and "needs 3 GPU(s)" in r.stderr and "has 0" in r.stderr, r.stderr[-2000:]
    assert "starting" not in r.stderr  # found before Redis or Ray were started
    assert not (tmp_path / "run" / "state.json").exists() and not (tmp_path / "run" / "redis.password").exists()
    assert _tide("status", home=tmp_path).returncode == 1  # nothing is up


def test_a_dead_ray_head_is_a_clear_error_and_down_still_cleans_up(tmp_path):
    """The head stopped or crashed since `tide up` (nothing listens at its address any more): the
    admin commands say so at once instead of retrying for minutes, and `tide down` stops what is
    left (here a stand-in for the redis-server) and forgets the cluster."""
    run = tmp_path / "run"
    run.mkdir()
    leftover = subprocess.Popen(["sleep", "300"])
    (run / "redis.password").write_text("pw")
    (run / "state.json").write_text(json.dumps({
        "ray_address": f"127.0.0.1:{free_port()}", "redis_pid": leftover.pid, "url": "http://127.0.0.1:1/v1",
        "redis_url": "redis://127.0.0.1:1/0"}))
    try:
        for cmd in (["status"], ["cache", "stats"], ["scale", "night"]):
            r = _tide(*cmd, home=tmp_path, timeout=60)
            assert r.returncode == 1 and "does not answer" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
        d = _tide("down", home=tmp_path, timeout=120)
        assert d.returncode == 0 and "does not answer" in d.stderr, d.stderr[-2000:]
        assert leftover.wait(timeout=30) is not None
        assert not (run / "state.json").exists() and not (run / "redis.password").exists()
    finally:
        leftover.kill()


def test_a_checkpoint_whose_weights_do_not_load_is_a_clear_error_and_leaves_nothing_running(tmp_path, fresh_home):
    """config.json is fine (checked before anything starts) but the weights are not a safetensors
    file: the replica fails while `tide up` waits for it, which gives up with Serve's reason and
    stops what it started."""
    from model.checkpoint import save_checkpoint
    from model.config import named_config

    ckpt = tmp_path / "broken"
    save_checkpoint(ckpt, named_config("tiny"), {})
    (ckpt / "model.safetensors").write_bytes(b"these are not weights")
    # Serve gives up on the replica after its first failure (its default: three tries a replica)
    env = _env(tmp_path, fresh_home, RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT="1")
    r = _tide("up", "--port", str(free_port()), "--num-cpus", "1", "--checkpoint", str(ckpt), home=tmp_path,
              env=env, timeout=300)
    assert r.returncode == 1 and "the app failed to deploy" in r.stderr, r.stderr[-3000:]
    assert "safetensors" in r.stderr.lower() and "Traceback (most recent call last)" not in r.stderr.split("failed to deploy")[0]
    assert not (tmp_path / "run" / "state.json").exists() and not (tmp_path / "run" / "redis.password").exists()
    assert processes_with(f"TIDE_HOME={tmp_path}", temp_dir_for(tmp_path)) == []


def test_a_taken_port_is_a_clear_error_and_starts_nothing(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _tide("up", "--port", str(port), home=tmp_path, timeout=120)
    assert r.returncode == 1 and f"--port {port}" in r.stderr and "not free" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run" / "state.json").exists() and not (tmp_path / "run" / "redis.password").exists()


def test_serve_run_on_a_token_cluster_and_the_admin_commands_reach_it(tmp_path, fresh_home):
    """README's `serve run` invocation on a Ray cluster `tide up` did not start (token
    authentication on), then `tide status` and `tide cache stats` through --address and
    RAY_ADDRESS."""
    import yaml

    from deploy.redis_proc import wait_healthy

    token = fresh_home / ".ray" / "auth_token"
    if not token.exists():
        token.parent.mkdir(mode=0o700, exist_ok=True)
        token.write_text(uuid.uuid4().hex * 2)
        token.chmod(0o600)
    agent_token = tmp_path / "agent.token"  # as README says: a 0600 file on every node
    agent_token.write_text(uuid.uuid4().hex * 2)
    agent_token.chmod(0o600)
    env = _env(tmp_path, fresh_home, RAY_AUTH_MODE="token", TIDE_AGENT_TOKEN_FILE=str(agent_token))
    ray_tmp = Path(f"/tmp/tide-serve-{uuid.uuid4().hex[:8]}")
    address, marker = _ray_head(ray_tmp, env)
    try:
        cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
        port = free_port()
        cfg["http_options"]["port"] = port
        cfg["applications"][0]["args"].update(cache_dir=str(tmp_path / "cache"), usage_dir=str(tmp_path / "usage"),
                                              replica_cpus=0.5)
        path = tmp_path / "serve.yaml"
        path.write_text(yaml.safe_dump(cfg))
        serve = str(Path(sys.executable).with_name("serve"))
        r = subprocess.run([serve, "run", "--address", address, "--non-blocking", str(path)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
        wait_healthy(f"http://127.0.0.1:{port}", 300)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        st = _tide("status", "--json", "--address", address, home=tmp_path, env=env)
        assert st.returncode == 0, st.stderr[-2000:]
        report = json.loads(st.stdout)
        assert report["url"] == f"http://127.0.0.1:{port}/v1" and report["address"] == address
        assert len(report["replicas"]) == 1 and report["replicas"][0]["engine"]["decode_tokens"] >= 1
        cache = _tide("cache", "stats", "--json", home=tmp_path, env={**env, "RAY_ADDRESS": address})
        assert cache.returncode == 0 and len(json.loads(cache.stdout)["nodes"]) == 1, cache.stderr[-2000:]
        logs = _tide("logs", "--lines", "200", "--address", address, home=tmp_path, env=env)
        assert logs.returncode == 0 and "/v1/chat/completions" in logs.stdout, logs.stdout[-2000:] + logs.stderr[-2000:]
        none = _tide("status", home=tmp_path, env=env)  # no --address, no RAY_ADDRESS, no `tide up`
        assert none.returncode == 1 and "no cluster is running" in none.stderr
    finally:
        stop_marked(marker)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.parametrize("args,named", [(["--ep-backend", "mpi"], "--ep-backend 'mpi'"),
                                        (["--ep-backend", "nccl"], "--ep-backend nccl needs --device cuda")])
def test_up_refuses_an_expert_parallel_backend_it_cannot_use(tmp_path, args, named):
    r = _tide_here("up", "--expert-shards", "2", *args, home=tmp_path)
    assert r.returncode == 2 and named in r.stderr.replace("\n", " ").replace("│", ""), r.stderr


def test_up_config_file_fields_are_checked_and_used(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas: 0\n")
    r = _tide_here("up", "--config", str(bad), home=tmp_path)
    assert r.returncode == 2 and "replicas" in r.stderr, r.stderr
    bad.write_text("replica: 2\n")  # a misspelled field is an error, not a default
    r = _tide_here("up", "--config", str(bad), home=tmp_path)
    assert r.returncode == 2 and "replica" in r.stderr.replace("\n", " ").replace("│", "")
    import socket

    with socket.socket() as taken:  # the file's port is the one `tide up` checks (and would serve on)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        good = tmp_path / "good.yaml"
        good.write_text(f"port: {port}\nreplicas: 1\nmodel_name: tiny\n")
        r = _tide("up", "--config", str(good), home=tmp_path, timeout=120)
        assert r.returncode == 1 and f"--port {port}" in r.stderr, r.stderr
        r = _tide_here("up", "--config", str(good), "--port", str(free_port()), "--replicas", "0", home=tmp_path)
        assert r.returncode == 2 and "--replicas" in r.stderr  # the command line wins and is checked
    assert not (tmp_path / "run" / "state.json").exists()


@pytest.mark.parametrize("args", [["cache", "evict", "--key", "xyz"], ["cache", "pin"], ["cache", "evict", "--all", "--key", "00"]])
def test_usage_errors_need_no_cluster(tmp_path, args):
    """A bad option is a usage error (exit 2) before anything connects; no cluster is exit 1."""
    r = _tide_here(*args, home=tmp_path)
    assert r.returncode == 2 and "no cluster" not in r.stderr, r.stderr


def _replica_pids(state: dict) -> list[int]:
    """The model replicas' processes of a `tide up` cluster (Ray titles them)."""
    out = []
    for pid in marked_processes(state["cluster_id"], state["ray_temp_dir"]):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ServeReplica:tideserve:LLMServer" in title:
            out.append(pid)
    return out


def test_a_batch_finishes_after_a_replica_is_killed_and_after_down_and_up(tmp_path, fresh_home):
    """The official client submits a batch to `tide up`; its replica is killed mid-run, then the
    whole cluster goes down and up again: every line is answered once, as it is interactively,
    and `tide batch` shows it. The replicas draft with the default model's MTP layer: the
    answers are the model's own greedy tokens, and the drafts' acceptance is in the metrics."""
    import signal
    import time

    import openai

    from model.checkpoint import load_model
    from model.default import default_checkpoint
    from model.generate import generate
    from model.tokenizer import ByteTokenizer

    port = free_port()
    config = tmp_path / "tide.yaml"  # one long line at a time: the batch is still running when it is hit
    config.write_text(f"port: {port}\nspeculative_tokens: 1\nlimits: {{batch_concurrency: 1}}\n")
    n = 24
    bodies = [{"model": "tiny", "messages": [{"role": "user", "content": f"Count to {i}, slowly."}],
               "max_tokens": 128, "temperature": 0, "ignore_eos": True} for i in range(n)]
    data = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": b})
                   + "\n" for i, b in enumerate(bodies)).encode()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

    def progress(bid: str, at_least: int, timeout_s: float = 240):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                batch = client.batches.retrieve(bid)
                if batch.request_counts.completed >= at_least or batch.status == "completed":
                    return batch
            except openai.APIConnectionError:
                pass  # the cluster coming up
            assert time.monotonic() < deadline, f"batch {bid} did not reach {at_least} lines"
            time.sleep(0.2)

    r = _tide("up", "--config", str(config), home=tmp_path, fresh_home=fresh_home)
    try:
        assert r.returncode == 0, r.stderr[-2000:]
        state = json.loads((tmp_path / "run" / "state.json").read_text())
        upload = client.files.create(file=("lines.jsonl", data), purpose="batch")
        bid = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h").id
        progress(bid, 1)
        killed_at = client.batches.retrieve(bid).request_counts.completed
        assert killed_at < n - 4, killed_at
        (replica,) = _replica_pids(state)
        os.kill(replica, signal.SIGKILL)  # Serve starts another; the line under way goes on there
        # while it restarts: the batch is listed, and the night's decision counts its work left
        # as demand beside the interactive load
        listed = _tide("batch", "list", "--json", home=tmp_path, fresh_home=fresh_home)
        assert listed.returncode == 0, listed.stderr[-2000:]
        assert [b["id"] for b in json.loads(listed.stdout)["batches"]] == [bid]
        night = _tide("scale", "night", "--dry-run", "--json", home=tmp_path, fresh_home=fresh_home)
        assert night.returncode == 0, night.stderr[-2000:]
        decision = json.loads(night.stdout)
        assert decision["batch_tokens_per_s"] > 0 and "batches due" in decision["reason"], decision
        before = progress(bid, killed_at + 1)
        assert before.status == "in_progress" and before.request_counts.completed < n, before  # down mid-run
    finally:
        d = _tide("down", home=tmp_path, fresh_home=fresh_home)
    assert d.returncode == 0, d.stderr[-2000:]
    r = _tide("up", "--config", str(config), home=tmp_path, fresh_home=fresh_home)
    try:
        assert r.returncode == 0, r.stderr[-2000:]
        batch = progress(bid, n)
        deadline = time.monotonic() + 60
        while batch.status != "completed":
            assert time.monotonic() < deadline, batch
            time.sleep(0.5)
            batch = client.batches.retrieve(bid)
        assert (batch.request_counts.completed, batch.request_counts.failed) == (n, 0) and batch.error_file_id is None
        lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert [x["custom_id"] for x in lines] == [f"l{i}" for i in range(n)]  # each once, in input order
        model, tok = load_model(default_checkpoint()), ByteTokenizer()
        for line, body in list(zip(lines, bodies, strict=True))[::6]:
            alone = client.chat.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                                   extra_body={"ignore_eos": True})
            assert line["response"]["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
            ids = generate(model, tok.apply_chat_template(body["messages"]), 128, eos_id=None)  # no drafts
            assert alone.choices[0].message.content == tok.decode(ids)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        accepted = [float(x.split()[-1]) for x in metrics.splitlines()
                    if x.startswith("tide:spec_decode_num_accepted_tokens_total")]
        assert accepted and accepted[0] > 0, metrics[-3000:]
        show = _tide("batch", "show", bid, "--json", home=tmp_path, fresh_home=fresh_home)
        assert show.returncode == 0 and json.loads(show.stdout)["status"] == "completed", show.stderr[-2000:]
        ended = _tide("batch", "cancel", bid, home=tmp_path, fresh_home=fresh_home)
        assert ended.returncode == 1 and "has ended" in ended.stderr, ended.stderr[-2000:]
    finally:
        assert _tide("down", home=tmp_path, fresh_home=fresh_home).returncode == 0
