"""`tide up` / `tide down` as a newcomer runs them: a real local cluster, then a clean stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from deploy.local import process_alive
from deploy.redis_proc import free_port

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]


def _tide(*args, home, timeout=600):
    env = {**os.environ, "TIDE_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_up_serves_then_down_stops_everything(tmp_path):
    port = free_port()
    # P/D (a prefill and a decode replica) over two expert shards that both use
    r = _tide("up", "--port", str(port), "--num-cpus", "2", "--expert-shards", "2", "--decode-replicas", "1",
              home=tmp_path)
    try:
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"http://127.0.0.1:{port}/v1" in r.stdout
        state = json.loads((tmp_path / "run" / "state.json").read_text())
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
        again = _tide("up", "--port", str(port), home=tmp_path)
        assert again.returncode == 1 and "already up" in again.stderr
        st = _tide("status", "--json", home=tmp_path)
        assert st.returncode == 0, st.stderr[-2000:]
        report = json.loads(st.stdout)
        assert report["url"] == state["url"] and report["nodes"][0]["role"] == "serving"
        assert [r.get("pool") for r in report["replicas"]] == ["prefill", "decode"]
        assert report["replicas"][0]["engine"]["prefill_tokens"] >= 1
        assert report["replicas"][1]["engine"]["decode_tokens"] >= 1  # the decode replica generated
        assert report["gpus"]["available"] in (True, False) and "gpus" in report["gpus"]
        assert report["expert_placement"]["shards"] == 2
        show = _tide("eplb", "show", "--json", home=tmp_path)
        assert show.returncode == 0, show.stderr[-2000:]
        placement = json.loads(show.stdout)
        assert placement["shards"] == 2 and list(placement["replicas"].values()) == [placement["version"]] * 2
        assert placement["imbalance"] is not None  # the replica's measured load reached the control
        rebalance = _tide("eplb", "rebalance", "--json", home=tmp_path)
        assert rebalance.returncode == 0, rebalance.stderr[-2000:]
        assert "moved_slots" in json.loads(rebalance.stdout)
        # day/night on a one-node cluster: nothing to lend, no training
        night = _tide("scale", "night", "--json", home=tmp_path)
        assert night.returncode == 0, night.stderr[-2000:]
        assert json.loads(night.stdout)["changed"] is False and json.loads(night.stdout)["serve_nodes"] == 1
        assert json.loads(_tide("train", "status", "--json", home=tmp_path).stdout)["job_id"] is None
        sub = _tide("train", "submit", home=tmp_path)
        assert sub.returncode == 2 and "no node is lent" in sub.stderr.replace("\n", " ").replace("│", "")
        # the cache through the node's agent: stats, pin a served prompt's units, evict the rest
        text = "the tide comes in and the tide goes out, " * 6  # 246 bytes: 3 whole units
        for _ in range(2):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": text, "max_tokens": 2})
            assert r.status_code == 200
        assert r.json()["usage"]["prompt_cache_hit_tokens"] == 3 * 64
        assert report["cache"]["totals"]["ssd_units"] >= 0 and len(report["cache"]["nodes"]) == 1
        stats = json.loads(_tide("cache", "stats", "--json", home=tmp_path).stdout)
        assert stats["totals"]["ssd_units"] >= 3
        pinned = _tide("cache", "pin", "--prompt", text, "--json", home=tmp_path)
        assert pinned.returncode == 0, pinned.stderr[-2000:]
        assert json.loads(pinned.stdout)["units"] == 3 and sum(json.loads(pinned.stdout)["pinned"].values()) == 3
        assert json.loads(_tide("cache", "stats", "--json", home=tmp_path).stdout)["totals"]["ssd_pinned"] == 3
        bad = _tide("cache", "evict", "--key", "xyz", home=tmp_path)
        assert bad.returncode == 2 and "xyz" in bad.stderr
        ev = _tide("cache", "evict", "--all", "--json", home=tmp_path)
        assert ev.returncode == 0 and json.loads(ev.stdout)["total"] >= 3
        assert json.loads(_tide("cache", "stats", "--json", home=tmp_path).stdout)["totals"]["ssd_units"] == 0
    finally:
        d = _tide("down", home=tmp_path)
    assert d.returncode == 0, d.stderr[-2000:]
    assert not (tmp_path / "run" / "redis.password").exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=3)
    assert not process_alive(state["redis_pid"])
    assert _tide("down", home=tmp_path).returncode == 1  # nothing left to stop
    gone = _tide("status", home=tmp_path)
    assert gone.returncode == 2 and "no local cluster is running" in gone.stderr.replace("\n", " ").replace("│", "")


@pytest.mark.parametrize("args, message", [(["--device", "tpu"], "tpu"), (["--dtype", "int3"], "int3"),
                                           (["--cache-layout", "flat"], "flat"),
                                           (["--checkpoint", "{llama}"], "unsupported model_type 'llama'")])
def test_bad_arguments_name_the_bad_value_and_start_nothing(tmp_path, args, message):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text('{"model_type": "llama"}')
    args = [a.replace("{llama}", str(llama)) for a in args]
    r = _tide("up", *args, home=tmp_path, timeout=120)
    assert r.returncode == 2 and message in r.stderr.replace("\n", " ").replace("│", "")
    assert not (tmp_path / "run" / "state.json").exists()  # nothing was started


def test_cuda_without_enough_gpus_is_a_clear_error_and_starts_nothing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = _tide("up", "--port", str(free_port()), "--num-cpus", "1", "--device", "cuda", "--expert-shards", "2",
              home=tmp_path, timeout=180)
    assert r.returncode == 1 and "needs 3 GPU(s)" in r.stderr and "has 0" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run" / "state.json").exists() and not (tmp_path / "run" / "redis.password").exists()
    assert _tide("status", home=tmp_path).returncode == 2  # nothing is up


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


def test_a_taken_port_is_a_clear_error_and_starts_nothing(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _tide("up", "--port", str(port), home=tmp_path, timeout=120)
    assert r.returncode == 1 and f"--port {port}" in r.stderr and "not free" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run" / "state.json").exists() and not (tmp_path / "run" / "redis.password").exists()
