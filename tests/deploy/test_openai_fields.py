"""Every field OpenAI documents for chat completions, completions and Responses is served, a
listed no-op, or a listed capability this server lacks (``deploy.openai_fields``), judged
against the official ``openai`` package's parameter types: a field OpenAI adds fails here until
it is listed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deploy.errors import APIError
from deploy.openai_fields import NO_OP, UNSERVED
from deploy.protocol import ChatCompletionRequest, CompletionRequest
from deploy.responses_api import ResponsesRequest

openai = pytest.importorskip("openai")

MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest, "responses": ResponsesRequest}
MINIMAL = {"chat": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
           "completions": {"model": "m", "prompt": "x"},
           "responses": {"model": "m", "input": "x"}}
# a value a client sends, for the no-op fields the Responses model declares (to echo them)
EXAMPLES = {"store": True, "metadata": {"run": "7"}, "user": "u-1", "reasoning": {"effort": "low"},
            "truncation": "auto"}


def _openai_fields(route: str) -> set[str]:
    """The request fields of ``route`` in the installed ``openai`` package (its streaming and
    non-streaming parameter types)."""
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import response_create_params as responses

    module = {"chat": chat, "completions": completions, "responses": responses}[route]
    base = "ResponseCreateParams" if route == "responses" else "CompletionCreateParams"
    return {name for kind in ("Streaming", "NonStreaming") for name in getattr(module, base + kind).__annotations__}


@pytest.mark.parametrize("route", sorted(MODELS))
def test_every_documented_field_is_served_or_listed(route):
    served = set(MODELS[route].model_fields)
    listed = NO_OP[route].keys() | UNSERVED[route].keys()
    assert not NO_OP[route].keys() & UNSERVED[route].keys()
    assert not UNSERVED[route].keys() & served  # an unserved field never reaches the model
    missing = _openai_fields(route) - served - listed
    assert not missing, f"OpenAI documents {sorted(missing)} for {route}: serve them or list them in deploy.openai_fields"


@pytest.mark.parametrize("route", sorted(MODELS))
def test_a_no_op_field_is_accepted_and_an_unknown_one_is_refused(route):
    model = MODELS[route]
    for name in NO_OP[route]:
        body = {**MINIMAL[route], name: EXAMPLES.get(name, "anything")}
        model(**body)  # accepted
        if name not in model.model_fields:
            assert model(**body) == model(**MINIMAL[route])  # and without effect
    with pytest.raises(ValidationError, match="stroe"):
        model(**MINIMAL[route], stroe=True)  # a typo is still a 400 naming it


@pytest.mark.parametrize("route", sorted(MODELS))
def test_an_unserved_field_is_accepted_empty_and_refused_given(route):
    model = MODELS[route]
    for name, what in UNSERVED[route].items():
        assert model(**MINIMAL[route], **{name: None}) == model(**MINIMAL[route])
        with pytest.raises(APIError) as e:
            model(**MINIMAL[route], **{name: {"some": "value"}})
        assert e.value.status == 400 and e.value.param == name and what in e.value.message


def test_text_is_the_only_modality_served():
    body = MINIMAL["chat"]
    assert ChatCompletionRequest(**body, modalities=["text"]) == ChatCompletionRequest(**body)
    with pytest.raises(APIError, match="modalities"):
        ChatCompletionRequest(**body, modalities=["text", "audio"])


def test_the_vllm_and_sglang_extensions_stay_accepted():
    extensions = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 1, "stop_token_ids": [3],
                  "ignore_eos": True, "include_stop_str_in_output": True, "prompt_logprobs": 1,
                  "structured_outputs": {"regex": "a+"}, "guided_json": {"type": "object"}, "guided_choice": ["a"],
                  "guided_regex": "a", "guided_grammar": 'root ::= "a"'}
    for name, value in extensions.items():
        for route in ("chat", "completions"):
            assert getattr(MODELS[route](**MINIMAL[route], **{name: value}), name) == value
    chat = ChatCompletionRequest(**MINIMAL["chat"], chat_template_kwargs={"thinking": True},
                                 add_generation_prompt=False, continue_final_message=False)
    assert chat.chat_template_kwargs == {"thinking": True}
