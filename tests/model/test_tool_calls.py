"""DeepSeek's tool-call format read into OpenAI's tool_calls, whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from model.tool_calls import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    FirstCall,
    ForcedCall,
    RequiredCall,
    ToolCall,
    ToolCallStream,
    format_tool_calls,
    parse_tool_calls,
)

V3 = (f"Let me look.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```{CALL_END}"
      f"{CALL_BEGIN}function{SEP}get_time\n```json\n{{}}\n```{CALL_END}{CALLS_END}")
V31 = f"{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{\"city\": \"Zürich\"}}{CALL_END}{CALLS_END}"


def test_v3_and_v31_calls_are_read():
    content, calls = parse_tool_calls(V3)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    content, calls = parse_tool_calls(V31)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Zürich"})]
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_a_call_with_bad_arguments_or_cut_off_is_dropped():
    bad = f"{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{not json{CALL_END}{CALL_BEGIN}g{SEP}[1]{CALL_END}{CALL_BEGIN}h{SEP}{{\"a\""
    content, calls = parse_tool_calls("x" + bad)
    assert content == "x" and [c.name for c in calls] == ["g"]


def test_formatted_calls_read_back():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"q": [1, 2]}'}}]
    content, back = parse_tool_calls("hi" + format_tool_calls(calls))
    assert content == "hi" and [(c.name, c.arguments) for c in back] == [("f", '{"q": [1, 2]}')]
    assert back[0].openai(0)["id"].startswith("call_") and back[0].openai(3)["index"] == 3


@pytest.mark.parametrize("text", [V3, V31, "plain text <｜tool▁ but no calls", "ends with a marker start <｜tool▁calls"])
def test_streamed_content_is_the_whole_contents_and_never_shows_the_calls(text):
    rng = random.Random(len(text))
    for _ in range(20):  # cut anywhere, also inside the marker
        split, sent, at = ToolCallStream(), "", 0
        while at < len(text):
            step = rng.randint(1, 6)
            out = split.feed(text[at:at + step])
            assert CALLS_BEGIN[:3] not in out or CALLS_BEGIN not in text  # no part of the marker leaks
            sent += out
            at += step
        rest, calls = split.finish()
        content, want = parse_tool_calls(text)
        assert sent + rest == content and calls == want
        assert len(rest) < len(CALLS_BEGIN)  # only a possible marker start was held back


def test_a_required_call_is_the_one_function_the_object_names():
    split = RequiredCall()
    assert split.feed('{"get_weather": {"ci') == "" and split.feed('ty": "Zürich"}}') == ""
    content, calls = split.finish()
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Zürich"})]
    cut = RequiredCall()
    cut.feed('{"get_weather": {"ci')  # max_tokens came first: no call, and no half call as content
    assert cut.finish() == ("", [])


def test_a_forced_call_cut_short_is_neither_a_call_nor_content():
    whole = ForcedCall("f")
    whole.feed('{"a": 1}')
    assert whole.finish() == ("", [ToolCall("f", '{"a": 1}')])
    cut = ForcedCall("f")
    cut.feed('{"a": ')
    assert cut.finish() == ("", [])


def test_without_parallel_tool_calls_only_the_first_call_comes_back():
    text = "Sure." + format_tool_calls([{"function": {"name": n, "arguments": "{}"}} for n in ("a", "b")])
    split = FirstCall(ToolCallStream())
    assert split.feed(text) == "Sure."
    assert split.finish() == ("", [ToolCall("a", "{}")])
    assert len(parse_tool_calls(text)[1]) == 2
