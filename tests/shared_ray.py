"""One local Ray shared by the test modules that serve on a single node (``local_ray``): started
by the first such module, reset between modules, stopped by the first module that needs another
Ray (a ``Cluster``) or at the end of the run. Starting Ray costs ~10 s here, every module."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SharedRay:
    """The shared Ray of this test run: 2 CPUs, ``TIDE_HOME=home`` for every job's workers."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.address: str | None = None

    def running(self) -> bool:
        """Whether this process is connected to the shared Ray (not to another one)."""
        import ray

        return self.address is not None and ray.is_initialized() and ray.get_runtime_context().gcs_address == self.address

    def acquire(self) -> None:
        import ray

        if self.running():
            return
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TIDE_HOME": str(self.home)}})
        self.address = ray.get_runtime_context().gcs_address

    def reset(self, within_s: float = 30.0) -> None:
        """Remove what a module left: Serve and its apps, every named actor (cache agents, the
        tidal state, expert shards). The next module gets every CPU free, or a new Ray."""
        import ray
        from ray import serve

        if not self.running():
            return
        try:
            serve.shutdown()
            for actor in ray.util.list_named_actors(all_namespaces=True):
                with contextlib.suppress(ValueError):  # gone meanwhile
                    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            deadline = time.monotonic() + within_s
            while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"CPUs still held {within_s} s after the module ended")
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - whatever is left, a new Ray leaves none of it
            self.stop()

    def stop(self) -> None:
        import ray

        if self.running():
            ray.shutdown()
        self.address = None


@contextlib.contextmanager
def serving(app, within_s: float = 300) -> Iterator[str]:
    """Serve ``app`` (a bound ``build_app``) on the connected Ray at a free port until the block
    ends: yields the base URL once ``/health`` answers."""
    from ray import serve

    from deploy.redis_proc import wait_healthy

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(app, name="tideserve", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, within_s)
        yield url
    finally:
        serve.shutdown()
