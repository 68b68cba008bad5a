"""``tide bench structured``: what JSON mode's token masks cost (``model.structured``,
``model.json_schema``).

A sequence in JSON mode needs, every step, the tokens its grammar state allows: a walk over the
vocabulary the first time a state is seen, a cache hit after that. The bench walks a typical
object through both grammars byte by byte, as a model writing it would reach the states, and
times the first (cold) and second (cached) pass. The vocabulary is a checkpoint's tokenizer, or
a synthetic one of DeepSeek-V3's size: every byte plus random 2-10 byte pieces of text and JSON
punctuation (a BPE vocabulary has that shape; only the token bytes matter here).
"""

from __future__ import annotations

import json
import random
import string
import time
from pathlib import Path
from typing import Any

from deploy.bench.machine import machine
from model.json_schema import SchemaGrammar
from model.structured import JsonMasks

VALUE = {"name": "tideserve", "nodes": [1, 2.5, {"lent": None, "ok": True}], "note": "é and a long text here"}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "nodes"], "properties": {
    "name": {"type": "string"}, "nodes": {"type": "array", "items": {}}, "note": {"type": "string"}}}


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    alphabet = (string.ascii_letters * 4 + string.digits * 2 + ' ,.:;"{}[]_-\n\'\\/()').encode()
    vocab = {bytes([i]) for i in range(256)}
    while len(vocab) < size:
        vocab.add(bytes(rng.choice(alphabet) for _ in range(rng.choice((2, 3, 3, 4, 4, 5, 6, 7, 8, 10)))))
    return sorted(vocab)[:size]


def _walk(masks: JsonMasks, text: bytes) -> dict[str, Any]:
    """Mask every state the text passes through (each byte a step), cold then cached."""
    grammar = masks.grammar
    cold = []
    state = grammar.start
    for b in text:
        t = time.perf_counter()
        masks.allowed(state)
        cold.append(time.perf_counter() - t)
        state = grammar.step(state, b)
    assert grammar.done(state), "the bench value must be whole"
    state, t = grammar.start, time.perf_counter()
    for b in text:
        masks.allowed(state)
        state = grammar.step(state, b)
    cached = time.perf_counter() - t
    return {"steps": len(text), "states_masked": masks.cached_states, "cold_total_ms": round(sum(cold) * 1e3, 1),
            "cold_max_ms": round(max(cold) * 1e3, 2), "cached_us_per_step": round(cached / len(text) * 1e6, 2)}


def run_structured_bench(checkpoint: Path | None = None, vocab_size: int = 129_280, seed: int = 0) -> dict[str, Any]:
    if checkpoint is not None:
        from model.config import load_config
        from model.tokenizer import load_tokenizer

        tok, vocab_size = load_tokenizer(checkpoint), load_config(checkpoint).vocab_size
        token_bytes, source = tok.token_bytes, str(checkpoint)
    else:
        vocab = synthetic_vocab(vocab_size, seed)
        token_bytes, source = vocab.__getitem__, "synthetic"
    t = time.perf_counter()
    masks = JsonMasks(token_bytes, vocab_size)
    table_s = time.perf_counter() - t
    text = json.dumps(VALUE, ensure_ascii=False).encode()
    return {**machine(), "vocab": source, "vocab_size": vocab_size, "table_build_s": round(table_s, 3),
            "json_object": _walk(masks, text), "json_schema": _walk(masks.for_grammar(SchemaGrammar(SCHEMA)), text)}
