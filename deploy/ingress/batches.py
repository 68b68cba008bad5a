"""OpenAI's Files and Batch APIs over the ingress: ``Batches`` answers the routes, ``BatchRunner``
runs the cluster's jobs from this ingress replica.

A job is validated (its file read, every line prepared as its route would: its tokens counted
against the limits and its prompt ordered so that lines sharing a prefix are neighbours), then run
line by line through the ingress as background requests (``GenerationRequest.background``: the
replicas run them behind interactive work), ``batch_concurrency`` lines at once. A group's first
line runs before the others that share its prefix, which then find it cached. Each line's result
is recorded once (``deploy.batch_store``) before the next is counted; a runner that dies loses its
lease and another goes on from the results recorded. A line waits while no replica serves; one
the replicas failed otherwise is tried ``LINE_TRIES`` times; a line whose request is refused (a
4xx) is a line of the error file at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pydantic import ValidationError

from cluster.batch import ENDPOINTS, WINDOW_S, BatchJob, BatchLine, BatchStatus, LineResult
from cluster.request import RequestFailed
from deploy.batch_store import (
    BatchStore,
    FileRecord,
    FileStore,
    MemoryKV,
    RedisKV,
    StoreUnavailable,
)
from deploy.errors import APIError, error_body, validation_message
from deploy.ingress.listing import page
from deploy.ingress.prepare import Prepared
from deploy.ingress.responses import Responses
from deploy.ingress.service import Ingress
from deploy.limits import KeyGrant
from deploy.protocol import ChatCompletionRequest, CompletionRequest
from deploy.responses_api import ResponsesRequest

__all__ = ["Batches", "KEEP_ENDED_S", "LEASE_S", "LINE_TRIES", "SAVE_S"]

log = logging.getLogger(__name__)

LEASE_S = 15.0  # a runner renews its job's lease every third of this; a dead one's job moves after it
LINE_TRIES = 4  # a line the replicas failed (not the request's own fault, not "none serving") is tried this often
RETRY_S = 2.0  # ... this long apart at first, doubling
MAX_RETRY_S = 30.0
SAVE_S = 1.0  # a running job's counts are saved at most this often
BATCH_PURPOSES = ("batch",)
KEEP_ENDED_S = 30 * 86400  # how long an ended job's record is kept


class Batches:
    def __init__(self, ingress: Ingress, responses: Responses, files: FileStore | None = None,
                 store: BatchStore | None = None, clock: Callable[[], float] = time.time) -> None:
        """``files``/``store``: default in the app's Redis (``IngressConfig.batch_state``) or, without
        one, this ingress's memory; file bodies under ``IngressConfig.files_dir``."""
        self.ingress, self.responses, self.limits, self.clock = ingress, responses, ingress.limits, clock
        if files is None or store is None:
            cfg = ingress.cfg
            kv = RedisKV.open(cfg.batch_state) if cfg.batch_state.url else MemoryKV()
            ns = cfg.batch_state.namespace
            files, store = FileStore(kv, cfg.files_dir, ns, clock), BatchStore(kv, ns)
        self.files, self.store = files, store

    # -- files ---------------------------------------------------------------------------
    async def upload(self, tenant: str, filename: str, purpose: str, data: bytes, expires_s: int | None) -> dict:
        if purpose not in BATCH_PURPOSES:
            raise APIError(400, f"purpose {purpose!r} is not served here; files are for batches (purpose 'batch')",
                           param="purpose")
        if len(data) > self.limits.max_file_bytes:
            raise APIError(413, f"the file has {len(data)} bytes, more than limits.max_file_bytes "
                                f"({self.limits.max_file_bytes})", param="file")
        ttl = self.limits.file_ttl_s if expires_s is None else expires_s
        if not 3600 <= ttl <= 30 * 86400:
            raise APIError(400, f"expires_after.seconds must be in [3600, 2592000], got {ttl}",
                           param="expires_after.seconds")
        return (await self._call(self.files.put, tenant, filename, purpose, data, ttl)).to_openai()

    async def file(self, tenant: str, fid: str) -> FileRecord:
        record = await self._call(self.files.get, tenant, fid)
        if record is None:
            raise APIError(404, f"no file {fid!r} (it was never uploaded, was deleted or expired)", code="not_found")
        return record

    async def content(self, tenant: str, fid: str) -> bytes:
        data = await self._call(self.files.content, tenant, fid)
        if data is None:
            raise APIError(404, f"no file {fid!r}", code="not_found")
        return data

    async def list_files(self, tenant: str, purpose: str | None, limit: int, after: str | None, order: str) -> dict:
        records = await self._call(self.files.list, tenant, purpose)
        return page([r.to_openai() for r in records], limit, after, order, 10000)

    async def delete_file(self, tenant: str, fid: str) -> dict:
        if not await self._call(self.files.delete, tenant, fid):
            raise APIError(404, f"no file {fid!r}", code="not_found")
        return {"id": fid, "object": "file", "deleted": True}

    # -- batches -------------------------------------------------------------------------
    async def create(self, grant: KeyGrant, input_file_id: str, endpoint: str, window: str,
                     metadata: dict[str, str] | None, output_expires_s: int | None) -> dict:
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint {endpoint!r} is not served; one of {', '.join(ENDPOINTS)}", param="endpoint")
        if window not in WINDOW_S:
            raise APIError(400, f"completion_window {window!r} is not supported; use 24h", param="completion_window")
        record = await self.file(grant.tenant, input_file_id)
        if record.purpose != "batch":
            raise APIError(400, f"file {input_file_id!r} has purpose {record.purpose!r}, not 'batch'",
                           param="input_file_id")
        live = [j for j in await self._call(self.store.list, grant.tenant) if not j.status.ended]
        if len(live) >= self.limits.max_tenant_batches:
            raise APIError(429, f"this tenant has {len(live)} batches not ended, the most limits.max_tenant_batches "
                                "allows; wait for one to end", "rate_limit_error", code="rate_limit_exceeded")
        models = sorted(grant.models) if grant.models is not None else None
        job = BatchJob.new(grant.tenant, endpoint, input_file_id, window, int(self.clock()), metadata=metadata,
                           output_expires_s=output_expires_s, models=models)
        await self._call(self.store.create, job, KEEP_ENDED_S + WINDOW_S[window])
        return job.to_openai()

    async def get(self, tenant: str, bid: str) -> BatchJob:
        job = await self._call(self.store.get, tenant, bid)
        if job is None:
            raise APIError(404, f"no batch {bid!r}", code="not_found")
        return job

    async def list(self, tenant: str, limit: int, after: str | None) -> dict:
        jobs = await self._call(self.store.list, tenant)
        return page([j.to_openai() for j in jobs], limit, after, "desc", 100)

    async def cancel(self, tenant: str, bid: str) -> dict:
        """Ask the job's runner to stop: it goes ``cancelling`` at once, ``cancelled`` once the
        lines under way have finished (those done stay in its files)."""
        job = await self.get(tenant, bid)
        if job.status.ended:
            raise APIError(409, f"batch {bid!r} has ended ({job.status.value}); it cannot be cancelled",
                           code="batch_ended")
        await self._call(self.store.cancel, tenant, bid, KEEP_ENDED_S)
        if job.status != BatchStatus.CANCELLING:
            job.enter(BatchStatus.CANCELLING, int(self.clock()))
        return job.to_openai()

    # -- the operators' view (``tide batch``): every tenant's ----------------------------------
    async def admin(self, action: str, batch_id: str | None = None, include_ended: bool = False) -> list[dict]:
        """``list`` (the jobs not ended, or every one kept), ``show`` or ``cancel`` one: each as
        OpenAI shows it, with its ``tenant``; ``demand``: each job's tokens left and due time."""
        jobs = await self._call(self.store.every)
        if action == "demand":  # the tidal policy's input (cluster.scaling.BatchDemand)
            return [{"tokens": j.tokens_left, "due_s": j.expires_at} for j in jobs if not j.status.ended]
        if action == "list":
            return [j.to_openai() | {"tenant": j.tenant} for j in jobs if include_ended or not j.status.ended]
        job = next((j for j in jobs if j.id == batch_id), None)
        if job is None:
            raise APIError(404, f"no batch {batch_id!r}", code="not_found")
        if action == "cancel":
            return [await self.cancel(job.tenant, job.id) | {"tenant": job.tenant}]
        return [job.to_openai() | {"tenant": job.tenant}]

    # -- one line, as its route runs it ----------------------------------------------------
    async def prepared(self, job: BatchJob, line: BatchLine) -> tuple[Prepared, ResponsesRequest | None]:
        """The line's request prepared as its route prepares it (a 400 for a body it refuses)."""
        body = line.body
        if body.get("stream"):
            raise APIError(400, "stream is not supported in a batch line", param="stream")
        grant = _grant(job)
        try:
            if job.endpoint == "/v1/chat/completions":
                return await self.ingress.chat(ChatCompletionRequest(**body), grant), None
            if job.endpoint == "/v1/completions":
                return await self.ingress.completion(CompletionRequest(**body), grant), None
            request = ResponsesRequest(**body)
        except ValidationError as e:
            msg, param = validation_message(e.errors(), skip=0)
            raise APIError(400, msg, param=param) from None
        _, chat = await self.responses.as_chat(request, grant)
        return await self.ingress.chat(chat, grant), request

    async def run_line(self, job: BatchJob, line: BatchLine) -> LineResult:
        """The line's answer, or its error as the route would have sent it. A line no replica
        could take (a 503: none serving, one restarting) waits for one without counting a try;
        another failure of the replicas is tried ``LINE_TRIES`` times, ``RETRY_S`` apart and
        doubling; a request refused (a 4xx) is its line's error at once."""
        tries, wait_s = 0, RETRY_S
        while True:
            try:
                return await self._answer(job, line)
            except APIError as e:
                if e.status < 500:
                    return LineResult(line.index, line.custom_id, e.status, error_body(e.message, e.type, e.param, e.code))
                tries += e.status != 503
                failure: Exception = e
            except Exception as e:  # noqa: BLE001 - a replica's failure: that line's, tried again
                cause = getattr(e, "cause", e)
                if isinstance(cause, RequestFailed) and cause.request_fault:
                    return LineResult(line.index, line.custom_id, 400,
                                      error_body(f"the request failed: {cause}", "invalid_request_error"))
                tries, failure = tries + 1, e
            if tries >= LINE_TRIES:
                log.warning("batch %s line %d failed: %r", job.id, line.index, failure)
                return LineResult(line.index, line.custom_id, 500, error_body("the request failed", "server_error"))
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, MAX_RETRY_S)

    async def _answer(self, job: BatchJob, line: BatchLine) -> LineResult:
        prepared, responses = await self.prepared(job, line)
        if responses is not None:
            body = await self.responses.whole(responses, _grant(job), background=True)
            usage = body.get("usage") or {}
            return LineResult(line.index, line.custom_id, 200, body, usage.get("input_tokens", 0),
                              (usage.get("input_tokens_details") or {}).get("cached_tokens", 0),
                              usage.get("output_tokens", 0))
        body = await self.ingress.answer(prepared, background=True).whole()
        usage = body.get("usage") or {}
        return LineResult(line.index, line.custom_id, 200, body, usage.get("prompt_tokens", 0),
                          usage.get("prompt_cache_hit_tokens", 0), usage.get("completion_tokens", 0))

    async def _call(self, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except StoreUnavailable as e:
            raise APIError(503, f"{e}; retry shortly", "server_error", code="store_unavailable",
                           retry_after_s=1) from None


def _grant(job: BatchJob) -> KeyGrant:
    return KeyGrant(job.tenant, frozenset(job.models) if job.models is not None else None)
