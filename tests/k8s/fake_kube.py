"""A small in-process Kubernetes API server for the few endpoints ``tide scale --k8s`` uses, and
a KubeRay controller stand-in that reconciles them, so the official ``kubernetes`` client talks
HTTP to something that behaves like the real thing.

Served: RayServices, RayClusters and RayJobs (``ray.io/v1``: get, list, create, delete, patch,
replace) and Pods (``v1``: get, list with an equality label selector, delete, patch). Patches:
JSON merge patch, JSON patch (RFC 6902, with ``test``) and strategic merge patch, which the real
server refuses for custom resources (415) and applies to pods. Every write bumps the object's
``resourceVersion``; a write carrying a stale one fails with 409 Conflict, and ``interfere``
makes another writer change an object before the next write to it.

``KubeRayController.reconcile`` does what KubeRay's controllers do with these objects, in one
step: a RayCluster's pods follow its groups' ``replicas``, the pods named in
``scaleStrategy.workersToDelete`` going first and random ones after (the autoscaler is off, so
KubeRay deletes random pods to meet a lower count); a RayJob runs when unsuspended and is torn
down when suspended; a changed ``serveConfigV2`` is handed to ``on_serve_config``.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import re
import string
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

CUSTOM = re.compile(r"^/apis/ray\.io/v1/namespaces/([^/]+)/(rayservices|rayclusters|rayjobs)(?:/([^/]+))?$")
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?$")
KINDS = {"rayservices": "RayService", "rayclusters": "RayCluster", "rayjobs": "RayJob", "pods": "Pod"}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Enough of Kubernetes' strategic merge for pods: maps merge, ``containers`` and ``env``
    lists merge by ``name``, other lists are replaced."""
    if not isinstance(patch, dict) or not isinstance(target, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, list) and k in ("containers", "env", "volumes") and isinstance(out.get(k), list):
            by_name = {x.get("name"): x for x in out[k]}
            for item in v:
                by_name[item.get("name")] = strategic_merge_patch(by_name.get(item.get("name"), {}), item)
            out[k] = list(by_name.values())
        else:
            out[k] = strategic_merge_patch(out.get(k), v)
    return out


def _pointer(doc: Any, path: str) -> tuple[Any, str]:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    for p in parts[:-1]:
        doc = doc[int(p)] if isinstance(doc, list) else doc[p]
    return doc, parts[-1]


def json_patch(doc: Any, ops: list[dict]) -> Any:
    """RFC 6902 (add, remove, replace, test); a failed ``test`` or a bad path is a 422."""
    doc = copy.deepcopy(doc)
    for op in ops:
        try:
            parent, key = _pointer(doc, op["path"])
            if isinstance(parent, list):
                index = len(parent) if key == "-" else int(key)
                if op["op"] == "add":
                    parent.insert(index, copy.deepcopy(op["value"]))
                elif op["op"] == "remove":
                    del parent[index]
                elif op["op"] == "replace":
                    parent[index] = copy.deepcopy(op["value"])
                elif op["op"] == "test" and parent[index] != op["value"]:
                    raise ApiError(422, "Invalid", f"test failed at {op['path']}")
            else:
                if op["op"] in ("add", "replace"):
                    if op["op"] == "replace" and key not in parent:
                        raise KeyError(key)
                    parent[key] = copy.deepcopy(op["value"])
                elif op["op"] == "remove":
                    del parent[key]
                elif op["op"] == "test" and parent.get(key) != op["value"]:
                    raise ApiError(422, "Invalid", f"test failed at {op['path']}")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"json patch {op}: {e}") from None
    return doc


class FakeKube:
    """The object store and the HTTP server in front of it (``url``: its address)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}  # (plural, namespace, name)
        self.log: list[dict] = []  # every write: method, plural, name, content_type, body, code
        self.calls: set[tuple[str, str, str | None]] = set()  # (plural, verb, name): what RBAC must allow
        self.lock = threading.RLock()
        self._version = itertools.count(1000)
        self._interfere: dict[tuple[str, str], int] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- the store ---------------------------------------------------------------------------------
    def put(self, plural: str, obj: dict, namespace: str = "tideserve") -> dict:
        with self.lock:
            obj = copy.deepcopy(obj)
            meta = obj.setdefault("metadata", {})
            meta["namespace"] = namespace
            meta["resourceVersion"] = str(next(self._version))
            meta.setdefault("uid", "".join(random.choices(string.hexdigits.lower(), k=16)))
            self.objects[(plural, namespace, meta["name"])] = obj
            return copy.deepcopy(obj)

    def obj(self, plural: str, name: str, namespace: str = "tideserve") -> dict:
        with self.lock:
            return copy.deepcopy(self.objects[(plural, namespace, name)])

    def names(self, plural: str, namespace: str = "tideserve", labels: dict[str, str] | None = None) -> list[str]:
        with self.lock:
            return sorted(n for (p, ns, n), o in self.objects.items() if p == plural and ns == namespace
                          and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in (labels or {}).items()))

    def delete(self, plural: str, name: str, namespace: str = "tideserve") -> None:
        with self.lock:
            self.objects.pop((plural, namespace, name), None)

    def interfere(self, plural: str, name: str, times: int = 1) -> None:
        """Another writer changes ``name`` before each of the next ``times`` writes to it."""
        self._interfere[(plural, name)] = times

    def writes(self, plural: str | None = None) -> list[dict]:
        return [w for w in self.log if plural is None or w["plural"] == plural]

    # -- the API -----------------------------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict, content_type: str, body: Any) -> tuple[int, dict]:
        m, p = CUSTOM.match(path), PODS.match(path)
        if m:
            namespace, plural, name = m.groups()
        elif p:
            (namespace, name), plural = p.groups(), "pods"
        else:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource {path}")
        verb = {"GET": "get" if name else "list", "POST": "create", "DELETE": "delete", "PATCH": "patch",
                "PUT": "update"}.get(method, method)
        with self.lock:
            self.calls.add((plural, verb, name))
            if name is None:
                if method == "GET":
                    selector = dict(kv.split("=", 1) for kv in query.get("labelSelector", [""])[0].split(",") if kv)
                    items = [self.obj(plural, n, namespace) for n in self.names(plural, namespace, selector)]
                    return 200, {"kind": f"{KINDS[plural]}List", "apiVersion": "v1", "metadata": {}, "items": items}
                if method == "POST":
                    if (plural, namespace, body["metadata"]["name"]) in self.objects:
                        raise ApiError(409, "AlreadyExists", f"{plural} {body['metadata']['name']} already exists")
                    self.log.append({"method": method, "plural": plural, "name": body["metadata"]["name"],
                                     "content_type": content_type, "body": body, "code": 201})
                    return 201, self.put(plural, body, namespace)
                raise ApiError(405, "MethodNotAllowed", method)
            key = (plural, namespace, name)
            if key not in self.objects:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            if method == "GET":
                return 200, self.obj(plural, name, namespace)
            entry = {"method": method, "plural": plural, "name": name, "content_type": content_type, "body": body,
                     "code": 200}
            self.log.append(entry)
            if method == "DELETE":
                gone = self.obj(plural, name, namespace)
                self.delete(plural, name, namespace)
                return 200, gone
            if self._interfere.get((plural, name)):
                self._interfere[(plural, name)] -= 1
                self.put(plural, self.objects[key], namespace)  # someone else wrote it: a new version
            current = self.objects[key]
            if method == "PUT":
                new = body
            elif content_type.startswith("application/merge-patch+json"):
                new = merge_patch(current, body)
            elif content_type.startswith("application/json-patch+json"):
                new = json_patch(current, body)
            elif content_type.startswith("application/strategic-merge-patch+json"):
                if plural != "pods":
                    raise ApiError(415, "UnsupportedMediaType",
                                   "strategic merge patch is not supported for custom resources")
                new = strategic_merge_patch(current, body)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}")
            asked = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
            if asked is not None and asked != current["metadata"]["resourceVersion"]:
                entry["code"] = 409
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {plural} "{name}": the object '
                               "has been modified; please apply your changes to the latest version and try again")
            new = copy.deepcopy(new)
            new["metadata"] = {**new.get("metadata", {}), "name": name, "uid": current["metadata"]["uid"]}
            return 200, self.put(plural, new, namespace)


def _handler(kube: FakeKube):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _serve(self) -> None:
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
                code, out = kube.handle(self.command, url.path, parse_qs(url.query),
                                        self.headers.get("Content-Type", ""), body)
            except ApiError as e:
                code, out = e.code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                     "message": e.message, "reason": e.reason, "code": e.code}
            data = json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    return Handler


class KubeRayController:
    """KubeRay's reconcile, one step at a time (see the module docstring). ``on_pod_created`` /
    ``on_pod_deleted``: the test's Ray cluster gains or loses the node; ``on_serve_config``: the
    RayService's Serve config changed (KubeRay PUTs it to the dashboard)."""

    def __init__(self, kube: FakeKube, namespace: str = "tideserve",
                 on_pod_created: Callable[[dict], None] | None = None,
                 on_pod_deleted: Callable[[dict], None] | None = None,
                 on_serve_config: Callable[[str], None] | None = None,
                 on_job_started: Callable[[dict], tuple[str, str]] | None = None) -> None:
        self.kube, self.namespace = kube, namespace
        self.on_pod_created, self.on_pod_deleted, self.on_serve_config = on_pod_created, on_pod_deleted, on_serve_config
        self.on_job_started = on_job_started  # submits the entrypoint: (job id, dashboard address)
        self.deleted_named: list[str] = []  # pods deleted because workersToDelete named them
        self.deleted_random: list[str] = []  # pods deleted to meet a lower count, chosen at random
        self.applied: dict[str, str] = {}  # RayService -> the serveConfigV2 last handed over
        self.job_runs: list[str] = []  # RayJob clusters created

    def reconcile(self) -> None:
        for name in self.kube.names("rayservices", self.namespace):
            config = self.kube.obj("rayservices", name, self.namespace)["spec"]["serveConfigV2"]
            if self.applied.get(name) != config:
                if name in self.applied and self.on_serve_config:
                    self.on_serve_config(config)
                self.applied[name] = config
        for name in self.kube.names("rayclusters", self.namespace):
            self._cluster(self.kube.obj("rayclusters", name, self.namespace))
        for name in self.kube.names("rayjobs", self.namespace):
            self._job(self.kube.obj("rayjobs", name, self.namespace))

    def _cluster(self, cluster: dict) -> None:
        name = cluster["metadata"]["name"]
        for g in cluster["spec"].get("workerGroupSpecs", []):
            labels = {"ray.io/cluster": name, "ray.io/group": g["groupName"], "ray.io/node-type": "worker"}
            pods = self.kube.names("pods", self.namespace, labels)
            for pod in (g.get("scaleStrategy") or {}).get("workersToDelete") or []:
                if pod in pods:  # KubeRay deletes the named pods whatever the count says
                    self._delete_pod(pod)
                    pods.remove(pod)
                    self.deleted_named.append(pod)
            while len(pods) > g.get("replicas", 0):
                pod = pods.pop(random.randrange(len(pods)))
                self._delete_pod(pod)
                self.deleted_random.append(pod)
            for _ in range(g.get("replicas", 0) - len(pods)):
                suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
                pod = self.kube.put("pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {
                    "name": f"{name}-{g['groupName']}-worker-{suffix}", "labels": labels},
                    "status": {"phase": "Running"}}, self.namespace)
                if self.on_pod_created:
                    self.on_pod_created(pod)

    def _delete_pod(self, name: str) -> None:
        pod = self.kube.obj("pods", name, self.namespace)
        self.kube.delete("pods", name, self.namespace)
        if self.on_pod_deleted:
            self.on_pod_deleted(pod)

    def _job(self, job: dict) -> None:
        status = job.get("status") or {}
        state = status.get("jobDeploymentStatus")
        name = job["metadata"]["name"]
        if job["spec"].get("suspend"):
            if state != "Suspended":
                self._set_status(name, {"jobDeploymentStatus": "Suspended", "jobStatus": "STOPPED"
                                        if status.get("jobStatus") in ("PENDING", "RUNNING") else status.get("jobStatus"),
                                        "rayClusterName": None})
        elif state in (None, "Suspended", "New"):
            cluster = f"{name}-{''.join(random.choices(string.ascii_lowercase + string.digits, k=5))}"
            self.job_runs.append(cluster)
            job_id, dashboard = (self.on_job_started(job) if self.on_job_started else
                                 (f"{name}-{len(self.job_runs)}", f"{cluster}-head-svc.{self.namespace}.svc.cluster.local:8265"))
            self._set_status(name, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING",
                                    "rayClusterName": cluster, "jobId": job_id, "dashboardURL": dashboard})

    def _set_status(self, name: str, status: dict) -> None:
        with self.kube.lock:  # a status write: a new resourceVersion, as on a real server
            job = self.kube.obj("rayjobs", name, self.namespace)
            self.kube.put("rayjobs", {**job, "status": {**(job.get("status") or {}), **status}}, self.namespace)

    def finish_job(self, name: str, state: str = "Complete", job_status: str = "SUCCEEDED") -> None:
        """The run ended by itself (its ``--minutes`` were up)."""
        self._set_status(name, {"jobDeploymentStatus": state, "jobStatus": job_status})
