"""Rays shared by the test modules of one shape (``local_ray``: one node; ``three_nodes``: three
simulated nodes): started by the first such module, reset between modules, stopped by the first
module that needs another Ray or at the end of the run. Starting a Ray costs 10-30 s here."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

_ACTIVE: list[SharedRay] = []  # the shared Ray that is running, if any (one at a time)


class SharedRay:
    """A Ray shared by the test modules of one shape (a ``deploy.sim_cluster.SimulatedCluster``,
    in ``.cluster``): one node with 2 CPUs, or ``nodes`` simulated nodes of one CPU each with
    resource ``node{i}`` and pod name ``pod_name(i)``. Every job's workers get ``TIDE_HOME=home``."""

    def __init__(self, home: Path, nodes: int = 1) -> None:
        self.home, self.nodes = home, nodes
        self.cluster = None
        self._workers: dict = {}  # i -> the worker node with resource node{i}
        self.address: str | None = None

    def running(self) -> bool:
        """Whether this process is connected to this Ray (not to another one)."""
        import ray

        return self.address is not None and ray.is_initialized() and ray.get_runtime_context().gcs_address == self.address

    def acquire(self) -> None:
        import ray

        if self.running():
            return
        stop_shared()
        if ray.is_initialized():
            ray.shutdown()
        from deploy.sim_cluster import SimulatedCluster

        runtime_env = {"env_vars": {"TIDE_HOME": str(self.home)}}
        if self.nodes == 1:  # no dashboard: no module of this shape submits a job
            c = SimulatedCluster(num_cpus=2, include_dashboard=False)
        else:
            c = SimulatedCluster(num_cpus=1, resources={"node0": 1}, env_vars={"RAY_CLOUD_INSTANCE_ID": pod_name(0)})
        self.cluster = c
        try:
            self._workers = {i: self._add_worker(i) for i in range(1, self.nodes)}
            c.wait_for_nodes()
            ray.init(address=c.address, log_to_driver=False, runtime_env=runtime_env)
        except BaseException:
            self.cluster = None
            c.shutdown()
            raise
        self.address = ray.get_runtime_context().gcs_address
        _ACTIVE.append(self)

    def reset(self, within_s: float = 30.0) -> None:
        """Remove what a module left: Serve and its apps, every named actor (cache agents, the
        tidal state, leases, expert shards), and put back a worker node it removed. The next
        module gets every node alive and every CPU free, or a new Ray."""
        import ray
        from ray import serve

        if not self.running():
            self.stop()
            return
        try:
            serve.shutdown()
            for actor in ray.util.list_named_actors(all_namespaces=True):
                with contextlib.suppress(ValueError):  # gone meanwhile
                    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            self._restore_nodes()
            deadline = time.monotonic() + within_s
            while (ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0)
                   or sum(n["Alive"] for n in ray.nodes()) != self.nodes):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a node or CPU still held {within_s} s after the module ended")
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - whatever is left, a new Ray leaves none of it
            self.stop()

    def _restore_nodes(self) -> None:
        """Back to the nodes it started with: a worker node a module removed (a fault under
        test) comes back as a new node with its ``node{i}`` resource and pod name, and a node a
        module added goes. A few seconds instead of a new Ray."""
        if self.cluster is None:
            return
        for node in [n for n in self.cluster.worker_nodes if n not in self._workers.values()]:
            self.cluster.remove_node(node)
        missing = [i for i, node in self._workers.items() if node not in self.cluster.worker_nodes]
        for i in missing:
            self._workers[i] = self._add_worker(i)
        if missing:
            self.cluster.wait_for_nodes()

    def _add_worker(self, i: int):
        return self.cluster.add_node(num_cpus=1, resources={f"node{i}": 1}, env_vars={"RAY_CLOUD_INSTANCE_ID": pod_name(i)})

    def stop(self) -> None:
        import ray

        if self.running():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
            self._workers = {}
        self.address = None
        if self in _ACTIVE:
            _ACTIVE.remove(self)


def pod_name(i: int) -> str:
    """Node i's pod (``RAY_CLOUD_INSTANCE_ID``, which KubeRay sets in every Ray container): the
    Kubernetes tests map pods to nodes by it."""
    return f"tide-test-{'head' if i == 0 else 'worker'}-{i}"


def stop_shared() -> None:
    """Stop the shared Ray that is running (before a module that starts its own)."""
    for shared in list(_ACTIVE):
        shared.stop()


@contextlib.contextmanager
def serving(app, within_s: float = 300) -> Iterator[str]:
    """Serve ``app`` (a bound ``build_app``) on the connected Ray at a free port until the block
    ends: yields the base URL once ``/health`` answers. One HTTP proxy, on the head (never lent
    at night): the simulated nodes share 127.0.0.1, where more proxies would share the port."""
    from ray import serve

    from deploy.redis_proc import free_port, wait_healthy

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    try:
        serve.run(app, name="tideserve", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, within_s)
        yield url
    finally:
        serve.shutdown()
