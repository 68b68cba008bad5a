"""Request bodies as the ingress reads them (no server): structured-output options, completion
prompts (one or a batch) and echoed logprobs."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from deploy.errors import APIError
from deploy.ingress import structured
from deploy.ingress.logprobs import (
    completion_logprobs,
    echo_logprobs,
    joined_logprobs,
    prompt_logprobs,
)
from deploy.protocol import ChatCompletionRequest, CompletionRequest
from model.grammar import GrammarError, Grammars, GrammarSpec, GrammarState, GrammarVocab
from model.sampling_params import TokenLogprob

MSGS = [{"role": "user", "content": "x"}]
LIMIT = 65536  # Limits.max_grammar_bytes
BYTES = Grammars(GrammarVocab(tuple(bytes([i]) for i in range(256)) + (b"",)), 257, [256])  # a token per byte
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _tools(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def test_a_named_function_is_generated_under_its_parameters_schema():
    req = ChatCompletionRequest(model="m", messages=MSGS, tools=_tools(CITY),
                                tool_choice={"type": "function", "function": {"name": "f"}})
    assert req.forced_function() == "f"
    spec = structured.forced_grammar(req, "f", LIMIT)
    assert spec.kind == "json_schema" and json.loads(spec.source) == CITY
    # a schema the grammar cannot enforce: the arguments are still one JSON object
    loose = ChatCompletionRequest(model="m", messages=MSGS, tools=_tools({"type": "object", "not": {"type": "object"}}),
                                  tool_choice={"type": "function", "function": {"name": "f"}})
    assert structured.forced_grammar(loose, "f", LIMIT).kind == "json_object"


def test_response_formats():
    def spec(fmt, **body):
        return structured.grammar(ChatCompletionRequest(model="m", messages=MSGS, response_format=fmt, **body), LIMIT)

    assert spec(None) is None and spec({"type": "text"}) is None
    assert spec({"type": "json_object"}).kind == "json_object"
    got = spec({"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}})
    assert got.kind == "json_schema" and json.loads(got.source) == CITY
    # vLLM's structured outputs, and its older guided_* fields
    assert spec(None, structured_outputs={"choice": ["a", "b"]}).choices == ("a", "b")
    assert spec(None, structured_outputs={"regex": "[0-9]+"}).source == "[0-9]+"
    assert spec(None, guided_grammar='root ::= "x"').kind == "grammar"
    assert spec(None, structured_outputs={"json": CITY, "disable_any_whitespace": False}).any_whitespace
    for bad, body, needle in (
            ({"type": "json_schema"}, {}, "needs json_schema"), ({"type": "yaml"}, {}, "'yaml' is not supported"),
            ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}, {}, "#/x"),
            ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "not": {}}}}, {}, "'not'"),
            ({"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 70000]}}}, {}, "over the limit"),
            ({"type": "json_object"}, {"guided_regex": "a"}, "not both"),
            (None, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "take one of"),
            (None, {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs regex"),
            (None, {"guided_grammar": "root ::= undefined_rule"}, "structured_outputs grammar"),
            (None, {"structured_outputs": {"choice": []}}, "a list of texts"),
            (None, {"structured_outputs": {"yaml": "x"}}, "'yaml' is not supported")):
        with pytest.raises(APIError) as e:
            spec(bad, **body)
        assert e.value.status == 400 and needle in e.value.message, e.value.message


@pytest.mark.parametrize(("prompt", "prompts"), [
    ("one", ["one"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]])])
def test_a_completion_prompt_is_one_or_a_batch(prompt, prompts):
    assert CompletionRequest(model="m", prompt=prompt).prompts() == prompts


@pytest.mark.parametrize(("prompt", "needle"), [
    ("", "must not be empty"), ([], "must not be empty"), (["a", ""], "prompt 1 of the batch is empty"),
    ([[1], []], "prompt 1 of the batch is empty"), ([1, "a"], "prompt")])
def test_an_empty_or_mixed_completion_prompt_is_refused(prompt, needle):
    with pytest.raises(ValidationError, match=needle):
        CompletionRequest(model="m", prompt=prompt)


def test_echo_with_max_tokens_zero_scores_the_prompt_only():
    assert CompletionRequest(model="m", prompt="x", echo=True, max_tokens=0).scores_only()
    assert not CompletionRequest(model="m", prompt="x", echo=True, max_tokens=1).scores_only()
    assert not CompletionRequest(model="m", prompt="x", echo=True).scores_only()
    assert not CompletionRequest(model="m", prompt="x", max_tokens=0).scores_only()


def test_alternatives_with_the_same_text_keep_the_likelier_ones_logprob():
    text = {0: "", 1: "", 2: "a"}.__getitem__  # two special tokens, both without text
    lp = completion_logprobs([TokenLogprob(2, -0.2, ((0, -1.0), (2, -0.2), (1, -2.0)))], text)
    assert lp["top_logprobs"] == [{"": -1.0, "a": -0.2}]


def test_echoed_logprobs_score_every_prompt_token_but_the_first_and_join_the_completions():
    text = {1: "ab", 2: "c", 3: "", 4: "de"}.__getitem__
    scored = [None, TokenLogprob(2, -0.5, ((2, -0.5), (4, -1.0), (1, -3.0)), rank=1), TokenLogprob(3, -2.0, rank=4)]
    prompt = echo_logprobs([1, 2, 3], scored, 2, text)  # the engine scored 3 alternatives, echo asked 2
    assert prompt == {"tokens": ["ab", "c", ""], "token_logprobs": [None, -0.5, -2.0],
                      "top_logprobs": [None, {"c": -0.5, "de": -1.0}, {}], "text_offset": [0, 2, 3]}
    after = completion_logprobs([TokenLogprob(4, -0.1)], text, 3)
    assert joined_logprobs(prompt, after) == {"tokens": ["ab", "c", "", "de"], "token_logprobs": [None, -0.5, -2.0, -0.1],
                                              "top_logprobs": [None, {"c": -0.5, "de": -1.0}, {}, {}],
                                              "text_offset": [0, 2, 3, 3]}
    # vLLM's prompt_logprobs: the token and the k most likely there, by token id (the second
    # position's token is its most likely; the third's has no alternatives scored)
    assert prompt_logprobs([1, 2, 3], scored, 1, text) == [
        None, {"2": {"logprob": -0.5, "rank": 1, "decoded_token": "c"}},
        {"3": {"logprob": -2.0, "rank": 4, "decoded_token": ""}}]


def _accepts(spec: GrammarSpec, value) -> bool:
    """Whether ``value``'s JSON text (a token per byte) is a whole output of ``spec``."""
    state = GrammarState(BYTES.matcher(spec), BYTES)
    try:
        for b in json.dumps(value).encode():
            state.feed(b)
    except GrammarError:
        return False
    return state.matcher.is_completed()


def test_tool_choice_required_is_a_schema_of_one_call_of_any_tool():
    """The call's schema holds each tool's parameters, their own $defs and recursive $refs moved
    under the tool's name; a tool without parameters, or with ones this server cannot enforce,
    takes any JSON object."""
    tree = {"type": "object", "properties": {"label": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}},
                                             "tag": {"$ref": "#/$defs/Tag"}},
            "required": ["label"], "additionalProperties": False,
            "$defs": {"Tag": {"type": "object", "properties": {"v": {"enum": ["a", "b"]}}, "required": ["v"],
                              "additionalProperties": False}}}
    tools = [{"type": "function", "function": {"name": "plant", "parameters": tree}},
             {"type": "function", "function": {"name": "ping"}},
             {"type": "function", "function": {"name": "match", "parameters": {
                 "type": "object", "properties": {"re": {"type": "string", "pattern": "^a"}}}}},
             {"type": "function", "function": {"name": "loose", "parameters": {"type": "object", "not": {}}}}]
    spec = structured.required_grammar(ChatCompletionRequest(model="m", messages=MSGS, tools=tools, tool_choice="required"), LIMIT)
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(spec.source))
    good = [{"plant": {"label": "x", "kids": [{"label": "y", "tag": {"v": "a"}}]}}, {"ping": {}},
            {"ping": {"any": [1]}}, {"match": {"re": "a"}}, {"loose": {"x": None}}]
    bad = [{}, {"plant": {"label": "x"}, "ping": {}}, {"plant": {"kids": []}}, {"other": {}}, {"match": {"re": "zzz"}},
           {"plant": {"label": "x", "kids": [{"label": "y", "tag": {"v": "c"}}]}}]
    for value in good:
        assert validator.is_valid(value) and _accepts(spec, value), value
    for value in bad:
        assert not validator.is_valid(value) and not _accepts(spec, value), value
    assert structured.required_grammar(ChatCompletionRequest(model="m", messages=MSGS, tools=tools), LIMIT) is None
    with pytest.raises(APIError, match="needs tools"):
        structured.required_grammar(ChatCompletionRequest(model="m", messages=MSGS, tool_choice="required"), LIMIT)
