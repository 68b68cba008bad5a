"""Constrained decoding for the engine: the token masks of JSON mode, JSON schemas and choices
among texts, per request.

A constrained sequence carries its grammar's masks, the grammar's state after its output so far,
and whether the masks apply yet (an R1 request is free while it thinks, until its
``constrain_after`` token). The masks of one grammar are built once per vocabulary and shared by
every request using it; the grammars of the most recent schemas and choice lists are kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from cluster.request import GenerationRequest, Sequence
from model.choice import ChoiceGrammar
from model.json_schema import SchemaGrammar
from model.structured import JsonMasks

__all__ = ["Constraints"]

MAX_SCHEMAS = 32  # schema and choice grammars kept (their masks share JsonMasks' byte budget)


class Constraints:
    def __init__(self, token_bytes: Callable[[int], bytes] | None, vocab_size: int, eos_id: int | None) -> None:
        """``token_bytes(id)``: a token's bytes (the tokenizer's); ``eos_id`` is what a row with
        no allowed token falls back to."""
        self.token_bytes = token_bytes
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self._json: JsonMasks | None = None  # JSON mode's, built on the first constrained request
        self._grammars: dict[str, JsonMasks] = {}  # by schema text or choice list, oldest first

    def start(self, seq: Sequence) -> None:
        """Set up ``seq``'s masks, and their state after the tokens another replica already
        generated for it (``continued_ids``); ValueError when those cannot start such an output."""
        req = seq.req
        masks = self._masks(req)
        state, active = masks.grammar.start, req.constrain_after is None
        for tok in req.continued_ids:
            if active:
                state = masks.advance(state, tok)
            active = active or tok == req.constrain_after
        if state is None or masks.done(state):
            raise ValueError("the continued tokens are not the start of an unfinished JSON output")
        seq.json_masks, seq.json_state, seq.json_active = masks, state, active

    def _masks(self, req: GenerationRequest) -> JsonMasks:
        if self.token_bytes is None:
            raise ValueError("JSON mode needs the tokenizer's token bytes (Engine(token_bytes=...))")
        if self._json is None:
            self._json = JsonMasks(self.token_bytes, self.vocab_size)
        if req.response_format == "json_object":
            return self._json
        key = req.json_schema if req.response_format == "json_schema" else json.dumps(["choice", *req.choices])
        masks = self._grammars.get(key)
        if masks is None:
            if len(self._grammars) >= MAX_SCHEMAS:
                self._grammars.pop(next(iter(self._grammars)))
            # SchemaError and ChoiceError are ValueErrors
            grammar = SchemaGrammar(json.loads(key)) if req.response_format == "json_schema" else ChoiceGrammar(req.choices)
            masks = self._grammars[key] = self._json.for_grammar(grammar)
        return masks

    def apply(self, logits: torch.Tensor, batch: list[Sequence]) -> torch.Tensor:
        """``logits`` [B, V] with each constrained row's disallowed tokens at -inf."""
        for masks in {id(s.json_masks): s.json_masks for s in batch if s.json_masks is not None}.values():
            rows = [b for b, seq in enumerate(batch) if seq.json_masks is masks and seq.json_active]
            if rows:
                logits = masks.apply(logits, rows, [batch[b].json_state for b in rows], fallback=self.eos_id)
        return logits

    @staticmethod
    def feed(seq: Sequence, tok: int) -> None:
        """The grammar reads ``tok``, or the masks start to apply after it when it ends the thought."""
        if seq.json_masks is None:
            return
        if seq.json_active:
            seq.json_state = seq.json_masks.advance(seq.json_state, tok)
        elif tok == seq.req.constrain_after:
            seq.json_active = True

    @staticmethod
    def done(seq: Sequence) -> bool:
        """Whether ``seq``'s constrained output is complete (the request ends)."""
        return seq.json_masks is not None and seq.json_active and seq.json_masks.done(seq.json_state)
