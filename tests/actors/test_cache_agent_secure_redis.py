"""A cache agent whose directory is a TLS-only redis-server with a password (a private CA): the
agent registers and heartbeats through it; without the CA or the password nobody reads it."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.security]


def test_agent_publishes_through_tls_redis_with_a_password(local_ray, tmp_path):
    import ray

    from actors.cache_agent import NAMESPACE, agent_name, ensure_cache_agents
    from actors.replica_config import AgentSection, DirectorySection, StoreSection
    from cachedir.directory import DirectoryUnavailable, open_directory
    from deploy.redis_proc import RedisServer
    from tests.certs import make_certs

    ca, cert, key = make_certs(tmp_path)
    server = RedisServer(tmp_path / "redis", password="s3cret-pw", tls=(ca, cert, key)).start()
    url = server.url.replace(":s3cret-pw@", "")  # the password travels separately, never in the URL
    try:
        agents = ensure_cache_agents(AgentSection(
            StoreSection(str(tmp_path / "cache" / "{node}"), ssd_bytes=1 << 28, ram_bytes=0),
            DirectorySection(url, "secure", password="s3cret-pw", ca_file=str(ca)), token="t", heartbeat_ttl_s=5.0))
        (node,) = agents
        d = open_directory(url, "secure", password="s3cret-pw", ssl_ca_certs=str(ca), timeout_s=2.0)
        deadline = time.monotonic() + 30
        while node not in d.live_nodes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert node in d.live_nodes()  # the agent heartbeats through TLS with the password
        for bad in (open_directory(url, "secure", ssl_ca_certs=str(ca), timeout_s=1.0),  # no password
                    open_directory(url, "secure", password="s3cret-pw", timeout_s=1.0)):  # CA not trusted
            with pytest.raises(DirectoryUnavailable):
                bad.live_nodes()
        ray.kill(ray.get_actor(agent_name(node), namespace=NAMESPACE), no_restart=True)
    finally:
        server.kill()
