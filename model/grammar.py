"""Structured output on xgrammar (the engine vLLM, SGLang and TensorRT-LLM use).

``GrammarSpec`` is what a request's output must match: one JSON object (OpenAI's
``json_object``), a JSON schema, one of a list of texts, a regular expression or an EBNF grammar
(xgrammar's GBNF dialect). The ingress checks it without a tokenizer (``GrammarSpec.check``: a
``GrammarError`` names what is wrong or what this server would not enforce); a replica compiles
it once per vocabulary (``Grammars``: xgrammar's compiler with its cache) into matchers whose
token masks constrain each step, and whose state says when the output is whole.

JSON comes compact unless ``any_whitespace``: separators as Python's ``json.dumps`` writes them
(``", "`` and ``": "``) and no other whitespace, so a model cannot spend its tokens on blank
runs; with ``any_whitespace`` a run is at most ``MAX_WHITESPACE_RUN``. Schemas are enforced
strictly, as vLLM, SGLang and OpenAI's structured outputs do: an object whose ``properties`` are
listed has no others unless ``additionalProperties`` allows them, an array with ``prefixItems`` no
more items unless ``items`` allows them (every output is still valid under the schema; a model
never wanders into keys it was not asked for). The keywords xgrammar does not enforce are
refused by name rather than silently ignored.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import xgrammar

__all__ = ["GRAMMAR_KINDS", "MAX_CHOICES", "MAX_WHITESPACE_RUN", "UNENFORCED_KEYWORDS", "GrammarError", "GrammarSpec",
           "GrammarState", "GrammarVocab", "Grammars", "apply_masks", "unenforced_keyword", "unpack", "warm"]

GRAMMAR_KINDS = ("json_object", "json_schema", "choice", "regex", "grammar")
MAX_CHOICES = 1024  # texts one request may choose among
MAX_WHITESPACE_RUN = 16  # with any_whitespace: the longest run between JSON tokens
# JSON Schema keywords xgrammar accepts but does not enforce: a schema using one is refused
UNENFORCED_KEYWORDS = ("not", "uniqueItems", "contains", "if", "then", "else", "dependentRequired",
                       "dependentSchemas", "unevaluatedProperties", "unevaluatedItems")
# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SCHEMA_VALUED = ("items", "additionalProperties", "propertyNames", "additionalItems", "not", "contains", "if", "then",
                  "else", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LOOSE_STRING_CHAR = r'([^\"\\\r\n])'  # xgrammar's character of a length-bounded string ...
_JSON_STRING_CHAR = r'([^\0-\x1f\"\\])'  # ... and JSON's unescaped one
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[06:15:47] /project/cpp/x.cc:94: "


class GrammarError(ValueError):
    """A grammar this server cannot enforce, with what is wrong in words a client can act on."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """``source``: the schema as JSON text (json_schema), the regex, or the EBNF (grammar);
    ``choices``: the texts (choice)."""

    kind: str
    source: str = ""
    choices: tuple[str, ...] = ()
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError("a choice grammar goes with choices, and only it")
        if self.kind in ("json_schema", "regex", "grammar") and not self.source:
            raise ValueError(f"a {self.kind} grammar needs its source")

    @property
    def size(self) -> int:
        """Its bytes (what ``Limits.max_grammar_bytes`` bounds)."""
        return len(self.source.encode()) + sum(len(c.encode()) for c in self.choices)

    def check(self) -> None:
        """A ``GrammarError`` where this grammar cannot be enforced (xgrammar cannot parse it, a
        schema keyword it would ignore, a choice list it cannot make) or matches no output at
        all (no rule of it ends: ``root ::= root root``); compiled for a vocabulary of single
        bytes, not the model's."""
        import xgrammar as xgr

        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except ValueError:
                raise GrammarError("the schema is not JSON") from None
            if not isinstance(schema, dict | bool):
                raise GrammarError("a schema is an object")
            keyword = unenforced_keyword(schema)
            if keyword is not None:
                raise GrammarError(f"the schema keyword {keyword!r} is not supported (it would not be enforced)")
        if self.kind == "choice":
            if len(self.choices) > MAX_CHOICES:
                raise GrammarError(f"give 1 to {MAX_CHOICES} choices, got {len(self.choices)}")
            if not all(self.choices):
                raise GrammarError("each choice must be a non-empty text")
        try:
            self._grammar(xgr)
        except RuntimeError as e:
            raise GrammarError(_message(e)) from None
        state = _byte_grammars().state(self)
        if not state.matcher.is_completed() and not unpack(state.mask()[0], 256).any():
            raise GrammarError("the grammar matches no output (none of its derivations ends)")

    def _grammar(self, xgr) -> xgrammar.Grammar:
        if self.kind == "regex":
            return xgr.Grammar.from_regex(self.source)
        return xgr.Grammar.from_ebnf(self._ebnf())

    def _schema_text(self) -> str:
        return self.source if self.kind == "json_schema" else '{"type": "object"}'

    def _json_ebnf(self) -> str:
        """The schema's grammar as EBNF, with the characters of a string whose length is bounded
        (minLength, maxLength) made what JSON allows unescaped (xgrammar's rule there lets
        control characters through, which no JSON parser takes)."""
        import xgrammar as xgr

        text = str(xgr.Grammar.from_json_schema(self._schema_text(), **self._json_options()))
        return text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)

    def _json_options(self) -> dict[str, Any]:
        if self.any_whitespace:
            return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE_RUN, "strict_mode": True}
        return {"any_whitespace": False, "strict_mode": True}

    def _ebnf(self) -> str:
        if self.kind in ("json_object", "json_schema"):
            return self._json_ebnf()
        if self.kind == "grammar":
            return self.source
        return "root ::= " + " | ".join(_ebnf_string(c) for c in self.choices)

    def compile(self, compiler: xgrammar.GrammarCompiler) -> xgrammar.CompiledGrammar:
        """Compiled for ``compiler``'s vocabulary (its cache keeps what it compiled)."""
        try:
            if self.kind == "regex":
                return compiler.compile_regex(self.source)
            return compiler.compile_grammar(self._ebnf())
        except RuntimeError as e:
            raise GrammarError(_message(e)) from None


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal: JSON's escapes (quote, backslash, control characters),
    every other character as itself."""
    return json.dumps(text, ensure_ascii=False)


def _message(e: Exception) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def unenforced_keyword(schema: Any) -> str | None:
    """The first of ``UNENFORCED_KEYWORDS`` (or an ``allOf`` of several schemas) used anywhere
    a schema is in ``schema``; None when there is none."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for keyword in UNENFORCED_KEYWORDS:
            if keyword in node:
                return keyword
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return "allOf"
        for key in _SCHEMA_VALUED:
            if isinstance(node.get(key), dict):
                stack.append(node[key])
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return None


@dataclass(frozen=True, slots=True)
class GrammarVocab:
    """A tokenizer's vocabulary as xgrammar reads it: each token's text in ``kind``'s encoding
    ("raw": its bytes; "byte_level": GPT-2's byte-to-character map, as BPE vocabularies such as
    DeepSeek's store it; "byte_fallback": SentencePiece's <0xNN> pieces), "" for a special token
    (never allowed)."""

    tokens: tuple[bytes | str, ...]
    kind: str = "raw"


class Grammars:
    """A vocabulary's grammar compiler (xgrammar's, caching up to ``cache_bytes`` of compiled
    grammars) and its matchers. ``stop_ids``: the tokens that end an output (EOS)."""

    def __init__(self, vocab: GrammarVocab, vocab_size: int, stop_ids: list[int], threads: int = 1,
                 cache_bytes: int = 256 << 20) -> None:
        import xgrammar as xgr

        kinds = {"raw": xgr.VocabType.RAW, "byte_level": xgr.VocabType.BYTE_LEVEL,
                 "byte_fallback": xgr.VocabType.BYTE_FALLBACK}
        tokens = list(vocab.tokens[:vocab_size]) + [b"" if vocab.kind == "raw" else ""] * (vocab_size - len(vocab.tokens))
        self.vocab_size, self.stop_ids = vocab_size, list(stop_ids)
        self.info = xgr.TokenizerInfo(tokens, kinds[vocab.kind], vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_limit_bytes=cache_bytes)

    def matcher(self, spec: GrammarSpec) -> xgrammar.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(spec.compile(self.compiler))

    def state(self, spec: GrammarSpec, constrain_after: int | None = None) -> GrammarState:
        """A new output's place at the start of ``spec`` (compiled here, on the caller's thread)."""
        return GrammarState(self.matcher(spec), self, constrain_after)

    def bitmask(self, rows: int) -> torch.Tensor:
        """A bitmask for ``rows`` rows (int32 [rows, ceil(V / 32)], on the CPU)."""
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(rows, self.vocab_size)


class GrammarState:
    """One output's place in its grammar: an xgrammar matcher, and whether the grammar applies
    yet (an R1 answer is free while it thinks, until its ``constrain_after`` token). The engine's
    thread feeds it while the mask thread may fill its mask: a lock keeps the two apart (an
    xgrammar matcher is not thread-safe)."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, grammars: Grammars, constrain_after: int | None = None) -> None:
        self.matcher, self.grammars = matcher, grammars
        self.constrain_after, self.active = constrain_after, constrain_after is None
        self._row: torch.Tensor | None = None  # this state's mask ([1, W] int32), filled once
        self._lock = threading.RLock()

    def feed(self, token: int) -> None:
        """The output goes on with ``token`` (a ``GrammarError`` when the grammar refuses it)."""
        with self._lock:
            if not self.active:
                self.active = token == self.constrain_after
                return
            if not self.matcher.accept_token(token):
                if token in self.grammars.stop_ids and not unpack(self.mask()[0], self.grammars.vocab_size).any():
                    raise GrammarError("the grammar allows no token here and the output is not whole (one of its "
                                       "rules never ends)")
                raise GrammarError(f"token {token} does not continue the output under its grammar")
            self._row = None

    def mask(self) -> torch.Tensor:
        """The tokens that may come next, as a bitmask row ([1, W] int32; a bit per token)."""
        with self._lock:
            if self._row is None:
                row = self.grammars.bitmask(1)
                self.matcher.fill_next_token_bitmask(row)
                self._row = row  # published whole: ``ready`` never sees a half-filled row
            return self._row

    @property
    def ready(self) -> bool:
        """Whether the mask of this place is filled (``mask`` returns at once)."""
        return self._row is not None

    def done(self) -> bool:
        """The output is whole: the grammar is matched and nothing but a stop token may follow
        (a text that another choice goes on from is not yet whole)."""
        with self._lock:
            return self._done()

    def _done(self) -> bool:
        if not self.active or not self.matcher.is_completed():
            return False
        allowed = unpack(self.mask()[0], self.grammars.vocab_size)
        allowed[[t for t in self.grammars.stop_ids if t < len(allowed)]] = False
        return not bool(allowed.any())


def unpack(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bitmask row (int32 [W]) as bool [vocab_size]."""
    import torch

    bits = (row.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.reshape(-1)[:vocab_size].bool()


def apply_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> torch.Tensor:
    """``logits`` [B, V] (a copy) with each row of ``rows`` masked to what its state allows; a
    state that no token of the vocabulary continues allows only the stop tokens (the output
    ends there; without stop tokens the row is left as it is). On a GPU, xgrammar's kernel
    applies the bitmask; on the CPU, a table of each byte's 8 bits unpacks it (xgrammar's CPU
    loop is slower)."""
    import torch

    if not rows:
        return logits
    grammars = states[0].grammars
    bitmask = torch.cat([s.mask() for s in states])  # [R, W]
    for r in (~bitmask.any(dim=1)).nonzero().flatten().tolist():
        if not grammars.stop_ids:
            bitmask[r] = -1
        for t in grammars.stop_ids:
            bitmask[r, t // 32] |= _bit(t % 32)
    out = logits.clone()
    if logits.is_cuda:
        import xgrammar as xgr

        full = grammars.bitmask(logits.shape[0])
        full[rows] = bitmask
        xgr.apply_token_bitmask_inplace(out, full.to(logits.device, non_blocking=True),
                                        vocab_size=min(grammars.vocab_size, logits.shape[-1]), indices=rows)
        return out
    banned = torch.index_select(_banned_bits(), 0, bitmask.view(torch.uint8).reshape(-1).int())
    banned = banned.reshape(len(rows), -1)[:, : logits.shape[-1]]
    if banned.shape[-1] < logits.shape[-1]:  # the bitmask covers the grammar's vocabulary only
        banned = torch.nn.functional.pad(banned, (0, logits.shape[-1] - banned.shape[-1]))
    if rows == list(range(logits.shape[0])):
        return out.masked_fill_(banned, float("-inf"))
    index = torch.tensor(rows)
    out[index] = logits[index].masked_fill_(banned, float("-inf"))
    return out


def warm() -> None:
    """Import xgrammar and build ``GrammarSpec.check``'s compiler now (seconds that hold the
    GIL), not on the first request that checks a grammar beside running streams."""
    _byte_grammars()


@functools.cache
def _byte_grammars() -> Grammars:
    """A compiler for a vocabulary of the 256 bytes and a stop token (``GrammarSpec.check``'s)."""
    return Grammars(GrammarVocab(tuple(bytes([i]) for i in range(256)) + (b"",)), 257, [256], cache_bytes=16 << 20)


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 (bit 31 is its sign)."""
    return -(1 << 31) if i == 31 else 1 << i


@functools.cache
def _banned_bits() -> torch.Tensor:
    """bool [256, 8]: each byte's bits cleared, lowest first (built on first use: the ingress
    imports this module without torch)."""
    import torch

    return ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1) == 0
