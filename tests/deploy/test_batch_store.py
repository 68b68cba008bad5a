"""The batch store's contract, on this process's memory and on a real redis-server: files kept
per tenant with their expiry, jobs listed per tenant, a line's result recorded once, one lease
holder at a time."""

from __future__ import annotations

import time

import pytest

from cluster.batch import BatchJob, BatchStatus, LineResult
from deploy.batch_store import BatchStore, FileStore, MemoryKV, RedisKV, StoreUnavailable

CHAT = "/v1/chat/completions"


@pytest.fixture(params=["memory", "redis"])
def kv(request):
    if request.param == "memory":
        return MemoryKV()
    from cachedir.directory.redis_links import open_links

    server = request.getfixturevalue("redis_server")
    client = open_links(server.url, 2.0)
    for c in client.clients().values():
        c.flushall()
    return RedisKV(client)


def test_files_are_kept_per_tenant_and_listed_in_order(kv, tmp_path):
    files = FileStore(kv, tmp_path, "ns")
    a = files.put("t1", "in.jsonl", "batch", b'{"x": 1}\n', 3600)
    b = files.put("t1", "more.jsonl", "batch_output", b"{}\n", 3600)
    files.put("t2", "theirs.jsonl", "batch", b"secret\n", 3600)
    assert files.get("t1", a.id) == a and a.bytes == 9 and a.expires_at == a.created_at + 3600
    assert files.content("t1", a.id) == b'{"x": 1}\n'
    assert [r.id for r in files.list("t1")] == [a.id, b.id] and [r.id for r in files.list("t1", "batch")] == [a.id]
    theirs = files.list("t2")[0]
    assert files.get("t1", theirs.id) is None and files.content("t1", theirs.id) is None  # not another tenant's
    assert not files.delete("t1", theirs.id) and files.content("t2", theirs.id) == b"secret\n"
    assert files.delete("t1", a.id) and files.get("t1", a.id) is None and files.content("t1", a.id) is None
    assert [r.id for r in files.list("t1")] == [b.id]
    assert all(p.stat().st_mode & 0o077 == 0 for p in tmp_path.rglob("*") if p.is_file())  # only its owner reads


def test_an_expired_files_body_is_swept(tmp_path):
    now = [1000.0]
    files = FileStore(MemoryKV(clock=lambda: now[0]), tmp_path, "ns", clock=lambda: now[0])
    old = files.put("t", "a.jsonl", "batch", b"a\n", 3600)
    new = files.put("t", "b.jsonl", "batch", b"b\n", 7200)
    assert files.sweep() == 0
    now[0] += 3601
    assert files.get("t", old.id) is None and files.content("t", new.id) == b"b\n"
    assert files.sweep() == 1 and len([p for p in tmp_path.rglob("file-*")]) == 1
    assert [r.id for r in files.list("t")] == [new.id]


def test_jobs_are_listed_per_tenant_and_leave_the_active_list_when_they_end(kv):
    store = BatchStore(kv, "ns")
    one = BatchJob.new("t1", CHAT, "file-1", "24h", 100)
    two = BatchJob.new("t1", CHAT, "file-2", "24h", 200)
    other = BatchJob.new("t2", CHAT, "file-3", "24h", 150)
    for job in (one, two, other):
        store.create(job, 3600)
    assert [j.id for j in store.list("t1")] == [one.id, two.id] and store.get("t2", one.id) is None
    assert store.active() == [("t1", one.id), ("t2", other.id), ("t1", two.id)]
    one.enter(BatchStatus.COMPLETED, 300)
    store.save(one, 3600)
    assert store.get("t1", one.id).status == BatchStatus.COMPLETED
    assert ("t1", one.id) not in store.active()
    assert not store.cancelled("t1", two.id)
    store.cancel("t1", two.id, 3600)
    assert store.cancelled("t1", two.id) and not store.cancelled("t2", two.id)


def test_a_lines_result_is_recorded_once(kv):
    store = BatchStore(kv, "ns")
    job = BatchJob.new("t", CHAT, "file-1", "24h", 100)
    first, again = LineResult(0, "a", 200, {"v": 1}), LineResult(0, "a", 200, {"v": 2})
    assert store.record(job, first) and not store.record(job, again)
    assert store.record(job, LineResult(1, "b", 400, {}))
    assert store.results(job) == {0: first, 1: LineResult(1, "b", 400, {})}
    store.set_plan(job, [[1, 0]], 3600)
    assert store.plan(job) == [[1, 0]]
    store.drop_work(job)
    assert store.results(job) == {} and store.plan(job) is None


def test_one_runner_holds_a_jobs_lease_until_it_lapses(kv):
    store = BatchStore(kv, "ns")
    assert store.lease("t", "b1", "runner-a", 0.3)
    assert store.lease("t", "b1", "runner-a", 0.3)  # renewed by its holder
    assert not store.lease("t", "b1", "runner-b", 0.3)
    assert store.lease("t", "b2", "runner-b", 0.3)  # another job's is another lease
    deadline = time.monotonic() + 5
    while not store.lease("t", "b1", "runner-b", 0.3):  # runner-a stopped renewing
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_redis_gone_is_store_unavailable(redis_server, tmp_path):
    from cachedir.directory.redis_links import open_links
    from deploy.redis_proc import free_port

    kv = RedisKV(open_links(f"redis://127.0.0.1:{free_port()}/0", 0.5))
    with pytest.raises(StoreUnavailable):
        BatchStore(kv, "ns").active()
    with pytest.raises(StoreUnavailable):
        FileStore(kv, tmp_path, "ns").put("t", "a", "batch", b"x", 3600)
