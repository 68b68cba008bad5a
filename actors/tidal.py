"""Day/night on Ray, the actor side: the cluster's ``TidalState`` (each node's role, the
replicas' reports), node leases, and training jobs on lent nodes through the Ray Jobs API.
``deploy/tidal.py`` drives a night and a morning with them (its docstring tells the steps)."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = ["TidalState", "lease_name", "lease_node", "jobs_client", "release_lease", "stop_training", "submit_training", "tidal_state", "wait_job"]

NAMESPACE = "tideserve"
STATE_NAME = "tideserve-tidal"
ROLES = ("serving", "draining", "migrate", "lent")


class TidalState:
    """Roles of the nodes and the replicas' latest reports (one detached actor per cluster)."""

    def __init__(self) -> None:
        self._roles: dict[str, str] = {}
        self._reports: dict[str, dict] = {}  # node -> the latest report from a replica there
        self._by_replica: dict[str, dict] = {}  # replica actor name -> its latest report
        self.job_id: str | None = None
        self._nights = {"nights": 0, "migrated": 0, "last_drain_s": 0.0}

    def record_night(self, drain_s: float, migrated: bool) -> None:
        """A night's drain took ``drain_s``; ``migrated``: past its deadline, requests moved."""
        self._nights = {"nights": self._nights["nights"] + 1, "migrated": self._nights["migrated"] + migrated,
                        "last_drain_s": drain_s}

    def nights(self) -> dict:
        """Nights so far, how many moved requests to finish their drain, the last drain's seconds."""
        return dict(self._nights)

    def set_roles(self, roles: dict[str, str]) -> None:
        for node, role in roles.items():
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}; roles: {ROLES}")
            self._roles[node] = role

    def drop(self, nodes: list[str]) -> None:
        """Forget nodes that left the cluster (a Kubernetes night deletes the lent pods)."""
        for node in nodes:
            self._roles.pop(node, None)
            self._reports.pop(node, None)

    def roles(self) -> dict[str, str]:
        return dict(self._roles)

    def report(self, node_id: str, info: dict) -> str:
        """A replica's heartbeat (``actor_name``, ``draining``, ``running``, optionally its
        ``stats``); returns the role of its node."""
        entry = {**info, "node_id": node_id, "time": time.time()}
        self._reports[node_id] = entry
        if info.get("actor_name"):
            self._by_replica[info["actor_name"]] = entry
        return self._roles.get(node_id, "serving")

    def reports(self) -> dict[str, dict]:
        return dict(self._reports)

    def forget(self, actor_name: str) -> None:
        """A replica stopped (Serve replaced or removed it)."""
        self._by_replica.pop(actor_name, None)

    def replica_reports(self, max_age_s: float = 3.0) -> dict[str, dict]:
        """Every replica that reported in the last ``max_age_s`` seconds (they report twice a
        second), by actor name: several replicas may share a node."""
        now = time.time()
        self._by_replica = {k: r for k, r in self._by_replica.items() if now - r["time"] < 600}
        return {k: r for k, r in self._by_replica.items() if now - r["time"] < max_age_s}

    def set_job(self, job_id: str | None) -> None:
        self.job_id = job_id

    def job(self) -> str | None:
        return self.job_id


HEAD = "node:__internal_head__"  # the resource only the head node has


def tidal_state():
    """The cluster's ``TidalState`` (made on first use). It lives on the head node: a worker
    node that fails or whose pod is deleted at night must not take the roles with it."""
    return ray.remote(TidalState).options(name=STATE_NAME, namespace=NAMESPACE, lifetime="detached",
                                          get_if_exists=True, num_cpus=0, resources={HEAD: 0.001}).remote()


class _Lease:
    """Holds a lent node's serving resources so no serving replica lands there."""

    def ready(self) -> str:
        return ray.get_runtime_context().get_node_id()


def lease_name(node_id: str) -> str:
    return f"tideserve-lease-{node_id}"


def lease_node(node_id: str, cpus: float, gpus: float = 0.0):
    """A pinned, detached actor holding a replica's resources on ``node_id`` (pending until the
    node's replica has gone); ``ready`` answers once it holds them."""
    return ray.remote(_Lease).options(
        name=lease_name(node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=cpus,
        num_gpus=gpus, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()


def release_lease(node_id: str) -> None:
    try:
        ray.kill(ray.get_actor(lease_name(node_id), namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass


def jobs_client(dashboard: str | None = None):
    """The Ray Jobs API of this cluster (``dashboard``: its address when known)."""
    from ray.job_submission import JobSubmissionClient

    address = dashboard or ray._private.worker.get_dashboard_url()
    if not address:
        raise RuntimeError("this Ray cluster runs no dashboard, so no Jobs API (start it with --include-dashboard=true)")
    if not address.startswith("http"):
        address = f"http://{address}"
    return JobSubmissionClient(address)


def submit_training(nodes: list[str], train: dict[str, Any]) -> str:
    """A Ray job whose driver may run only on ``nodes`` (the ``ray.io/node-id`` label)."""
    selector = nodes[0] if len(nodes) == 1 else f"in({','.join(nodes)})"
    return jobs_client(train.get("dashboard")).submit_job(
        entrypoint=train["entrypoint"], runtime_env=train.get("runtime_env"),
        submission_id=train.get("submission_id"), entrypoint_label_selector={"ray.io/node-id": selector},
    )


def wait_job(client, job_id: str, timeout_s: float) -> str:
    """Poll the job until it ends or ``timeout_s`` passes; its status then (``SUCCEEDED``,
    ``STOPPED``, ``RUNNING``...)."""
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not client.get_job_status(job_id).is_terminal():
        time.sleep(0.25)
    status = client.get_job_status(job_id)
    return status.value if isinstance(status, JobStatus) else str(status)


def stop_training(job_id: str, deadline_s: float = 60.0, dashboard: str | None = None) -> str:
    """SIGTERM the job (the trainer checkpoints and exits), wait for it to end; its final status."""
    client = jobs_client(dashboard)
    if not client.get_job_status(job_id).is_terminal():
        client.stop_job(job_id)
    if wait_job(client, job_id, deadline_s) in ("PENDING", "RUNNING"):
        client.stop_job(job_id)  # again: Ray kills it after its own grace period
    return wait_job(client, job_id, 0.0)
