"""A request's cost (``deploy.request_cost``), counted and refused before any work, and a scored
prompt's scores shared by its choices; the ingress runs in-process on a fake replica handle."""

from __future__ import annotations

import asyncio

import pytest

from deploy.errors import APIError
from deploy.request_cost import RequestCost
from model.sampling_params import TokenLogprob
from tests.deploy.ingress_fakes import FakePool, ingress, output, prepared, request

pytestmark = [pytest.mark.security]


def test_the_cost_counts_every_choice_and_each_scored_prompt_once():
    reqs = [request(prompt=range(10), max_tokens=5, prompt_logprobs=2), request(prompt=range(4), max_tokens=5)]
    assert RequestCost.of(reqs, n=3) == RequestCost(tokens=3 * (15 + 9), scored=10)


@pytest.mark.parametrize("limits, needle", [({"max_request_tokens": 71}, "limits.max_request_tokens"),
                                            ({"max_scored_tokens": 9}, "limits.max_scored_tokens")])
def test_a_request_over_a_cost_limit_is_a_400_naming_it(limits, needle):
    from deploy.limits import Limits

    cost = RequestCost(tokens=72, scored=10)
    with pytest.raises(APIError) as e:
        cost.check(Limits(**limits))
    assert e.value.status == 400 and needle in e.value.message and e.value.code == "request_too_large"
    cost.check(Limits(max_request_tokens=72, max_scored_tokens=10))  # at the limits: accepted


def _recording() -> FakePool:
    """Replicas that answer each request with two tokens, the first with the prompt's scores
    when the request asked for them."""
    async def outputs(req):
        scores = None
        if req.sampling.prompt_logprobs is not None:
            scores = [None] + [TokenLogprob(t, -1.0, (), 1) for t in req.prompt_ids[1:]]
        await asyncio.sleep(0.01 * (req.sampling.prompt_logprobs is not None))  # the scored choice comes late
        yield output(7, prompt_logprobs=scores)
        yield output(8, finished=True)

    return FakePool(outputs)


def test_a_scored_prompt_is_scored_once_for_all_its_choices():
    """n = 3 choices of each of two scored prompts: the replica scores each prompt once (one
    request each with prompt_logprobs), and every choice's first output carries its prompt's
    scores."""
    handle = _recording()
    reqs = (request(seed=5, prompt=(1, 2, 3), prompt_logprobs=1), request(seed=5, prompt=(4, 5), prompt_logprobs=1))

    async def run():
        return [x async for x in ingress(handle).dispatch.choices(reqs, 3)]

    firsts: dict[int, object] = {}
    for i, item in asyncio.run(run()):
        firsts.setdefault(i, item)
    scored = [r for r in handle.requests if r.sampling.prompt_logprobs is not None]
    assert sorted(r.prompt_ids for r in scored) == [(1, 2, 3), (4, 5)]
    assert len(handle.requests) == 6 and sorted(r.sampling.seed for r in handle.requests) == [5, 5, 6, 6, 7, 7]
    for i in range(6):
        prompt = reqs[i // 3].prompt_ids
        assert [s and s.token for s in firsts[i].prompt_logprobs] == [None, *prompt[1:]], i


def test_a_tenant_over_its_token_quota_gets_a_429_and_others_do_not():
    """tenant_tokens_per_minute: each request draws its cost; over what is left a 429 with
    Retry-After, refilled as the minute goes; a cost over a minute's worth is a 400."""
    now = [0.0]
    ing = ingress(_recording(), tokens_per_minute=600, clock=lambda: now[0])
    cost = RequestCost(tokens=400, scored=0)
    ing.charge(cost, "alpha")
    with pytest.raises(APIError) as e:
        ing.charge(cost, "alpha")
    assert e.value.status == 429 and "limits.tenant_tokens_per_minute" in e.value.message
    assert e.value.retry_after_s == 20  # 200 tokens short at 10 a second
    ing.charge(cost, "beta")  # another tenant's bucket is its own
    now[0] = 20.0
    ing.charge(cost, "alpha")
    with pytest.raises(APIError) as e:
        ing.charge(RequestCost(tokens=601, scored=0), "gamma")
    assert e.value.status == 400 and "more than its tenant's quota of 600" in e.value.message


def test_the_ingress_refuses_an_over_budget_request_before_any_replica_sees_it():
    handle = _recording()
    big = [request(prompt=range(1000), max_tokens=64)] * 4

    with pytest.raises(APIError, match="max_request_tokens"):
        ingress(handle, {"max_request_tokens": 30000}).answer(prepared(big, n=8))
    assert handle.requests == []
