"""A request's output text as it is generated: incremental detokenization and stop strings.

``TextStream`` decodes only a window of the last few tokens per step, once (the window grows
from a point where the text was stable, and starts again at the last such point every few
tokens), so the host work per token does not grow with the output; the text equals decoding
every token at once. Stop strings are searched only in text not
yet sent: text that may be the start of a stop string is held back, so an occurrence can never
begin in text already sent. A trailing U+FFFD (the first bytes of a character whose next token
completes it) is held back until the request finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]

_REPLACEMENT = "\ufffd"
_BACK = 8  # tokens a window may reach back to find a character boundary (UTF-8: 4 bytes)
_CONTEXT = 5  # tokens before the new ones a continued request's first window decodes with
WINDOW = 8  # tokens a window grows to before it starts again at the last boundary


class TextStream:
    """One request's text. ``continued_ids`` are tokens another replica generated and whose
    text it sent ``continued_chars`` characters of; the text goes on from them, so a character
    split across the move comes out whole."""

    def __init__(self, detokenize: Callable[[list[int]], str], stops: Sequence[str] = (),
                 continued_ids: Sequence[int] = (), continued_chars: int = 0, include_stop: bool = False) -> None:
        """``include_stop``: the text ends with the stop string found, not before it."""
        self._detok = detokenize
        self.stops = tuple(stops)
        self.include_stop = include_stop
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1
        self._ids = list(continued_ids)
        # the window: tokens [prefix, read) decoded as ``_prefix_text`` form whole characters
        self._read = self._stable_boundary()
        # the first window starts a few tokens back: decoders that drop the first token's space
        # (SentencePiece) drop it from both the window and its prefix
        self._prefix = max(0, self._read - _CONTEXT)
        self._prefix_text = detokenize(self._ids[self._prefix : self._read]) if self._read else ""
        self._skip = continued_chars  # characters of the text the other replica sent already
        self._pending = ""  # decoded, not yet sent
        self._add(detokenize(self._ids[: self._read]) if self._read else "")
        self._unstable = ""  # the window's text past ``_read`` when it ends inside a character
        self._searched = 0  # characters of ``_pending`` already searched for stop strings
        if len(self._ids) > self._read:  # a character split across the move
            self._decode_window()

    def _stable_boundary(self) -> int:
        """The largest end (within ``_BACK`` tokens of the end) whose text ends on a whole
        character; 0 when there is none (the first window then decodes everything)."""
        n = len(self._ids)
        for end in range(n, max(0, n - _BACK) - 1, -1):
            if end == 0 or not self._detok(self._ids[max(0, end - _BACK) : end]).endswith(_REPLACEMENT):
                return end
        return 0

    def _add(self, text: str) -> None:
        """Stable text into ``_pending``, less what the other replica sent already."""
        if self._skip:
            cut = min(self._skip, len(text))
            text, self._skip = text[cut:], self._skip - cut
        self._pending += text

    def feed(self, token: int, stops: bool = True) -> bool:
        """Add one token's text; True when a stop string now appears (the text ends before it).
        ``stops`` False: the text so far cannot stop the output (a request's ``min_tokens``)."""
        self._ids.append(token)
        self._decode_window()
        if not stops:
            self._searched = len(self._pending)
            return False
        return self._match_stop()

    def _decode_window(self) -> None:
        full = self._detok(self._ids[self._prefix :])
        joined = full.startswith(self._prefix_text)
        if not joined:  # a tokenizer whose windows do not concatenate
            full = self._prefix_text + self._detok(self._ids[self._read :])
        new = full[len(self._prefix_text) :]
        if new.endswith(_REPLACEMENT):  # may be the first bytes of a character: wait for the rest
            self._unstable = new
            return
        if self._skip:
            self._add(new)
        else:
            self._pending += new
        self._unstable = ""
        start, self._read = self._read, len(self._ids)
        if joined and self._read - self._prefix <= WINDOW:  # the window grows: one decode a token
            self._prefix_text = full
            return
        text = self._detok(self._ids[start:])  # the window starts again at the last boundary
        if not text:  # e.g. only special tokens: the next window keeps text before them, so that a
            start, text = self._prefix, full  # decoder that drops the first token's space drops it there
        self._prefix, self._prefix_text = start, text

    def _match_stop(self) -> bool:
        if not self.stops:
            return False
        hay, found, end = self._pending, -1, -1
        for stop in self.stops:
            at = hay.find(stop, max(0, self._searched - len(stop) + 1))
            if at >= 0 and (found < 0 or at < found):
                found, end = at, at + len(stop)
        self._searched = len(hay)
        if found < 0:
            return False
        self._pending, self._unstable = hay[: end if self.include_stop else found], ""
        return True

    def take(self, finished: bool) -> str:
        """The text to send now: everything when ``finished``, else all but what may start a
        stop string or end inside a character."""
        if finished:
            out, self._pending, self._unstable = self._pending + self._unstable, "", ""
            self._searched = 0
            return out
        # counted from the last whole character: a partial one may still become part of a stop
        upto = max(0, len(self._pending) - self.hold_back)
        out, self._pending = self._pending[:upto], self._pending[upto:]
        self._searched = max(0, self._searched - upto)
        return out
