"""A day -> night -> day cycle on a simulated 3-node Ray cluster under a continuous request
stream: no request fails, the night's training job runs only on the lent node and writes a
checkpoint, serving returns to full size, and units written before the night still hit."""

from __future__ import annotations

import socket
import sys
import threading
import time

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]

PROMPT = "the tide comes in and the tide goes out, " * 8


@pytest.fixture(scope="module")
def serving(redis_server, tmp_path_factory):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deploy.app import build_app
    from deploy.redis_proc import wait_healthy

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    home = tmp_path_factory.mktemp("tidal")
    args = {"replicas": 3, "replica_cpus": 1, "max_replicas_per_node": 1, "num_pages": 512,
            "cache_dir": str(home / "cache" / "{node}"), "usage_dir": str(home / "usage"),
            "directory_url": redis_server.url, "directory_namespace": "tidal-test"}
    serve.run(build_app(args), name="tideserve", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 300)
    yield url, args, home
    serve.shutdown()
    ray.shutdown()
    c.shutdown()


def _complete(url: str, prompt: str, max_tokens: int = 4) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _llm_replica_nodes() -> list[str]:
    from ray.util.state import list_actors

    return [a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if "LLMServer" in (a.class_name or "") or "LLMServer" in (a.name or "")]


def test_day_night_day(serving):
    import ray
    from ray.job_submission import JobSubmissionClient

    from deploy.tidal import lend_nodes, return_nodes

    url, args, home = serving
    before = _complete(url, PROMPT)
    assert before["usage"]["prompt_cache_hit_tokens"] == 0
    time.sleep(1.0)  # its units reach the directory
    from actors.tidal import tidal_state

    reports = ray.get(tidal_state().replica_reports.remote())  # what `tide status` lists
    assert len(reports) == 3 and len({r["node_id"] for r in reports.values()}) == 3
    assert sum(r["stats"]["engine"]["prefill_tokens"] for r in reports.values()) >= 1

    failures: list[str] = []
    done = [0]
    stop = threading.Event()

    def stream() -> None:  # a continuous request stream through the whole cycle
        i = 0
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                i += 1
                try:
                    r = client.post(f"{url}/v1/completions", json={
                        "model": "tiny", "prompt": f"request {i}: " + "waves " * (i % 30), "max_tokens": 12,
                        "temperature": 0})
                    if r.status_code != 200:
                        failures.append(f"{r.status_code}: {r.text[:200]}")
                    else:
                        done[0] += 1
                except httpx.HTTPError as e:
                    failures.append(repr(e))

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        out = home / "train-run"
        entrypoint = (f"{sys.executable} -m deploy.cli train run --out {out} --steps 100000 --batch-size 2 "
                      f"--seq-len 64 --checkpoint-every 5 --docs-limit 40")
        night = lend_nodes(args, 1, deadline_s=30, train={"entrypoint": entrypoint})
        time.sleep(3.0)  # the lent replica's last report goes stale
        staying = ray.get(tidal_state().replica_reports.remote())
        assert len(staying) == 2 and set(staying) < set(reports)  # the others were not replaced
        lent = night["lent"][0]
        assert night["serving_replicas"] == 2 and night["job_id"]
        assert sorted(_llm_replica_nodes()) != [] and lent not in _llm_replica_nodes()
        client = JobSubmissionClient(f"http://{ray._private.worker.get_dashboard_url()}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "model.safetensors").is_file():
            time.sleep(0.5)
        assert (out / "model.safetensors").is_file(), client.get_job_logs(night["job_id"])[-2000:]
        assert client.get_job_info(night["job_id"]).driver_node_id == lent  # trained on the lent node only
        served_at_night = done[0]
        time.sleep(2)
        assert done[0] > served_at_night  # serving went on at night

        day = return_nodes(args, deadline_s=60)
        assert day["returned"] == [lent] and day["serving_replicas"] == 3
        assert day["job_status"] in ("STOPPED", "SUCCEEDED"), client.get_job_logs(night["job_id"])[-2000:]
        assert lent in _llm_replica_nodes()  # serving is back on the lent node
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    assert failures == [] and done[0] > 0
    morning = _complete(url, PROMPT)
    assert morning["usage"]["prompt_cache_hit_tokens"] >= 4 * 64  # units from before the night


def test_a_replica_killed_mid_decode_loses_no_request_and_no_token(serving):
    """Fault: the replica streaming a request dies; the ingress continues the request on another
    replica from the tokens already streamed, and the output equals an undisturbed run."""
    import json

    import ray

    from actors.tidal import tidal_state
    from deploy.tidal import _running_replicas, _wait

    url, _, _ = serving
    body = {"model": "tiny", "prompt": "a long answer about the sea: ", "max_tokens": 160, "temperature": 0,
            "ignore_eos": True}
    ref = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert ref.status_code == 200, ref.text
    want = ref.json()["choices"][0]["text"]
    state = tidal_state()
    killed = []
    text = []
    started = time.time()
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            if len(text) == 5 and not killed:  # mid-decode: kill the replica that runs it
                # reports made after this request started (older ones may still show the reference run)
                deadline = time.monotonic() + 10
                busy = []
                while not busy and time.monotonic() < deadline:
                    busy = [rep for rep in ray.get(state.reports.remote()).values()
                            if rep.get("running") and rep["time"] > started]
                    time.sleep(0.1)
                assert len(busy) == 1
                ray.kill(ray.get_actor(busy[0]["actor_name"], namespace="serve"), no_restart=True)
                killed.append(busy[0]["actor_name"])
    assert killed and "".join(text) == want
    _wait(lambda: _running_replicas("tideserve") == 3, 300, "Serve to replace the killed replica")
