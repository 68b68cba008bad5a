"""The Files and Batch APIs' work (``deploy.ingress.batches``, ``deploy.ingress.batch_runner``)
on a fake pool: every line once, in background, OpenAI's output and error files; a prefix's
first line before the rest; a runner's death, a failing replica, a cancel, an expired window and
the limits. The real thing, through the official client, is in test_openai_app.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.batch import BatchStatus
from cluster.request import FinishReason, RequestOutput, TokenSources
from deploy.batch_store import BatchStore, FileStore, MemoryKV
from deploy.errors import APIError
from deploy.ingress import batch_runner as runner_mod
from deploy.ingress import batches as batches_mod
from deploy.ingress.batch_runner import BatchRunner
from deploy.ingress.batches import Batches
from deploy.ingress.responses import Responses
from deploy.limits import KeyGrant
from deploy.protocol import ChatCompletionRequest
from tests.deploy.ingress_fakes import FakePool, ingress

CHAT = "/v1/chat/completions"


def _pool(delay_s: float = 0.0, fail=lambda req: False):
    """Replicas that answer ``n<prompt length>`` after ``delay_s``; ``fail(req)``: raise instead."""
    events: list[tuple[str, int]] = []

    async def outputs(req):
        n = len(req.prompt_ids)
        events.append(("start", n))
        await asyncio.sleep(delay_s)
        if fail(req):
            raise RuntimeError("replica lost")
        events.append(("end", n))
        yield RequestOutput("r", [7], f"n{n}", True, FinishReason.STOP, n, 1, 0, TokenSources(compute=n))

    pool = FakePool(outputs)
    pool.events = events
    return pool


def _lines(*contents: str, **body) -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT,
                               "body": {"model": "tiny", "messages": [{"role": "user", "content": c}], "max_tokens": 4}
                               | body}) + "\n" for i, c in enumerate(contents)).encode()


def _batches(pool, tmp_path, kv=None, limits=None, clock=None):
    import time

    ing = ingress(pool, limits)
    kv = kv or MemoryKV()
    clock = clock or time.time
    return Batches(ing, Responses(ing), FileStore(kv, tmp_path, "ns", clock), BatchStore(kv, "ns"), clock)


async def _submit(b: Batches, data: bytes, tenant: str = "t") -> str:
    f = await b.upload(tenant, "in.jsonl", "batch", data, None)
    return (await b.create(KeyGrant(tenant), f["id"], CHAT, "24h", None, None))["id"]


async def _run(b: Batches, bid: str, tenant: str = "t", **kw):
    runner = BatchRunner(b, poll_s=0.01, **kw)
    await runner.poll()
    await runner.idle()
    return await b.get(tenant, bid), runner


async def _file(b: Batches, fid: str | None, tenant: str = "t") -> list[dict]:
    return [] if fid is None else [json.loads(x) for x in (await b.content(tenant, fid)).splitlines()]


def test_a_batch_runs_every_line_once_in_background_and_writes_openais_files(tmp_path):
    pool = _pool()
    b = _batches(pool, tmp_path)
    data = _lines("a", "bb", "ccc") + json.dumps({"custom_id": "bad", "method": "POST", "url": CHAT, "body": {
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}}).encode() + b"\n" + \
        json.dumps({"custom_id": "streamed", "method": "POST", "url": CHAT, "body": {
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}}).encode()

    async def scenario():
        bid = await _submit(b, data)
        job, runner = await _run(b, bid)
        return job, runner, await _file(b, job.output_file_id), await _file(b, job.error_file_id)

    job, runner, out, err = asyncio.run(scenario())
    assert job.status == BatchStatus.COMPLETED and (job.total, job.completed, job.failed) == (5, 3, 2)
    assert [o["custom_id"] for o in out] == ["c0", "c1", "c2"]  # input order
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in out] == \
        [f"n{len(r.prompt_ids)}" for r in sorted(pool.requests, key=lambda r: len(r.prompt_ids))]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in err] == [("bad", 400), ("streamed", 400)]
    assert "max_tokens" in err[0]["response"]["body"]["error"]["message"]
    assert len(pool.requests) == 3 and all(r.background for r in pool.requests)
    assert job.input_tokens == sum(len(r.prompt_ids) for r in pool.requests) and job.output_tokens == 3
    assert runner.done == {"completed": 3, "failed": 2} and (runner.queued, runner.running) == (0, 0)
    assert job.times.keys() >= {"in_progress", "finalizing", "completed"}
    assert b.store.results(job) == {} and b.store.active() == []  # its work is dropped once its files hold it


def test_lines_sharing_a_prefix_wait_for_the_first_of_them(tmp_path):
    pool = _pool(delay_s=0.05)
    b = _batches(pool, tmp_path)
    system = "You are a careful assistant. " * 20  # several whole units, shared
    data = _lines(system + "one", "alone", system + "two", system + "three")

    async def scenario():
        job, _ = await _run(b, await _submit(b, data))
        return job

    assert asyncio.run(scenario()).completed == 4
    shared = sorted(len(r.prompt_ids) for r in pool.requests)[1:]  # "alone" is the shortest
    events = [e for e in pool.events if e[1] in shared]
    first_end = events.index(next(e for e in events if e[0] == "end"))
    assert sum(1 for e in events[:first_end] if e[0] == "start") == 1  # the first ran alone
    assert [e[0] for e in events[first_end + 1:]].count("start") == 2  # then the others


def test_a_runner_that_dies_leaves_its_job_to_another_which_finishes_each_line_once(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "LEASE_S", 0.3)
    pool = _pool(delay_s=0.02)
    kv = MemoryKV()
    b = _batches(pool, tmp_path, kv, limits={"batch_concurrency": 2})
    data = _lines(*(f"line {i}" for i in range(12)))

    async def scenario():
        bid = await _submit(b, data)
        first = BatchRunner(b, poll_s=0.01, holder="first")
        await first.poll()
        while first.done["completed"] < 4:
            await asyncio.sleep(0.01)
        for task in first._jobs.values():  # it dies: no finalizing, no lease given back
            task.cancel()
        await asyncio.sleep(0)
        second = BatchRunner(b, poll_s=0.01, holder="second")
        await second.poll()
        assert not second._jobs  # the lease has not lapsed yet
        await asyncio.sleep(0.4)
        await second.poll()
        await second.idle()
        return await b.get("t", bid), first, second

    job, first, second = asyncio.run(scenario())
    assert job.status == BatchStatus.COMPLETED and job.completed == 12
    out = asyncio.run(_file(b, job.output_file_id))
    assert sorted(o["custom_id"] for o in out) == sorted(f"c{i}" for i in range(12))  # each once
    assert first.done["completed"] + second.done["completed"] == 12


def test_a_line_the_replicas_fail_is_tried_again_then_kept_as_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(batches_mod, "RETRY_S", 0.0)
    tries: dict[int, int] = {}

    def fail(req):
        n = len(req.prompt_ids)
        tries[n] = tries.get(n, 0) + 1
        return (n == flaky and tries[n] < 2) or n == broken

    pool = _pool(fail=fail)
    b = _batches(pool, tmp_path)
    data = _lines("ok", "flaky line", "the broken line")
    flaky = broken = -1

    async def scenario():
        nonlocal flaky, broken
        bid = await _submit(b, data)
        lens = [len((await b.ingress.chat(ChatCompletionRequest(**json.loads(x)["body"]), KeyGrant("t")))
                    .requests[0].prompt_ids) for x in data.splitlines()]
        flaky, broken = lens[1], lens[2]
        job, _ = await _run(b, bid)
        return job, await _file(b, job.error_file_id)

    job, err = asyncio.run(scenario())
    assert (job.completed, job.failed) == (2, 1) and tries[flaky] == 2 and tries[broken] == batches_mod.LINE_TRIES
    assert err[0]["custom_id"] == "c2" and err[0]["response"]["status_code"] == 500


def test_a_cancelled_batch_stops_and_keeps_what_it_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "SAVE_S", 0.01)
    pool = _pool(delay_s=0.05)
    b = _batches(pool, tmp_path, limits={"batch_concurrency": 1})
    data = _lines(*(f"line {i}" for i in range(20)))

    async def scenario():
        bid = await _submit(b, data)
        runner = BatchRunner(b, poll_s=0.01)
        await runner.poll()
        while runner.done["completed"] < 2:
            await asyncio.sleep(0.01)
        shown = await b.cancel("t", bid)
        await runner.idle()
        job = await b.get("t", bid)
        with pytest.raises(APIError) as again:
            await b.cancel("t", bid)
        return shown, job, await _file(b, job.output_file_id), again.value

    shown, job, out, again = asyncio.run(scenario())
    assert shown["status"] == "cancelling" and job.status == BatchStatus.CANCELLED
    assert 2 <= job.completed < 20 and len(out) == job.completed and again.status == 409


def test_a_batch_past_its_window_expires_listing_the_lines_it_did_not_run(tmp_path):
    now = [1_000_000.0]
    b = _batches(_pool(), tmp_path, clock=lambda: now[0], kv=MemoryKV(clock=lambda: now[0]))

    async def scenario():
        bid = await _submit(b, _lines("a", "b"))
        now[0] += 86400 + 1
        job, _ = await _run(b, bid)
        return job, await _file(b, job.error_file_id)

    job, err = asyncio.run(scenario())
    assert job.status == BatchStatus.EXPIRED and job.completed == 0
    assert [(e["custom_id"], e["error"]["code"]) for e in err] == [("c0", "batch_expired"), ("c1", "batch_expired")]


def test_limits_and_tenants(tmp_path):
    b = _batches(_pool(), tmp_path, limits={"max_batch_tokens": 50, "max_tenant_batches": 1})

    async def scenario():
        big = await _submit(b, _lines("a long enough prompt to pass fifty tokens with its template " * 3))
        job, _ = await _run(b, big)
        assert job.status == BatchStatus.FAILED and job.errors[0]["code"] == "token_limit_exceeded"
        bad = await _submit(b, b"not json\n")
        job, _ = await _run(b, bad)
        assert job.status == BatchStatus.FAILED and job.errors[0]["line"] == 1
        f = await b.upload("t", "in.jsonl", "batch", _lines("a"), None)
        await b.create(KeyGrant("t"), f["id"], CHAT, "24h", None, None)
        refusals = []
        for call in (lambda: b.create(KeyGrant("t"), f["id"], CHAT, "24h", None, None),  # one not ended already
                     lambda: b.create(KeyGrant("u"), f["id"], CHAT, "24h", None, None),  # another tenant's file
                     lambda: b.get("u", big),
                     lambda: b.content("u", f["id"]),
                     lambda: b.upload("t", "x", "fine-tune", b"{}", None),
                     lambda: b.create(KeyGrant("u"), "file-x", "/v1/embeddings", "24h", None, None),
                     lambda: b.create(KeyGrant("u"), "file-x", CHAT, "1h", None, None)):
            with pytest.raises(APIError) as e:
                await call()
            refusals.append(e.value.status)
        return refusals

    assert asyncio.run(scenario()) == [429, 404, 404, 404, 400, 400, 400]


def test_a_line_waits_while_no_replica_serves_without_spending_its_tries(tmp_path, monkeypatch):
    from cluster.batch import BatchJob, BatchLine, LineResult

    monkeypatch.setattr(batches_mod, "RETRY_S", 0.0)
    b = _batches(_pool(), tmp_path)
    calls = []

    async def answer(job, line):
        calls.append(1)
        if len(calls) <= 2 * batches_mod.LINE_TRIES:
            raise APIError(503, "no replica is serving", "server_error")
        return LineResult(line.index, line.custom_id, 200, {})

    monkeypatch.setattr(b, "_answer", answer)
    job, line = BatchJob.new("t", CHAT, "file-1", "24h", 0), BatchLine(0, "a", CHAT, {})
    assert asyncio.run(b.run_line(job, line)).ok and len(calls) == 2 * batches_mod.LINE_TRIES + 1


def test_the_operators_see_every_tenants_batches_and_their_work_left(tmp_path):
    b = _batches(_pool(), tmp_path)

    async def scenario():
        mine = await _submit(b, _lines("a", "b"))
        await _run(b, mine)
        theirs = await _submit(b, _lines("c"), tenant="u")
        listed = await b.admin("list", include_ended=True)
        demand_before = await b.admin("demand")
        shown = await b.admin("show", mine)
        cancelled = await b.admin("cancel", theirs)
        with pytest.raises(APIError):
            await b.admin("show", "batch_nope")
        return listed, demand_before, shown, cancelled, await b.admin("list"), await b.admin("list", include_ended=True)

    listed, demand, shown, cancelled, live, every = asyncio.run(scenario())
    assert [(j["tenant"], j["status"]) for j in listed] == [("t", "completed"), ("u", "validating")]
    assert len(demand) == 1 and demand[0]["due_s"] > 0
    assert shown[0]["status"] == "completed" and cancelled[0]["status"] == "cancelling"
    assert [j["tenant"] for j in live] == ["u"] and len(every) == 2


def test_a_cancelled_batch_whose_lines_no_replica_takes_still_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "SAVE_S", 0.01)
    monkeypatch.setattr(runner_mod, "CANCEL_GRACE_S", 0.1)
    pool = _pool(delay_s=3600)  # the replicas never answer
    b = _batches(pool, tmp_path)

    async def scenario():
        bid = await _submit(b, _lines("a", "b", "c"))
        runner = BatchRunner(b, poll_s=0.01)
        await runner.poll()
        while not pool.requests:
            await asyncio.sleep(0.01)
        await b.cancel("t", bid)
        await asyncio.wait_for(runner.idle(), 30)
        return await b.get("t", bid), runner

    job, runner = asyncio.run(scenario())
    assert job.status == BatchStatus.CANCELLED and job.completed == 0 and job.output_file_id is None
    assert len(pool.cancelled) == len(pool.requests) and (runner.running, runner.queued) == (0, 0)


def test_a_batch_survives_a_redis_restart_mid_run(tmp_path, monkeypatch):
    """On the real server, logging every write: the runner's calls fail while Redis is down, then
    it takes its job up again from the results Redis kept, and each line is answered once."""
    import shutil
    import time

    from cachedir.directory.redis_links import open_links
    from deploy.redis_proc import RedisServer
    from deploy.state_kv import RedisKV
    from tests.conftest import require

    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    monkeypatch.setattr(runner_mod, "SAVE_S", 0.05)
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        pool = _pool(delay_s=0.05)
        b = _batches(pool, tmp_path / "files", kv=RedisKV(open_links(server.url, 1.0)), limits={"batch_concurrency": 2})

        async def scenario():
            bid = await _submit(b, _lines(*(f"line {i}" for i in range(16))))
            runner = BatchRunner(b, poll_s=0.05)
            serving = asyncio.create_task(runner.serve())
            while runner.done["completed"] < 4:
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.1)  # the log is fsynced every second
            await asyncio.to_thread(server.kill)  # SIGKILL: no shutdown save
            await asyncio.sleep(0.3)
            await asyncio.to_thread(server.start)
            deadline = time.monotonic() + 60
            while (job := await b.get("t", bid)).status != BatchStatus.COMPLETED:
                assert time.monotonic() < deadline, job
                await asyncio.sleep(0.1)
            serving.cancel()
            return job, await _file(b, job.output_file_id)

        job, out = asyncio.run(scenario())
        assert job.completed == 16 and sorted(o["custom_id"] for o in out) == sorted(f"c{i}" for i in range(16))
    finally:
        server.kill()


def test_files_and_batches_are_listed_in_pages_newest_first(tmp_path):
    b = _batches(_pool(), tmp_path)

    async def scenario():
        ids = [(await b.upload("t", f"{i}.jsonl", "batch", _lines("a"), None))["id"] for i in range(3)]
        first = await b.list_files("t", None, 2, None, "desc")
        rest = await b.list_files("t", "batch", 2, first["last_id"], "desc")
        with pytest.raises(APIError) as bad:
            await b.list_files("t", None, 0, None, "desc")
        return ids, first, rest, bad.value

    ids, first, rest, bad = asyncio.run(scenario())
    assert [f["id"] for f in first["data"]] == ids[:0:-1] and first["has_more"]
    assert [f["id"] for f in rest["data"]] == ids[:1] and not rest["has_more"] and bad.status == 400
