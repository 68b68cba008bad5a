"""The OpenAI-compatible HTTP ingress (FastAPI) in front of the ``LLMServer`` replicas.

Routes: ``/v1/chat/completions``, ``/v1/completions`` (SSE streaming or not), ``/v1/responses``
(OpenAI's Responses API as a chat: ``deploy.responses_api``), ``/v1/models``,
``/tokenize``, ``/detokenize``, ``/version`` (as vLLM and SGLang have them), ``/health`` (503
while no replica can serve), ``/metrics``. API keys (each maps to a tenant whose salt isolates its
cache), the content type and the body size are checked before the body is read
(``deploy.http_edge``); then the ingress validates, applies the chat template, tokenizes, checks
limits and streams from an ``LLMServer`` replica. Every error, a bad path or method included,
uses OpenAI's JSON shape; a request that fails validation is a 400 naming the field.

``serve.ingress`` is applied where the class is defined: a replica re-imports this module, and only
a class decorated at import time carries its routes there. ``deploy/app.py`` applies
``serve.deployment`` and binds.
"""


# No `from __future__ import annotations` here: FastAPI must see the route annotations as types.
import asyncio
import dataclasses
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.pd_handoff import decode_request, read_prefill
from actors.replica_config import DirectorySection
from actors.serve_bind import bind_replica_grpc_to_node
from cachedir.directory.base import DirectoryUnavailable
from cachedir.hashing import chain_keys, read_secret
from cluster.request import (
    UNIT_TOKENS,
    FinishReason,
    GenerationRequest,
    PrefixPlan,
    RequestFailed,
    RequestMigrated,
    RequestOutput,
    cache_namespace,
)
from deploy.http_edge import PUBLIC_PATHS, EdgeConfig, EdgeMiddleware, TenantQuotas
from deploy.metrics import IngressMetrics
from deploy.prep_pool import PrepPool
from deploy.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    KeyGrant,
    Limits,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    error_body,
    joined_logprobs,
    prompt_logprobs,
)
from deploy.request_cost import RequestCost
from deploy.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    StoredResponse,
    StoreUnavailable,
)
from deploy.responses_api import ResponseEvents, ResponsesRequest, response_of
from model.config import load_config
from model.grammar import warm as warm_grammars
from model.reasoning import ReasoningStream, ReasoningTokens, thought_open
from model.sampling_params import SamplingParams, TokenLogprob
from model.tokenizer import load_tokenizer
from model.tool_calls import FirstCall, ForcedCall, RequiredCall, ToolCall
from model.weights_id import weights_digest, weights_form

__all__ = ["OpenAIIngress", "api"]

log = logging.getLogger(__name__)
bind_replica_grpc_to_node()  # the ingress replica imports this module before Serve opens its gRPC port

api = FastAPI(title="tideserve", description="OpenAI-compatible API of tideserve")
api.add_middleware(EdgeMiddleware)


@api.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s is not None else None
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=headers)


@api.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    errs = e.errors()
    if errs and errs[0].get("type") == "json_invalid":
        return JSONResponse(error_body(f"malformed JSON body: {errs[0].get('msg')}", "invalid_request_error"), 400)
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ())[1:])
    msg = f"{loc}: {first.get('msg', 'invalid value')}" if loc else str(first.get("msg", "invalid request"))
    return JSONResponse(error_body(msg, "invalid_request_error", loc or None), 400)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Unknown paths and wrong methods, in OpenAI's shape."""
    if e.status_code == 404:
        msg, code = f"no such route: {request.method} {request.url.path}", "not_found"
    elif e.status_code == 405:
        msg, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        msg, code = str(e.detail), None
    return JSONResponse(error_body(msg, "invalid_request_error", None, code), e.status_code, headers=e.headers)


@api.exception_handler(Exception)
async def _server_error(_: Request, e: Exception) -> JSONResponse:
    """Anything else, in OpenAI's shape (never Starlette's plain-text 500): a request that failed
    alone on its replica (``RequestFailed``) says why; other errors are logged, not shown."""
    cause = getattr(e, "cause", e)  # a replica's error arrives as Ray's RayTaskError of it
    if isinstance(cause, RequestFailed) and cause.request_fault:
        return JSONResponse(error_body(f"the request failed: {cause}", "invalid_request_error"), 400)
    if isinstance(cause, RequestFailed):
        return JSONResponse(error_body(f"the request failed: {cause}", "server_error"), 500)
    log.error("request failed", exc_info=e)
    return JSONResponse(error_body("the request failed", "server_error"), 500)


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` (as /v1/completions tokenizes it) or chat ``messages``
    (rendered with the chat template, as /v1/chat/completions does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # a text prompt starts with BOS, as completions do
    add_generation_prompt: bool = True  # messages end where the assistant speaks, as chat does


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


MAX_CONTINUATIONS = 2
RETRY_AFTER_S = 2  # what a 503 tells the client to wait: about one replica restart or handoff
HEALTH_TIMEOUT_S = 5.0  # a replica that does not answer /health's call within this is not serving


def _continuable(e: BaseException) -> bool:
    """A replica gave the request back or went away: the request can go on elsewhere."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, ObjectLostError, RayActorError

    # ObjectLostError: P/D, the prompt's KV was lost before the decode replica pulled it (its
    # node went away); nothing was streamed from it, the request starts over
    gone = (RequestMigrated, RayActorError, ActorDiedError, ActorUnavailableError, ObjectLostError)
    return isinstance(e, gone) or isinstance(getattr(e, "cause", None), gone)


async def _streamed(response) -> AsyncIterator[RequestOutput]:
    """The outputs of a streaming replica call; the call is cancelled when its reader stops early
    (the client went away, another choice failed), so the replica frees the request's KV."""
    done = False
    try:
        async for item in response:
            yield item
        done = True
    finally:
        if not done:
            response.cancel()


def _own_request_id() -> None:
    """Give this asyncio task's Serve request context an internal request id of its own. The
    replica calls made while serving an HTTP request inherit its id, and Ray 2.60's request
    routers index the calls waiting for a replica by that id: two waiting at once (the choices of
    ``n`` > 1) collide, and one is never given a replica. (asyncio gives each task a copy of the
    context, so this changes only the calling task's.)"""
    from ray.serve import context

    ctx = context._get_serve_request_context()
    context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=uuid.uuid4().hex))


def _unavailable(e: BaseException) -> bool:
    """No replica could serve the request right now (all gone, or each try was lost): the client
    should retry, so it gets a 503 with Retry-After rather than a 500."""
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    return _continuable(e) or isinstance(e, (BackPressureError, DeploymentUnavailableError))


def _unavailable_error() -> APIError:
    return APIError(503, "no serving replica is available right now; retry the request", "server_error",
                    code="service_unavailable", retry_after_s=RETRY_AFTER_S)


def _add(total: dict, part: dict) -> None:
    """Add ``part``'s numbers into ``total``'s, key by key (nested dicts too): a batch's usage."""
    for key, value in part.items():
        if isinstance(value, dict):
            _add(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0) + value


@serve.ingress(api)
class OpenAIIngress:
    health_timeout_s = HEALTH_TIMEOUT_S  # per instance: Serve's ingress decorator copies the module's globals

    def __init__(self, server, cfg: dict, decode=None) -> None:
        """``server``: a handle to the ``LLMServer`` deployment; ``decode``: one to the decode
        pool (P/D disaggregation: ``server`` then only prefills). ``cfg`` keys: checkpoint,
        model_name, api_keys ({key: "TENANT[:MODEL+...]"} or None), limits (dict); with a ``directory``
        (``actors.replica_config.DirectorySection`` with a URL; and ``dtype``) each request carries its
        prefix ``plan`` (``cluster.request.PrefixPlan``: the prompt hashed once, one directory
        round trip) for the cache-aware router, which fills in what to load, and the replica."""
        self.server = server
        self.decode = decode
        ckpt = Path(cfg["checkpoint"])
        self.tokenizer = load_tokenizer(ckpt)
        mcfg = load_config(ckpt)
        self.context_len = mcfg.max_position_embeddings
        self.vocab_size = mcfg.vocab_size
        self.model_name = cfg["model_name"]
        keys = cfg.get("api_keys") or None
        self.api_keys = {k: KeyGrant.parse(v) for k, v in keys.items()} if keys else None
        self.limits = Limits(**(cfg.get("limits") or {}))
        # structured output: the most bytes a grammar may have, and whether JSON may hold any whitespace
        self._grammar_limits = (self.limits.max_grammar_bytes, cfg.get("structured_whitespace", "compact") == "any")
        lim = self.limits
        self.quotas = TenantQuotas(lim.tenant_requests_per_minute / 60, lim.tenant_burst, lim.tenant_concurrency,
                                   tokens_per_minute=lim.tenant_tokens_per_minute)
        api.state.edge = EdgeConfig(self.api_keys, lim.max_body_bytes,  # read by deploy.http_edge
                                    PUBLIC_PATHS | frozenset(cfg.get("public_paths") or ()), self.quotas,
                                    lim.body_timeout_s)
        self.metrics = IngressMetrics(cfg["model_name"])
        self.prep = PrepPool(lim.prep_workers, lim.tenant_prep_concurrency)  # templates, tokenizing, grammars
        warm_grammars()
        self.expert_parallel = bool(cfg.get("expert_parallel"))  # /metrics reports the expert placement
        self.directory = self.namespace = None
        directory: DirectorySection = cfg.get("directory") or DirectorySection()
        keep = (lim.stored_response_ttl_s, lim.max_stored_response_bytes, lim.max_stored_responses)
        self.response_store = RedisResponseStore.open(directory, *keep) if directory.url else MemoryResponseStore(*keep)
        if directory.url:
            self.directory = directory.open()
            self.namespace = cache_namespace(mcfg, weights_digest(ckpt), cfg.get("dtype", "float32"),
                                             read_secret(cfg.get("cache_secret_file")),
                                             weights_form(ckpt, cfg.get("device", "cpu"), cfg.get("cpu_weights", "fp32"),
                                                          cfg.get("fp8_weights", "auto")))

    async def _plan(self, req: GenerationRequest) -> PrefixPlan | None:
        """The prompt's prefix plan: the keys of its whole units (hashed here, once) and the
        live holders of the leading ones the directory finds (the prompt's last token is always
        computed, so only units before it); None without a directory or a whole unit. A
        directory that fails gives a plan with no holders (every unit computed)."""
        whole = len(req.prompt_ids) // UNIT_TOKENS
        if self.directory is None or whole == 0:
            return None
        ns = self.namespace.for_tenant(req.tenant) if req.tenant else self.namespace
        keys = tuple(chain_keys(ns.seed, req.prompt_ids, UNIT_TOKENS))
        usable = (len(req.prompt_ids) - 1) // UNIT_TOKENS
        if req.sampling.prompt_logprobs is not None:  # scored whole: nothing cached is used
            usable = 0
        holders: tuple[tuple[str, ...], ...] = ()
        dropped = False
        if usable:
            try:
                match = await asyncio.to_thread(self.directory.longest_prefix, keys[:usable])
                holders = tuple(tuple(h.node_id for h in hs) for hs in match.holders)
                dropped = match.dropped_next
            except DirectoryUnavailable:
                pass
        return PrefixPlan(keys, holders, dropped_next=dropped)

    # -- helpers -------------------------------------------------------------------------
    def _grant(self, request: Request) -> KeyGrant:
        """The caller's grant, which the edge (``deploy.http_edge``) checked before the body was
        read (a caller without a valid key never gets here when keys are configured)."""
        grant = request.scope.get("state", {}).get("grant")
        if grant is None:  # the edge did not run (it always does when served): refuse rather than guess
            if self.api_keys is None:
                return KeyGrant("")
            raise APIError(401, "missing or invalid API key", "authentication_error", code="invalid_api_key")
        return grant

    def _charge(self, cost: RequestCost, tenant: str) -> None:
        """Refuse a request over the cost limits (400) or its tenant's token quota (429), before
        any of it is sent to a replica."""
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

    def _token_text(self, token: int) -> str:
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")

    def _engine_request(self, body, prompt_ids: list[int], grant: KeyGrant, prompt_param: str = "messages", *,
                        prompt_logprobs: int | None = None, scores_only: bool = False, **extra) -> GenerationRequest:
        """The engine's request for a validated body (``extra``: more ``GenerationRequest``
        fields); the replica gives it its id. ``prompt_logprobs``: score the prompt's tokens
        (echo); ``scores_only``: the caller keeps none of the output (echo with max_tokens 0),
        so the engine stops at its first token."""
        self._check_model(body.model, grant)
        body.check_supported()
        body.check_prompt_logprobs()
        if body.n > self.limits.max_n:
            raise APIError(400, f"n={body.n} exceeds the limit of {self.limits.max_n}", param="n")
        stops = body.stop_list()
        if len(stops) > self.limits.max_stop:
            raise APIError(400, f"{len(stops)} stop strings exceed the limit of {self.limits.max_stop}", param="stop")
        max_tokens = self._max_tokens(body, prompt_ids, prompt_param, scores_only)
        bias = tuple(body.logit_bias_pairs(self.vocab_size, self.limits.max_logit_bias))
        stop_ids = body.stop_token_tuple(self.vocab_size, self.limits.max_stop_token_ids)
        try:
            sampling = SamplingParams(
                body.temperature, body.top_p, body.top_k, body.seed, body.logprobs_k(), body.presence_penalty,
                body.frequency_penalty, bias, repetition_penalty=body.repetition_penalty, min_p=body.min_p,
                prompt_logprobs=prompt_logprobs)
            return GenerationRequest("", tuple(prompt_ids), max_tokens, sampling, tuple(stops), body.ignore_eos,
                                     grant.tenant, stop_token_ids=stop_ids, min_tokens=body.min_tokens,
                                     include_stop=body.include_stop_str_in_output,
                                     **({"grammar": body.grammar(*self._grammar_limits)} | extra))
        except ValueError as e:  # a combination the field checks above let through
            raise APIError(400, str(e)) from None

    def _max_tokens(self, body, prompt_ids: list[int], prompt_param: str, scores_only: bool) -> int:
        """The engine's max_tokens for a prompt of this body (its checks against the limits and
        the context length are the prompt's own; ``scores_only``: 1)."""
        if len(prompt_ids) > self.limits.max_prompt_tokens:
            raise APIError(400, f"prompt of {len(prompt_ids)} tokens exceeds the limit of {self.limits.max_prompt_tokens}",
                           param=prompt_param, code="context_length_exceeded")
        room = self.context_len - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"prompt of {len(prompt_ids)} tokens does not fit the context length {self.context_len}",
                           param=prompt_param, code="context_length_exceeded")
        max_tokens = 1 if scores_only else body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = min(room, self.limits.max_tokens)
        if not 1 <= max_tokens <= self.limits.max_tokens:
            zero = " (0 with echo: the prompt only)" if max_tokens == 0 and prompt_param == "prompt" else ""
            raise APIError(400, f"max_tokens={max_tokens} must be in [1, {self.limits.max_tokens}]{zero}",
                           param="max_tokens")
        if max_tokens > room:
            raise APIError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                           f"length {self.context_len}", param="max_tokens", code="context_length_exceeded")
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens={body.min_tokens} exceeds max_tokens={max_tokens}", param="min_tokens")
        return max_tokens

    @classmethod
    def _batch_usage(cls, lasts: list[RequestOutput], n: int, reasoning: list[ReasoningTokens] | None = None,
                     scores_only: bool = False) -> dict:
        """Usage of a request of one prompt or a batch, whose prompt p's choices are ``lasts[p * n
        : p * n + n]``: each prompt's usage, summed; ``scores_only``: no completion tokens (the
        engine's one token was not returned)."""
        total: dict = {}
        for p in range(0, len(lasts), n):
            group = lasts[p : p + n]
            if scores_only:
                group = [last._replace(completion_tokens=0) for last in group]
            _add(total, cls._usage(group, reasoning[p : p + n] if reasoning is not None else None))
        return total

    @staticmethod
    def _usage(lasts: list[RequestOutput], reasoning: list[ReasoningTokens] | None = None) -> dict:
        """Usage of a request from each choice's last output: the prompt counts once, and as cached
        only the tokens every choice found in the cache (``prompt_cache_hit_sources``: where that
        choice's cached KV came from: this replica's pool or node's RAM, the node's SSD, another
        node); ``reasoning``: each choice's count of its thought's tokens (a model that reasons)."""
        least = min(lasts, key=lambda last: last.cached_tokens)
        prompt, hit = lasts[0].prompt_tokens, least.cached_tokens
        completion = sum(last.completion_tokens for last in lasts)
        sources = least.sources
        out = {
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_cache_hit_tokens": hit, "prompt_cache_miss_tokens": prompt - hit,
            "prompt_cache_hit_sources": {"ram": sources.ram, "ssd": sources.ssd, "remote": sources.remote},
            # the cache's accounting of this prompt: what the fleet held (the directory's answer),
            # what routing chose to load, and why the computed tokens of whole units were computed
            "prompt_cache_accounting": sources.accounting(prompt),
            "prompt_tokens_details": {"cached_tokens": hit},
        }
        if reasoning is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": sum(r.count for r in reasoning)}
        return out

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """One attempt at the request. Co-located, one replica streams every output. With a
        decode pool (P/D), a prefill replica computes the prompt and the first token and hands the
        prompt's KV off (a Ray object); a decode replica, chosen by the decode router for its free
        KV, pulls it and streams every token. A request that ends at its first token never
        reaches the decode pool."""
        if self.decode is None:
            async for item in _streamed(self.server.options(stream=True).generate.remote(req)):
                yield item
            return
        prefill = self.server.options(stream=True).generate.remote(dataclasses.replace(req, handoff=True))
        try:
            last, kv = await read_prefill(await prefill._to_object_ref_gen())
        except BaseException:
            prefill.cancel()
            raise
        if last is None:
            return
        if kv is None:
            yield last
            return
        self.metrics.handoffs.inc()
        scored = last.prompt_logprobs  # the prompt was scored on the prefill replica
        async for item in _streamed(self.decode.options(stream=True).generate.remote(decode_request(req, last, kv))):
            if scored is not None:
                item, scored = item._replace(prompt_logprobs=scored), None
            yield item

    async def _continued(self, engine_req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """The replica's outputs. When a replica hands the request back (its node is being lent to
        training) or dies mid-stream, the request continues on another replica from its prompt
        plus the tokens already streamed (greedy output is unchanged); usage still describes the
        client's request."""
        prompt_len = len(engine_req.prompt_ids)
        emitted: list[int] = []
        chars = 0  # characters of text streamed
        cached: int | None = None
        req = engine_req
        for attempt in range(MAX_CONTINUATIONS + 1):
            try:
                async for item in self._generate(req):
                    if cached is None:
                        cached = item.cached_tokens
                    if item.prompt_logprobs is not None:  # sent: a continuation need not score the prompt again
                        engine_req = dataclasses.replace(
                            engine_req, sampling=dataclasses.replace(engine_req.sampling, prompt_logprobs=None))
                    emitted += item.new_token_ids
                    chars += len(item.text)
                    if item.finished and attempt:
                        item = item._replace(prompt_tokens=prompt_len, completion_tokens=len(emitted),
                                             cached_tokens=min(cached, prompt_len))
                    yield item
                return
            except Exception as e:
                remaining = engine_req.max_tokens - len(emitted)
                if not _continuable(e) or attempt == MAX_CONTINUATIONS or remaining <= 0:
                    raise
                log.warning("continuing a request elsewhere after %d tokens: %s", len(emitted), type(e).__name__)
                self.metrics.continued.inc()
                req = dataclasses.replace(  # a longer prompt: planned there
                    engine_req, plan=None, prompt_ids=engine_req.prompt_ids + tuple(emitted), max_tokens=remaining,
                    continued_ids=tuple(emitted), continued_chars=chars)

    async def _stream(self, engine_req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        start = time.monotonic()
        first = last_t = None
        n_tokens = 0
        self.metrics.in_flight.inc()
        status = "error"
        try:
            plan = await self._plan(engine_req)
            if plan is not None:
                engine_req = dataclasses.replace(engine_req, plan=plan)
            async for item in self._continued(engine_req):
                now = time.monotonic()
                if item.new_token_ids:
                    if first is None:
                        first = now
                        self.metrics.ttft.observe(now - start)
                    elif last_t is not None:
                        self.metrics.itl.observe((now - last_t) / len(item.new_token_ids))
                    last_t = now
                    n_tokens += len(item.new_token_ids)
                if item.finished:
                    self.metrics.count_prompt(item.prompt_tokens, item.sources)
                    self.metrics.generation_tokens.inc(item.completion_tokens)
                    self.metrics.queue_time.observe(item.queued_s)
                    status = "ok"
                yield item
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests(status).inc()
            if status == "ok":
                self.metrics.e2e.observe(time.monotonic() - start)

    async def _choices(self, engine_reqs: list[GenerationRequest], n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of ``n`` choices of each request (a batch's prompts), as ``(index, output)``
        in the order they come; request p's choice j has index p * n + j. Each choice is its own
        engine request (a seeded request's choice j samples with seed + j); the first failure ends
        them all. A scored prompt is scored once, by its choice 0: the others are not scored and
        carry choice 0's scores on their first output."""
        if n == 1 and len(engine_reqs) == 1:
            async for item in self._stream(engine_reqs[0]):
                yield 0, item
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()
        loop = asyncio.get_running_loop()
        scores = [loop.create_future() if r.sampling.prompt_logprobs is not None and n > 1 else None
                  for r in engine_reqs]  # prompt p's scores, from its choice 0

        async def pump(i: int) -> None:
            _own_request_id()
            engine_req, scored = engine_reqs[i // n], scores[i // n]
            sampling = engine_req.sampling
            if sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=sampling.seed + i % n)
            waits = scored is not None and i % n > 0  # for choice 0's scores, at its first output
            if waits:
                sampling = dataclasses.replace(sampling, prompt_logprobs=None)
            try:
                async for item in self._stream(dataclasses.replace(engine_req, sampling=sampling)):
                    if scored is not None and not i % n and not scored.done():
                        scored.set_result(item.prompt_logprobs)
                    if waits:
                        item, waits = item._replace(prompt_logprobs=await scored), False
                    await queue.put((i, item))
                await queue.put((i, done))
            except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i)) for i in range(n * len(engine_reqs))]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is done:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _respond(self, engine_reqs: list[GenerationRequest], body, kind: str, calls=None,
                       tool_finish: str = "tool_calls", thought: bool | None = None,
                       echoes: list[str] | None = None, scores_only: bool = False, prompt_k: int | None = None):
        """The HTTP response to one request (a chat, or a completion of one prompt or a batch:
        ``engine_reqs``, each with ``body.n`` choices). ``calls``: the chat output may hold tool
        calls; a factory of the splitter (``model.tool_calls``) that reads one choice's output
        into content and calls, which go out as the message's ``tool_calls`` with finish_reason
        ``tool_finish`` (OpenAI says ``stop`` for a function the request named). ``thought`` (a
        model that reasons, R1): whether the prompt opened the thought; the output's thought goes
        out as ``reasoning_content`` (DeepSeek's field), the rest as content (and calls).
        ``echoes`` (completions' ``echo``): each prompt's text, which starts its choices' text
        (and its scored tokens their logprobs); ``scores_only`` (echo with max_tokens 0): only
        that comes back, none of the engine's output. ``prompt_k`` (vLLM's ``prompt_logprobs``,
        not streamed): each choice's prompt scored (chat: once, for the response)."""
        self._charge(RequestCost.of(engine_reqs, body.n), engine_reqs[0].tenant)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        n = body.n
        total = n * len(engine_reqs)
        want_logprobs = engine_reqs[0].sampling.logprobs is not None
        text_offset = [0] * total  # completions' logprobs: where each choice's next token's text starts
        think = self.tokenizer.think_ids() if thought is not None else None
        counts = [ReasoningTokens(thought, *think) for _ in range(total)] if think else None

        def choice(i: int, text: str, finish: FinishReason | None, delta: bool, logprobs: list[TokenLogprob],
                   tool_calls: list[ToolCall] | None = None, reasoning: str | None = None,
                   echo: dict | None = None) -> dict:
            lp = None
            if want_logprobs and kind == "chat":
                lp = chat_logprobs(logprobs, self.tokenizer.token_bytes)
            elif want_logprobs:
                if echo is not None:  # the prompt's scored tokens first
                    text_offset[i] = echo["text_offset"][-1] + len(echo["tokens"][-1])
                lp = completion_logprobs(logprobs, self._token_text, text_offset[i])
                text_offset[i] += sum(len(t) for t in lp["tokens"])
                lp = lp if echo is None else joined_logprobs(echo, lp)
            if kind == "chat":
                key = "delta" if delta else "message"
                msg = {"role": "assistant", "content": text} if not delta or text else {}
                if tool_calls:
                    msg = {"role": "assistant", "content": text or None,
                           "tool_calls": [c.openai(k) for k, c in enumerate(tool_calls)]}
                    finish = tool_finish if finish == "stop" else finish
                if think is not None and (reasoning or not delta):
                    msg = {"role": "assistant", **msg, "reasoning_content": reasoning if reasoning or delta else None}
                return {"index": i, key: msg, "finish_reason": finish and str(finish), "logprobs": lp}
            return {"index": i, "text": text, "finish_reason": finish and str(finish), "logprobs": lp}

        def echoed(i: int, first: RequestOutput) -> tuple[str, dict | None]:
            """Choice i's echo: its prompt's text, and with logprobs its scored tokens (from the
            choice's first output)."""
            text = echoes[i // n]
            if not want_logprobs:
                return text, None
            return text, echo_logprobs(list(engine_reqs[i // n].prompt_ids), scored(first), body.logprobs,
                                       self._token_text)

        def scored(first: RequestOutput) -> list[TokenLogprob | None]:
            if first.prompt_logprobs is None:
                raise RuntimeError("the replica's first output has no prompt logprobs")
            return first.prompt_logprobs

        def kept(item: RequestOutput) -> RequestOutput:
            """What goes out of an output: with ``scores_only`` none of its tokens."""
            if not scores_only:
                return item
            return item._replace(new_token_ids=[], text="", new_logprobs=[],
                                 finish_reason=item.finish_reason and FinishReason.LENGTH)

        if not body.stream:
            texts: list[list[str]] = [[] for _ in range(total)]
            logprobs: list[list[TokenLogprob]] = [[] for _ in range(total)]
            lasts: list[RequestOutput | None] = [None] * total
            firsts: list[RequestOutput | None] = [None] * total
            try:
                async for i, item in self._choices(engine_reqs, n):
                    item = kept(item)
                    if firsts[i] is None:
                        firsts[i] = item
                    texts[i].append(item.text)
                    logprobs[i] += item.new_logprobs or []
                    lasts[i] = item
                    if counts is not None:
                        counts[i].feed(item.new_token_ids)
            except Exception as e:
                if _unavailable(e):
                    raise _unavailable_error() from None
                raise
            choices = []
            for i in range(total):
                text, found, reasoning, echo = "".join(texts[i]), [], None, None
                if echoes is not None:
                    prompt_text, echo = echoed(i, firsts[i])
                    text = prompt_text + text
                if think is not None:
                    split_r = ReasoningStream(thought)
                    reasoning, text = split_r.feed(text)
                    rest_r, rest_c = split_r.finish()
                    reasoning, text = reasoning + rest_r, text + rest_c
                if calls is not None:
                    split = calls()
                    text = split.feed(text)
                    rest, found = split.finish()
                    text += rest
                choices.append(choice(i, text, lasts[i].finish_reason, False, logprobs[i], found, reasoning, echo))
                if prompt_k is not None and kind == "completion":
                    choices[i]["prompt_logprobs"] = prompt_logprobs(
                        list(engine_reqs[i // n].prompt_ids), scored(firsts[i]), prompt_k, self._token_text)
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices,
                   "usage": self._batch_usage(lasts, n, counts, scores_only)}
            if prompt_k is not None and kind == "chat":  # one prompt for every choice
                out["prompt_logprobs"] = prompt_logprobs(list(engine_reqs[0].prompt_ids), scored(firsts[0]), prompt_k,
                                                         self._token_text)
            return JSONResponse(out)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        async def sse() -> AsyncIterator[str]:
            # the status line is sent already: a failure mid-stream is an error event
            lasts: list[RequestOutput | None] = [None] * total
            splits = [calls() for _ in range(total)] if calls is not None else None
            thoughts = [ReasoningStream(thought) for _ in range(total)] if think is not None else None
            try:
                async for i, item in self._choices(engine_reqs, n):
                    item, echo = kept(item), None
                    if echoes is not None and lasts[i] is None:  # the choice's first chunk starts with its prompt
                        prompt_text, echo = echoed(i, item)
                        item = item._replace(text=prompt_text + item.text)
                    text, found, reasoning = item.text, None, None
                    if thoughts is not None:  # the thought as reasoning deltas, the rest as content
                        reasoning, text = thoughts[i].feed(text)
                        counts[i].feed(item.new_token_ids)
                        if item.finished:
                            rest_r, rest_c = thoughts[i].finish()
                            reasoning, text = reasoning + rest_r, text + rest_c
                    if splits is not None:  # content goes out at once, the calls at the end
                        text = splits[i].feed(text)
                        if item.finished:
                            rest, found = splits[i].finish()
                            text += rest
                    chunk = {"id": rid, "object": chunk_obj, "created": created, "model": self.model_name,
                             "choices": [choice(i, text, item.finish_reason, True, item.new_logprobs or [], found,
                                                reasoning, echo)]}
                    if include_usage:
                        chunk["usage"] = None
                    yield f"data: {json.dumps(chunk)}\n\n"
                    lasts[i] = item
                if include_usage:
                    usage = {"id": rid, "object": chunk_obj, "created": created, "model": self.model_name,
                             "choices": [], "usage": self._batch_usage(lasts, n, counts, scores_only)}
                    yield f"data: {json.dumps(usage)}\n\n"
            except Exception as e:
                err = _unavailable_error() if _unavailable(e) else APIError(500, "the request failed", "server_error")
                if err.status == 500:
                    log.exception("streaming request failed")
                yield f"data: {json.dumps(error_body(err.message, err.type, None, err.code))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    # -- routes --------------------------------------------------------------------------
    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        grant = self._grant(request)
        engine_req, calls, tool_finish, thought = await self.prep.run(grant.tenant, self._chat_request, body, grant)
        return await self._respond([engine_req], body, "chat", calls, tool_finish, thought=thought,
                                   prompt_k=body.prompt_logprobs)

    def _chat_request(self, body: ChatCompletionRequest, grant: KeyGrant):
        """A chat's engine request (its prompt rendered and tokenized, its grammar checked: on a
        prep thread), the factory of the splitter that reads its output's tool calls (None
        without tools) with the finish_reason of a call, and whether the prompt opened a thought."""
        messages = [m.template_dict() for m in body.messages]
        tools, forced = body.tool_functions(), body.forced_function()
        required = body.required_grammar(*self._grammar_limits)
        prefix = body.answer_prefix()  # chat prefix completion: the answer goes on from that text
        extra = body.chat_template_kwargs or {}
        try:
            if prefix is None:
                prompt_ids = self.tokenizer.apply_chat_template(messages, tools, **extra,
                                                                generation_prompt=body.add_generation_prompt)
            else:
                prompt_ids = self.tokenizer.apply_chat_template(messages[:-1], tools, **extra) + self.tokenizer.encode(prefix)
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages") from None
        except TypeError as e:  # the template called with variables it cannot take
            raise APIError(400, f"the chat template failed: {e}", param="messages") from None
        think = self.tokenizer.think_ids()
        thought = thought_open(prompt_ids, *think) if think is not None else None
        fields = {}
        if thought:  # R1: JSON mode, a schema or a named function constrain only the answer, after the thought
            fields["constrain_after"] = think[1]
        if forced is not None:  # the output is that function's arguments: per its schema, or any JSON object
            fields["grammar"] = body.forced_grammar(forced, *self._grammar_limits)
        if required is not None:  # the output is one call, {NAME: ARGUMENTS}, of one of the tools
            fields["grammar"] = required
        engine_req = self._engine_request(body, prompt_ids, grant, prompt_logprobs=body.prompt_logprobs, **fields)
        if forced is not None:
            return engine_req, functools.partial(ForcedCall, forced), "stop", thought
        if required is not None:
            return engine_req, RequiredCall, "tool_calls", thought
        splitter = self.tokenizer.tool_call_stream if tools is not None else None
        if splitter is not None and not body.parallel_tool_calls:
            splitter = lambda: FirstCall(self.tokenizer.tool_call_stream())  # noqa: E731 - a factory, as above
        return engine_req, splitter, "tool_calls", thought

    @api.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, request: Request):
        """OpenAI's Responses API, as a chat (``deploy.responses_api``), stored unless ``store``
        is false (``deploy.response_store``)."""
        tenant = self._grant(request).tenant
        earlier = []
        if body.previous_response_id is not None:
            earlier = (await self._stored(tenant, body.previous_response_id, "previous_response_id")).history
        try:
            chat = ChatCompletionRequest(**body.chat_body(earlier))
        except ValidationError as e:  # a value the chat route refuses, named as the chat names it
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first.get("loc", ()))
            raise APIError(400, f"{loc}: {first.get('msg', 'invalid value')}", param=loc or None) from None
        answer = await self.chat_completions(chat, request)
        if not body.stream:
            response = response_of(body, json.loads(answer.body))
            await self._keep(tenant, body, earlier, response)
            return JSONResponse(response)
        events = ResponseEvents(body)

        async def stream() -> AsyncIterator[str]:
            async for event in events.of(answer.body_iterator):
                yield event
            if events.final is not None:
                await self._keep(tenant, body, earlier, events.final)

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def _stored(self, tenant: str, rid: str, param: str | None = None) -> StoredResponse:
        """``tenant``'s stored response ``rid``: a 404 when there is none (or it expired), a
        503 when the store does not answer."""
        record = await self._store_call(self.response_store.get, tenant, rid)
        if record is None:
            raise APIError(404, f"no stored response {rid!r} (it was not stored, was deleted or expired)",
                           param=param, code="not_found")
        return record

    async def _store_call(self, fn, *args):
        """``fn(*args)``, a response store call, off the event loop; a 503 when the store does
        not answer."""
        try:
            return await asyncio.to_thread(fn, *args)
        except StoreUnavailable as e:
            raise APIError(503, str(e), "server_error", code="store_unavailable", retry_after_s=1) from None

    async def _keep(self, tenant: str, body: ResponsesRequest, earlier: list[dict], response: dict) -> None:
        """Store ``response`` with its conversation (unless ``store`` is false); a store that
        fails or a record over the size limit is logged and counted, the response still returned."""
        if not body.stored:
            return
        items = body.input_items()
        record = StoredResponse(response, items, [*earlier, *items, *response["output"]])
        try:
            kept = await asyncio.to_thread(self.response_store.put, tenant, record)
        except StoreUnavailable as e:
            log.warning("response %s not stored: %s", response["id"], e)
            kept = False
        if not kept:
            self.metrics.responses_not_stored.inc()

    @api.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request):
        return JSONResponse((await self._stored(self._grant(request).tenant, response_id)).response)

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request):
        deleted = await self._store_call(self.response_store.delete, self._grant(request).tenant, response_id)
        if not deleted:
            raise APIError(404, f"no stored response {response_id!r}", code="not_found")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @api.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(self, response_id: str, request: Request, limit: int = 20,
                                   order: Literal["asc", "desc"] = "desc", after: str | None = None):
        """The stored response's input items, OpenAI's list shape (``after``: the items past
        that id, in ``order``)."""
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be in [1, 100], got {limit}", param="limit")
        items = (await self._stored(self._grant(request).tenant, response_id)).input
        items = items[::-1] if order == "desc" else items
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after: {after!r} is not an input item of {response_id!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        grant = self._grant(request)
        reqs, echoes = await self.prep.run(grant.tenant, self._completion_requests, body, grant)
        return await self._respond(reqs, body, "completion", echoes=echoes if body.echo else None,
                                   scores_only=body.scores_only(), prompt_k=body.prompt_logprobs)

    def _completion_requests(self, body: CompletionRequest, grant: KeyGrant) -> tuple[list[GenerationRequest], list[str]]:
        """The engine requests of a completion's prompts (tokenized on a prep thread), and with
        ``echo`` each prompt's text."""
        prompts = body.prompts()
        if len(prompts) > self.limits.max_prompts:
            raise APIError(400, f"a batch of {len(prompts)} prompts exceeds the limit of {self.limits.max_prompts}",
                           param="prompt")
        if body.echo and body.suffix is not None:
            raise APIError(400, "echo and suffix (fill in the middle) do not go together", param="echo")
        asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        scored = max(asked, default=None)  # echo with logprobs and prompt_logprobs score the prompt
        reqs: list[GenerationRequest] = []
        echoes = []  # each prompt's text, as echo returns it
        for p, prompt in enumerate(prompts):
            try:
                ids = self._completion_ids(body, prompt)
                if not reqs:
                    reqs.append(self._engine_request(body, ids, grant, "prompt", prompt_logprobs=scored,
                                                     scores_only=body.scores_only()))
                else:  # the batch's other prompts: the first's request with their own ids and length
                    reqs.append(dataclasses.replace(reqs[0], prompt_ids=tuple(ids),
                                                    max_tokens=self._max_tokens(body, ids, "prompt", body.scores_only())))
            except APIError as e:
                if len(prompts) > 1:  # which prompt of the batch
                    e.message = f"prompt {p} of the batch: {e.message}"
                raise
            if body.echo:
                echoes.append(prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt))
        return reqs, echoes

    def _completion_ids(self, body: CompletionRequest, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids: a text's (after the BOS token, or in the fill-in-the-
        middle form with ``suffix``), or the ids given, each in the vocabulary."""
        if body.suffix is not None:  # fill in the middle
            if not isinstance(prompt, str):
                raise APIError(400, "suffix (fill in the middle) needs a text prompt", param="suffix")
            try:
                return self.tokenizer.fim_prompt(prompt, body.suffix)
            except ValueError as e:
                raise APIError(400, str(e), param="suffix") from None
        if isinstance(prompt, str):
            bos = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
            return bos + self.tokenizer.encode(prompt)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        return list(prompt)

    @api.get("/v1/models")
    async def models(self, request: Request):
        grant = self._grant(request)
        models = [self.model_name] if grant.allows(self.model_name) else []
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "tideserve"}
                                            for m in models]}

    @api.get("/v1/models/{model:path}")
    async def retrieve_model(self, model: str, request: Request):
        """OpenAI's model retrieval: the served model, a 404 for any other name (and for a key
        that may not use it, as ``/v1/models`` does not list it)."""
        grant = self._grant(request)
        if model != self.model_name or not grant.allows(model):
            raise APIError(404, f"model {model!r} does not exist", param="model", code="model_not_found")
        return {"id": model, "object": "model", "created": 0, "owned_by": "tideserve"}

    def _check_model(self, name: str | None, grant: KeyGrant) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; available: {self.model_name!r}", param="model",
                           code="model_not_found")
        if not grant.allows(self.model_name):
            raise APIError(403, f"this API key has no access to model {self.model_name!r}", "permission_error",
                           param="model", code="model_not_allowed")

    @api.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest, request: Request):
        """Token ids of a prompt or of chat messages, as the completion routes would make them."""
        grant = self._grant(request)
        self._check_model(body.model, grant)
        return await self.prep.run(grant.tenant, self._tokenized, body)

    def _tokenized(self, body: TokenizeRequest) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            try:
                ids = self.tokenizer.apply_chat_template([m.template_dict() for m in body.messages], None,
                                                         generation_prompt=body.add_generation_prompt)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
        else:
            bos = [self.tokenizer.bos_id] if body.add_special_tokens and self.tokenizer.bos_id is not None else []
            ids = bos + self.tokenizer.encode(body.prompt)
        return {"count": len(ids), "max_model_len": self.context_len, "tokens": ids}

    @api.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, request: Request):
        grant = self._grant(request)
        self._check_model(body.model, grant)
        bad = [t for t in body.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="tokens")
        return {"prompt": await self.prep.run(grant.tenant, self.tokenizer.decode, body.tokens)}

    @api.get("/version")
    async def version(self):
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("tideserve")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @api.get("/health")
    async def health(self):
        """200 once a replica of every pool answers; 503 while none can serve (starting, every
        replica gone)."""
        pools = [("LLMServer", self.server)] + ([("LLMDecode", self.decode)] if self.decode is not None else [])
        for name, handle in pools:
            try:
                ok = await asyncio.wait_for(handle.ready.remote(), timeout=self.health_timeout_s)
            except Exception:  # noqa: BLE001 - no replica answered in time: not ready
                ok = False
            if not ok:
                return JSONResponse(error_body(f"no {name} replica can serve right now", "server_error", None,
                                               "service_unavailable"), 503,
                                    headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ok"}

    @staticmethod
    async def _node_caches(stats: dict) -> dict[str, dict]:
        """Each node's cache tiers: from every node's cache agent (which owns the node's units),
        or from the replica's own store when the app runs without agents."""
        if "ssd_units" in stats["cache"]:  # a per-replica store (cache_agents off)
            return {stats["node_id"]: stats["cache"]}
        from actors.cache_agent import agents_stats

        return await asyncio.to_thread(agents_stats, 10.0)

    @api.get("/metrics")
    async def metrics(self):
        try:
            from actors.tidal import tidal_state

            state = tidal_state()
            self.metrics.replicas(await state.replica_reports.remote())
            alive = await asyncio.to_thread(lambda: [n["NodeID"] for n in ray.nodes() if n["Alive"]])
            self.metrics.node_roles(alive, await state.roles.remote())
            self.metrics.tidal(await state.nights.remote(), await state.job.remote())
        except Exception as e:  # noqa: BLE001 - no day/night state: the other series still serve
            log.warning("replica reports unavailable for /metrics: %s", e)
        if self.expert_parallel:
            try:
                from deploy.ep_admin import find_ep_control_info, placement_imbalance

                found = await asyncio.to_thread(find_ep_control_info, 5.0)
                if found is not None:
                    control, info = found
                    load = await control.load.remote()
                    self.metrics.expert_placement(info, await asyncio.to_thread(placement_imbalance, info, load))
            except Exception as e:  # noqa: BLE001 - the control restarts: the other series still serve
                log.warning("expert placement unavailable for /metrics: %s", e)
        try:  # the nodes' cache tiers and GPUs, through one replica
            stats = await self.server.stats.remote()
            for node, cache in (await self._node_caches(stats)).items():
                for tier in ("ssd", "ram"):
                    self.metrics.tier_bytes(node[:12], tier).set(cache.get(f"{tier}_bytes", 0))
                    self.metrics.tier_units(node[:12], tier).set(cache.get(f"{tier}_units", 0))
            gpus = stats.get("gpus", {}).get("gpus", [])
            self.metrics.gpus.set(len(gpus))
            for g in gpus:
                idx = str(g["index"])
                self.metrics.gpu_memory_used(idx).set(g["memory_used_bytes"])
                self.metrics.gpu_memory_total(idx).set(g["memory_total_bytes"])
                self.metrics.gpu_utilization(idx).set(g["utilization"])
                self.metrics.gpu_temperature(idx).set(g["temperature_c"])
        except Exception as e:  # noqa: BLE001 - metrics still serve the ingress's own series
            log.warning("replica stats unavailable for /metrics: %s", e)
        return PlainTextResponse(self.metrics.render().decode(),
                                 media_type="text/plain; version=0.0.4")
