"""The OpenAI-compatible HTTP ingress (FastAPI on Ray Serve) in front of the ``LLMServer`` replicas.

Routes: ``/v1/chat/completions``, ``/v1/completions`` (SSE streaming or not), ``/v1/responses``
(OpenAI's Responses API as a chat, stored: ``deploy.ingress.responses``), ``/v1/files`` and
``/v1/batches`` (OpenAI's Files and Batch APIs: ``deploy.ingress.batches``), ``/v1/models``,
``/tokenize``, ``/detokenize``, ``/version`` (as vLLM and SGLang have them), ``/health`` (503
while no replica can serve), ``/metrics``. API keys (each maps to a tenant whose salt isolates its
cache), the content type and the body size are checked before the body is read
(``deploy.http_edge``); each route then hands the body to the request path in
``deploy.ingress`` (prepare, plan, dispatch, render). Every error, a bad path or method
included, uses OpenAI's JSON shape; a request that fails validation is a 400 naming the field.

``serve.ingress`` is applied where the class is defined: a replica re-imports this module, and only
a class decorated at import time carries its routes there. ``deploy/app.py`` applies
``serve.deployment`` and binds.
"""


# No `from __future__ import annotations` here: FastAPI must see the route annotations as types.
import asyncio
import contextlib
import logging
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.serve_bind import bind_replica_grpc_to_node
from cluster.request import RequestFailed
from deploy.errors import APIError, error_body, validation_message
from deploy.http_edge import PUBLIC_PATHS, EdgeConfig, EdgeMiddleware
from deploy.ingress import ops
from deploy.ingress.batch_runner import BatchRunner
from deploy.ingress.batches import Batches
from deploy.ingress.config import IngressConfig
from deploy.ingress.responses import Responses
from deploy.ingress.serve_pool import ServePool
from deploy.ingress.service import Ingress
from deploy.limits import KeyGrant
from deploy.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from deploy.responses_api import ResponsesRequest

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
    msg, param = validation_message(errs)
    return JSONResponse(error_body(msg, "invalid_request_error", param), 400)


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


class ExpiresAfter(BaseModel):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=30 * 86400)


class BatchCreateRequest(BaseModel):
    """OpenAI's batch creation (``POST /v1/batches``)."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=128)
    endpoint: str
    completion_window: str
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    output_expires_after: ExpiresAfter | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


HEALTH_TIMEOUT_S = 5.0  # a replica that does not answer /health's call within this is not serving


@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, server, cfg: IngressConfig, decode=None) -> None:
        """``server``: a handle to the ``LLMServer`` deployment; ``decode``: one to the decode
        pool (P/D disaggregation: ``server`` then only prefills)."""
        directory = cfg.directory.open() if cfg.directory.url else None
        namespace = cfg.identity.namespace() if directory is not None else None
        self.ingress = Ingress(cfg, ServePool(server, HEALTH_TIMEOUT_S),
                               ServePool(decode, HEALTH_TIMEOUT_S) if decode is not None else None,
                               directory=directory, namespace=namespace)
        self.grants = cfg.grants()
        self.responses_api = Responses(self.ingress)
        self.batches = Batches(self.ingress, self.responses_api)
        self.batch_runner = BatchRunner(self.batches)
        with contextlib.suppress(RuntimeError):  # Serve runs the constructor in the replica's event loop
            self._runner_task = asyncio.get_running_loop().create_task(self.batch_runner.serve())
        lim = cfg.limits
        api.state.edge = EdgeConfig(self.grants, lim.max_body_bytes,  # read by deploy.http_edge
                                    PUBLIC_PATHS | frozenset(cfg.public_paths), self.ingress.quotas,
                                    lim.body_timeout_s, {"/v1/files": lim.max_file_bytes + (64 << 10)})

    def _grant(self, request: Request) -> KeyGrant:
        """The caller's grant, which the edge (``deploy.http_edge``) checked before the body was
        read (a caller without a valid key never gets here when keys are configured)."""
        grant = request.scope.get("state", {}).get("grant")
        if grant is None:  # the edge did not run (it always does when served): refuse rather than guess
            if self.grants is None:
                return KeyGrant("")
            raise APIError(401, "missing or invalid API key", "authentication_error", code="invalid_api_key")
        return grant

    # -- generation ----------------------------------------------------------------------
    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await self.ingress.respond(await self.ingress.chat(body, self._grant(request)))

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await self.ingress.respond(await self.ingress.completion(body, self._grant(request)))

    @api.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, request: Request):
        return await self.responses_api.create(body, self._grant(request))

    @api.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request):
        return JSONResponse((await self.responses_api.get(self._grant(request).tenant, response_id)).response)

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request):
        return JSONResponse(await self.responses_api.delete(self._grant(request).tenant, response_id))

    @api.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(self, response_id: str, request: Request, limit: int = 20,
                                   order: Literal["asc", "desc"] = "desc", after: str | None = None):
        tenant = self._grant(request).tenant
        return JSONResponse(await self.responses_api.input_items(tenant, response_id, limit, order, after))

    # -- files and batches ---------------------------------------------------------------
    @api.post("/v1/files")
    async def upload_file(self, request: Request):
        """A multipart form: ``file`` (JSONL), ``purpose`` (``batch``), optionally
        ``expires_after[anchor]``/``expires_after[seconds]``."""
        grant = self._grant(request)
        async with request.form(max_files=1, max_fields=8) as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if upload is None or isinstance(upload, str):
                raise APIError(400, "the form has no file part named 'file'", param="file")
            if not isinstance(purpose, str):
                raise APIError(400, "the form has no field 'purpose'", param="purpose")
            seconds = form.get("expires_after[seconds]")
            if seconds is not None and (not isinstance(seconds, str) or not seconds.isdigit()):
                raise APIError(400, f"expires_after[seconds] must be a whole number, got {seconds!r}",
                               param="expires_after.seconds")
            data = await upload.read()
            name = upload.filename or "upload.jsonl"
        return await self.batches.upload(grant.tenant, name, purpose, data, int(seconds) if seconds else None)

    @api.get("/v1/files")
    async def list_files(self, request: Request, purpose: str | None = None, limit: int = 10000,
                         order: Literal["asc", "desc"] = "desc", after: str | None = None):
        return await self.batches.list_files(self._grant(request).tenant, purpose, limit, after, order)

    @api.get("/v1/files/{file_id}")
    async def get_file(self, file_id: str, request: Request):
        return (await self.batches.file(self._grant(request).tenant, file_id)).to_openai()

    @api.get("/v1/files/{file_id}/content")
    async def file_content(self, file_id: str, request: Request):
        data = await self.batches.content(self._grant(request).tenant, file_id)
        return Response(data, media_type="application/jsonl")

    @api.delete("/v1/files/{file_id}")
    async def delete_file(self, file_id: str, request: Request):
        return await self.batches.delete_file(self._grant(request).tenant, file_id)

    @api.post("/v1/batches")
    async def create_batch(self, body: BatchCreateRequest, request: Request):
        expires = body.output_expires_after.seconds if body.output_expires_after else None
        return await self.batches.create(self._grant(request), body.input_file_id, body.endpoint,
                                         body.completion_window, body.metadata, expires)

    @api.get("/v1/batches")
    async def list_batches(self, request: Request, limit: int = 20, after: str | None = None):
        return await self.batches.list(self._grant(request).tenant, limit, after)

    @api.get("/v1/batches/{batch_id}")
    async def get_batch(self, batch_id: str, request: Request):
        return (await self.batches.get(self._grant(request).tenant, batch_id)).to_openai()

    @api.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(self, batch_id: str, request: Request):
        return await self.batches.cancel(self._grant(request).tenant, batch_id)

    async def batch_admin(self, action: str, batch_id: str | None = None, include_ended: bool = False) -> list[dict]:
        """``tide batch``'s calls (a handle's, never a route): every tenant's jobs."""
        return await self.batches.admin(action, batch_id, include_ended)

    # -- models and tokens ---------------------------------------------------------------
    @api.get("/v1/models")
    async def models(self, request: Request):
        name = self.ingress.cfg.model_name
        models = [name] if self._grant(request).allows(name) else []
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "tideserve"}
                                            for m in models]}

    @api.get("/v1/models/{model:path}")
    async def retrieve_model(self, model: str, request: Request):
        """OpenAI's model retrieval: the served model, a 404 for any other name (and for a key
        that may not use it, as ``/v1/models`` does not list it)."""
        if model != self.ingress.cfg.model_name or not self._grant(request).allows(model):
            raise APIError(404, f"model {model!r} does not exist", param="model", code="model_not_found")
        return {"id": model, "object": "model", "created": 0, "owned_by": "tideserve"}

    @api.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest, request: Request):
        """Token ids of a prompt or of chat messages, as the completion routes would make them."""
        grant = self._grant(request)
        self.ingress.prepare.check_model(body.model, grant)
        return await self.ingress.prep.run(grant.tenant, ops.tokenized, self.ingress, body.prompt, body.messages,
                                           body.add_special_tokens, body.add_generation_prompt)

    @api.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, request: Request):
        grant = self._grant(request)
        self.ingress.prepare.check_model(body.model, grant)
        self.ingress.prepare.check_tokens(body.tokens, "tokens")
        return {"prompt": await self.ingress.prep.run(grant.tenant, self.ingress.tokenizer.decode, body.tokens)}

    # -- operations ----------------------------------------------------------------------
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
        """200 once a replica of every pool answers; 503 while none can serve."""
        status, body, headers = await ops.health(self.ingress)
        return JSONResponse(body, status, headers=headers or None)

    @api.get("/metrics")
    async def metrics(self):
        return PlainTextResponse(await ops.metrics_text(self.ingress, self.batch_runner), media_type="text/plain; version=0.0.4")
