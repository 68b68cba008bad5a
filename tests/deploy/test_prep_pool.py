"""A request's CPU work runs off the ingress's event loop (``deploy.prep_pool``), at most a
tenant's share of the pool at once: a tenant's heavy requests queue behind each other while
another tenant's go on."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from deploy.limits import KeyGrant
from deploy.prep_pool import PrepPool
from tests.deploy.ingress_fakes import FakePool, ingress

pytestmark = [pytest.mark.security]


def test_work_runs_on_a_pool_thread_and_its_error_reaches_the_caller():
    pool = PrepPool(2, 1)

    async def main():
        loop_thread = threading.current_thread()
        ran_on = await pool.run("a", threading.current_thread)
        assert ran_on is not loop_thread and ran_on.name.startswith("ingress-prep")
        with pytest.raises(ZeroDivisionError):
            await pool.run("a", lambda: 1 / 0)
        assert await pool.run("a", divmod, 7, 2) == (3, 1)

    asyncio.run(main())


def test_a_tenant_holds_at_most_its_share_and_others_go_on():
    pool = PrepPool(3, 2)
    release = threading.Event()
    started: list[str] = []

    def heavy(tag: str) -> str:
        started.append(tag)
        release.wait(10)
        return tag

    async def main():
        hostile = [asyncio.create_task(pool.run("hostile", heavy, f"h{i}")) for i in range(4)]
        await asyncio.sleep(0.2)
        assert sorted(started) == ["h0", "h1"]  # two at once; the others wait for its slots
        assert await asyncio.wait_for(pool.run("neighbour", str.upper, "ok"), 5) == "OK"  # not behind them
        release.set()
        assert sorted(await asyncio.gather(*hostile)) == ["h0", "h1", "h2", "h3"]

    asyncio.run(main())


def test_a_share_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="per_tenant"):
        PrepPool(2, 3)


def test_the_chat_route_renders_its_prompt_on_a_prep_thread():
    ing = ingress(FakePool())
    seen = {}

    def chat(body, grant):
        seen["thread"] = threading.current_thread().name
        return "prepared"

    ing.prepare.chat = chat
    assert asyncio.run(ing.chat(SimpleNamespace(), KeyGrant("t"))) == "prepared"
    assert seen["thread"].startswith("ingress-prep")
