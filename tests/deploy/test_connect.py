"""An admin command names what is missing on a cluster that does not run the app."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray]


def test_a_cluster_without_serve_or_without_the_app_is_named_as_such(local_ray):
    from ray import serve

    from deploy.connect import Target, TideError, require_app
    from deploy.redis_proc import free_port

    target = Target(local_ray.address)
    with pytest.raises(TideError, match="runs no Ray Serve"):
        require_app(target)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()}, proxy_location="HeadOnly")
    with pytest.raises(TideError, match="runs no 'tideserve' app"):
        require_app(target)


def test_a_command_leaves_the_cluster_it_joined_and_keeps_a_connection_it_found(local_ray):
    """``tide`` leaves a connection it made before it exits (Ray's exit hook would first sleep
    half a second for log lines it never forwards); run in a process already connected (a
    driver of one's own, a test) it leaves that connection alone."""
    import subprocess
    import sys

    import ray

    from tests.cli import tide_here

    child = subprocess.run([sys.executable, "-c", f"""
import ray
from deploy.cli import main
try:
    main(["eplb", "show", "--address", "{local_ray.address}"])
except SystemExit as e:
    print(e.code, ray.is_initialized())
"""], capture_output=True, text=True, timeout=120)
    assert child.stdout.split() == ["1", "False"], child.stdout + child.stderr[-2000:]
    assert "runs no" in child.stderr  # it did reach the cluster: no Serve, or no app there
    r = tide_here("eplb", "show", "--address", local_ray.address)
    assert r.returncode == 1 and "runs no" in r.stderr, r.stderr
    assert ray.is_initialized() and ray.get_runtime_context().gcs_address == local_ray.address
