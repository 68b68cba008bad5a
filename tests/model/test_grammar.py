"""Structured output's grammars (``model.grammar``, on xgrammar): what each kind lets a sampled
output be, checked against the format's own judge (``json``, ``jsonschema``, ``re``), and the
masks against the grammar token by token."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from model.grammar import (
    MAX_WHITESPACE_RUN,
    GrammarError,
    Grammars,
    GrammarSpec,
    GrammarState,
    GrammarVocab,
    apply_masks,
    unpack,
)

jsonschema = pytest.importorskip("jsonschema")

EOS = 256
# every byte, EOS, and pieces of JSON and text (a BPE vocabulary's shape, small)
PIECES = [bytes([i]) for i in range(256)] + [b""] + [p.encode() for p in (
    '{"', '":', '", "', '": ', ', ', '{}', '[]', 'true', 'false', 'null', '123', '0.5', 'name', 'age', 'red', 'green',
    'é', '\\"', '\\u00e9', '  ', '\n', ' "', 'yes', 'no', 'maybe', '"}', '"]', '}]', '], ', '-1', 'e5')]
VOCAB = GrammarVocab(tuple(PIECES))
V = len(PIECES) + 7  # the model's vocabulary is padded past the tokenizer's


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(VOCAB, V, [EOS])


def _sample(grammars: Grammars, spec: GrammarSpec, seed: int, max_tokens: int = 200) -> tuple[bytes, bool]:
    """An output sampled from random logits under ``spec``'s masks: its bytes, and whether it
    ended as a whole output (its state done, or EOS)."""
    gen = torch.Generator().manual_seed(seed)
    state = GrammarState(grammars.matcher(spec), grammars)
    out = b""
    for _ in range(max_tokens):
        logits = apply_masks(torch.randn(1, V, generator=gen) * 3, [0], [state])
        tok = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        if tok == EOS:
            return out, state.matcher.is_completed()
        state.feed(tok)
        out += PIECES[tok]
        if state.done():
            return out, True
    return out, False


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "re"]}, "maxItems": 3},
        "where": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                  "additionalProperties": False},
        "ok": {"type": "boolean"},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "kind": {"const": "v1"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_objects_sampled_under_the_masks_parse_and_are_compact(grammars):
    """json_object: every output that ends is one JSON object, and its only whitespace is the
    separators' (", " and ": "), so a model cannot spend its tokens on blank runs."""
    ended = 0
    for seed in range(24):
        text, whole = _sample(grammars, GrammarSpec("json_object"), seed)
        if not whole:
            continue
        ended += 1
        assert isinstance(json.loads(text), dict)
        outside = re.sub(rb'"(\\.|[^"\\])*"', b'""', text)  # whitespace inside strings is the value's
        assert [m.start() for m in re.finditer(rb"\s", outside)] == [m.start() + 1 for m in re.finditer(rb"[:,] ", outside)]
    assert ended >= 12


def test_with_any_whitespace_runs_are_bounded(grammars):
    spec = GrammarSpec("json_object", any_whitespace=True)
    for seed in range(12):
        text, whole = _sample(grammars, spec, seed)
        if whole:
            json.loads(text)
        outside = re.sub(rb'"(\\.|[^"\\])*"', b'""', text)  # whitespace inside strings is the value's
        assert all(len(run) <= MAX_WHITESPACE_RUN for run in re.findall(rb"[ \t\n\r]+", outside)), text


def test_schema_outputs_validate_against_the_schema(grammars):
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    ended = 0
    for seed in range(24):
        text, whole = _sample(grammars, spec, seed, max_tokens=300)
        if whole:
            ended += 1
            jsonschema.validate(json.loads(text), SCHEMA)
    assert ended >= 8


def test_pydantic_schemas_with_defs_and_recursive_refs(grammars):
    from pydantic import BaseModel

    class Node(BaseModel):
        label: str
        children: list[Node]

    schema = Node.model_json_schema()
    assert "$defs" in schema or "$ref" in json.dumps(schema)
    spec = GrammarSpec("json_schema", json.dumps(schema))
    good = {"label": "a", "children": [{"label": "b", "children": []}]}
    assert _accepts(grammars, spec, json.dumps(good).encode())
    assert not _accepts(grammars, spec, json.dumps({"label": 1, "children": []}).encode())


def _accepts(grammars: Grammars, spec: GrammarSpec, text: bytes) -> bool:
    """Whether ``text`` (a token per byte) is a whole output of ``spec``."""
    state = GrammarState(grammars.matcher(spec), grammars)
    for b in text:
        try:
            state.feed(b)
        except GrammarError:
            return False
    return state.matcher.is_completed()


def test_schemas_are_strict_where_they_list_properties(grammars):
    """As vLLM's and OpenAI's structured outputs: listed properties and no others unless the
    schema allows them; an object schema that lists none takes any object."""
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    assert _accepts(grammars, GrammarSpec("json_schema", json.dumps(person)), b'{"name": "Ann", "age": 30}')
    assert not _accepts(grammars, GrammarSpec("json_schema", json.dumps(person)), b'{"name": "Ann", "age": 30, "x": 1}')
    open_ = {**person, "additionalProperties": True}
    assert _accepts(grammars, GrammarSpec("json_schema", json.dumps(open_)), b'{"name": "Ann", "age": 30, "x": 1}')
    assert _accepts(grammars, GrammarSpec("json_schema", '{"type": "object"}'), b'{"x": [1]}')
    assert not _accepts(grammars, GrammarSpec("json_schema", '{"prefixItems": [{"type": "integer"}]}'), b"[1, 2]")


def test_a_grammar_that_matches_nothing_is_refused_and_a_dead_end_fails_clearly(grammars):
    with pytest.raises(GrammarError, match="matches no output"):
        GrammarSpec("grammar", "root ::= root root").check()
    dead_end = GrammarSpec("grammar", 'root ::= "a" x\nx ::= x')
    dead_end.check()  # "a" starts an output; only after it does no rule go on
    state = grammars.state(dead_end)
    state.feed(ord("a"))
    logits = apply_masks(torch.zeros(1, V), [0], [state])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]  # only the stop token is left
    with pytest.raises(GrammarError, match="allows no token here"):
        state.feed(EOS)


def test_choices_regexes_and_ebnf_give_exactly_what_they_match(grammars):
    """A choice is one of the texts; a text that another goes on from ("yes" of "yes!") is
    whole only where the model ends it; a regex or EBNF output matches it whole."""
    choices = ("yes", "yes!", "no", 'a "quoted" é\n')
    seen = set()
    for seed in range(40):
        text, whole = _sample(grammars, GrammarSpec("choice", choices=choices), seed)
        assert whole and text.decode() in choices, text
        seen.add(text.decode())
    assert {"yes", "yes!"} <= seen
    state = GrammarState(grammars.matcher(GrammarSpec("choice", choices=("yes", "yes!"))), grammars)
    for b in b"yes":
        state.feed(b)
    assert state.matcher.is_completed() and not state.done()  # "!" may still come
    state.feed(ord("!"))
    assert state.done()
    for seed in range(12):
        text, whole = _sample(grammars, GrammarSpec("regex", r"[a-z]{2,5}@(tide|ebb)\.com"), seed)
        assert whole and re.fullmatch(rb"[a-z]{2,5}@(tide|ebb)\.com", text), text
        text, whole = _sample(grammars, GrammarSpec("grammar", 'root ::= "(" [0-9]+ ")" | "none"'), seed)
        assert whole and re.fullmatch(rb"\([0-9]+\)|none", text), text


def test_masks_are_the_grammar_token_by_token(grammars):
    """At every state a sampled output passes through, a token is unmasked exactly when the
    matcher accepts it (so the bitmask unpacking and the CPU mask agree with xgrammar)."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    rng = random.Random(0)
    state = GrammarState(grammars.matcher(spec), grammars)
    for _ in range(40):
        allowed = unpack(state.mask()[0], V)
        masked = apply_masks(torch.zeros(2, V), [1], [state])
        assert torch.equal(masked[1] == 0, allowed) and not masked[0].isinf().any()
        for tok in range(V):
            if tok == EOS or not PIECES[tok:tok + 1] or not (PIECES + [b""] * 7)[tok]:
                assert tok == EOS or not allowed[tok]
                continue
            ok = state.matcher.accept_token(tok)
            if ok:
                state.matcher.rollback(1)
            assert ok == bool(allowed[tok]), (tok, PIECES[tok])
        choices = [t for t in range(V) if allowed[t] and t != EOS]
        if not choices:
            break
        state.feed(rng.choice(choices))


@pytest.mark.parametrize("spec, needle", [
    (GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})),
     "'not'"),
    (GrammarSpec("json_schema", json.dumps({"$defs": {"x": {"type": "array", "uniqueItems": True}}})), "'uniqueItems'"),
    (GrammarSpec("json_schema", json.dumps({"allOf": [{"type": "integer"}, {"minimum": 5}]})), "'allOf'"),
    (GrammarSpec("json_schema", json.dumps({"if": {"type": "string"}, "then": {"maxLength": 1}})), "'if'"),
    (GrammarSpec("json_schema", json.dumps({"type": "date"})), 'Unsupported type "date"'),
    (GrammarSpec("json_schema", json.dumps({"$ref": "#/$defs/x"})), "#/$defs/x"),
    (GrammarSpec("json_schema", json.dumps({"type": "integer", "minimum": 3, "maximum": 2})), "minimum greater"),
    (GrammarSpec("json_schema", "{not json"), "not JSON"),
    (GrammarSpec("regex", "(ab"), "parenthesis"),
    (GrammarSpec("grammar", 'root ::= "a" | b'), 'Rule "b" is not defined'),
    (GrammarSpec("choice", choices=("a", "")), "non-empty"),
])
def test_grammars_it_cannot_enforce_are_refused_by_name(spec, needle):
    with pytest.raises(GrammarError) as e:
        spec.check()
    assert needle in str(e.value) and "/project/" not in str(e.value)


def test_an_enum_keyword_name_inside_a_value_is_not_a_keyword():
    """'not' as a property's name, or inside an enum or const value, is data, not a keyword."""
    GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"not": {"enum": [{"if": 1}]}}})).check()


def test_a_byte_level_bpe_vocabulary_is_read_as_its_bytes(tmp_path):
    """DeepSeek's tokenizer stores pieces in GPT-2's byte-to-character map ("Ġ" for a space):
    the grammar reads them as bytes, and special tokens are never allowed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from model.tokenizer import HFTokenizer

    vocab = {"<s>": 0, "</s>": 1, "{": 2, "}": 3, '"': 4, "a": 5, ":": 6, "Ġ": 7, "1": 8, ",": 9, "Ġ1": 10}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    hf = HFTokenizer(tmp_path)
    gv = hf.grammar_vocab()
    assert gv.kind == "byte_level" and gv.tokens[0] == "" and gv.tokens[10] == "Ġ1"
    g = Grammars(gv, 16, [1])
    state = GrammarState(g.matcher(GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}))), g)
    for t in (2, 4, 5, 4, 6, 10, 3):  # {"a": 1}: the space is in "Ġ1"
        state.feed(t)
    assert state.done()
    assert not unpack(GrammarState(g.matcher(GrammarSpec("json_object")), g).mask()[0], 16)[[0, 1]].any()
