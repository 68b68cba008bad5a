"""Structured output: JSON mode (OpenAI's ``response_format: {"type": "json_object"}``).

Each decoding step may only pick a token whose bytes keep the output a prefix of one JSON object
(RFC 8259), and the request ends when the object closes. The object starts the output, and
whitespace runs are bounded (``MAX_WHITESPACE_RUN``). The grammar is a byte-level pushdown
automaton: a state is ``(mode, arg, stack)`` where ``stack`` holds the open containers (``o``
object, ``a`` array) and ``arg`` what the mode needs (a string key flag, hex digits left in a
``\\uXXXX`` escape, the rest of a literal, the whitespace run between tokens). Strings hold
whole UTF-8 characters only. States are plain tuples, so they are cheap to keep
per sequence and to use as cache keys.

``JsonMasks`` computes, per state, which tokens of the vocabulary are allowed, and caches the
answer: a token's fate depends only on the mode, ``arg`` and as many open containers as the
token has closing brackets, so states that differ deeper in the stack share one mask. Inside a
string (where most of a long output is) tokens without a quote, backslash or control byte are
always allowed and need no walk. ``JsonMasks`` takes any grammar with this module's interface
(``JSON_OBJECT``; ``model.json_schema.SchemaGrammar`` for a schema).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the grammar itself is plain Python: the ingress checks schemas without torch
    import torch

__all__ = ["MaskCache", "JSON_OBJECT", "JSON_START", "MAX_WHITESPACE_RUN", "NUMBER_END", "NUMBER_STARTS", "STRING_END", "STRING_MODES",
           "WHITESPACE", "JsonMasks", "json_advance", "json_done", "json_step", "number_start", "number_step",
           "string_step"]

State = tuple[int, object, str]

# modes
_START, _OBJ_FIRST, _OBJ_KEY, _COLON, _VALUE, _ARR_FIRST, _AFTER, _DONE = range(8)
_STR, _ESC, _HEX = 8, 9, 10
_NUM = 11  # arg: where in the number (below)
_LIT = 19
# inside a number
_MINUS, _ZERO, _INT, _DOT, _FRAC, _EXP_MARK, _EXP_SIGN, _EXP = range(8)

JSON_START: State = (_START, None, "")
# The output starts with "{", and whitespace between tokens comes in runs of at most this many
# bytes: enough to pretty-print, and a model that likes spaces cannot fill max_tokens with them.
MAX_WHITESPACE_RUN = 16

WHITESPACE = frozenset(b" \t\n\r")
NUMBER_STARTS = frozenset(b"-0123456789")
_DIGITS = frozenset(b"0123456789")
_HEXDIGITS = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_NUM_END = {_ZERO, _INT, _FRAC, _EXP}  # a number may end here (the next byte belongs to what follows)
_DIGIT_NEXT = {_DOT: _FRAC, _EXP_MARK: _EXP, _EXP_SIGN: _EXP}  # after a digit (else the place stays)
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


def _close(stack: str) -> State:
    stack = stack[:-1]
    return (_DONE, None, "") if not stack else (_AFTER, None, stack)


def _value(b: int, stack: str) -> State | None:
    """The first byte of a value."""
    if b == ord("{"):
        return (_OBJ_FIRST, None, stack + "o")
    if b == ord("["):
        return (_ARR_FIRST, None, stack + "a")
    if b == _QUOTE:
        return (_STR, (False, 0), stack)
    if b in NUMBER_STARTS:
        return (_NUM, number_start(b), stack)
    for lit in (b"true", b"false", b"null"):
        if b == lit[0]:
            return (_LIT, lit[1:], stack)
    return None


def json_step(state: State, b: int) -> State | None:
    """The state after byte ``b``, or None when ``b`` cannot follow."""
    mode, arg, stack = state
    if mode in STRING_MODES:
        nxt = string_step(mode, arg, b)
        if nxt is STRING_END:
            return (_COLON, None, stack) if arg[0] else (_AFTER, None, stack)
        return None if nxt is None else (*nxt, stack)
    if mode == _LIT:
        if b != arg[0]:
            return None
        return (_LIT, arg[1:], stack) if len(arg) > 1 else (_AFTER, None, stack)
    if mode == _NUM:
        nxt = number_step(arg, b)
        if nxt is NUMBER_END:
            return json_step((_AFTER, None, stack), b)
        return None if nxt is None else (_NUM, nxt, stack)
    if mode == _DONE:
        return None
    if b in WHITESPACE:  # arg: the whitespace run so far
        if mode == _START or (arg or 0) >= MAX_WHITESPACE_RUN:
            return None
        return (mode, (arg or 0) + 1, stack)
    if mode == _START:
        return (_OBJ_FIRST, None, "o") if b == ord("{") else None
    if mode in (_OBJ_FIRST, _OBJ_KEY):
        if b == _QUOTE:
            return (_STR, (True, 0), stack)
        return _close(stack) if b == ord("}") and mode == _OBJ_FIRST else None
    if mode == _COLON:
        return (_VALUE, None, stack) if b == ord(":") else None
    if mode == _VALUE:
        return _value(b, stack)
    if mode == _ARR_FIRST:
        return _close(stack) if b == ord("]") else _value(b, stack)
    # _AFTER: a value ended inside the innermost container
    top = stack[-1]
    if b == ord(","):
        return (_OBJ_KEY, None, stack) if top == "o" else (_VALUE, None, stack)
    if (b == ord("}") and top == "o") or (b == ord("]") and top == "a"):
        return _close(stack)
    return None


STRING_MODES = (_STR, _ESC, _HEX)
STRING_END = "end"


def string_step(mode: int, arg, b: int):
    """Byte ``b`` inside a string, shared by the grammars here and in ``model.json_schema``:
    the next ``(mode, arg)``, ``STRING_END`` at the closing quote, or None. In ``_STR``, ``arg``
    is (a key?, UTF-8 continuation bytes still due); in ``_ESC`` the key flag; in ``_HEX`` (the
    key flag, hex digits left of a ``\\uXXXX`` escape)."""
    if mode == _STR:
        key, due = arg
        if due:
            return (_STR, (key, due - 1)) if 0x80 <= b <= 0xBF else None
        if b == _QUOTE:
            return STRING_END
        if b == _BACKSLASH:
            return (_ESC, key)
        if b < 0x80:
            return None if b < 0x20 else (_STR, arg)
        due = 1 if 0xC2 <= b <= 0xDF else 2 if 0xE0 <= b <= 0xEF else 3 if 0xF0 <= b <= 0xF4 else 0
        return (_STR, (key, due)) if due else None
    if mode == _ESC:
        if b == ord("u"):
            return (_HEX, (arg, 4))
        return (_STR, (arg, 0)) if b in _ESCAPES else None
    key, left = arg  # _HEX
    if b not in _HEXDIGITS:
        return None
    return (_STR, (key, 0)) if left == 1 else (_HEX, (key, left - 1))


NUMBER_END = "end of number"


def number_start(b: int) -> int:
    """Where in a number its first byte (one of ``NUMBER_STARTS``) leaves it."""
    return _MINUS if b == ord("-") else _ZERO if b == ord("0") else _INT


def number_step(place: int, b: int, integer: bool = False):
    """Byte ``b`` in a number, shared with ``model.json_schema``: the next place in it,
    ``NUMBER_END`` when the number ended before ``b`` (which belongs to what follows), or None.
    ``integer``: no fraction or exponent."""
    if b in _DIGITS:
        if place == _ZERO:
            return None  # a leading zero takes no digits after it
        if place == _MINUS:
            return _ZERO if b == ord("0") else _INT
        return _DIGIT_NEXT.get(place, place)
    if not integer:
        if b == ord(".") and place in (_ZERO, _INT):
            return _DOT
        if b in b"eE" and place in (_ZERO, _INT, _FRAC):
            return _EXP_MARK
        if b in b"+-" and place == _EXP_MARK:
            return _EXP_SIGN
    return NUMBER_END if place in _NUM_END else None


def json_advance(state: State | None, data: bytes) -> State | None:
    """The state after ``data`` (None once a byte cannot follow)."""
    for b in data:
        if state is None:
            return None
        state = json_step(state, b)
    return state


def json_done(state: State | None) -> bool:
    """The object is complete."""
    return state is not None and state[0] == _DONE


class _ObjectGrammar:
    """JSON mode's grammar (one JSON object) in the interface ``JsonMasks`` takes; a schema's
    grammar (``model.json_schema.SchemaGrammar``) has the same."""

    start = JSON_START
    step = staticmethod(json_step)
    done = staticmethod(json_done)

    @staticmethod
    def cache_key(state: State, depth: int) -> tuple:
        """A token that pops at most ``depth`` containers never sees the stack below them."""
        mode, arg, stack = state
        return (mode, arg, stack[-depth:], len(stack) <= depth)

    @staticmethod
    def in_free_string(state: State) -> bool:
        return state[0] == _STR and state[1][1] == 0


JSON_OBJECT = _ObjectGrammar()


def _plain_text(token: bytes) -> bool:
    """Whole UTF-8 characters with no quote, backslash or control character: such a token
    continues any string between two characters."""
    try:
        token.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not any(b in (_QUOTE, _BACKSLASH) or b < 0x20 for b in token)


_IDS = itertools.count()


class MaskCache:
    """The masks of every grammar over one vocabulary, least recently used dropped first once
    they hold ``budget_bytes`` (a mask is vocab_size bytes: at a 129k vocabulary 4,096 masks of
    each of 33 grammars were 17 GB)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes, self.bytes = budget_bytes, 0
        self._masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def get(self, key: tuple) -> torch.Tensor | None:
        mask = self._masks.get(key)
        if mask is not None:
            self._masks.move_to_end(key)
        return mask

    def put(self, key: tuple, mask: torch.Tensor) -> None:
        self._masks[key] = mask
        self.bytes += mask.numel()
        while self.bytes > self.budget_bytes and len(self._masks) > 1:
            _, old = self._masks.popitem(last=False)
            self.bytes -= old.numel()

    def __len__(self) -> int:
        return len(self._masks)


class JsonMasks:
    """Which tokens may come next under ``grammar`` (JSON mode's by default). ``token_bytes(i)``
    is token i's bytes (b"" for a special token, which is never allowed) for i in
    ``range(vocab_size)``. The grammars made by ``for_grammar`` share one ``MaskCache`` of
    ``budget_bytes``."""

    BUDGET_BYTES = 256 << 20

    def __init__(self, token_bytes: Callable[[int], bytes] | None, vocab_size: int, grammar=JSON_OBJECT,
                 _tables: JsonMasks | None = None, budget_bytes: int = BUDGET_BYTES) -> None:
        self.vocab_size = vocab_size
        self.grammar = grammar
        self._id = next(_IDS)  # its masks' part of the shared cache's keys (an id() could be reused)
        if _tables is not None:  # another grammar over the same vocabulary: share its tables and cache
            self.tokens, self._by_first = _tables.tokens, _tables._by_first
            self._plain_in_string, self._not_plain, self._depth = _tables._plain_in_string, _tables._not_plain, _tables._depth
            self.cache = _tables.cache
            return
        self.cache = MaskCache(budget_bytes)
        self.tokens: list[bytes] = [token_bytes(i) for i in range(vocab_size)]
        self._by_first: dict[int, list[int]] = {}
        self._plain_in_string = [False] * vocab_size  # tokens that keep a string open whatever came before
        for i, t in enumerate(self.tokens):
            if t:
                self._by_first.setdefault(t[0], []).append(i)
                self._plain_in_string[i] = _plain_text(t)
        self._not_plain = [i for i, t in enumerate(self.tokens) if t and not self._plain_in_string[i]]
        # a token pops at most this many containers, so the stack below that never matters
        self._depth = 1 + max((t.count(b"}") + t.count(b"]") for t in self.tokens), default=0)

    def for_grammar(self, grammar) -> JsonMasks:
        """Masks for another grammar (a schema's) over the same vocabulary."""
        return JsonMasks(None, self.vocab_size, grammar, _tables=self)

    @property
    def cached_states(self) -> int:
        """Masks cached, of every grammar sharing this one's cache."""
        return len(self.cache)

    def done(self, state) -> bool:
        """The output is whole (the request ends)."""
        return self.grammar.done(state)

    def _advance(self, state, data: bytes):
        step = self.grammar.step
        for b in data:
            if state is None:
                return None
            state = step(state, b)
        return state

    def advance(self, state, token: int):
        return self._advance(state, self.tokens[token]) if 0 <= token < self.vocab_size else None

    def allowed(self, state) -> torch.Tensor:
        """bool [vocab_size]: the tokens that may follow ``state``."""
        key = (self._id, self.grammar.cache_key(state, self._depth))
        mask = self.cache.get(key)
        if mask is None:
            import torch

            mask = torch.tensor(self._compute(state), dtype=torch.bool)
            self.cache.put(key, mask)
        return mask

    def _compute(self, state) -> list[bool]:
        if self.grammar.in_free_string(state):  # most tokens stay inside the string: walk only the others
            ok = list(self._plain_in_string)
            for i in self._not_plain:
                ok[i] = self._advance(state, self.tokens[i]) is not None
            return ok
        ok = [False] * self.vocab_size
        step = self.grammar.step
        for first, ids in self._by_first.items():
            after = step(state, first)
            if after is not None:
                for i in ids:
                    ok[i] = self._advance(after, self.tokens[i][1:]) is not None
        return ok

    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[State],
              fallback: int | None = None) -> torch.Tensor:
        """``logits`` [B, V] with the tokens each row of ``rows`` may not take (in its state of
        ``states``) at -inf (a copy). A state that no token of this vocabulary can continue
        allows only ``fallback`` (the EOS token: the request ends there), or leaves the row as it is."""
        logits = logits.clone()
        for b, state in zip(rows, states, strict=True):
            mask = self.allowed(state)
            if not mask.any():
                if fallback is None:
                    continue
                mask = mask.new_zeros(mask.shape)
                mask[fallback] = True
            logits[b].masked_fill_(~mask.to(logits.device), float("-inf"))
        return logits
