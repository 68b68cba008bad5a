"""One prefix plan per prompt (``deploy.ingress.planner``): the choices and retries of a request
share it, against a real Redis directory, with the replicas a fake pool."""

from __future__ import annotations

import asyncio

import pytest

from tests.deploy.ingress_fakes import FakePool, Gone, ingress, output, prepared, request

UNIT = 64


class _Counting:
    """A directory whose lookups and live-node reads are counted."""

    def __init__(self, directory) -> None:
        self.directory, self.lookups, self.live_reads = directory, 0, 0

    def longest_prefix(self, keys):
        self.lookups += 1
        return self.directory.longest_prefix(keys)

    def live_nodes(self):
        self.live_reads += 1
        return self.directory.live_nodes()


@pytest.fixture(scope="module")
def directory(redis_server):
    from cachedir.directory import open_directory

    d = open_directory(redis_server.url, "plans", timeout_s=2.0)
    yield d
    d.close()


@pytest.fixture(scope="module")
def namespace():
    from cluster.cache_identity import CacheIdentity
    from model.default import default_checkpoint

    return CacheIdentity(str(default_checkpoint())).namespace()


def _held(directory, namespace, prompt, units: int, node: str = "node-a", address: str = "10.0.0.1:7070"):
    """``units`` leading units of ``prompt`` held by ``node``, live at ``address``."""
    from cachedir.hashing import chain_keys

    keys = chain_keys(namespace.seed, prompt, UNIT)
    directory.register(node, keys[:units])
    directory.heartbeat(node, address, 60)
    return keys


def _answering(tokens: int = 2):
    async def outputs(req):
        for t in range(tokens):
            yield output(t, finished=t == tokens - 1, prompt_tokens=len(req.prompt_ids))

    return FakePool(outputs)


def test_a_request_with_four_choices_is_planned_with_one_lookup(directory, namespace):
    prompt = tuple(range(3, 3 + 3 * UNIT + 9))
    keys = _held(directory, namespace, prompt, units=2)
    counting, pool = _Counting(directory), _answering()
    ing = ingress(pool, directory=counting, namespace=namespace)
    asyncio.run(ing.answer(prepared([request(prompt=prompt, seed=1)], n=4)).whole())
    assert counting.lookups == 1 and counting.live_reads <= 1
    assert len(pool.requests) == 4
    plans = {r.plan for r in pool.requests}
    assert len(plans) == 1  # the same plan for every choice
    plan = plans.pop()
    assert plan.unit_keys == tuple(keys) and plan.holders == (("node-a",),) * 2
    assert plan.namespace == namespace.id and dict(plan.addresses) == {"node-a": "10.0.0.1:7070"}


def test_a_batch_is_planned_once_per_prompt_in_its_tenants_namespace(directory, namespace):
    prompts = [tuple(range(5, 5 + 2 * UNIT + 1)), tuple(range(9, 9 + UNIT + 4))]
    counting, pool = _Counting(directory), _answering()
    reqs = [request(prompt=p) for p in prompts]
    reqs = [r.__class__(**{**{f: getattr(r, f) for f in r.__dataclass_fields__}, "tenant": "acme"}) for r in reqs]
    asyncio.run(ingress(pool, directory=counting, namespace=namespace).answer(prepared(reqs, n=3)).whole())
    assert counting.lookups == 2 and len(pool.requests) == 6
    assert {r.plan.namespace for r in pool.requests} == {namespace.for_tenant("acme").id}


def test_a_request_continued_elsewhere_keeps_its_plan(directory, namespace):
    """A retry after a replica gave the request back asks the directory nothing: the plan's
    holders stay, its keys are those of the longer prompt, the router decides the load again."""
    import dataclasses

    from cachedir.hashing import chain_keys

    prompt = tuple(range(40, 40 + 2 * UNIT - 1))
    _held(directory, namespace, prompt, units=1, node="node-b", address="10.0.0.2:7070")

    async def outputs(req):
        if len(pool.requests) == 1:
            yield output(1)
            yield output(2)
            raise Gone()
        yield output(3, finished=True, prompt_tokens=len(req.prompt_ids))

    counting, pool = _Counting(directory), FakePool(outputs)
    asyncio.run(ingress(pool, directory=counting, namespace=namespace).answer(prepared([request(prompt=prompt)])).whole())
    first, again = pool.requests
    assert counting.lookups == 1
    assert again.prompt_ids == prompt + (1, 2)
    assert again.plan.unit_keys == tuple(chain_keys(namespace.seed, prompt + (1, 2), UNIT))  # one more whole unit
    assert again.plan.holders == first.plan.holders == (("node-b",),)
    assert dataclasses.replace(again.plan, unit_keys=first.plan.unit_keys) == first.plan


def test_the_ingress_and_the_replicas_share_one_cache_identity(tmp_path):
    """``build_app`` gives the ingress the replicas' own identity, so both derive one namespace."""
    from deploy.app import AppArgs, build_app

    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    token = tmp_path / "token"
    token.write_bytes(b"t" * 32)
    token.chmod(0o600)
    app = build_app(AppArgs(cache_secret_file=str(secret), agent_token_file=str(token), directory_url="mem://x"))
    ingress_cfg, server = app._bound_deployment.init_args[1], app._bound_deployment.init_args[0]
    replica_cfg = server._bound_deployment.init_args[0]
    assert ingress_cfg.identity == replica_cfg.identity
    assert ingress_cfg.identity.namespace().id == replica_cfg.identity.namespace().id
