"""A day -> night -> day cycle on a simulated 3-node Ray cluster under a continuous request
stream: no request fails, the night's training job runs only on the lent node and writes a
checkpoint, serving returns to full size, and units written before the night still hit."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from deploy.connect import alive_actors
from tests.actors.tidal_streams import ClientThreads, day_after_a_failure
from tests.waiting import until

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]

PROMPT = "the tide comes in and the tide goes out, " * 8
LIVE = "tideserve-abc12"  # the RayService's live RayCluster in the Kubernetes test


@pytest.fixture(scope="module")
def serving(three_nodes, redis_server, tmp_path_factory):
    from deploy.app import build_app
    from tests.shared_ray import serving

    home = tmp_path_factory.mktemp("tidal")
    args = {"replicas": 3, "replica_cpus": 1, "max_replicas_per_node": 1, "num_pages": 512,
            "cache_dir": str(home / "cache" / "{node}"), "usage_dir": str(home / "usage"), "files_dir": str(home / "files"),
            "directory_url": redis_server.url, "directory_namespace": "tidal-test"}
    # one HTTP proxy, on the head: the simulated nodes' proxies would share its port, and no load
    # balancer here could stop sending connections to a lent node's draining proxy as KubeRay's
    # serve Service does
    with serving(build_app(args), 300) as url:
        yield url, args, home, three_nodes.cluster


def _complete(url: str, prompt: str, max_tokens: int = 4) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _batch(url: str, prompts: list[str]) -> str:
    """A batch of completions, submitted as OpenAI's client does (multipart upload, then create)."""
    import json

    lines = "".join(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0}}) + "\n" for i, p in enumerate(prompts))
    f = httpx.post(f"{url}/v1/files", timeout=30, files={"file": ("night.jsonl", lines.encode())},
                   data={"purpose": "batch"})
    assert f.status_code == 200, f.text
    b = httpx.post(f"{url}/v1/batches", timeout=30, json={"input_file_id": f.json()["id"],
                                                           "endpoint": "/v1/completions", "completion_window": "24h"})
    assert b.status_code == 200, b.text
    return b.json()["id"]


def _llm_replica_nodes() -> list[str]:
    return [a.node_id for a in alive_actors()
            if "LLMServer" in (a.class_name or "") or "LLMServer" in (a.name or "")]


class _RequestStream(ClientThreads):
    """Two clients sending requests without pause while the block runs; ``failures`` and
    ``done`` count what came back."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url, self.failures, self.done = url, [], 0
        self.going = threading.Event()  # cleared: the clients pause between requests
        self.going.set()

    def _run(self, worker: int) -> None:
        i = 0
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                self.going.wait()
                i += 1
                try:
                    r = client.post(f"{self.url}/v1/completions", json={
                        "model": "tiny", "prompt": f"request {worker}.{i}: " + "waves " * (i % 30), "max_tokens": 12,
                        "temperature": 0})
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code}: {r.text[:200]}")
                    else:
                        self.done += 1
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))


def test_day_night_day(serving):
    import ray
    from ray.job_submission import JobSubmissionClient

    from deploy.tidal import lend_nodes, return_nodes

    url, args, home, _ = serving
    before = _complete(url, PROMPT)
    assert before["usage"]["prompt_cache_hit_tokens"] == 0
    from actors.tidal import tidal_state

    def reports_of(n: int):  # what `tide status` lists, once it lists n replicas
        reports = ray.get(tidal_state().replica_reports.remote())
        return reports if len(reports) == n else None

    def prefilled() -> int:
        return sum(r["stats"]["engine"]["prefill_tokens"] for r in (reports_of(3) or {}).values())

    until(prefilled, 60, "3 replicas reporting, one of them the request's prefill")
    reports = reports_of(3)
    assert len({r["node_id"] for r in reports.values()}) == 3
    # the state lives on the head node (a worker that fails must not take it along); one that
    # died anyway is made again on the next look-up, and the replicas report to that one
    from actors.tidal import STATE_NAME

    head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])
    assert [a.node_id for a in alive_actors() if a.name == STATE_NAME] == [head]
    ray.kill(tidal_state(), no_restart=True)

    def reporting_again():
        try:
            return reports_of(3)
        except ray.exceptions.RayActorError:  # the dead one's name is not free yet
            return None

    until(reporting_again, 60, "the replicas reporting to a state actor made again")

    stream = _RequestStream(url)
    with day_after_a_failure(args), stream:
        until(lambda: stream.done or stream.failures, 120, "the stream's first answer")
        out = home / "train-run"
        entrypoint = (f"{sys.executable} -m deploy.cli train run --out {out} --steps 100000 --batch-size 2 "
                      f"--seq-len 64 --checkpoint-every 5 --docs-limit 40")
        night = lend_nodes(args, 1, deadline_s=30, train={"entrypoint": entrypoint})
        staying = until(lambda: reports_of(2), 60, "the lent replica's last report to go stale")
        assert set(staying) < set(reports)  # the others were not replaced
        lent = night["lent"][0]
        assert night["serving_replicas"] == 2 and night["job_id"]
        # its agent copied its hot units that no staying node held to the nodes that stay
        assert set(night["kept"]) == {lent} and night["kept"][lent]["failed"] == 0, night["kept"]
        from deploy.serve_state import serve_replicas as _serve_replicas

        ingress = {node for name, (_, node) in _serve_replicas("tideserve").items() if "#OpenAIIngress#" in name}
        assert ingress and lent not in ingress  # the ingress runs on the head (the default), which is never lent
        assert sorted(_llm_replica_nodes()) != [] and lent not in _llm_replica_nodes()
        client = JobSubmissionClient(f"http://{ray._private.worker.get_dashboard_url()}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "model.safetensors").is_file():
            time.sleep(0.5)
        assert (out / "model.safetensors").is_file(), client.get_job_logs(night["job_id"])[-2000:]
        assert client.get_job_info(night["job_id"]).driver_node_id == lent  # trained on the lent node only
        served_at_night = stream.done
        until(lambda: stream.done > served_at_night, 120, "an answer at night")  # serving went on
        # batch work runs on the nodes that still serve while the lent one trains, once the
        # interactive clients pause (on a CPU, batch lines wait for a quiet moment: they never
        # make an interactive step longer than the measured slack allows, and here that is none)
        stream.going.clear()
        batch = _batch(url, [f"night line {i}: " + "waves " * i for i in range(6)])
        done = until(lambda: (b := httpx.get(f"{url}/v1/batches/{batch}", timeout=30).json())["status"] == "completed"
                     and b, 120, "the night's batch")
        assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
        assert client.get_job_status(night["job_id"]) == "RUNNING"  # the training went on beside it
        stream.going.set()

        day = return_nodes(args, deadline_s=60)
        assert day["returned"] == [lent] and day["serving_replicas"] == 3
        assert set(day["warmed"]) == {lent} and day["warmed"][lent]["failed"] == 0, day["warmed"]  # before serving
        assert day["job_status"] in ("STOPPED", "SUCCEEDED"), client.get_job_logs(night["job_id"])[-2000:]
        assert lent in _llm_replica_nodes()  # serving is back on the lent node
        served_at_dawn = stream.done
        until(lambda: stream.done > served_at_dawn, 120, "an answer in the morning")
    assert stream.failures == [] and stream.done > 0
    morning = _complete(url, PROMPT)
    assert morning["usage"]["prompt_cache_hit_tokens"] >= 4 * 64  # units from before the night
    # /metrics has a series per serving replica (their heartbeats), not one replica's view
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    series = [s for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "tide:num_requests_running"]
    assert len({s.labels["replica"] for s in series}) == 3 and len({s.labels["node"] for s in series}) == 3
    night = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name in ("tide:nights", "tide:night_drain_seconds", "tide:training_job_active")}
    assert night["tide:nights"] == 1 and night["tide:night_drain_seconds"] > 0 and night["tide:training_job_active"] == 0


def test_a_replica_killed_mid_decode_loses_no_request_and_no_token(serving):
    """Fault: the replica streaming a request dies; the ingress continues the request on another
    replica from the tokens already streamed, and the output equals an undisturbed run."""
    import json

    import ray

    from actors.tidal import tidal_state
    from deploy.serve_state import running_replicas as _running_replicas
    from deploy.serve_state import serve_replicas as _serve_replicas

    url, _, _, _ = serving
    # long enough that its replica reports it running (twice a second) while it streams: a decode
    # step of the tiny model is a millisecond or two
    body = {"model": "tiny", "prompt": "a long answer about the sea: ", "max_tokens": 1500, "temperature": 0,
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
    # Serve lists the killed replica as running until its next health check: wait for it to go
    until(lambda: killed[0] not in _serve_replicas("tideserve") and _running_replicas("tideserve") == 3, 300,
          "Serve to replace the killed replica")


def test_a_kubernetes_night_and_morning(serving, tmp_path):
    """``tide scale night|day --k8s`` against the in-process Kubernetes API with this cluster as
    the RayService's live RayCluster: the drain runs here as a Ray job (``tide drain``), the
    KubeRay stand-in deletes the pod named for deletion (its Ray node goes) and applies
    ``serveConfigV2`` (Serve's count drops); the morning stops the training run (a Ray job:
    SIGTERM), brings a pod back (a new Ray node) and the day's count. No request fails."""
    import copy
    import json
    import os
    import subprocess

    import ray
    import yaml
    from ray import serve

    from actors.tidal import jobs_client
    from deploy.app import build_app
    from deploy.serve_state import running_replicas as _running_replicas
    from deploy.serve_state import wait_for as _wait
    from tests.k8s.fake_kube import FakeKube, KubeRayController

    url, args, home, cluster = serving
    _wait(lambda: _running_replicas("tideserve") == 3, 300, "three serving replicas")
    k8s = Path(__file__).resolve().parents[2] / "k8s"
    svc = next(d for d in yaml.safe_load_all((k8s / "rayservice.yaml").read_text()) if d["kind"] == "RayService")
    svc["spec"]["serveConfigV2"] = yaml.safe_dump({"applications": [
        {"name": "tideserve", "route_prefix": "/", "import_path": "deploy.app:build_app", "args": args}]})
    groups = [g for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "lendable"]
    svc["spec"]["rayClusterConfig"]["workerGroupSpecs"] = groups  # the head is the node that always serves
    svc["status"] = {"activeServiceStatus": {"rayClusterName": LIVE}}
    job = next(d for d in yaml.safe_load_all((k8s / "rayjob-train.yaml").read_text()) if d["kind"] == "RayJob")
    kube = FakeKube()
    kube.put("rayservices", svc)
    kube.put("rayclusters", {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": LIVE},
                             "spec": copy.deepcopy(svc["spec"]["rayClusterConfig"])})
    kube.put("rayjobs", job)
    labels = {"ray.io/cluster": LIVE, "ray.io/group": "lendable", "ray.io/node-type": "worker"}
    # each worker node is a pod of the lendable group (its RAY_CLOUD_INSTANCE_ID, as KubeRay sets it)
    nodes = {n._ray_params.env_vars["RAY_CLOUD_INSTANCE_ID"]: n for n in cluster.worker_nodes}
    lendable_pods = sorted(nodes)
    for pod in lendable_pods:
        kube.put("pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "labels": labels}})
    dashboard = f"http://{ray._private.worker.get_dashboard_url()}"
    marker, ready = tmp_path / "checkpointed", tmp_path / "training"
    run = (f"{sys.executable} -c \"import signal, sys, time, pathlib; signal.signal(signal.SIGTERM, lambda *a: "
           f"(pathlib.Path('{marker}').write_text('ok'), sys.exit(0))); pathlib.Path('{ready}').touch(); "
           f"time.sleep(900)\"")

    def created(pod: dict) -> None:  # a pod comes up: a Ray node joins
        name = pod["metadata"]["name"]
        nodes[name] = cluster.add_node(num_cpus=1, env_vars={"RAY_CLOUD_INSTANCE_ID": name})

    def applied(config: str) -> None:  # KubeRay PUTs serveConfigV2 to Serve and goes on
        (app,) = yaml.safe_load(config)["applications"]
        serve._run(build_app(app["args"]), _blocking=False, name="tideserve", route_prefix="/")  # serve.run waits

    controller = KubeRayController(
        kube, on_pod_created=created, on_pod_deleted=lambda pod: cluster.remove_node(nodes.pop(pod["metadata"]["name"])),
        on_serve_config=applied, on_job_started=lambda j: (jobs_client(dashboard).submit_job(entrypoint=run), dashboard))

    def waiting(cond, timeout_s: float, what: str):
        """Wait for ``cond`` while KubeRay reconciles, in this thread (a Ray node starts only in
        the main thread)."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            controller.reconcile()
            time.sleep(0.5)

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
        "users": [{"name": "tide", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tide"}}]}))
    env = {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "KUBERNETES_SERVICE_HOST")},
           "KUBECONFIG": str(kubeconfig), "TIDE_HOME": str(tmp_path / "home")}

    def tide(*argv: str) -> dict:
        with subprocess.Popen([sys.executable, "-m", "deploy.cli", "scale", *argv, "--k8s", "--fixed-nodes", "1",
                               "--dashboard", dashboard, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) as proc:
            waiting(lambda: proc.poll() is not None, 600, f"tide scale {argv[0]}")
            out, err = proc.communicate()
        assert proc.returncode == 0, out + err
        return json.loads(out)

    stream = _RequestStream(url)
    try:
        with stream:
            waiting(lambda: stream.done or stream.failures, 120, "the stream's first answer")
            night = tide("night", "--night-nodes", "2", "--deadline", "20")
            (lent,) = night["workers_to_delete"]
            assert lent in lendable_pods and night["serve_replicas"] == {"LLMServer": 2} and night["job"] == "unsuspended"
            waiting(lambda: controller.deleted_named == [lent], 60, "KubeRay to delete the drained pod")
            assert controller.deleted_random == []
            waiting(lambda: _running_replicas("tideserve") == 2 and len([n for n in ray.nodes() if n["Alive"]]) == 2,
                    120, "two nodes and two replicas serving")
            waiting(lambda: (kube.obj("rayjobs", "tideserve-train").get("status") or {}).get("jobStatus") == "RUNNING",
                    60, "the training run")
            served_at_night = stream.done
            waiting(lambda: stream.done > served_at_night + 2, 60, "requests served at night")
            waiting(ready.exists, 60, "the training run to listen for SIGTERM")  # it checkpoints on it

            morning = tide("day", "--deadline", "60")
            assert morning["training"]["run"] == "STOPPED" and marker.read_text() == "ok"  # it checkpointed
            assert morning["serve_replicas"] == {"LLMServer": 3} and morning["replicas"] == 2
            waiting(lambda: _running_replicas("tideserve") == 3, 300, "three replicas again")
            served_at_dawn = stream.done
            waiting(lambda: stream.done > served_at_dawn, 120, "requests served in the morning")
    finally:
        kube.close()
    assert stream.failures == [] and stream.done > 0, stream.failures
    assert kube.obj("rayjobs", "tideserve-train")["spec"]["suspend"] is True
    assert len([n for n in ray.nodes() if n["Alive"]]) == 3
