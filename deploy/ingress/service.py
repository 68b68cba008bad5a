"""``Ingress``: the request path composed (prepare, plan, dispatch, render), Ray-free; the Serve
class in ``deploy.openai_api`` builds one over its handles and each route calls it."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi.responses import JSONResponse, StreamingResponse

from deploy.errors import APIError
from deploy.http_edge import TenantQuotas
from deploy.ingress.config import IngressConfig
from deploy.ingress.dispatch import Dispatcher, ReplicaPool
from deploy.ingress.planner import Planner
from deploy.ingress.prepare import Prepared, Preparer
from deploy.ingress.render import Answer
from deploy.limits import KeyGrant
from deploy.metrics import IngressMetrics
from deploy.prep_pool import PrepPool
from deploy.protocol import ChatCompletionRequest, CompletionRequest
from deploy.request_cost import RequestCost
from model.config import load_config
from model.grammar import warm as warm_grammars
from model.tokenizer import load_tokenizer

__all__ = ["Ingress"]


class Ingress:
    def __init__(self, cfg: IngressConfig, pool: ReplicaPool, decode: ReplicaPool | None = None, *,
                 directory=None, namespace=None, quotas: TenantQuotas | None = None) -> None:
        """``pool``: the replicas (with ``decode``, P/D: they only prefill). ``directory`` and
        ``namespace``: plan each prompt (the cache-aware router's input); None: no plans.
        ``quotas``: the tenants' rate limits (the HTTP edge shares them)."""
        self.cfg, self.limits = cfg, cfg.limits
        self.tokenizer = load_tokenizer(cfg.checkpoint)
        mcfg = load_config(cfg.checkpoint)
        self.context_len, self.vocab_size = mcfg.max_position_embeddings, mcfg.vocab_size
        self.prepare = Preparer(cfg, self.tokenizer, self.context_len, self.vocab_size)
        self.metrics = IngressMetrics(cfg.model_name)
        self.pool, self.decode = pool, decode
        self.dispatch = Dispatcher(pool, Planner(directory, namespace), self.metrics, decode)
        lim = self.limits
        self.quotas = quotas or TenantQuotas(lim.tenant_requests_per_minute / 60, lim.tenant_burst,
                                             lim.tenant_concurrency, tokens_per_minute=lim.tenant_tokens_per_minute)
        self.prep = PrepPool(lim.prep_workers, lim.tenant_prep_concurrency)  # templates, tokenizing, grammars
        warm_grammars()

    async def chat(self, body: ChatCompletionRequest, grant: KeyGrant) -> Prepared:
        return await self.prep.run(grant.tenant, self.prepare.chat, body, grant)

    async def completion(self, body: CompletionRequest, grant: KeyGrant) -> Prepared:
        return await self.prep.run(grant.tenant, self.prepare.completion, body, grant)

    def answer(self, prepared: Prepared, background: bool = False) -> Answer:
        """The answer of a prepared request, charged to its tenant before any replica sees it;
        ``background``: a batch line's, which replicas run behind interactive requests (its
        batch's tokens were checked against the batch limits, not the per-minute quota)."""
        cost = RequestCost.of(list(prepared.requests), prepared.n)
        if background:
            cost.check(self.limits)
            prepared = replace(prepared, requests=tuple(replace(r, background=True) for r in prepared.requests))
        else:
            self.charge(cost, prepared.requests[0].tenant)
        outputs = self.dispatch.choices(prepared.requests, prepared.n)
        return Answer(prepared, outputs, self.tokenizer, self.cfg.model_name)

    async def respond(self, prepared: Prepared) -> JSONResponse | StreamingResponse:
        """The HTTP response: the whole answer, or its chunks as server-sent events."""
        answer = self.answer(prepared)
        if not prepared.stream:
            return JSONResponse(await answer.whole())
        return StreamingResponse(sse(answer.chunks()), media_type="text/event-stream")

    def charge(self, cost: RequestCost, tenant: str) -> None:
        """Refuse a request over the cost limits (400) or its tenant's token quota (429)."""
        cost.check(self.limits)
        per_minute = self.limits.tenant_tokens_per_minute
        if per_minute and cost.tokens > per_minute:
            raise APIError(400, f"the request may cost {cost.tokens} tokens, more than its tenant's quota of {per_minute} "
                                f"a minute (limits.tenant_tokens_per_minute)", code="request_too_large")
        wait_s = self.quotas.charge(tenant, cost.tokens)
        if wait_s is not None:
            raise APIError(429, f"this request's {cost.tokens} tokens exceed what is left of its tenant's quota of "
                                f"{per_minute} a minute (limits.tenant_tokens_per_minute); retry after the Retry-After "
                                f"seconds", "rate_limit_error", code="rate_limit_exceeded",
                           retry_after_s=max(1, math.ceil(wait_s)))


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Chunks as server-sent events, ending with ``[DONE]``."""
    async for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
