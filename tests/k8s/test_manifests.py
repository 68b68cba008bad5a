"""k8s/: every manifest validates (KubeRay CRD schemas, core kinds against the official client's
models), serveConfigV2 against Ray Serve's schema and our AppArgs, and the kustomization renders."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SCHEMAS = ROOT.parent / "shared" / "schemas" / "kuberay"
CRDS = {"RayService": "rayservice_v1.json", "RayJob": "rayjob_v1.json", "RayCluster": "raycluster_v1.json"}


def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return docs


DOCS = documents()


def test_the_expected_kinds_are_there():
    kinds = sorted(d["kind"] for _, d in DOCS)
    for kind in ("RayService", "RayJob", "StatefulSet", "Service", "CronJob", "ServiceAccount",
                 "Role", "RoleBinding", "PersistentVolumeClaim", "NetworkPolicy"):
        assert kind in kinds, kind


@pytest.mark.parametrize("name, doc", [d for d in DOCS if d[1]["kind"] in CRDS], ids=lambda v: v if isinstance(v, str) else "")
def test_kuberay_resources_validate_against_the_crd_schemas(name, doc):
    jsonschema = pytest.importorskip("jsonschema")
    path = SCHEMAS / CRDS[doc["kind"]]
    if not path.is_file():
        pytest.skip(f"KubeRay schema {path} is not available")
    assert doc["apiVersion"] == "ray.io/v1"
    schema = json.loads(path.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]


def _core_model(doc: dict) -> str:
    group_version = doc["apiVersion"].split("/")[-1]
    return f"{group_version.capitalize()}{doc['kind']}"


def _check_model(data, type_name: str, path: str) -> None:
    """Every key is a field of the kubernetes client model, recursively; required fields present."""
    import kubernetes.client.models as models

    m = re.fullmatch(r"list\[(.+)\]", type_name)
    if m:
        assert isinstance(data, list), f"{path}: expected a list"
        for i, item in enumerate(data):
            _check_model(item, m.group(1), f"{path}[{i}]")
        return
    m = re.fullmatch(r"dict\((.+), (.+)\)", type_name)
    if m:
        assert isinstance(data, dict), f"{path}: expected a mapping"
        for k, v in data.items():
            _check_model(v, m.group(2), f"{path}.{k}")
        return
    cls = getattr(models, type_name, None)
    if cls is None:  # str, int, bool, object, datetime
        return
    assert isinstance(data, dict), f"{path}: expected a {type_name} mapping"
    by_json = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    for key, value in data.items():
        assert key in by_json, f"{path}: {type_name} has no field {key!r}"
        _check_model(value, cls.openapi_types[by_json[key]], f"{path}.{key}")
    # constructing the model runs the client's own required-field checks
    from kubernetes.client import ApiClient

    ApiClient()._ApiClient__deserialize(data, type_name)


@pytest.mark.parametrize("name, doc", [d for d in DOCS if d[1]["kind"] not in CRDS and d[1]["kind"] != "PodMonitor"],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_core_resources_validate_against_the_kubernetes_models(name, doc):
    pytest.importorskip("kubernetes")
    _check_model(doc, _core_model(doc), name)


def test_serve_config_v2_is_a_valid_serve_config_of_our_app():
    from ray.serve.schema import ServeDeploySchema

    from deploy.app import AppArgs

    (service,) = [d for _, d in DOCS if d["kind"] == "RayService"]
    config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    (app,) = config.applications
    assert app.import_path == "deploy.app:build_app"
    AppArgs(**app.args)  # unknown or bad fields raise


def test_rbac_allows_exactly_what_the_scaler_needs():
    (role,) = [d for _, d in DOCS if d["kind"] == "Role"]
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r.get("resourceNames", ()))): set(r["verbs"])
             for r in role["rules"]}
    assert rules == {
        (("ray.io",), ("rayservices",), ("tideserve",)): {"get", "patch"},
        (("ray.io",), ("rayclusters",), ()): {"get", "patch"},
        (("ray.io",), ("rayjobs",), ("tideserve-train",)): {"get", "patch", "delete"},
        (("ray.io",), ("rayjobs",), ()): {"create"},
        (("",), ("pods",), ()): {"list"},
    }  # tests/deploy/test_k8s_scale.py checks a night and a day use all of it


def test_the_training_job_can_be_suspended_and_runs_on_what_the_night_frees():
    (job,) = [d for _, d in DOCS if d["kind"] == "RayJob"]
    spec = job["spec"]
    # KubeRay's validation: suspend needs shutdownAfterJobFinishes and its own cluster
    assert spec["suspend"] is True and spec["shutdownAfterJobFinishes"] is True
    assert "clusterSelector" not in spec and spec["rayClusterSpec"]
    (service,) = [d for _, d in DOCS if d["kind"] == "RayService"]
    lendable = next(g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "lendable")

    def gpus(group: dict) -> int:
        return group["maxReplicas"] * sum(int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
                                          for c in group["template"]["spec"]["containers"])

    assert sum(gpus(g) for g in spec["rayClusterSpec"]["workerGroupSpecs"]) == gpus(lendable)
    # checkpoints outlive the run's cluster: --out is on the claim every pod of it mounts
    out = next(a for a in spec["entrypoint"].split() if a.startswith("/"))
    claims = {d["metadata"]["name"] for _, d in DOCS if d["kind"] == "PersistentVolumeClaim"}
    for pod in [spec["rayClusterSpec"]["headGroupSpec"], *spec["rayClusterSpec"]["workerGroupSpecs"]]:
        mounts = {m["name"]: m["mountPath"] for c in pod["template"]["spec"]["containers"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["template"]["spec"]["volumes"]}
        (name,) = [n for n, path in mounts.items() if out.startswith(path + "/")]
        assert volumes[name]["persistentVolumeClaim"]["claimName"] in claims


def test_kustomization_renders():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (Debian: kubernetes-client); the manifests were validated above")
    r = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rendered = [d for d in yaml.safe_load_all(r.stdout) if d]
    generated = yaml.safe_load((K8S / "kustomization.yaml").read_text())["configMapGenerator"]
    assert len(rendered) == len(DOCS) + len(generated)  # + the dashboard's ConfigMap
    dashboard = next(d for d in rendered if d["kind"] == "ConfigMap")
    assert json.loads(dashboard["data"]["tideserve.json"])["uid"] == "tideserve"
    cluster_scoped = {"Namespace", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    assert all(d["metadata"].get("namespace") == "tideserve" for d in rendered if d["kind"] not in cluster_scoped)


@pytest.mark.security
def test_the_shipped_cluster_runs_ray_with_token_auth_and_the_api_with_keys():
    """Ray's dashboard (the Jobs API runs code) and GCS listen beyond the pod: token
    authentication is on (KubeRay's authOptions) with the Ray version pyproject.toml pins; Serve
    listens on 0.0.0.0, so every serving container gets its API keys from a Secret."""
    import tomllib

    svc = next(d for _, d in DOCS if d["kind"] == "RayService")
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token"
    pin = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
               if d.startswith("ray["))
    low, high = re.search(r">=([\d.]+),<([\d.]+)", pin).groups()
    version = tuple(int(x) for x in cluster["rayVersion"].split("."))
    assert tuple(int(x) for x in low.split(".")) <= version < tuple(int(x) for x in high.split(".")), pin
    serve = yaml.safe_load(svc["spec"]["serveConfigV2"])
    assert serve["http_options"]["host"] == "0.0.0.0"
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            assert env["TIDE_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "tideserve-api-keys", container["name"]
            # the cache secret and the agent token are files from their Secrets that only their user reads
            for var, secret in (("TIDE_CACHE_SECRET_FILE", "tideserve-cache-secret"),
                                ("TIDE_AGENT_TOKEN_FILE", "tideserve-agent-token")):
                path = env[var]["value"]
                mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
                volume = next(v for v in group["template"]["spec"]["volumes"] if v["name"] == mount["name"])
                assert volume["secret"]["secretName"] == secret and volume["secret"]["defaultMode"] & 0o077 == 0, var


@pytest.mark.security
def test_no_secret_ships_with_a_value_and_the_redis_password_stays_off_command_lines():
    assert not [d["metadata"]["name"] for _, d in DOCS if d["kind"] == "Secret"]  # each made by its owner
    redis = next(d for _, d in DOCS if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "tideserve-redis")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    start = " ".join(container.get("command", []) + container.get("args", []))
    assert "requirepass" in start and "redis.conf" in start and "--requirepass" not in start
    probe = " ".join(container["readinessProbe"]["exec"]["command"])
    assert "REDISCLI_AUTH" in probe and " -a " not in probe


def _parse_tide(argv: list[str]) -> dict:
    """``argv`` parsed by the real `tide` CLI (click), without running it: its options, or
    click's UsageError naming the bad one."""
    from typer.main import get_command

    from deploy.cli import app

    cmd = get_command(app)
    ctx = cmd.make_context("tide", [], resilient_parsing=True)
    while hasattr(cmd, "get_command"):
        sub = cmd.get_command(ctx, argv[0])
        assert sub is not None, f"no `tide` command {argv[0]!r}"
        leaf = not hasattr(sub, "get_command")
        ctx = sub.make_context(argv[0], argv[1:] if leaf else [], parent=ctx, resilient_parsing=not leaf)
        cmd, argv = sub, argv[1:]
    return ctx.params


def test_every_tide_command_in_the_manifests_parses_with_the_real_cli():
    import shlex

    commands = []
    for _, doc in DOCS:
        if doc["kind"] == "RayJob":
            commands.append(shlex.split(doc["spec"]["entrypoint"]))
        if doc["kind"] == "CronJob":
            for c in doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]:
                commands.append(c["command"])
    assert len(commands) == 3
    for argv in commands:
        assert argv[0] == "tide"
        _parse_tide(argv[1:])  # a UsageError (an unknown option) fails the test
    job = next(d for _, d in DOCS if d["kind"] == "RayJob")
    minutes = _parse_tide(shlex.split(job["spec"]["entrypoint"])[1:])["minutes"]
    assert minutes * 60 < job["spec"]["activeDeadlineSeconds"]  # it checkpoints before it is killed


def test_the_rayservice_uses_no_removed_fields_and_says_who_scales_and_upgrades():
    svc = next(d for _, d in DOCS if d["kind"] == "RayService")
    spec = svc["spec"]
    # KubeRay deprecated these (1657) and removed what they did (1665)
    assert not {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"} & set(spec)
    assert spec["upgradeStrategy"]["type"] in ("None", "NewCluster", "NewClusterWithIncrementalUpgrade")
    assert spec["rayClusterConfig"]["enableInTreeAutoscaling"] is False  # `tide scale` owns worker counts


def test_the_pod_monitors_select_the_rayservice_pods_and_ports():
    monitors = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "PodMonitor"}
    assert set(monitors) == {"tideserve-api", "tideserve-ray"}
    assert all(d["apiVersion"] == "monitoring.coreos.com/v1" for d in monitors.values())
    svc = next(d for _, d in DOCS if d["kind"] == "RayService")
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    (api,) = monitors["tideserve-api"]["spec"]["podMetricsEndpoints"]
    assert api["port"] in {p["name"] for p in head["ports"]} and api["path"] == "/metrics"
    assert api["authorization"]["credentials"]["name"] == "tideserve-metrics-key"  # /metrics needs a key
    assert monitors["tideserve-api"]["spec"]["selector"]["matchLabels"]["ray.io/node-type"] == "head"
    (ray_endpoint,) = monitors["tideserve-ray"]["spec"]["podMetricsEndpoints"]
    assert ray_endpoint["port"] == "metrics"  # the port KubeRay adds to every Ray container


def test_the_dashboard_ships_as_a_configmap_and_queries_only_series_that_exist():
    from deploy.metrics import IngressMetrics

    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (gen,) = kustomization["configMapGenerator"]
    assert gen["options"]["labels"] == {"grafana_dashboard": "1"}  # Grafana's sidecar picks it up
    assert "monitoring.yaml" in kustomization["resources"]
    dashboard = json.loads((K8S / gen["files"][0]).read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = set(re.findall(r"tide:[a-z0-9_]+", " ".join(exprs)))
    exported = {m.name for m in IngressMetrics("m").registry.collect()}
    histograms = {m.name for m in IngressMetrics("m").registry.collect() if m.type == "histogram"}
    counters = {m.name for m in IngressMetrics("m").registry.collect() if m.type == "counter"}
    for name in used:
        base = name.removesuffix("_bucket") if name.removesuffix("_bucket") in histograms else name
        base = base.removesuffix("_total") if base.removesuffix("_total") in counters else base
        assert base in exported, name
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("tokens", "first token", "inter-token", "cache", "kv", "queue", "nodes serving vs lent", "expert"):
        assert topic in titles, topic


def test_network_policies_open_only_the_api_beyond_the_namespace():
    """Within the namespace everything; from elsewhere the API port to every Ray pod, the head's
    dashboard and GCS only from the operator's labelled namespace, metrics only from monitoring's."""
    policies = {d["metadata"]["name"]: d["spec"] for _, d in DOCS if d["kind"] == "NetworkPolicy"}
    assert policies["tideserve-within-namespace"] == {"podSelector": {}, "policyTypes": ["Ingress"],
                                                      "ingress": [{"from": [{"podSelector": {}}]}]}
    open_to_all = [rule for spec in policies.values() for rule in spec["ingress"] if "from" not in rule]
    assert [p["port"] for rule in open_to_all for p in rule["ports"]] == [8000]  # the API alone
    operator = policies["tideserve-kuberay-operator"]
    assert operator["podSelector"]["matchLabels"] == {"ray.io/node-type": "head"}
    (rule,) = operator["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"tideserve.io/kuberay-operator": "true"}}}]
    assert sorted(p["port"] for p in rule["ports"]) == [6379, 8265]
    head = next(d for _, d in DOCS if d["kind"] == "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports["dashboard"] == 8265 and ports["gcs"] == 6379 and ports["serve"] == 8000


def _admission():
    """The scaler's admission rules (k8s/admission.yaml) as a function of (object, oldObject):
    the messages of the rules it breaks, for a call by tideserve-scaler."""
    celpy = pytest.importorskip("celpy")
    (policy,) = [d for _, d in DOCS if d["kind"] == "ValidatingAdmissionPolicy"]
    spec = policy["spec"]
    assert spec["matchConditions"] == [{"name": "by-the-scaler", "expression":
                                        "request.userInfo.username == 'system:serviceaccount:tideserve:tideserve-scaler'"}]
    env = celpy.Environment()
    variables = [(v["name"], env.program(env.compile(v["expression"]))) for v in spec["variables"]]
    rules = [(env.program(env.compile(v["expression"])), v["message"]) for v in spec["validations"]]

    def broken(obj: dict, old: dict | None = None) -> list[str]:
        act = {"object": celpy.json_to_cel(obj), "oldObject": celpy.json_to_cel(old)}
        act["variables"] = celpy.json_to_cel({})
        values = {name: program.evaluate(act) for name, program in variables}
        act["variables"] = celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in values.items()})
        return [message for program, message in rules if not program.evaluate(act)]

    return broken


@pytest.mark.security
def test_the_scaler_may_change_worker_counts_and_start_the_shipped_training_job_only():
    """rbac.yaml cannot name the RayCluster it patches nor the RayJob it creates; admission.yaml
    holds those rights to what a night and a day do, and refuses what would reach a Secret."""
    import copy

    broken = _admission()
    (job,) = [d for _, d in DOCS if d["kind"] == "RayJob"]
    (service,) = [d for _, d in DOCS if d["kind"] == "RayService"]
    cluster = {"kind": "RayCluster", "metadata": {"name": "tideserve-x7k2p"}, "spec": service["spec"]["rayClusterConfig"]}
    assert broken(job) == [] and broken(job, job) == []  # created as shipped, and patched (suspend)
    night = copy.deepcopy(cluster)
    night["spec"]["workerGroupSpecs"][1].update(replicas=0, scaleStrategy={"workersToDelete": ["pod-1"]})
    assert broken(night, cluster) == []
    forged_pod = copy.deepcopy(cluster)
    forged_pod["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"] = "evil:1"
    assert broken(forged_pod, cluster) == ["tideserve-scaler may change a RayCluster's worker counts, not its pods"]
    secret_volume = {"name": "loot", "secret": {"secretName": "tideserve-redis"}}
    forgeries = [
        ({"metadata": {"name": "other"}}, "only the training RayJob"),
        ({"spec": {**job["spec"], "entrypoint": "python -c 'steal()'"}}, "only the training RayJob"),
        ({"spec": {**job["spec"], "rayClusterSpec": {**job["spec"]["rayClusterSpec"], "headGroupSpec": {
            **job["spec"]["rayClusterSpec"]["headGroupSpec"], "template": {"spec": {
                **job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"],
                "volumes": [secret_volume]}}}}}}, "no Secret"),
    ]
    for change, needle in forgeries:
        forged = {**job, **change}
        assert any(needle in m for m in broken(forged)), change
    env_secret = copy.deepcopy(job)
    worker = env_secret["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    worker["env"] = [{"name": "P", "valueFrom": {"secretKeyRef": {"name": "tideserve-redis", "key": "password"}}}]
    assert any("no Secret" in m for m in broken(env_secret))
    # the policy's literals are the shipped job's
    text = (K8S / "admission.yaml").read_text()
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert f"'{job['spec']['entrypoint']}'" in text and f"'{head['containers'][0]['image']}'" in text
    assert f"'{head['volumes'][0]['persistentVolumeClaim']['claimName']}'" in text
