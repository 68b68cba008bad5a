"""The simulated clusters of the benchmarks and tests keep to themselves beside other Rays."""

from __future__ import annotations

import pytest


def test_the_machines_current_ray_is_put_back_unless_another_wrote_it(tmp_path, monkeypatch):
    import ray._common.utils as common
    import ray._private.utils as ray_utils

    from deploy.sim_cluster import _restore_current

    monkeypatch.setattr(common, "get_default_ray_temp_dir", lambda: str(tmp_path))
    ray_utils.write_ray_address("10.0.0.1:6379")
    ray_utils.write_ray_address("127.0.0.1:4000")  # what Cluster does
    _restore_current("10.0.0.1:6379", "127.0.0.1:4000")
    assert ray_utils.read_ray_address() == "10.0.0.1:6379"
    ray_utils.write_ray_address("127.0.0.1:4000")
    _restore_current(None, "127.0.0.1:4000")  # there was none: there is none
    assert ray_utils.read_ray_address() is None
    ray_utils.write_ray_address("127.0.0.1:5000")  # another Ray started meanwhile: its mark stays
    _restore_current("10.0.0.1:6379", "127.0.0.1:4000")
    assert ray_utils.read_ray_address() == "127.0.0.1:5000"


def test_it_starts_on_a_fresh_machine_that_has_no_default_ray_temp_dir_yet(tmp_path, monkeypatch):
    """``Cluster`` marks itself in ``/tmp/ray``, which nothing has made on a fresh machine (CI
    failed there); the mark is made and then put back as it was: absent."""
    import ray._common.utils as common
    import ray._private.utils as ray_utils
    import ray.cluster_utils

    from deploy import sim_cluster

    class MarkingCluster:  # what Cluster does to the machine's mark, without starting a Ray
        def __init__(self, initialize_head, head_node_args):
            self.address = "127.0.0.1:4000"
            ray_utils.write_ray_address(self.address)

        def shutdown(self):
            pass

    monkeypatch.setattr(common, "get_default_ray_temp_dir", lambda: str(tmp_path / "ray"))
    monkeypatch.setattr(ray.cluster_utils, "Cluster", MarkingCluster)
    c = sim_cluster.SimulatedCluster(num_cpus=1)
    try:
        assert ray_utils.read_ray_address() is None
        assert ray_utils.read_ray_address(c.temp_dir) == "127.0.0.1:4000"
    finally:
        c.shutdown()


@pytest.mark.ray
def test_its_nodes_live_in_its_own_temp_dir_where_a_jobs_driver_finds_it(three_nodes):
    import ray
    import ray._private.utils as ray_utils

    c = three_nodes.cluster
    assert ray_utils.read_ray_address(c.temp_dir) == c.address  # what a job's driver resolves "auto" with
    assert ray_utils.read_ray_address() != c.address  # not the machine's current Ray
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 3 and all(n["ObjectStoreSocketName"].startswith(c.temp_dir) for n in nodes)


def test_every_node_gives_serves_proxy_time_to_start_unless_the_environment_says(monkeypatch):
    from deploy.ray_head import SERVE_ENV
    from deploy.sim_cluster import _env

    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", raising=False)
    assert _env({"env_vars": {"RAY_CLOUD_INSTANCE_ID": "pod-1"}}) == {**SERVE_ENV, "RAY_CLOUD_INSTANCE_ID": "pod-1"}
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "7")  # inherited by the node as it is
    assert _env({}) == {}
