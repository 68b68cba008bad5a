"""The Responses API's request read as a chat, and the chat's answer and stream read back as a
Response and its events (no server; ``tests/deploy/test_deepseek_api.py`` runs it over HTTP)."""

from __future__ import annotations

import json

import pytest

from deploy.errors import APIError
from deploy.ingress import structured
from deploy.protocol import ChatCompletionRequest
from deploy.responses_api import ResponseEvents, ResponsesRequest, response_of

TOOL = {"type": "function", "name": "get_weather", "description": "now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_input_items_become_the_chats_messages():
    req = ResponsesRequest(model="m", instructions="be brief", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather in "}, {"type": "input_text", "text": "Oslo"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # not sent back
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Bergen"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rain."}]}])
    msgs = req.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[1]["content"] == "weather in Oslo" and msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "rain"}
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]  # consecutive calls: one assistant turn
    assert ResponsesRequest(model="m", input="hi").messages() == [{"role": "user", "content": "hi"}]
    with pytest.raises(APIError, match="input has no messages"):
        ResponsesRequest(model="m", input=[{"type": "reasoning"}]).messages()


def test_the_request_is_a_chat_request():
    req = ResponsesRequest(model="m", input="hi", max_output_tokens=9, temperature=0.3, tools=[TOOL],
                           tool_choice={"type": "function", "name": "get_weather"}, stream=True, seed=5,
                           parallel_tool_calls=False,
                           text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}})
    chat = ChatCompletionRequest(**req.chat_body())
    assert chat.max_tokens == 9 and chat.temperature == 0.3 and chat.stream and chat.stream_options.include_usage
    assert chat.seed == 5 and chat.parallel_tool_calls is False
    assert chat.tools == [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}]
    assert chat.forced_function() == "get_weather"
    spec = structured.grammar(chat, 65536)
    assert (spec.kind, spec.source) == ("json_schema", '{"type": "object"}')


def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if delta is None and finish is None else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    return {"choices": choices, "usage": usage}


USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 2},
         "completion_tokens_details": {"reasoning_tokens": 2}}


def _events(req: ResponsesRequest, chunks: list[dict]) -> list[dict]:
    stream = ResponseEvents(req)
    raw = list(stream.start()) + [e for c in chunks for e in stream.chunk(c)]
    out = []
    for event in raw:
        head, data = event.strip().split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert head == f"event: {body['type']}"
        out.append(body)
    return out


def test_a_streamed_thought_and_answer_are_a_reasoning_item_then_a_message():
    events = _events(ResponsesRequest(model="m", input="hi"), [
        _chunk({"reasoning_content": "hmm "}), _chunk({"reasoning_content": "ok"}), _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}, "stop"), _chunk(usage=USAGE)])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "hmm ok" and final["output"][1]["content"][0]["text"] == "Hello"
    assert final["usage"] == {"input_tokens": 5, "output_tokens": 4, "total_tokens": 9,
                              "input_tokens_details": {"cached_tokens": 2}, "output_tokens_details": {"reasoning_tokens": 2}}


def test_a_stream_cut_by_max_output_tokens_is_incomplete_and_an_error_fails_it():
    events = _events(ResponsesRequest(model="m", input="hi"), [_chunk({"content": "Hi"}, "length"), _chunk(usage=USAGE)])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    empty = _events(ResponsesRequest(model="m", input="hi"), [_chunk({}, "stop"), _chunk(usage=USAGE)])
    assert [o["content"][0]["text"] for o in empty[-1]["response"]["output"]] == [""]  # still a message
    failed = _events(ResponsesRequest(model="m", input="hi"), [
        _chunk({"content": "Hi"}), {"error": {"message": "the request failed", "code": None}}])
    assert [e["type"] for e in failed[-2:]] == ["error", "response.failed"]
    assert failed[-1]["response"]["status"] == "failed"


def test_the_chat_answer_is_a_response():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    chat = {"created": 7, "usage": USAGE, "choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [call]}}]}
    r = response_of(ResponsesRequest(model="m", input="hi", tools=[TOOL]), chat)
    assert r["status"] == "completed" and r["tools"] == [TOOL] and r["created_at"] == 7
    assert [o["type"] for o in r["output"]] == ["reasoning", "function_call"]  # no empty message beside the call
    assert r["output"][1]["call_id"] == "call_1" and r["output"][1]["arguments"] == "{}"
