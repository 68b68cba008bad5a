"""A choice among fixed texts: the grammar, and its token masks over a vocabulary."""

from __future__ import annotations

import pytest
import torch

from model.choice import ChoiceError, ChoiceGrammar
from model.structured import JsonMasks

CHOICES = ["positive", "negative", "neutral", "né"]


def _walk(grammar: ChoiceGrammar, text: str):
    state = grammar.start
    for b in text.encode():
        state = grammar.step(state, b) if state is not None else None
    return state


def test_exactly_the_choices_are_whole_and_nothing_else_goes_on():
    grammar = ChoiceGrammar(CHOICES)
    for text in CHOICES:
        assert grammar.done(_walk(grammar, text))
        assert all(grammar.step(_walk(grammar, text), b) is None for b in range(256))  # nothing after a choice
    for text in ("pos", "ne", "n"):
        state = _walk(grammar, text)
        assert state is not None and not grammar.done(state)
    for text in ("positives", "x", "neg ", "Positive"):
        assert _walk(grammar, text) is None


@pytest.mark.parametrize(("choices", "needle"), [
    ([], "give 1 to"), (["a", ""], "1 to 1024 bytes"), (["yes", "yes!"], "'yes' is the beginning of 'yes!'"),
    (["b", "a", "ab"], "'a' is the beginning of 'ab'")])
def test_lists_it_cannot_choose_among_are_refused(choices, needle):
    with pytest.raises(ChoiceError, match=needle):
        ChoiceGrammar(choices)


def test_sampled_outputs_under_the_masks_are_one_of_the_choices():
    vocab = [bytes([i]) for i in range(256)] + [b"pos", b"itive", b"neg", b"ne", b"utral", b"tral", b"n\xc3\xa9", b"x"]
    masks = JsonMasks(lambda i: vocab[i], len(vocab)).for_grammar(ChoiceGrammar(CHOICES))
    gen = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(60):
        state, out = masks.grammar.start, b""
        while not masks.done(state):
            logits = masks.apply(torch.randn(1, len(vocab), generator=gen), [0], [state])
            tok = int(torch.multinomial(logits.softmax(-1)[0], 1, generator=gen))
            state, out = masks.advance(state, tok), out + vocab[tok]
        seen.add(out.decode())
    assert seen == set(CHOICES)
