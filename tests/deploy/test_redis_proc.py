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


def test_an_appendonly_server_keeps_its_writes_across_a_crash(tmp_path):
    """`tide up`'s Redis (batch jobs, stored responses): a write a second old survives a kill -9."""
    import time

    import redis

    from tests.conftest import require

    require(__import__("shutil").which("redis-server") is not None, "redis-server is not installed")
    for appendonly, kept in ((True, b"1"), (False, None)):
        server = RedisServer(tmp_path / str(appendonly), appendonly=appendonly, save="").start()
        try:
            redis.Redis(port=server.port).set("job", "1")
            time.sleep(1.5)  # the log is fsynced every second
            server.kill()  # SIGKILL: no shutdown save
            server.start()
            assert redis.Redis(port=server.port).get("job") == kept
        finally:
            server.kill()
