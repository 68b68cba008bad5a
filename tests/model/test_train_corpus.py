"""The training corpus (``model/train.py``): the ``mixed`` corpus's JSON answers are compact JSON
objects as structured output writes them, its brief answers are one sentence, and every
document ends with EOS."""

from __future__ import annotations

import json
import random

import pytest

from model.tokenizer import ByteTokenizer
from model.train import encode_corpus, first_sentence, json_answer, stdlib_documents


def test_json_answers_are_compact_objects_of_short_values():
    docs = stdlib_documents(limit=300)
    rng = random.Random(3)
    for name, doc in docs:
        text = json_answer(name, doc, rng)
        value = json.loads(text)
        assert isinstance(value, dict) and 2 <= len(value) <= 5, text
        assert text == json.dumps(value, separators=(", ", ": "))  # the separators of compact structured output
        assert all(len(v) <= 60 for v in value.values() if isinstance(v, str)), text


def test_brief_answers_are_a_first_sentence():
    assert first_sentence("Return the sum. Then more.\n\nDetails here.") == "Return the sum."
    assert first_sentence("A heading\nwrapped line\n\nBody.") == "A heading wrapped line"
    assert len(first_sentence("x" * 500)) == 200


def test_the_mixed_corpus_holds_each_kind_of_turn_and_a_wrong_name_is_refused():
    tok = ByteTokenizer()
    docs = stdlib_documents(limit=200)
    text = tok.decode([t for t in encode_corpus(docs, 0, "mixed").tolist() if t not in (tok.BOS,)])
    plain = tok.decode([t for t in encode_corpus(docs, 0).tolist() if t not in (tok.BOS,)])
    assert "Reply in JSON." in text or "Answer with a JSON object." in text
    assert text.count('": ') > plain.count('": ') + 50  # JSON answers
    assert encode_corpus(docs, 0, "mixed").tolist().count(tok.EOS) == len(docs)
    with pytest.raises(ValueError, match="corpus must be one of"):
        encode_corpus(docs, 0, "tweets")
