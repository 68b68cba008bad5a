"""Shared test setup: service markers skip locally when a service is missing, fail under CI=true."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

IN_CI = os.environ.get("CI", "").lower() == "true"

# Triton kernels run in Triton's CPU interpreter when there is no GPU. The flag is read when a
# kernel is decorated, so it must be set before any ``kernels.*`` module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# On a GPU, tuning every kernel for every test shape would compile each config for each of them
# (minutes); tests run the first config, and the kernel tests check every config separately.
os.environ.setdefault("TIDE_AUTOTUNE", "0")


def require(condition: bool, why: str) -> None:
    """Skip (locally) or fail (CI=true) when a needed service is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{why} (CI=true: a missing service is a failure, not a skip)")
    pytest.skip(why)


@pytest.fixture(autouse=True)
def _services_for_markers(request):
    if request.node.get_closest_marker("redis"):
        require(shutil.which("redis-server") is not None, "redis-server is not installed")
    if request.node.get_closest_marker("ray"):
        try:
            import ray  # noqa: F401
        except ImportError:
            require(False, "ray is not installed")
    if request.node.get_closest_marker("gpu"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server for the module (killed at its end)."""
    from deploy.redis_proc import RedisServer

    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A real Redis Cluster for the module: three primaries with a replica each (killed at its end)."""
    from deploy.redis_proc import RedisClusterServer

    require(shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None,
            "redis-server / redis-cli are not installed")
    cluster = RedisClusterServer(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.kill()


# The shared Rays (tests/shared_ray.py) by fixture name, with the order their modules run in.
SHARED_RAYS = {"three_nodes": 1, "local_ray": 2}
# Module -> the shared Ray its tests use (set at collection).
_ON_SHARED_RAY: dict = {}


def pytest_collection_modifyitems(config, items):
    """The modules on a shared Ray run after the others, those of one shared Ray in a row, so it
    starts once."""
    for item in items:
        for name in SHARED_RAYS:
            if name in item.fixturenames:
                _ON_SHARED_RAY[getattr(item, "module", None)] = name
    items.sort(key=lambda item: SHARED_RAYS.get(_ON_SHARED_RAY.get(getattr(item, "module", None)), 0))


@pytest.fixture(scope="session")
def _shared_rays(tmp_path_factory):
    from tests.shared_ray import SharedRay, stop_shared

    home = tmp_path_factory.mktemp("shared-ray-home")
    yield {"local_ray": SharedRay(home, nodes=1), "three_nodes": SharedRay(home, nodes=3)}
    stop_shared()


@pytest.fixture(scope="module")
def local_ray(_shared_rays):
    """This run's one-node Ray (2 CPUs; ``tests/shared_ray.py``), shared with the other modules
    that use it and reset when the module ends: Serve and every named actor removed."""
    shared = _shared_rays["local_ray"]
    shared.acquire()
    yield shared
    shared.reset()


@pytest.fixture(scope="module")
def three_nodes(_shared_rays):
    """This run's three simulated nodes (one CPU, resource ``node{i}`` and pod name
    ``tests.shared_ray.pod_name(i)`` each; ``.cluster``), shared like ``local_ray``: a worker
    node a module removed or added is put back or removed when the module ends."""
    shared = _shared_rays["three_nodes"]
    shared.acquire()
    yield shared
    shared.reset()


@pytest.fixture(scope="module", autouse=True)
def _no_ray_left_initialized(request):
    """A module whose Ray fixture failed half-way must not leave Ray initialized in this process:
    every later module's ``ray.init`` would fail with "called ray.init twice". A module that
    starts its own Ray (or none) begins without a shared one."""
    own = request.module not in _ON_SHARED_RAY
    if own:
        _stop_ray()
    yield
    if own:
        _stop_ray()


def _stop_ray() -> None:
    from tests.shared_ray import stop_shared

    stop_shared()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
