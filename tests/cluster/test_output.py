"""``TextStream`` (incremental detokenization, stop strings in a bounded window) against
decoding the whole output at every step, as the engine did: the same text in the same pieces,
for byte, byte-level BPE, SentencePiece-style and word-level tokenizers."""

from __future__ import annotations

import random

import pytest

from cluster.output import TextStream
from model.tokenizer import ByteTokenizer


def _reference(detok, stops, continued, chars, tokens, finish_at):
    """Decode everything after each token (the old engine), cut at the first stop string, send
    all but a trailing U+FFFD and, before it, what may start a stop string. (The old engine
    counted a trailing U+FFFD toward that hold-back and so could send the first characters of a
    stop string that a completed character then finished.)"""
    hold = max((len(s) for s in stops), default=1) - 1
    sent, out, ids = chars, [], list(continued)
    for i, tok in enumerate(tokens):
        ids.append(tok)
        text = detok(ids)
        found = [at for s in stops if (at := text.find(s)) >= 0]
        stopped = bool(found)
        if stopped:  # the text ends before the earliest stop string (the old engine cut at each in turn)
            text = text[: min(found)]
        finished = stopped or i == finish_at
        upto = len(text) if finished else len(text.rstrip("\ufffd")) - hold
        upto = max(sent, upto)
        out.append(text[sent:upto])
        sent = upto
        if finished:
            return out, stopped
    return out, False


def _stream(detok, stops, continued, chars, tokens, finish_at):
    ts, out = TextStream(detok, stops, continued, chars), []
    for i, tok in enumerate(tokens):
        stopped = ts.feed(tok)
        finished = stopped or i == finish_at
        out.append(ts.take(finished))
        if finished:
            return out, stopped
    return out, False


def _check(detok, vocab, rng, cases=300, max_len=60):
    for _ in range(cases):
        tokens = [rng.choice(vocab) for _ in range(rng.randint(1, max_len))]
        text = detok(tokens)
        stops = []
        for _ in range(rng.randint(0, 3)):  # substrings of the text (so they do match) or random ones
            if text and rng.random() < 0.7:
                a = rng.randrange(len(text))
                stops.append(text[a : a + rng.randint(1, 4)])
            else:
                stops.append("".join(rng.choice("ab é€") for _ in range(rng.randint(1, 3))))
        stops = [s for s in stops if s and "\ufffd" not in s]  # stops match whole characters
        cut = rng.randint(0, len(tokens) // 2) if rng.random() < 0.3 else 0  # continued on this replica
        continued, rest = tokens[:cut], tokens[cut:]
        chars = 0
        if continued:  # what the other replica had sent of them (held-back text not yet)
            sent, stopped = _reference(detok, stops, [], 0, continued, -1)
            if stopped:
                continue  # it would have finished the request there
            chars = len("".join(sent))
        finish_at = len(rest) - 1
        want = _reference(detok, stops, continued, chars, rest, finish_at)
        got = _stream(detok, stops, continued, chars, rest, finish_at)
        assert got == want, (tokens, stops, cut)


def test_byte_tokens_with_split_and_broken_characters():
    rng = random.Random(0)
    tok = ByteTokenizer()
    text = "tide é€ 🌊 naïve"
    vocab = list(text.encode()) + [0xC3, 0xE2, 0x82, 0xFF, 256, 257]  # lone lead/continuation bytes, specials
    _check(tok.decode, vocab, rng)


def _hf(kind: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = ["the tide comes in and the tide goes out", "naïve café: é € 🌊 über", "the moon pulls the sea"]
    if kind == "bytelevel":  # DeepSeek's kind: byte-level BPE
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    elif kind == "metaspace":  # SentencePiece style: the first token's space is dropped
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>"]))
    else:  # word level: tokens are joined with spaces
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>"]))
    return tok


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace", "wordlevel"])
def test_hugging_face_tokenizers(kind):
    tok = _hf(kind)

    def detok(ids):
        return tok.decode(ids, skip_special_tokens=True)

    _check(detok, list(range(tok.get_vocab_size())), random.Random(1), cases=200)


def test_a_stop_string_split_over_tokens_ends_the_text_before_it():
    tok = ByteTokenizer()
    ts = TextStream(tok.decode, ["END"])
    sent = []
    for b in b"abcEN":
        assert not ts.feed(b)
        sent.append(ts.take(False))
    assert "".join(sent) == "abc"  # "EN" waits: it may start the stop string
    assert ts.feed(ord("D")) and ts.take(True) == ""


def test_the_stop_string_ends_the_text_when_it_is_included():
    tok = ByteTokenizer()
    ts = TextStream(tok.decode, ["END", "ND!"], include_stop=True)
    sent = []
    for b in b"abcEN":
        assert not ts.feed(b)
        sent.append(ts.take(False))
    assert ts.feed(ord("D")) and "".join(sent) + ts.take(True) == "abcEND"  # the first stop found, whole


def test_text_before_min_tokens_stops_nothing_even_later():
    tok = ByteTokenizer()
    ts = TextStream(tok.decode, ["ab"])
    assert not ts.feed(ord("a"), stops=False) and not ts.feed(ord("b"), stops=False)
    assert not ts.feed(ord("c"))  # "ab" was written before stops counted
    assert not ts.feed(ord("a")) and ts.feed(ord("b")) and ts.take(True) == "abc"
