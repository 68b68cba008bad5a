"""JSON mode's grammar against Python's own JSON parser, and its token masks against the grammar."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from model.structured import JSON_START, MAX_WHITESPACE_RUN, JsonMasks, json_advance, json_done

VALID = [
    '{}', '{"a": 1}', '{"a":-0.5e+3,"b":[true,false,null,{}],"c":{"d":[]}}', '{"k":"\\u00e9\\n\\"x\\"\\\\"}',
    '{"n":[0,1e5,12.25,-3E-2,[[]]]}', '{"a":' + ' ' * 16 + '1}', '{\n\t"deep": [[[[{"x": [1, [2, [3]]]}]]]]\r\n}', '{"é": "ça va"}',
]
INVALID = ['[1]', '"a"', '1', '{"a" 1}', '{"a":01}', '{"a":tru}', '{"a":"\x01"}', '{,}', '{"a":1,}',
           '{"a":[1,]}', '{"a":1}}', '{"a":"\\x"}', '{"a":1} ', '{"a":-}', '{"a":1.}', '{"a":1e}', '{a:1}',
           '{"a":[}', '{"a":"\\u12g4"}', '{"a":.5}',
           ' {}', '{"a":' + ' ' * (MAX_WHITESPACE_RUN + 1) + '1}']
INVALID_BYTES = [b'{"a":"\xc3"}', b'{"a":"\xff"}', b'{"a":"\xe2\x82"}', b'{"\xa9":1}', b'{"a":\xc3\xa9}']


def _accepts(text: str) -> bool:
    return json_done(json_advance(JSON_START, text.encode()))


def _python_accepts(text: str) -> bool:
    """A complete JSON object that starts the text, with nothing after it and no whitespace run
    longer than JSON mode allows (Python allows those, and NaN)."""
    too_long = re.compile(f"[ \t\n\r]{{{MAX_WHITESPACE_RUN + 1}}}")
    if text[:1].isspace() or text != text.rstrip(" \t\n\r") or too_long.search(text):
        return False
    try:
        return isinstance(json.loads(text, parse_constant=lambda c: 1 / 0), dict)
    except (ValueError, ZeroDivisionError):
        return False


@pytest.mark.parametrize("text", VALID)
def test_valid_objects_and_every_prefix_are_accepted(text):
    assert _accepts(text)
    data = text.encode()
    assert all(json_advance(JSON_START, data[:i]) is not None for i in range(len(data)))
    assert not any(json_done(json_advance(JSON_START, data[:i])) for i in range(len(data)))


@pytest.mark.parametrize("text", INVALID)
def test_invalid_texts_are_refused(text):
    assert not _accepts(text) and not _python_accepts(text)


@pytest.mark.parametrize("data", INVALID_BYTES)
def test_strings_hold_whole_utf8_characters_only(data):
    assert not json_done(json_advance(JSON_START, data))
    assert json_done(json_advance(JSON_START, '{"a":"é€😀"}'.encode()))


def test_the_grammar_agrees_with_pythons_json_on_mutated_objects():
    rng = random.Random(0)
    alphabet = '{}[]":,-+.eE0123456789 \\"unltrfasxb\n' + " " * 8
    checked = 0
    for _ in range(4000):
        text = rng.choice(VALID)
        for _ in range(rng.randint(1, 3)):  # replace, insert or delete a character
            at, op = rng.randrange(len(text) + 1), rng.randrange(3)
            c = rng.choice(alphabet)
            text = (text[:at] + c + text[at + 1:], text[:at] + c + text[at:], text[:at] + text[at + 1:])[op]
        assert _accepts(text) == _python_accepts(text), text
        checked += _python_accepts(text)
    assert checked > 50  # the mutations kept some objects valid


def _vocab() -> list[bytes]:
    """Single bytes (as byte-level tokenizers have) and the multi-byte tokens that make masks
    interesting: several closers in one token, a quote inside, a whole key, a special token."""
    multi = [b'"}', b"}}", b"]}", b"}]}", b'":', b' {"', b"0.5", b"true", b'", "', b"abc", b'"a"', b"\\n", b"\xc3\xa9",
             b"}}}}", b"1,2", b""]
    return [bytes([i]) for i in range(256)] + multi


def test_masks_are_the_grammar_for_every_state_also_deep_in_the_stack():
    vocab = _vocab()
    masks = JsonMasks(lambda i: vocab[i], len(vocab))
    rng = random.Random(1)
    states = {JSON_START}
    for _ in range(300):  # random walks through allowed tokens reach deep and shallow stacks
        state = JSON_START
        for _ in range(rng.randint(1, 80)):
            if json_done(state):
                break
            ids = masks.allowed(state).nonzero().flatten().tolist()
            opens = [i for i in ids if vocab[i] in (b"[", b"{")]
            state = masks.advance(state, rng.choice(opens if opens and rng.random() < 0.5 else ids))
            states.add(state)
    assert max(len(s[2]) for s in states) >= 6
    for state in states:
        if json_done(state):
            continue
        want = [json_advance(state, t) is not None for t in vocab]
        want[-1] = False  # the special token (no bytes) is never allowed
        assert masks.allowed(state).tolist() == want, state


def test_sampling_under_the_masks_ends_in_valid_json():
    vocab = _vocab()
    masks = JsonMasks(lambda i: vocab[i], len(vocab))
    gen = torch.Generator().manual_seed(0)
    closers = torch.zeros(len(vocab))
    for t in (b"}", b"]", b'"', b"}}", b'"}', b"1", b","):
        closers[vocab.index(t)] = 6.0  # a tilted random model, so outputs end
    done = 0
    for _ in range(20):
        state, out = JSON_START, b""
        for _ in range(400):
            logits = masks.apply((torch.randn(1, len(vocab), generator=gen) + closers), [0], [state])
            tok = int(torch.multinomial(logits.softmax(-1)[0], 1, generator=gen))
            state, out = masks.advance(state, tok), out + vocab[tok]
            assert state is not None, out
            if json_done(state):
                break
        if json_done(state):
            done += 1
            assert isinstance(json.loads(out.decode("utf-8")), dict), out  # whole characters, too
    assert done >= 15


@pytest.mark.security
def test_masks_of_every_grammar_share_one_byte_budget_and_never_mix():
    from model.json_schema import SchemaGrammar

    vocab = _vocab()
    masks = JsonMasks(lambda i: vocab[i], len(vocab), budget_bytes=40 * len(vocab))  # room for 40 masks
    grammars = [masks] + [masks.for_grammar(SchemaGrammar({"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                                            "required": [f"k{i}"]})) for i in range(8)]
    rng = random.Random(2)
    for _ in range(200):  # random walks of every grammar, each mask checked against its own grammar
        m = rng.choice(grammars)
        state = m.grammar.start
        for _ in range(rng.randint(1, 12)):
            if m.done(state):
                break
            allowed = m.allowed(state)
            want = [m._advance(state, t) is not None if t else False for t in vocab]
            assert allowed.tolist() == want
            state = m.advance(state, rng.choice(allowed.nonzero().flatten().tolist()))
        assert masks.cache.bytes <= 40 * len(vocab) and masks.cached_states <= 40
