"""A choice among fixed texts (vLLM's ``structured_outputs: {"choice": [...]}``, ``guided_choice``).

``ChoiceGrammar`` has the grammar interface ``model.structured.JsonMasks`` takes, so the same
masks constrain a request to output exactly one of the texts: a state is the bytes written so
far, which must begin one of the texts, and the output is whole (the request ends) when they
are one. A text that begins another would be cut there, so such lists are refused.
"""

from __future__ import annotations

__all__ = ["MAX_CHOICES", "ChoiceError", "ChoiceGrammar"]

MAX_CHOICES = 1024  # texts one request may choose among
MAX_CHOICE_BYTES = 1024  # the length of each


class ChoiceError(ValueError):
    """Texts this grammar cannot choose among (none, empty, too many or too long, or one the
    beginning of another)."""


class ChoiceGrammar:
    def __init__(self, choices: list[str] | tuple[str, ...]) -> None:
        texts = [c.encode("utf-8") for c in choices]
        if not texts or len(texts) > MAX_CHOICES:
            raise ChoiceError(f"give 1 to {MAX_CHOICES} choices, got {len(texts)}")
        if any(not t or len(t) > MAX_CHOICE_BYTES for t in texts):
            raise ChoiceError(f"each choice must be 1 to {MAX_CHOICE_BYTES} bytes")
        ordered = sorted(set(texts))
        for a, b in zip(ordered, ordered[1:], strict=False):  # a prefix sorts right before a text it begins
            if b.startswith(a):
                raise ChoiceError(f"choice {a.decode()!r} is the beginning of {b.decode()!r}: the output would "
                                  "end at the first")
        self.texts = frozenset(texts)
        self._prefixes = frozenset(t[:i] for t in texts for i in range(len(t) + 1))
        self.start = b""

    def step(self, state: bytes, b: int) -> bytes | None:
        nxt = state + bytes([b])
        return nxt if nxt in self._prefixes and state not in self.texts else None

    def done(self, state: bytes | None) -> bool:
        return state in self.texts

    @staticmethod
    def cache_key(state: bytes, depth: int) -> bytes:
        return state

    @staticmethod
    def in_free_string(state: bytes) -> bool:
        return False
