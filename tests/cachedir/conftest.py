from __future__ import annotations

import pytest

from deploy.redis_proc import RedisServer


class FakeClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    import shutil

    from tests.conftest import require

    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()
