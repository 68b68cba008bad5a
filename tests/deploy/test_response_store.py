"""The stored Responses (``deploy.response_store``): one contract, run on the in-process store
and on a real redis-server (and a real Redis Cluster: a tenant's keys share a slot): a tenant's
own responses only, the size and count limits, the TTL, and a store that is down."""

from __future__ import annotations

import pytest

from actors.replica_config import DirectorySection
from deploy.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    StoredResponse,
    StoreUnavailable,
)
from tests.cachedir.conftest import FakeClock

TTL_S = 60


def _record(rid: str, text: str = "hi") -> StoredResponse:
    item = {"id": f"msg_{rid}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    out = {"id": f"out_{rid}", "type": "message", "role": "assistant",
           "content": [{"type": "output_text", "text": "hello"}]}
    return StoredResponse({"id": rid, "object": "response", "output": [out]}, [item], [item, out])


@pytest.fixture(params=["memory", "redis", "redis_cluster"])
def store(request):
    if request.param == "memory":
        return MemoryResponseStore(TTL_S, 4096, 3)
    server = request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
    ns = f"rs{request.node.name.__hash__() & 0xFFFF}"
    return RedisResponseStore.open(DirectorySection(server.url, namespace=ns), TTL_S, 4096, 3)


@pytest.mark.redis
def test_a_tenant_reads_and_deletes_its_own_responses_only(store):
    assert store.put("alpha", _record("resp_1"))
    got = store.get("alpha", "resp_1")
    assert got == _record("resp_1")
    assert store.get("beta", "resp_1") is None and not store.delete("beta", "resp_1")  # another tenant's
    assert store.delete("alpha", "resp_1") and store.get("alpha", "resp_1") is None
    assert not store.delete("alpha", "resp_1")


@pytest.mark.redis
def test_a_record_over_the_size_limit_is_not_kept_and_a_tenant_keeps_the_newest(store):
    assert not store.put("alpha", _record("big", "x" * 5000)) and store.get("alpha", "big") is None
    for i in range(5):
        assert store.put("alpha", _record(f"resp_{i}"))
    kept = [i for i in range(5) if store.get("alpha", f"resp_{i}") is not None]
    assert kept == [2, 3, 4]  # at most 3 a tenant: the oldest went first
    assert store.put("beta", _record("resp_0")) and store.get("beta", "resp_0") is not None  # per tenant


def test_a_record_expires_after_its_ttl():
    clock = FakeClock()
    store = MemoryResponseStore(TTL_S, 4096, 3, clock=clock)
    store.put("alpha", _record("resp_1"))
    clock.advance(TTL_S - 1)
    assert store.get("alpha", "resp_1") is not None
    clock.advance(2)
    assert store.get("alpha", "resp_1") is None and not store.delete("alpha", "resp_1")


@pytest.mark.redis
def test_redis_keeps_the_ttl_on_each_record(redis_server):
    import redis

    store = RedisResponseStore.open(DirectorySection(redis_server.url, namespace="ttl"), TTL_S, 4096, 3)
    store.put("alpha", _record("resp_1"))
    r = redis.Redis.from_url(redis_server.url)
    (key,) = r.keys("ttl:responses:*resp_1")
    assert 0 < r.ttl(key) <= TTL_S and 0 < r.ttl("ttl:responses:{alpha}") <= TTL_S


def test_a_store_that_does_not_answer_raises_unavailable():
    from deploy.redis_proc import free_port

    store = RedisResponseStore.open(DirectorySection(f"redis://127.0.0.1:{free_port()}"), TTL_S, 4096, 3,
                                    timeout_s=0.5)
    with pytest.raises(StoreUnavailable):
        store.get("alpha", "resp_1")
    with pytest.raises(StoreUnavailable):
        store.put("alpha", _record("resp_1"))
