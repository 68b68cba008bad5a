"""``tide scale --k8s`` through the official ``kubernetes`` client against an in-process API
server with a KubeRay stand-in (``tests/k8s/fake_kube.py``): a whole night and morning, the
exact patches, the pods named for deletion, the training RayJob's suspend and unsuspend,
resourceVersion conflicts, and the RBAC the manifests grant. The Ray side of the drain runs on a
real Ray cluster in ``tests/actors/test_tidal.py``; here the drain is given its answer."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.k8s_scale import DAY_REPLICAS, K8sScaleError, KubeRay, day, night
from tests.k8s.fake_kube import FakeKube, KubeRayController

K8S = Path(__file__).resolve().parents[2] / "k8s"
LIVE = "tideserve-abc12"


def _doc(path: Path, kind: str) -> dict:
    return next(d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == kind)


@pytest.fixture
def kube():
    """The shipped RayService, its live RayCluster with its pods, and the training RayJob."""
    fake = FakeKube()
    svc = _doc(K8S / "rayservice.yaml", "RayService")
    svc["status"] = {"activeServiceStatus": {"rayClusterName": LIVE}}
    fake.put("rayservices", svc)
    fake.put("rayclusters", {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": LIVE},
                             "spec": copy.deepcopy(svc["spec"]["rayClusterConfig"])})
    fake.put("rayjobs", _doc(K8S / "rayjob-train.yaml", "RayJob"))
    controller = KubeRayController(fake)
    controller.reconcile()  # the cluster's pods come up, the suspended job stays so
    yield fake, controller
    fake.close()


def _client(fake: FakeKube) -> KubeRay:
    from kubernetes import client

    api = client.ApiClient(client.Configuration(host=fake.url))
    return KubeRay(client.CustomObjectsApi(api), client.CoreV1Api(api), "tideserve", "tideserve")


def _lendable(fake: FakeKube) -> list[str]:
    return fake.names("pods", labels={"ray.io/cluster": LIVE, "ray.io/group": "lendable"})


def _group(obj: dict, name: str) -> dict:
    spec = obj["spec"].get("rayClusterConfig", obj["spec"])
    return next(g for g in spec["workerGroupSpecs"] if g["groupName"] == name)


def _serve_args(fake: FakeKube) -> dict:
    return yaml.safe_load(fake.obj("rayservices", "tideserve")["spec"]["serveConfigV2"])["applications"][0]["args"]


class Drain:
    """The Ray side's answer: it drained the last ``n`` candidates, one replica each."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []

    def __call__(self, pods: list[str], n: int) -> dict:
        self.calls.append((list(pods), n))
        return {"lent_pods": pods[-n:], "replicas": {"LLMServer": 4 - n}, "migrated": False}


def test_a_night_deletes_exactly_the_drained_pods_and_starts_training_and_the_morning_undoes_it(kube):
    fake, controller = kube
    k = _client(fake)
    pods = _lendable(fake)
    assert len(pods) == 2 and fake.obj("rayjobs", "tideserve-train")["status"]["jobDeploymentStatus"] == "Suspended"
    drain = Drain()
    out = night(k, "lendable", 1, drain, job="tideserve-train")
    assert drain.calls == [(pods, 1)] and out["workers_to_delete"] == [pods[-1]] and out["job"] == "unsuspended"

    live, svc = fake.obj("rayclusters", LIVE), fake.obj("rayservices", "tideserve")
    assert _group(live, "lendable")["replicas"] == 1
    assert _group(live, "lendable")["scaleStrategy"]["workersToDelete"] == [pods[-1]]
    assert _group(svc, "lendable")["replicas"] == 1  # KubeRay 2331: both
    assert "scaleStrategy" not in _group(svc, "lendable")  # a pod name means nothing to a future cluster
    assert _group(live, "serve")["replicas"] == 2  # the other group is untouched
    assert _serve_args(fake)["replicas"] == 3  # Serve's count follows the drain
    assert json.loads(svc["metadata"]["annotations"][DAY_REPLICAS]) == {"LLMServer": 4}
    assert fake.obj("rayjobs", "tideserve-train")["spec"]["suspend"] is False
    # every write is a merge patch guarded by the version it was computed from
    patches = [w for w in fake.log if w["method"] == "PATCH"]
    assert patches and all(w["content_type"].startswith("application/merge-patch+json") and
                           w["body"]["metadata"]["resourceVersion"] for w in patches)

    controller.reconcile()  # KubeRay: exactly the named pod goes, training starts
    assert controller.deleted_named == [pods[-1]] and controller.deleted_random == []
    assert _lendable(fake) == pods[:-1]
    job = fake.obj("rayjobs", "tideserve-train")["status"]
    assert job["jobDeploymentStatus"] == "Running" and job["jobStatus"] == "RUNNING"

    stopped: list[tuple[str, str]] = []
    out = day(k, "lendable", job="tideserve-train", stop_run=lambda jid, url: stopped.append((jid, url)) or "STOPPED")
    assert stopped == [(job["jobId"], "http://" + job["dashboardURL"])]  # checkpoint first
    assert out["training"]["run"] == "STOPPED" and out["training"]["suspended"]
    assert fake.obj("rayjobs", "tideserve-train")["spec"]["suspend"] is True
    live, svc = fake.obj("rayclusters", LIVE), fake.obj("rayservices", "tideserve")
    assert _group(live, "lendable")["replicas"] == 2 and _group(svc, "lendable")["replicas"] == 2
    assert _group(live, "lendable")["scaleStrategy"]["workersToDelete"] == []
    assert _serve_args(fake)["replicas"] == 4 and DAY_REPLICAS not in (svc["metadata"].get("annotations") or {})
    controller.reconcile()
    assert len(_lendable(fake)) == 2 and controller.deleted_random == []
    assert fake.obj("rayjobs", "tideserve-train")["status"]["jobDeploymentStatus"] == "Suspended"
    # a second morning changes nothing
    writes = len(fake.log)
    assert day(k, "lendable", job="tideserve-train", stop_run=None)["changed"] is False
    assert len(fake.log) == writes


def test_lowering_replicas_alone_lets_kuberay_delete_any_pod(kube):
    """Why the night names its pods: the stand-in deletes at random what is not named."""
    fake, controller = kube
    fake.put("rayclusters", {**fake.obj("rayclusters", LIVE), "spec": {
        **fake.obj("rayclusters", LIVE)["spec"],
        "workerGroupSpecs": [{**g, "replicas": 1} if g["groupName"] == "lendable" else g
                             for g in fake.obj("rayclusters", LIVE)["spec"]["workerGroupSpecs"]]}})
    controller.reconcile()
    assert len(controller.deleted_random) == 1 and controller.deleted_named == []


def test_a_concurrent_writer_makes_the_patch_retry_from_a_fresh_read(kube):
    fake, _ = kube
    fake.interfere("rayclusters", LIVE, times=2)
    fake.interfere("rayservices", "tideserve", times=1)
    night(_client(fake), "lendable", 0, Drain())
    codes = [w["code"] for w in fake.log if w["plural"] == "rayclusters"]
    assert codes == [409, 409, 200]
    assert _group(fake.obj("rayclusters", LIVE), "lendable")["replicas"] == 0
    assert len(_group(fake.obj("rayclusters", LIVE), "lendable")["scaleStrategy"]["workersToDelete"]) == 2
    fake.interfere("rayclusters", LIVE, times=10)
    with pytest.raises(K8sScaleError, match="409"):
        _client(fake).set_group("lendable", 2)


def test_a_run_that_ended_is_created_again_the_next_night(kube):
    fake, controller = kube
    k = _client(fake)
    night(k, "lendable", 1, Drain(), job="tideserve-train")
    controller.reconcile()
    controller.finish_job("tideserve-train")  # its --minutes were up before the morning
    out = day(k, "lendable", job="tideserve-train", stop_run=lambda *a: pytest.fail("nothing to stop"))
    assert "suspended" not in out["training"]  # KubeRay already shut its cluster down
    controller.reconcile()
    assert night(k, "lendable", 1, Drain(), job="tideserve-train")["job"] == "re-created (last run: Complete)"
    job = fake.obj("rayjobs", "tideserve-train")
    assert job["spec"]["suspend"] is False and "status" not in job
    assert job["spec"]["entrypoint"] == _doc(K8S / "rayjob-train.yaml", "RayJob")["spec"]["entrypoint"]
    assert [w["method"] for w in fake.writes("rayjobs")][-2:] == ["DELETE", "POST"]
    controller.reconcile()
    assert fake.obj("rayjobs", "tideserve-train")["status"]["jobDeploymentStatus"] == "Running"


def test_a_second_night_keeps_the_first_nights_day_counts(kube):
    fake, controller = kube
    k = _client(fake)
    night(k, "lendable", 1, Drain())
    controller.reconcile()
    night(k, "lendable", 0, lambda pods, n: {"lent_pods": pods, "replicas": {"LLMServer": 2}})
    controller.reconcile()
    assert _serve_args(fake)["replicas"] == 2 and _lendable(fake) == []
    assert k.day_serve_replicas() == {"LLMServer": 4}
    day(k, "lendable")
    assert _serve_args(fake)["replicas"] == 4


def test_errors_name_the_problem(kube):
    fake, _ = kube
    k = _client(fake)
    with pytest.raises(K8sScaleError, match="no worker group 'gpu'"):
        night(k, "gpu", 0, Drain())
    with pytest.raises(K8sScaleError, match="at most 2"):
        k.set_group("lendable", 5)
    with pytest.raises(K8sScaleError, match="404"):
        KubeRay(k.custom, k.core, "tideserve", "missing").service()
    with pytest.raises(ValueError, match="-1"):
        k.set_group("lendable", -1)
    with pytest.raises(K8sScaleError, match="outside group"):
        night(k, "lendable", 1, lambda pods, n: {"lent_pods": ["tideserve-abc12-serve-worker-x"], "replicas": {}})
    fake.put("rayservices", {**fake.obj("rayservices", "tideserve"), "status": {}})
    with pytest.raises(K8sScaleError, match="no active RayCluster"):
        night(k, "lendable", 0, Drain())
    assert not [w for w in fake.log if w["method"] != "PUT"]  # nothing was changed on the way


def test_the_fake_refuses_what_the_real_server_refuses(kube):
    """Strategic merge is for built-in kinds; a stale resourceVersion is a conflict."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    fake, _ = kube
    api = client.CustomObjectsApi(client.ApiClient(client.Configuration(host=fake.url)))
    with pytest.raises(ApiException) as e:
        api.patch_namespaced_custom_object("ray.io", "v1", "tideserve", "rayjobs", "tideserve-train", {"spec": {}},
                                           _content_type="application/strategic-merge-patch+json")
    assert e.value.status == 415
    with pytest.raises(ApiException) as e:
        api.patch_namespaced_custom_object("ray.io", "v1", "tideserve", "rayjobs", "tideserve-train",
                                           {"metadata": {"resourceVersion": "1"}, "spec": {"suspend": False}})
    assert e.value.status == 409 and fake.obj("rayjobs", "tideserve-train")["spec"]["suspend"] is True
    pod = _lendable(fake)[0]
    core = client.CoreV1Api(client.ApiClient(client.Configuration(host=fake.url)))
    core.patch_namespaced_pod(pod, "tideserve", {"metadata": {"labels": {"x": "y"}}})
    assert fake.obj("pods", pod)["metadata"]["labels"]["x"] == "y"


@pytest.mark.security
def test_the_scaler_role_grants_exactly_what_a_night_and_day_use(kube):
    fake, controller = kube
    k = _client(fake)
    night(k, "lendable", 1, Drain(), job="tideserve-train")
    controller.reconcile()
    controller.finish_job("tideserve-train")
    day(k, "lendable", job="tideserve-train")
    night(k, "lendable", 1, Drain(), job="tideserve-train")  # re-creates the finished job
    controller.reconcile()
    day(k, "lendable", job="tideserve-train", stop_run=lambda *a: "STOPPED")
    role = _doc(K8S / "rbac.yaml", "Role")
    granted = {(res, verb, name) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]
               for name in rule.get("resourceNames", [None])}
    used = {(plural, verb, name if (plural, verb, name) in granted else None) for plural, verb, name in fake.calls}
    assert {(p, v) for p, v, _ in granted} == {(p, v) for p, v, _ in used}  # nothing granted that is unused
    assert used <= granted  # and every call allowed, by name where the rule names one
    assert ("rayclusters", "get", LIVE) in fake.calls  # KubeRay's name for it: no resourceNames possible


def _kubeconfig(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "tide", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tide", "namespace": "tideserve"}}]}))
    return path


def test_the_cli_decides_from_the_live_cluster_and_the_morning_needs_no_ray(kube, tmp_path):
    fake, controller = kube

    def tide(*args: str) -> subprocess.CompletedProcess:
        env = {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "KUBERNETES_SERVICE_HOST")},
               "KUBECONFIG": str(_kubeconfig(tmp_path, fake.url)), "TIDE_HOME": str(tmp_path / "home")}
        return subprocess.run([sys.executable, "-m", "deploy.cli", "scale", *args, "--k8s", "--json"],
                              capture_output=True, text=True, timeout=120, env=env)

    r = tide("night", "--dry-run", "--night-nodes", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["serve_nodes"] == 3 and out["replicas"] == 1 and out["dry_run"] and fake.log == []
    r = tide("day", "--group", "gpu")
    assert r.returncode == 2 and "'gpu'" in r.stderr
    # a night happened: the morning is Kubernetes only (no Ray connection from the CronJob)
    night(_client(fake), "lendable", 0, Drain())
    controller.reconcile()
    r = tide("day", "--job", "")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["serve_nodes"] == 4 and out["replicas"] == 2 and out["serve_replicas"] == {"LLMServer": 4}
    controller.reconcile()
    assert len(_lendable(fake)) == 2


@pytest.mark.parametrize("args, status, message", [
    (["night"], 1, "no cluster is running"),  # a runtime condition: one line, exit 1
    (["dusk"], 2, "'dusk'"),  # usage errors: exit 2
    ([], 2, "exactly one"),
    (["day", "--serve-nodes", "2"], 2, "exactly one"),
])
def test_scale_cli_says_what_is_wrong(tmp_path, args, status, message):
    from tests.cli import tide_here

    r = tide_here("scale", *args, env={"RAY_ADDRESS": None, "TIDE_HOME": str(tmp_path)})
    assert r.returncode == status and message in " ".join(r.stderr.replace("│", " ").split())


def test_schedule_show_and_set(tmp_path):
    import json

    from tests.cli import tide_here

    def tide(*args):
        return tide_here("schedule", *args, env={"TIDE_HOME": str(tmp_path)})

    assert json.loads(tide("show", "--json").stdout)["day"] == "08:00"
    r = tide("set", "--night", "23:30", "--tz", "Europe/Berlin", "--night-nodes", "2")
    assert r.returncode == 0, r.stderr
    shown = json.loads(tide("show", "--json").stdout)
    assert shown == {"day": "08:00", "night": "23:30", "timezone": "Europe/Berlin", "night_nodes": 2}
    bad = tide("set", "--tz", "Mars/Base")
    assert bad.returncode == 2 and "Mars/Base" in bad.stderr
    assert json.loads(tide("show", "--json").stdout)["timezone"] == "Europe/Berlin"  # nothing lost
