"""An ``OpenAIIngress`` without Serve, for unit tests of its request handling: its replica
handle is a fake the test gives (``options(stream=True).generate.remote(req)`` streaming
``RequestOutput``s)."""

from __future__ import annotations


def ingress(handle, limits: dict | None = None, tokens_per_minute: int = 0, clock=None):
    """The ingress of ``handle`` with ``limits`` (``deploy.protocol.Limits`` fields) and a tenant
    token quota on ``clock``."""
    import time

    from deploy.http_edge import TenantQuotas
    from deploy.metrics import IngressMetrics
    from deploy.openai_api import OpenAIIngress
    from deploy.prep_pool import PrepPool
    from deploy.protocol import Limits

    ing = object.__new__(OpenAIIngress)
    ing.server, ing.model_name, ing.metrics, ing.directory, ing.decode = handle, "tiny", IngressMetrics("tiny"), None, None
    ing.api_keys = None
    ing.limits = Limits(**({"tenant_tokens_per_minute": tokens_per_minute} | (limits or {})))
    ing.quotas = TenantQuotas(tokens_per_minute=tokens_per_minute, clock=clock or time.monotonic)
    ing.prep = PrepPool(ing.limits.prep_workers, ing.limits.tenant_prep_concurrency)
    return ing


def request(seed: int | None = None, prompt=(1, 2, 3), max_tokens: int = 8, **sampling):
    from cluster.request import GenerationRequest
    from model.sampling import SamplingParams

    return GenerationRequest("", tuple(prompt), max_tokens, SamplingParams(seed=seed, **sampling))


def output(token: int, finished: bool = False, prompt_logprobs=None):
    from cluster.request import FinishReason, RequestOutput, TokenSources

    return RequestOutput("r", [token], "x", finished, FinishReason.LENGTH if finished else None, 3, 1, 0,
                         TokenSources(compute=3), prompt_logprobs=prompt_logprobs)
