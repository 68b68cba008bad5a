"""``tide bench structured``: what structured output's token masks cost (``model.grammar``, on
xgrammar).

A constrained sequence needs, every step, the tokens its grammar allows. The bench compiles
JSON mode's grammar, a typical schema's, a schema of 1,000 enum properties (the largest kind a
client may send) and a choice among 1,024 texts; then walks a typical object through the first
two, a token per byte as a model writing it would reach the states, timing each step's mask
(``fill``), and times applying a batch's masks to its logits. The vocabulary is a checkpoint's
tokenizer, or a synthetic one of DeepSeek-V3's size: every byte plus random 2-10 byte pieces of
text and JSON punctuation (a BPE vocabulary has that shape; only the token bytes matter here).
"""

from __future__ import annotations

import json
import random
import statistics
import string
import time
from pathlib import Path
from typing import Any

from deploy.bench.machine import machine
from model.grammar import Grammars, GrammarSpec, GrammarState, GrammarVocab, apply_masks

VALUE = {"name": "tideserve", "nodes": [1, 2.5, {"lent": None, "ok": True}], "note": "é and a long text here"}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "nodes"], "properties": {
    "name": {"type": "string"}, "nodes": {"type": "array", "items": {}}, "note": {"type": "string"}}}
WIDE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"enum": [f"v{i}a", f"v{i}b"]} for i in range(1000)}}
BATCH = 32  # rows of the batch whose masks are applied


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    alphabet = (string.ascii_letters * 4 + string.digits * 2 + ' ,.:;"{}[]_-\n\'\\/()').encode()
    vocab = {bytes([i]) for i in range(256)}
    while len(vocab) < size:
        vocab.add(bytes(rng.choice(alphabet) for _ in range(rng.choice((2, 3, 3, 4, 4, 5, 6, 7, 8, 10)))))
    return sorted(vocab)[:size]


def _walk(grammars: Grammars, spec: GrammarSpec, token_of: dict[bytes, int], text: bytes) -> dict[str, Any]:
    """Compile ``spec``, then mask every state ``text`` passes through (a token per byte)."""
    t = time.perf_counter()
    state = GrammarState(grammars.matcher(spec), grammars)
    compile_s = time.perf_counter() - t
    fills = []
    for b in text:
        t = time.perf_counter()
        state.mask()
        fills.append(time.perf_counter() - t)
        state.feed(token_of[bytes([b])])
    assert state.done(), "the bench value must be whole"
    return {"compile_ms": round(compile_s * 1e3, 1), "steps": len(text),
            "fill_us_per_step": round(statistics.median(fills) * 1e6, 1),
            "fill_max_ms": round(max(fills) * 1e3, 3), "fill_total_ms": round(sum(fills) * 1e3, 2)}


def _compile_ms(grammars: Grammars, spec: GrammarSpec) -> float:
    t = time.perf_counter()
    grammars.matcher(spec)
    return round((time.perf_counter() - t) * 1e3, 1)


def run_structured_bench(checkpoint: Path | None = None, vocab_size: int = 129_280, seed: int = 0) -> dict[str, Any]:
    import torch

    if checkpoint is not None:
        from model.config import load_config
        from model.tokenizer import load_tokenizer

        tok, vocab_size = load_tokenizer(checkpoint), load_config(checkpoint).vocab_size
        vocab, source, stops = tok.grammar_vocab(), str(checkpoint), [tok.eos_id] if tok.eos_id is not None else []
        token_of = {tok.token_bytes(i): i for i in reversed(range(vocab_size))}
    else:
        pieces = synthetic_vocab(vocab_size, seed)
        vocab, source, stops = GrammarVocab(tuple(pieces)), "synthetic", [0]
        token_of = {p: i for i, p in enumerate(pieces)}
    t = time.perf_counter()
    grammars = Grammars(vocab, vocab_size, stops)
    info_s = time.perf_counter() - t
    text = json.dumps(VALUE, ensure_ascii=False).encode()  # json.dumps' separators: the compact grammar's
    walks = {"json_object": _walk(grammars, GrammarSpec("json_object"), token_of, text),
             "json_schema": _walk(grammars, GrammarSpec("json_schema", json.dumps(SCHEMA)), token_of, text)}
    states = [GrammarState(grammars.matcher(GrammarSpec("json_object")), grammars) for _ in range(BATCH)]
    for s in states:
        s.mask()
    logits = torch.randn(BATCH, vocab_size)
    t, reps = time.perf_counter(), 20
    for _ in range(reps):
        apply_masks(logits, list(range(BATCH)), states)
    apply_ms = (time.perf_counter() - t) / reps * 1e3
    choices = GrammarSpec("choice", choices=tuple(f"option number {i}" for i in range(1024)))
    return {**machine(), "engine": "xgrammar", "vocab": source, "vocab_size": vocab_size,
            "tokenizer_info_s": round(info_s, 3),
            **walks,
            "compile_ms": {"schema_1000_enum_properties": _compile_ms(grammars, GrammarSpec("json_schema", json.dumps(WIDE_SCHEMA))),
                           "choice_of_1024": _compile_ms(grammars, choices)},
            f"apply_batch_{BATCH}_ms": round(apply_ms, 3)}
