"""Client libraries no one here wrote, used as their users use them, against a `tide up` cluster
serving the default model (``tests/conftest.py``'s ``tide_up``): the OpenAI Agents SDK (its Responses and chat
models, a tool round trip), instructor (JSON_SCHEMA and TOOLS), LangChain (invoke, stream,
structured output by json_schema and by function calling) and LiteLLM (chat, stream, text
completion). Settings are a user's (``max_tokens`` of a few hundred); a seed makes the default
model's sampled answer reproducible, so a failure here is the server's, never a coin's."""

from __future__ import annotations

import os

import pytest
from pydantic import BaseModel

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]

MAX_TOKENS = 300
SEED = 7


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def url(tide_up):
    return tide_up + "/v1"


@pytest.fixture(scope="module")
def async_openai(url):
    import openai

    return openai.AsyncOpenAI(base_url=url, api_key="sk-client", max_retries=0)


@pytest.fixture(scope="module")
def sync_openai(url):
    import openai

    return openai.OpenAI(base_url=url, api_key="sk-client", max_retries=0)


@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_the_agents_sdk_answers_and_calls_a_tool(async_openai, kind):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    model = (agents.OpenAIResponsesModel if kind == "responses" else agents.OpenAIChatCompletionsModel)("tiny", async_openai)
    settings = agents.ModelSettings(max_tokens=MAX_TOKENS, extra_body={"seed": SEED})
    answer = agents.Runner.run_sync(agents.Agent(name="a", instructions="Be brief.", model=model,
                                                 model_settings=settings), "Say hello")
    assert isinstance(answer.final_output, str) and answer.final_output
    asked: list[str] = []

    @agents.function_tool
    def get_tide(port: str) -> str:
        """The tide at a port."""
        asked.append(port)
        return "high"

    tool_user = agents.Agent(name="t", instructions="Use the tool.", tools=[get_tide], model=model,
                             model_settings=settings.resolve(agents.ModelSettings(tool_choice="required")),
                             tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(tool_user, "What is the tide at Brest?")
    assert result.final_output == "high" and len(asked) == 1  # the call came back, ran, and its output ended the run


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_extracts_a_model(sync_openai, mode):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(sync_openai, mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(model="tiny", response_model=Person, max_tokens=MAX_TOKENS, max_retries=0,
                                            seed=SEED, messages=[{"role": "user", "content": "Ann is 30."}])
    assert isinstance(person, Person)


@pytest.fixture(scope="module")
def chat_model(url):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model="tiny", base_url=url, api_key="sk-client", max_tokens=MAX_TOKENS,
                                       max_retries=0, seed=SEED)


def test_langchain_invokes_and_streams(chat_model):
    whole = chat_model.invoke("Hello")
    assert isinstance(whole.content, str) and whole.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk.content for chunk in chat_model.stream("Hello"))
    assert streamed == whole.content  # the same seed: the same answer, whole or streamed


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat_model, method):
    person = chat_model.with_structured_output(Person, method=method).invoke("Ann is 30.")
    assert isinstance(person, Person)


def test_litellm_chat_stream_and_text_completion(url):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    litellm = pytest.importorskip("litellm")
    kw = {"api_base": url, "api_key": "sk-client", "max_tokens": MAX_TOKENS, "seed": SEED}
    msgs = [{"role": "user", "content": "Hello"}]
    whole = litellm.completion(model="openai/tiny", messages=msgs, **kw)
    assert whole.choices[0].message.content and whole.usage.completion_tokens <= MAX_TOKENS
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(model="openai/tiny", messages=msgs,
                                                                                  stream=True, **kw))
    assert streamed == whole.choices[0].message.content
    text = litellm.text_completion(model="text-completion-openai/tiny", prompt="Hello", **kw)
    assert text.choices[0].text and text.usage.completion_tokens <= MAX_TOKENS
