"""The local redis-server `tide up` and the tests start."""

from __future__ import annotations

import pytest

from deploy.redis_proc import RedisServer

pytestmark = pytest.mark.redis


@pytest.mark.security
def test_the_password_is_required_and_never_on_the_command_line(tmp_path):
    import redis

    from tests.conftest import require

    require(__import__("shutil").which("redis-server") is not None, "redis-server is not installed")
    server = RedisServer(tmp_path, password="pw-" + "x" * 20).start()
    try:
        cmdline = open(f"/proc/{server.proc.pid}/cmdline", "rb").read()
        assert b"pw-xxxx" not in cmdline  # anyone on the machine can read a command line
        assert (tmp_path / "redis.conf").stat().st_mode & 0o777 == 0o600
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        assert redis.Redis(port=server.port, password=server.password).ping()
    finally:
        server.kill()
