"""A simulated multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``), for the
benchmarks and the tests, that keeps to itself beside other Rays.

``Cluster`` alone shares the machine's defaults: the temp dir ``/tmp/ray`` (where a Ray job's
driver looks up "its" cluster, and where ``Cluster`` marks itself as the machine's current
one), the dashboard port and the head's dashboard-agent port (through which the Jobs API
submits). A ``SimulatedCluster`` has its own of each and leaves the machine's current-cluster
mark as it found it. It runs no autoscaler (its nodes are the ones added) and no log monitor (its
drivers connect with ``log_to_driver=False``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any

from deploy.ray_head import serve_env
from deploy.redis_proc import free_port

__all__ = ["SimulatedCluster"]


class SimulatedCluster:
    """A head node with ``head_args`` (``ray.cluster_utils.Cluster``'s node arguments) in a temp
    dir of its own; ``add_node`` adds worker nodes there. ``shutdown`` stops every node and
    removes the temp dir."""

    def __init__(self, **head_args: Any) -> None:
        import ray._private.utils as ray_utils
        from ray.cluster_utils import Cluster

        self.temp_dir = tempfile.mkdtemp(prefix="tide-sim-")  # short: Ray's socket paths live in it
        # no autoscaler monitor: nothing here adds nodes on demand; no log monitor: its drivers
        # take no worker logs (log_to_driver=False), and each node's log files stay as they are
        head_args = {"temp_dir": self.temp_dir, "dashboard_port": free_port(),
                     "dashboard_agent_listen_port": free_port(), "no_monitor": True, "include_log_monitor": False,
                     **head_args,
                     "env_vars": _env(head_args)}
        machine_current = ray_utils.read_ray_address()
        # Cluster writes its address there, and a fresh machine has no /tmp/ray yet
        os.makedirs(os.path.dirname(ray_utils.get_ray_address_file(None)), exist_ok=True)
        try:
            self.cluster = Cluster(initialize_head=True, head_node_args=head_args)
        except BaseException:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            raise
        self.address: str = self.cluster.address
        _restore_current(machine_current, self.address)
        # a job's driver looks its cluster up in the node's temp dir ("auto"); without this file
        # it takes any Ray it finds running on the machine
        ray_utils.write_ray_address(self.address, self.temp_dir)

    @property
    def worker_nodes(self) -> list:
        return list(self.cluster.worker_nodes)

    def add_node(self, **args: Any):
        """A worker node (``Cluster.add_node`` arguments), in this cluster's temp dir."""
        return self.cluster.add_node(**{"temp_dir": self.temp_dir, "dashboard_agent_listen_port": free_port(), **args,
                                        "env_vars": _env(args)})

    def remove_node(self, node, allow_graceful: bool = True) -> None:
        self.cluster.remove_node(node, allow_graceful=allow_graceful)

    def wait_for_nodes(self) -> None:
        self.cluster.wait_for_nodes()

    def shutdown(self) -> None:
        try:
            self.cluster.shutdown()
        finally:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _env(node_args: dict[str, Any]) -> dict[str, str]:
    """A node's environment beside the one it inherits: ``serve_env()`` and ``node_args``'."""
    return {**serve_env(), **node_args.get("env_vars", {})}


def _restore_current(before: str | None, ours: str) -> None:
    """``Cluster`` writes its address as the machine's current Ray (``/tmp/ray``); put back what
    was there, unless another Ray wrote it meanwhile."""
    import ray._common.utils as common
    import ray._private.utils as ray_utils

    if ray_utils.read_ray_address() != ours:
        return
    path = common.get_ray_address_file(None)
    if before is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    else:
        with open(path, "w") as f:
            f.write(before)
