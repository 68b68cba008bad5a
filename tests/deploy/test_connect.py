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
