"""Request bodies as the ingress reads them (no server): structured-output options."""

from __future__ import annotations

import json

import pytest

from deploy.protocol import APIError, ChatCompletionRequest

MSGS = [{"role": "user", "content": "x"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _tools(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def test_a_named_function_is_generated_under_its_parameters_schema():
    req = ChatCompletionRequest(model="m", messages=MSGS, tools=_tools(CITY),
                                tool_choice={"type": "function", "function": {"name": "f"}})
    assert req.forced_function() == "f" and json.loads(req.forced_parameters("f")) == CITY
    # a schema the grammar cannot enforce: the arguments are still one JSON object
    loose = ChatCompletionRequest(model="m", messages=MSGS, tools=_tools({"type": "string", "pattern": "a"}),
                                  tool_choice={"type": "function", "function": {"name": "f"}})
    assert loose.forced_parameters("f") is None


def test_response_formats():
    def mode(fmt):
        return ChatCompletionRequest(model="m", messages=MSGS, response_format=fmt).json_mode()

    assert mode(None) == {"response_format": None, "json_schema": None}
    assert mode({"type": "json_object"}) == {"response_format": "json_object", "json_schema": None}
    got = mode({"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}})
    assert got["response_format"] == "json_schema" and json.loads(got["json_schema"]) == CITY
    for bad, needle in (({"type": "json_schema"}, "needs json_schema"), ({"type": "yaml"}, "'yaml' is not supported"),
                        ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}, "$ref '#/x' is not supported")):
        with pytest.raises(APIError) as e:
            mode(bad)
        assert e.value.status == 400 and needle in e.value.message
