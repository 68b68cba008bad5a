"""JSON mode with a schema: the grammar against the schema's own validator (``jsonschema``), and
its token masks against the grammar."""

from __future__ import annotations

import json

import pytest
import torch

from model.json_schema import SchemaError, SchemaGrammar
from model.structured import JsonMasks

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "re"]}},
        "where": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": ["string", "null"]}},
                  "required": ["city"], "additionalProperties": False},
        "ok": {"type": "boolean"},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
        "any": {},
        "kind": {"const": "v1"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
VALID = [
    {"name": "x", "age": 3},
    {"age": -12, "name": "é\"q", "tags": ["red", "re", "green"], "ok": True},
    {"name": "", "age": 0, "where": {"city": "Oslo", "zip": None}, "score": -1.5e3, "kind": "v1"},
    {"name": "n", "age": 7, "extra": {"a": 1, "b": 22}, "any": [1, {"x": [None, "y"]}], "score": None},
    {"name": "n", "age": 7, "where": {"zip": "0150", "city": "Oslo"}, "tags": []},
]
INVALID = ['{"name": "x"}', '{"age": 1}', '{"name": "x", "age": 1.5}', '{"name": "x", "age": "1"}',
           '{"name": "x", "age": 1, "name": "y"}', '{"name": "x", "age": 1, "other": 1}', '{"name": 1, "age": 1}',
           '{"name": "x", "age": 1, "tags": ["blue"]}', '{"name": "x", "age": 1, "where": {}}',
           '{"name": "x", "age": 1, "kind": "v2"}', '{"name": "x", "age": 1, "extra": {"a": "s"}}',
           '{"name": "x", "age": 1, "ok": 1}', '{"name": "x", "age": 1} ', ' {"name": "x", "age": 1}', '[]',
           '{"name": "x", "age": 01}', '{"name": "x", "age": 1, "tags": ["re", ]}']


def _accepts(grammar: SchemaGrammar, text: str) -> bool:
    state = grammar.start
    for b in text.encode():
        state = grammar.step(state, b)
        if state is None:
            return False
    return grammar.done(state)


@pytest.mark.parametrize("value", VALID)
@pytest.mark.parametrize("indent", [None, 2])
def test_valid_values_and_every_prefix_are_accepted(value, indent):
    jsonschema.validate(value, SCHEMA)
    grammar = SchemaGrammar(SCHEMA)
    text = json.dumps(value, ensure_ascii=False, indent=indent)
    assert _accepts(grammar, text)
    state = grammar.start
    for b in text.encode()[:-1]:
        state = grammar.step(state, b)
        assert state is not None and not grammar.done(state)


@pytest.mark.parametrize("text", INVALID)
def test_values_the_schema_refuses_are_refused(text):
    assert not _accepts(SchemaGrammar(SCHEMA), text)


def _vocab() -> list[bytes]:
    multi = [b'"name"', b'"age":', b'": "', b'", "', b"true", b"null", b"12", b"-3", b".5", b"e2", b'"red"', b'"re',
             b"en", b'"],', b"}}", b"]}", b'"where": {"city": "', b'"', b"v1", b'"kind"', b"\xc3\xa9", b""]
    return [bytes([i]) for i in range(256)] + multi


def test_sampled_outputs_under_the_masks_are_valid_and_masks_are_the_grammar():
    vocab = _vocab()
    grammar = SchemaGrammar(SCHEMA)
    masks = JsonMasks(lambda i: vocab[i], len(vocab)).for_grammar(grammar)
    gen = torch.Generator().manual_seed(0)
    tilt = torch.zeros(len(vocab))
    for t in (b"}", b"]", b'"', b",", b"1", b'"age":', b'"name"', b"}}"):
        tilt[vocab.index(t)] = 5.0  # so outputs end
    states, done = set(), 0
    for _ in range(40):
        state, out = grammar.start, b""
        for _ in range(300):
            states.add(state)
            logits = masks.apply(torch.randn(1, len(vocab), generator=gen) + tilt, [0], [state])
            tok = int(torch.multinomial(logits.softmax(-1)[0], 1, generator=gen))
            state, out = masks.advance(state, tok), out + vocab[tok]
            assert state is not None, out
            if masks.done(state):
                break
        if masks.done(state):
            done += 1
            jsonschema.validate(json.loads(out.decode("utf-8")), SCHEMA)
    assert done >= 30
    for state in list(states)[:300]:
        want = []
        for t in vocab:
            s = state
            for b in t:
                s = grammar.step(s, b) if s is not None else None
            want.append(s is not None and bool(t))
        assert masks.allowed(state).tolist() == want


ONE_OF_TWO = {"type": "object", "minProperties": 1, "maxProperties": 1, "properties": {
    "f": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}, "g": {"type": "string"}}}
TWO_WITH_A = {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "required": ["a"], "maxProperties": 2}


@pytest.mark.parametrize(("schema", "text", "valid"), [
    (ONE_OF_TWO, '{"f": {"x": 1}}', True), (ONE_OF_TWO, '{"g": "s"}', True), (ONE_OF_TWO, "{}", False),
    (ONE_OF_TWO, '{"f": {"x": 1}, "g": "s"}', False), (ONE_OF_TWO, '{"f": "s"}', False),
    (TWO_WITH_A, '{"a": 1}', True), (TWO_WITH_A, '{"c": 1, "a": 2}', True), (TWO_WITH_A, '{"a": 1, "b": 2, "c": 3}', False),
    (TWO_WITH_A, '{"b": 1, "c": 2}', False), (TWO_WITH_A, '{"b": 1}', False)])
def test_how_many_properties_an_object_has(schema, text, valid):
    assert _accepts(SchemaGrammar(schema), text) == valid
    assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) == valid


def test_past_the_room_that_required_keys_need_only_they_may_follow():
    """Two keys at most, one of them "a": after "b" the next key can only be "a" (no dead end
    where the object may neither close nor go on)."""
    grammar, state = SchemaGrammar(TWO_WITH_A), None
    for prefix, ok in (('{"b": 1, "a', True), ('{"b": 1, "c', False), ('{"b": 1}', False)):
        state = grammar.start
        for b in prefix.encode():
            state = state and grammar.step(state, b)
        assert (state is not None) == ok, prefix


@pytest.mark.parametrize("schema, needle", [
    ({"type": "object", "minProperties": 1}, "only beside properties"),
    ({"type": "object", "properties": {"a": {}}, "minProperties": 2}, "no object has 2..1"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1},
     "no object has 0..1"),
    ({"type": "object", "properties": {"a": {}}, "maxProperties": -1}, "maxProperties must be a non-negative"),

    ({"type": "string", "pattern": "^a"}, "'pattern'"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 2}}}, "$.properties.a: 'minLength'"),
    ({"$ref": "#/$defs/x"}, "names no definition"),
    ({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}, "only '#' and '#/$defs/NAME'"),
    ({"anyOf": [{"type": "integer"}, {"type": "number"}]}, "must start differently"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required names ['b']"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True}, "additionalProperties beside"),
    ({"type": "date"}, "unknown type 'date'"),
    ({"enum": [{"a": 1}]}, "enum/const"),
    ({"type": "integer"}, "a number at the top level never ends"),
    ({}, "a number at the top level"),
])
def test_schemas_it_cannot_enforce_are_refused_by_name(schema, needle):
    with pytest.raises(SchemaError) as e:
        SchemaGrammar(schema)
    assert needle in str(e.value)


@pytest.mark.security
def test_a_schema_past_the_complexity_budget_is_a_schema_error_not_a_crash():
    """A 5 KB anyOf nested 400 deep was a RecursionError (a 500); now a SchemaError (a 400)."""
    from model.json_schema import MAX_DEPTH, MAX_NODES, SchemaError, SchemaGrammar

    deep: dict = {"type": "string"}
    for _ in range(400):
        deep = {"anyOf": [deep]}
    with pytest.raises(SchemaError, match="nested more than"):
        SchemaGrammar({"type": "object", "properties": {"a": deep}})
    ok: dict = {"type": "string"}
    for _ in range(MAX_DEPTH - 1):
        ok = {"type": "array", "items": ok}
    SchemaGrammar(ok)  # at the limit: fine
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_NODES + 1)}}
    with pytest.raises(SchemaError, match="parts"):
        SchemaGrammar(wide)



def test_pydantic_schemas_with_defs_and_recursive_refs():
    """What Pydantic models give (``$defs`` and ``$ref``; a model that contains itself is
    expanded a few levels deep): valid values are accepted, invalid ones refused."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        sunny: bool

    class Forecast(BaseModel):
        city: City
        next: list[City]

    schema = Forecast.model_json_schema()
    assert "$defs" in schema
    grammar = SchemaGrammar(schema)
    good = {"city": {"name": "Paris", "sunny": True}, "next": [{"name": "Lyon", "sunny": False}]}
    jsonschema.validate(good, schema)
    assert _accepts(grammar, json.dumps(good))
    assert not _accepts(grammar, json.dumps({"city": {"name": "Paris"}, "next": []}))  # sunny is required

    class Node(BaseModel):
        label: str
        children: list[Node]

    tree = Node.model_json_schema()
    grammar = SchemaGrammar(tree)
    value = {"label": "a", "children": [{"label": "b", "children": [{"label": "c", "children": []}]}]}
    jsonschema.validate(value, tree)
    assert _accepts(grammar, json.dumps(value))
    assert not _accepts(grammar, json.dumps({"label": "a", "children": [{"label": 1, "children": []}]}))
