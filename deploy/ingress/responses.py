"""OpenAI's Responses API over the ingress: a Responses request runs as a chat
(``deploy.responses_api``), its answer rendered from the chat's own chunks, and is stored
unless ``store`` is false (``deploy.response_store``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from deploy.errors import APIError
from deploy.ingress.listing import page
from deploy.ingress.service import Ingress
from deploy.limits import KeyGrant
from deploy.protocol import ChatCompletionRequest
from deploy.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    StoredResponse,
    StoreUnavailable,
)
from deploy.responses_api import ResponseEvents, ResponsesRequest, response_of

__all__ = ["Responses"]

log = logging.getLogger(__name__)


class Responses:
    def __init__(self, ingress: Ingress, store: MemoryResponseStore | RedisResponseStore | None = None) -> None:
        """``store``: where responses are kept (default: the directory's Redis when the app has
        one, else this ingress's memory)."""
        self.ingress = ingress
        if store is None:
            lim, directory = ingress.limits, ingress.cfg.directory
            keep = (lim.stored_response_ttl_s, lim.max_stored_response_bytes, lim.max_stored_responses)
            store = RedisResponseStore.open(directory, *keep) if directory.url else MemoryResponseStore(*keep)
        self.store = store

    async def create(self, body: ResponsesRequest, grant: KeyGrant) -> JSONResponse | StreamingResponse:
        if not body.stream:
            return JSONResponse(await self.whole(body, grant))
        earlier, chat = await self.as_chat(body, grant)
        answer = self.ingress.answer(await self.ingress.chat(chat, grant))
        tenant = grant.tenant
        events = ResponseEvents(body)

        async def stream() -> AsyncIterator[str]:
            async for event in events.of(answer.chunks()):
                yield event
            if events.final is not None:
                await self._keep(tenant, body, earlier, events.final)

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def whole(self, body: ResponsesRequest, grant: KeyGrant, background: bool = False) -> dict:
        """The Response of a request not streamed (``background``: a batch line's), stored
        unless ``store`` is false."""
        earlier, chat = await self.as_chat(body, grant)
        answer = self.ingress.answer(await self.ingress.chat(chat, grant), background)
        response = response_of(body, await answer.whole())
        await self._keep(grant.tenant, body, earlier, response)
        return response

    async def as_chat(self, body: ResponsesRequest, grant: KeyGrant) -> tuple[list, ChatCompletionRequest]:
        """The conversation before ``body`` and the chat request it runs as."""
        earlier = []
        if body.previous_response_id is not None:
            earlier = (await self.get(grant.tenant, body.previous_response_id, "previous_response_id")).history
        try:
            return earlier, ChatCompletionRequest(**body.chat_body(earlier))
        except ValidationError as e:  # a value the chat route refuses, named as the chat names it
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first.get("loc", ()))
            raise APIError(400, f"{loc}: {first.get('msg', 'invalid value')}", param=loc or None) from None

    async def get(self, tenant: str, rid: str, param: str | None = None) -> StoredResponse:
        """``tenant``'s stored response ``rid``: a 404 when there is none (or it expired), a
        503 when the store does not answer."""
        record = await self.call(self.store.get, tenant, rid)
        if record is None:
            raise APIError(404, f"no stored response {rid!r} (it was not stored, was deleted or expired)",
                           param=param, code="not_found")
        return record

    async def delete(self, tenant: str, rid: str) -> dict:
        if not await self.call(self.store.delete, tenant, rid):
            raise APIError(404, f"no stored response {rid!r}", code="not_found")
        return {"id": rid, "object": "response", "deleted": True}

    async def input_items(self, tenant: str, rid: str, limit: int, order: str, after: str | None) -> dict:
        """The stored response's input items, OpenAI's list shape (``after``: the items past
        that id, in ``order``)."""
        return page((await self.get(tenant, rid)).input, limit, after, order, 100)

    async def call(self, fn, *args):
        """``fn(*args)``, a store call, off the event loop; a 503 when the store does not answer."""
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
            kept = await asyncio.to_thread(self.store.put, tenant, record)
        except StoreUnavailable as e:
            log.warning("response %s not stored: %s", response["id"], e)
            kept = False
        if not kept:
            self.ingress.metrics.responses_not_stored.inc()
