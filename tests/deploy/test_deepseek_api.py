"""DeepSeek's API features through HTTP with the official ``openai`` client, on a scripted
checkpoint (tests/model/scripted.py) whose answers are known: tool calls (the model answers with a
call in DeepSeek-V3's format and the server returns OpenAI's ``tool_calls``, whole and streamed),
fill in the middle (``suffix``), chat prefix completion, and R1's reasoning (the template opens the
thought when ``chat_template_kwargs`` asks for thinking, as DeepSeek-V3.1's does)."""

from __future__ import annotations

import json

import httpx
import pytest

from model.tool_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from tests.model.scripted import TEMPLATE, make_scripted_checkpoint

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")

SCRIPT = ["Checking", CALLS_BEGIN, CALL_BEGIN, "function", SEP, "get_weather", "\n```json\n", '{"city": "Paris"}',
          "\n```", CALL_END, CALLS_END]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "what is the weather in Paris ?"}]
FIM_SCRIPT = ["\n    if a < 2:", "\n        return a\n"]  # said after <｜fim▁end｜>
THINK_SCRIPT = ["pondering", "</think>", '{"ok":', " true}"]  # said after <think>
R1_TEMPLATE = TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|>{% if thinking %}<think>{% endif %}{% endif %}")
WORDS = ["what", "is", "the", "weather", "in", "Paris", "?", "def", "fib", "(", "a", ")", ":", "return"]


@pytest.fixture(scope="module")
def client(local_ray, tmp_path_factory):
    from deploy.app import build_app
    from tests.shared_ray import serving

    home = tmp_path_factory.mktemp("tools")
    ckpt = make_scripted_checkpoint(home / "scripted", WORDS, {"<|assistant|>": SCRIPT, "<｜fim▁end｜>": FIM_SCRIPT,
                                                               "<think>": THINK_SCRIPT},
                                    template=R1_TEMPLATE, added=("<think>",))
    app = build_app({"checkpoint": str(ckpt), "model_name": "scripted", "cache_dir": str(home / "cache"),
                     "replica_cpus": 0.5, "num_pages": 64})
    with serving(app, 300) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        client.ckpt = ckpt
        yield client


def test_the_call_comes_back_as_tool_calls(client):
    r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, max_tokens=20, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking"
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("function", "get_weather", {"city": "Paris"})]
    assert msg.tool_calls[0].id.startswith("call_")
    # without tools (or with tool_choice none) the same output is all content
    plain = client.chat.completions.create(model="scripted", messages=ASK, max_tokens=20, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == "".join(SCRIPT)
    none = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=20, temperature=0)
    assert none.choices[0].message.content == "".join(SCRIPT)
    # the tools reach the chat template (it writes them into the prompt)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens


def test_streamed_content_comes_first_and_the_call_at_the_end(client):
    chunks = list(client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, max_tokens=20,
                                                 temperature=0, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Checking" and CALLS_BEGIN not in content
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_named_function_is_called_with_json_arguments(client):
    """tool_choice naming a function: the output, generated in JSON mode, is its arguments (this
    vocabulary's only token that starts a JSON object is the script's arguments)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=20,
                                       temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.content is None  # as OpenAI reports a forced call
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    chunks = list(client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, tool_choice=named,
                                                 max_tokens=20, temperature=0, stream=True))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [("get_weather", '{"city": "Paris"}')]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_a_conversation_with_the_tools_answer_goes_on(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS, max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"  # the script calls again


FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's tools


def test_the_responses_api_returns_the_message_and_the_call_as_items(client):
    """POST /v1/responses (OpenAI's client): the content is a message item, the call a
    function_call item, usage in the Responses names; a conversation carrying the call and its
    output as input items goes on as the chat does."""
    r = client.responses.create(model="scripted", input=ASK[0]["content"], tools=FLAT_TOOLS, max_output_tokens=20,
                                temperature=0)
    assert r.status == "completed" and r.output_text == "Checking"
    message, call = r.output
    assert message.type == "message" and message.content[0].text == "Checking"
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    chat = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, max_tokens=20, temperature=0)
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    again = client.responses.create(model="scripted", max_output_tokens=20, temperature=0, tools=FLAT_TOOLS, input=[
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert [o.type for o in again.output][-1] == "function_call"  # the script calls again, as in the chat
    assert again.usage.input_tokens > r.usage.input_tokens
    short = client.responses.create(model="scripted", input=ASK[0]["content"], max_output_tokens=1, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_the_responses_stream_is_typed_events_ending_with_the_response(client):
    events = list(client.responses.create(model="scripted", input=ASK[0]["content"], tools=FLAT_TOOLS,
                                          max_output_tokens=20, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == "Checking"
    assert json.loads(final.output[-1].arguments) == {"city": "Paris"} and final.usage.output_tokens > 0


def test_fill_in_the_middle(client):
    from model.tokenizer import load_tokenizer

    r = client.completions.create(model="scripted", prompt="def fib(a):", suffix="    return fib(a-1) + fib(a-2)",
                                  max_tokens=10, temperature=0)
    assert r.choices[0].text == "".join(FIM_SCRIPT) and r.choices[0].finish_reason == "stop"
    tok = load_tokenizer(client.ckpt)
    assert r.usage.prompt_tokens == 4 + len(tok.encode("def fib(a):")) + len(tok.encode("    return fib(a-1) + fib(a-2)"))
    # without the suffix it is a plain completion (not the FIM script)
    plain = client.completions.create(model="scripted", prompt="def fib(a):", max_tokens=10, temperature=0)
    assert plain.choices[0].text != "".join(FIM_SCRIPT)


def test_chat_prefix_completion_goes_on_from_the_prefix(client):
    msgs = [*ASK, {"role": "assistant", "content": "Checking", "prefix": True}]
    r = client.chat.completions.create(model="scripted", messages=msgs, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == "".join(SCRIPT[1:])  # the script after "Checking"
    whole = client.chat.completions.create(model="scripted", messages=ASK, max_tokens=20, temperature=0)
    assert r.usage.prompt_tokens == whole.usage.prompt_tokens + 1


@pytest.mark.parametrize("extra, status, needle", [
    ({"tools": TOOLS, "tool_choice": "any"}, 400, "tool_choice 'any' is not supported"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, 400,
     "tool_choice names 'get_time', which is not one of the tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, 400, "tool_choice must be"),
    ({"tools": [{"type": "retrieval"}]}, 400, "each tool must be"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": 3}}]}]}, 400,
     "each tool call must be"),
    ({"messages": [{"role": "user", "content": "x", "prefix": True}]}, 400, "only the last message, an assistant's"),
    ({"messages": [{"role": "assistant", "content": "x", "prefix": True}, *ASK]}, 400, "may be a prefix"),
])
def test_bad_requests_get_openai_errors(client, extra, status, needle):
    body = {"model": "scripted", "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{client.base_url}chat/completions", json=body, timeout=60)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("extra, needle", [
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input item type 'input_image' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "content part type 'input_image'"),
    ({"temperature": 3}, "temperature"),
    ({"tool_choice": {"type": "function"}}, "tool_choice must be"),
    ({"background": True}, "background: this server does not serve background responses"),
])
def test_bad_responses_requests_get_openai_errors(client, extra, needle):
    r = httpx.post(str(client.base_url) + "responses", timeout=30,
                   json={"model": "scripted", "input": "x", "max_output_tokens": 2, **extra})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_an_unknown_previous_response_is_a_404_naming_it(client):
    r = httpx.post(str(client.base_url) + "responses", timeout=30,
                   json={"model": "scripted", "input": "x", "previous_response_id": "resp_1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
    assert "resp_1" in r.json()["error"]["message"]


def test_fill_in_the_middle_needs_a_text_prompt(client):
    r = httpx.post(f"{client.base_url}completions", timeout=60,
                   json={"model": "scripted", "prompt": [1, 2], "suffix": "x", "max_tokens": 2})
    assert r.status_code == 400 and "needs a text prompt" in r.json()["error"]["message"]


THINK = {"chat_template_kwargs": {"thinking": True}}


def test_the_thought_comes_back_as_reasoning_content(client):
    r = client.chat.completions.create(model="scripted", messages=ASK, max_tokens=20, temperature=0, extra_body=THINK)
    msg = r.choices[0].message
    assert msg.reasoning_content == "pondering" and msg.content == '{"ok": true}'
    assert r.usage.completion_tokens_details.reasoning_tokens == 2  # "pondering" and </think>
    plain = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, max_tokens=20, temperature=0)
    assert plain.choices[0].message.reasoning_content is None  # no thought: the template did not open one
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


def test_streamed_reasoning_and_content_deltas(client):
    stream = client.chat.completions.create(model="scripted", messages=ASK, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=THINK)
    reasoning, content, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
            content.append(c.delta.content or "")
    assert "".join(reasoning) == "pondering" and "".join(content) == '{"ok": true}'
    assert usage.completion_tokens_details.reasoning_tokens == 2


def test_json_mode_constrains_the_answer_after_the_thought(client):
    """With the thought open, JSON mode lets the model think first (the masks would refuse
    "pondering" as the start of an object) and holds the answer to one object."""
    r = client.chat.completions.create(model="scripted", messages=ASK, max_tokens=20, temperature=0,
                                       response_format={"type": "json_object"}, extra_body=THINK)
    msg = r.choices[0].message
    assert msg.reasoning_content == "pondering" and json.loads(msg.content) == {"ok": True}
    assert r.choices[0].finish_reason == "stop"


def test_unknown_request_fields_are_refused_and_client_fields_accepted(client):
    url = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    body = {"model": "scripted", "messages": ASK, "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_token": 5}, timeout=60)
    assert r.status_code == 400 and "max_token" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={**body, "messages": [{**ASK[0], "reasoning_content": "x"}]})
    assert r.status_code == 400 and "reasoning_content" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "parallel_tool_calls": True, "store": False,
                                                        "metadata": {"a": "b"}}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "chat_template_kwargs": {"messages": []}}, timeout=60)
    assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"]
