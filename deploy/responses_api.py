"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat route.

A Responses request is a chat in another shape: ``input`` (a text, or items: messages, the
model's earlier function calls and their outputs) with ``instructions`` as the system message,
flat function ``tools``, ``text.format`` for JSON output and ``max_output_tokens``.
``ResponsesRequest.chat_body`` rewrites it as a ``ChatCompletionRequest``; the chat route runs
it (templates, tools, reasoning, JSON mode, errors); ``response_of`` reads the chat's whole answer
as a Response (a reasoning item, a message, function calls), and ``ResponseEvents`` turns the
chat's chunks into the Responses stream's typed events.

A response is stored unless ``store`` is false (``deploy.response_store``): its conversation
goes on from ``previous_response_id``, whose earlier items come before ``input``. The documented
fields this route does not serve are listed in ``deploy.openai_fields``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deploy.errors import APIError
from deploy.protocol import documented_fields

__all__ = ["ResponseEvents", "ResponsesRequest", "response_of"]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: Any, where: str) -> str:
    """A message's content: a text, or parts of text (input_text, output_text or text)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}: content part type {kind!r} is not supported (only text)", param="input")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


class ResponsesRequest(BaseModel):
    # an unknown field is a 400 naming it, as on the other routes
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    stream: bool = False
    seed: int | None = None  # an extension (as the chat route's): a sampled answer made reproducible
    store: bool | None = None  # keep the response (deploy.response_store); OpenAI's default: True
    previous_response_id: str | None = None  # go on from a stored response's conversation
    # without effect here (deploy.openai_fields.NO_OP), declared for the Response to echo them
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _documented(cls, body: Any) -> Any:
        return documented_fields("responses", body, cls.model_fields)

    @property
    def stored(self) -> bool:
        return self.store is not False

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as items, each with an id (a text is one user message), as a stored
        response lists them."""
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}] \
            if isinstance(self.input, str) else self.input
        return [item if "id" in item else {"id": _id("msg" if item.get("type", "message") == "message" else "item"),
                                           **item} for item in items]

    def messages(self, earlier: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """The chat messages: ``instructions`` as the system message, then the ``earlier`` items
        of a stored conversation (``previous_response_id``'s), then ``input``'s (consecutive
        function calls one assistant message's ``tool_calls``; a reasoning item is not sent
        back, as DeepSeek's chat refuses it)."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str) and not earlier:
            return [*out, {"role": "user", "content": self.input}]
        for i, item in enumerate([*earlier, *self.input_items()]):
            kind = item.get("type", "message")
            where = f"input[{i - len(earlier)}]" if i >= len(earlier) else f"the conversation's item {i}"
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise APIError(400, f"{where}: role {role!r} is not one of user, system, developer, assistant",
                                   param="input")
                out.append({"role": role, "content": _text(item.get("content"), where)})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(item.get("output"), where)})
            elif kind != "reasoning":
                raise APIError(400, f"{where}: input item type {kind!r} is not supported by this server",
                               param="input", code="unsupported_parameter")
        if not out:
            raise APIError(400, "input has no messages", param="input")
        return out

    def chat_body(self, earlier: list[dict[str, Any]] = ()) -> dict[str, Any]:
        """The ``ChatCompletionRequest`` fields of this request (streamed with usage, which the
        final event carries), going on from the ``earlier`` items of a stored conversation."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(earlier), "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for mine, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("parallel_tool_calls", "parallel_tool_calls"), ("seed", "seed")):
            if getattr(self, mine) is not None:
                body[theirs] = getattr(self, mine)
        if self.tools:
            body["tools"] = [self._tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            choice = self.tool_choice
            if isinstance(choice, dict):
                if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                    raise APIError(400, "tool_choice must be auto, none, required or {type: function, name}",
                                   param="tool_choice")
                choice = {"type": "function", "function": {"name": choice["name"]}}
            body["tool_choice"] = choice
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict):
                raise APIError(400, "text.format must be an object", param="text")
            if fmt.get("type") == "json_schema":
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": fmt.get("name", "output"), "schema": fmt.get("schema", {})}}
            else:
                body["response_format"] = {"type": fmt.get("type", "text")}
        return body

    @staticmethod
    def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools[{i}]: only function tools ({{type: function, name, parameters}}) are "
                           "supported by this server", param="tools", code="unsupported_parameter")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        return {"type": "function", "function": fn}

    def echo(self) -> dict[str, Any]:
        """The request's settings as a Response repeats them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p, "tools": self.tools or [],
                "tool_choice": self.tool_choice or "auto",
                "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
                "text": self.text or {"format": {"type": "text"}}, "metadata": self.metadata or {},
                "previous_response_id": self.previous_response_id, "reasoning": self.reasoning, "store": self.stored,
                "truncation": self.truncation or "disabled", "user": self.user, "background": False}


def _usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens_details": {"reasoning_tokens":
                                      (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)}}


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


def _shell(req: ResponsesRequest, rid: str, created: int, status: str, output: list, usage: dict | None,
           finish: str | None) -> dict:
    incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
    return {"id": rid, "object": "response", "created_at": created, "model": req.model,
            "status": "incomplete" if incomplete and status == "completed" else status, "output": output,
            "usage": usage, "error": None, "incomplete_details": incomplete, **req.echo()}


def response_of(req: ResponsesRequest, chat: dict) -> dict:
    """The Response of a finished chat answer (its one choice): the thought as a reasoning item,
    the content as a message (also when empty, unless the answer is only calls), the calls as
    function_call items; ``incomplete`` when max_output_tokens cut it."""
    choice = chat["choices"][0]
    msg, finish = choice["message"], choice["finish_reason"]
    output: list[dict] = []
    if msg.get("reasoning_content"):
        output.append(_reasoning_item(_id("rs"), msg["reasoning_content"]))
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not calls:
        output.append(_message_item(_id("msg"), msg.get("content") or "",
                                    "incomplete" if finish == "length" else "completed"))
    output += [_call_item(c) for c in calls]
    return _shell(req, _id("resp"), chat["created"], "completed", output, _usage(chat.get("usage")), finish)


class ResponseEvents:
    """The Responses stream of a chat stream: feed each chat chunk (``chunks``), get the typed
    events, each with its ``sequence_number``: created and in_progress, then per output item
    added, its deltas and done (the thought's reasoning text, the message's output text, each
    function call's arguments), then completed (or incomplete) with the whole Response."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req, self.rid, self.created = req, _id("resp"), int(time.time())
        self._seq = 0
        self.output: list[dict] = []
        self._open: dict | None = None  # the item whose deltas are coming: reasoning or message
        self._text = ""
        self._finish: str | None = None
        self.final: dict | None = None  # the whole Response, once the stream completed

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def _response(self, status: str, usage: dict | None = None) -> dict:
        return _shell(self.req, self.rid, self.created, status, self.output, usage, self._finish)

    def start(self) -> Iterator[str]:
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))

    def _begin(self, kind: str) -> Iterator[str]:
        """Close the open item and open one of ``kind`` (reasoning or message)."""
        yield from self._close()
        index = len(self.output)
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress", "content": []}
        else:
            item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress", "content": []}
        self._open = item
        yield self._event("response.output_item.added", output_index=index, item=item)
        if kind == "message":
            yield self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self._text = ""

    def _close(self) -> Iterator[str]:
        item = self._open
        if item is None:
            return
        index, self._open = len(self.output), None
        if item["type"] == "reasoning":
            done = _reasoning_item(item["id"], self._text)
            yield self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=self._text)
        else:
            done = _message_item(item["id"], self._text, "incomplete" if self._finish == "length" else "completed")
            yield self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=self._text, logprobs=[])
            yield self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                              part=done["content"][0])
        self.output.append(done)
        yield self._event("response.output_item.done", output_index=index, item=done)

    def _delta(self, kind: str, text: str) -> Iterator[str]:
        if self._open is None or self._open["type"] != kind:
            yield from self._begin(kind)
        self._text += text
        index, item_id = len(self.output), self._open["id"]
        if kind == "reasoning":
            yield self._event("response.reasoning_text.delta", item_id=item_id, output_index=index, content_index=0,
                              delta=text)
        else:
            yield self._event("response.output_text.delta", item_id=item_id, output_index=index, content_index=0,
                              delta=text, logprobs=[])

    def chunk(self, chunk: dict) -> Iterator[str]:
        """The events of one chat chunk (a delta, the finish, the usage, or an error)."""
        if "error" in chunk:
            yield from self._failed(chunk["error"])
            return
        for choice in chunk.get("choices") or []:
            yield from self._choice(choice)
        if chunk.get("usage") is not None:
            status = "incomplete" if self._finish == "length" else "completed"
            self.final = self._response(status, _usage(chunk["usage"]))
            yield self._event(f"response.{status}", response=self.final)

    def _failed(self, err: dict) -> Iterator[str]:
        yield self._event("error", message=err.get("message"), code=err.get("code"), param=err.get("param"))
        yield self._event("response.failed", response={**self._response("failed"), "error": {
            "code": err.get("code") or "server_error", "message": err.get("message")}})

    def _choice(self, choice: dict) -> Iterator[str]:
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            yield from self._delta("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            yield from self._delta("message", delta["content"])
        if choice.get("finish_reason"):
            self._finish = choice["finish_reason"]
        calls = delta.get("tool_calls") or []
        if calls or choice.get("finish_reason"):
            open_message = self._open is not None and self._open["type"] == "message"
            if not calls and not open_message and not any(o["type"] == "message" for o in self.output):
                yield from self._begin("message")  # an empty answer is still a message
            yield from self._close()
        for call in calls:
            yield from self._call(call)

    def _call(self, call: dict) -> Iterator[str]:
        item, index = _call_item(call), len(self.output)
        yield self._event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                  "status": "in_progress"})
        yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=item["arguments"])
        yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          arguments=item["arguments"])
        self.output.append(item)
        yield self._event("response.output_item.done", output_index=index, item=item)

    async def of(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """The Responses stream of the chat's chunks (``deploy.ingress.render.Answer.chunks``)."""
        for event in self.start():
            yield event
        async for chunk in chunks:
            for event in self.chunk(chunk):
                yield event
