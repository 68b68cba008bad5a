"""DeepSeek-R1's reasoning: the output's thought (``<think>`` ... ``</think>``) apart from the answer.

R1's chat template opens the thought at the end of the prompt, so the output is reasoning until
``</think>`` and the answer after it; a model whose prompt did not open one may start its output
with ``<think>``. ``ReasoningStream`` splits a streamed output into reasoning and content deltas
(DeepSeek's API: ``reasoning_content`` and ``content``), holding back a tail that may still turn
out to be a marker. ``thought_open`` tells whether a prompt leaves a thought open.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["THINK_CLOSE", "THINK_OPEN", "ReasoningStream", "ReasoningTokens", "thought_open"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def thought_open(prompt_ids: Sequence[int], open_id: int, close_id: int) -> bool:
    """The prompt's last thought marker opens a thought (the output starts inside it)."""
    for tok in reversed(prompt_ids):
        if tok == close_id:
            return False
        if tok == open_id:
            return True
    return False


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that starts ``marker`` (0 when none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningStream:
    """Reasoning and content deltas of one output. ``in_thought``: the prompt opened the thought;
    otherwise the output is reasoning only if it starts with ``<think>`` (leading whitespace
    aside). The answer's leading newlines (``</think>\\n\\n``) are not part of the content."""

    def __init__(self, in_thought: bool) -> None:
        self._mode = "reasoning" if in_thought else "start"  # start | reasoning | content
        self._buf = ""  # text not yet sent
        self.reasoning = ""  # everything sent as reasoning so far
        self._answer_started = False

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that can go to the client now."""
        self._buf += delta
        reasoning = content = ""
        if self._mode == "start":
            stripped = self._buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._mode, self._buf = "reasoning", stripped[len(THINK_OPEN):]
            elif not THINK_OPEN.startswith(stripped):  # not a marker: all of it is the answer
                self._mode = "content"
            else:
                return "", ""  # may still become <think>
        if self._mode == "reasoning":
            at = self._buf.find(THINK_CLOSE)
            if at < 0:
                keep = _partial(self._buf, THINK_CLOSE)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                self.reasoning += reasoning
                return reasoning, ""
            reasoning, self._buf = self._buf[:at], self._buf[at + len(THINK_CLOSE):]
            self.reasoning += reasoning
            self._mode = "content"
        if self._mode == "content":
            if not self._answer_started:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return reasoning, ""
                self._answer_started = True
            content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """At the end of the output: what is still held back (an unfinished thought is reasoning;
        a lone start that never became ``<think>`` is content)."""
        rest, self._buf = self._buf, ""
        if self._mode == "reasoning":
            self.reasoning += rest
            return rest, ""
        if self._mode == "content" and not self._answer_started:
            rest = rest.lstrip("\n")
        return "", rest


class ReasoningTokens:
    """Counts an output's reasoning tokens (its thought's, ``</think>`` included; a ``<think>``
    that starts the output too): DeepSeek's ``usage.completion_tokens_details.reasoning_tokens``."""

    def __init__(self, in_thought: bool, open_id: int, close_id: int) -> None:
        self._open, self._close = open_id, close_id
        self._mode = "thought" if in_thought else "start"
        self.count = 0

    def feed(self, token_ids: Sequence[int]) -> None:
        for tok in token_ids:
            if self._mode == "start":
                self._mode = "thought" if tok == self._open else "answer"
            if self._mode == "thought":
                self.count += 1
                if tok == self._close:
                    self._mode = "answer"
