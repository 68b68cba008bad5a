"""``tide scale --k8s`` against an in-memory Kubernetes object store (no live cluster)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from deploy.k8s_scale import K8sScaleError, scale_worker_group

RAYSERVICE = Path(__file__).resolve().parents[2] / "k8s" / "rayservice.yaml"


class FakeCustomObjects:
    """``CustomObjectsApi``'s get/patch over a dict, with JSON merge patch semantics."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.patches: list[tuple[str, str, dict]] = []
        self.calls: set[tuple[str, str, str]] = set()  # (plural, verb, name)

    def put(self, plural: str, namespace: str, obj: dict) -> None:
        self.objects[(plural, namespace, obj["metadata"]["name"])] = copy.deepcopy(obj)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.calls.add((plural, "get", name))
        try:
            return copy.deepcopy(self.objects[(plural, namespace, name)])
        except KeyError:
            raise RuntimeError(f"(404) {plural} {namespace}/{name} not found") from None

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body):
        self.calls.add((plural, "patch", name))
        obj = self.objects[(plural, namespace, name)]
        _merge(obj, body)
        self.patches.append((plural, name, body))
        return copy.deepcopy(obj)


def _merge(target: dict, patch: dict) -> None:
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(target.get(k), dict):
            _merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


@pytest.fixture
def api():
    svc = yaml.safe_load(RAYSERVICE.read_text())
    svc["status"] = {"activeServiceStatus": {"rayClusterName": "tideserve-abc12"}}
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "tideserve-abc12"},
               "spec": copy.deepcopy(svc["spec"]["rayClusterConfig"])}
    fake = FakeCustomObjects()
    fake.put("rayservices", "tideserve", svc)
    fake.put("rayclusters", "tideserve", cluster)
    return fake


def _replicas(obj_spec: dict, group: str) -> int:
    return next(g["replicas"] for g in obj_spec["workerGroupSpecs"] if g["groupName"] == group)


def test_night_then_day_patches_the_service_and_the_live_cluster(api):
    r = scale_worker_group(api, "tideserve", "tideserve", "lendable", 0)
    assert r["replicas_before"] == 2 and r["raycluster"] == "tideserve-abc12"
    svc = api.get_namespaced_custom_object("ray.io", "v1", "tideserve", "rayservices", "tideserve")
    live = api.get_namespaced_custom_object("ray.io", "v1", "tideserve", "rayclusters", "tideserve-abc12")
    assert _replicas(svc["spec"]["rayClusterConfig"], "lendable") == 0
    assert _replicas(live["spec"], "lendable") == 0  # KubeRay 2331: the live cluster too
    assert _replicas(live["spec"], "serve") == 2  # other groups untouched
    scale_worker_group(api, "tideserve", "tideserve", "lendable", 2)
    live = api.get_namespaced_custom_object("ray.io", "v1", "tideserve", "rayclusters", "tideserve-abc12")
    assert _replicas(live["spec"], "lendable") == 2
    assert [p[0] for p in api.patches] == ["rayservices", "rayclusters"] * 2


@pytest.mark.security
def test_the_scaler_role_grants_exactly_what_a_night_and_day_use(api):
    scale_worker_group(api, "tideserve", "tideserve", "lendable", 0)
    scale_worker_group(api, "tideserve", "tideserve", "lendable", 2)
    docs = list(yaml.safe_load_all((RAYSERVICE.parent / "rbac.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "Role")
    granted = {(res, verb) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]}
    used = {(plural, verb) for plural, verb, _ in api.calls}
    assert granted == used  # nothing the code does not use (rayjobs create/delete were granted)
    for rule in role["rules"]:
        names = {name for plural, _, name in api.calls if plural in rule["resources"]}
        # the RayService by name; the live RayCluster's name is KubeRay's (tideserve-<random>)
        assert rule.get("resourceNames") == (["tideserve"] if rule["resources"] == ["rayservices"] else None)
        assert not rule.get("resourceNames") or names <= set(rule["resourceNames"])


def test_dry_run_changes_nothing(api):
    r = scale_worker_group(api, "tideserve", "tideserve", "lendable", 1, dry_run=True)
    assert r["dry_run"] and r["replicas"] == 1 and api.patches == []


def test_errors_name_the_problem(api):
    with pytest.raises(K8sScaleError, match="no worker group 'gpu'"):
        scale_worker_group(api, "tideserve", "tideserve", "gpu", 1)
    with pytest.raises(K8sScaleError, match="at most 2"):
        scale_worker_group(api, "tideserve", "tideserve", "lendable", 5)
    with pytest.raises(K8sScaleError, match="404"):
        scale_worker_group(api, "tideserve", "missing", "lendable", 1)
    with pytest.raises(ValueError, match="-1"):
        scale_worker_group(api, "tideserve", "tideserve", "lendable", -1)


@pytest.mark.parametrize("args, status, message", [
    (["night"], 1, "no cluster is running"),  # a runtime condition: one line, exit 1
    (["dusk"], 2, "'dusk'"),  # usage errors: exit 2
    ([], 2, "exactly one"),
    (["day", "--serve-nodes", "2"], 2, "exactly one"),
])
def test_scale_cli_says_what_is_wrong(tmp_path, args, status, message):
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "deploy.cli", "scale", *args], capture_output=True, text=True,
                       timeout=120, env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
                                         "TIDE_HOME": str(tmp_path)})
    assert r.returncode == status and message in " ".join(r.stderr.replace("│", " ").split())


def test_schedule_show_and_set(tmp_path):
    import json
    import os
    import subprocess
    import sys

    def tide(*args):
        return subprocess.run([sys.executable, "-m", "deploy.cli", "schedule", *args], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "TIDE_HOME": str(tmp_path)})

    assert json.loads(tide("show", "--json").stdout)["day"] == "08:00"
    r = tide("set", "--night", "23:30", "--tz", "Europe/Berlin", "--night-nodes", "2")
    assert r.returncode == 0, r.stderr
    shown = json.loads(tide("show", "--json").stdout)
    assert shown == {"day": "08:00", "night": "23:30", "timezone": "Europe/Berlin", "night_nodes": 2}
    bad = tide("set", "--tz", "Mars/Base")
    assert bad.returncode == 2 and "Mars/Base" in bad.stderr
    assert json.loads(tide("show", "--json").stdout)["timezone"] == "Europe/Berlin"  # nothing lost
