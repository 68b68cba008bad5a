"""Tool calls in DeepSeek's output format, parsed into OpenAI's ``tool_calls``.

DeepSeek-V3 (and R1) write the calls after the message's text::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

DeepSeek-V3.1 drops the ``function`` type and the code fence:
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>``. Both are read. The markers are
ordinary (not special) tokens of DeepSeek's tokenizer, so they are in the decoded text.

``ToolCallStream`` splits a streamed text into the content a client may see at once and the
calls, which are known when the output ends: text that may be the start of the calls marker is
held back until it is clear. ``ForcedCall`` is the same interface for a request that names the
function to call: the whole output (generated in JSON mode) is its arguments. ``RequiredCall`` is
it for ``tool_choice`` required: the output (generated under a schema) is ``{NAME: ARGUMENTS}``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

__all__ = ["CALLS_BEGIN", "CALLS_END", "CALL_BEGIN", "CALL_END", "SEP", "FirstCall", "ForcedCall", "RequiredCall", "ToolCall",
           "ToolCallStream", "format_tool_calls", "parse_tool_calls"]

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_FENCED = re.compile(r"^(?P<name>[^\n]*)\n```(?:json)?\n(?P<args>.*)\n```$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = ""

    def openai(self, index: int) -> dict:
        return {"index": index, "id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """``text`` -> (the message content, the calls). Text without the calls marker is all
    content; a call whose arguments are not JSON is dropped (the content keeps nothing of it)."""
    at = text.find(CALLS_BEGIN)
    if at < 0:
        return text, []
    calls = []
    for kind_or_name, rest in _CALL.findall(text[at:]):
        fenced = _FENCED.match(rest.strip("\r")) if kind_or_name.strip() == "function" else None
        name, args = (fenced["name"], fenced["args"]) if fenced else (kind_or_name, rest)
        try:
            json.loads(args)
        except ValueError:
            continue
        calls.append(ToolCall(name.strip(), args.strip()))
    return text[:at], calls


def format_tool_calls(calls: list[dict]) -> str:
    """OpenAI ``tool_calls`` of an assistant message in DeepSeek-V3's format (for a chat
    template that has none of its own)."""
    parts = [f"{CALL_BEGIN}function{SEP}{c['function']['name']}\n```json\n{c['function']['arguments']}\n```{CALL_END}"
             for c in calls]
    return CALLS_BEGIN + "".join(parts) + CALLS_END


class ToolCallStream:
    """Content deltas of a streamed output whose end may hold tool calls: the calls begin at
    ``marker`` (after ``lead``, which is not content either) and ``parse`` splits a whole
    output into its content and calls. DeepSeek-V3's markers by default."""

    def __init__(self, marker: str = CALLS_BEGIN, parse=parse_tool_calls, lead: str = "") -> None:
        self._marker, self._parse, self._lead = marker, parse, lead
        self._held = lead + marker  # a tail that may still become this is held back
        self._text = ""
        self._sent = 0
        self._calls_started = False

    def feed(self, delta: str) -> str:
        """Content that can go to the client now."""
        self._text += delta
        if self._calls_started:
            return ""
        at = self._text.find(self._marker, self._sent)
        if at >= 0:
            self._calls_started = True
            upto = at - len(self._lead) if self._lead and self._text[:at].endswith(self._lead) else at
        else:
            upto = len(self._text)
            for k in range(min(len(self._held) - 1, len(self._text) - self._sent), 0, -1):
                if self._text.endswith(self._held[:k]):
                    upto -= k
                    break
        upto = max(upto, self._sent)
        out, self._sent = self._text[self._sent:upto], upto
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: the content still held back, and the calls."""
        content, calls = self._parse(self._text)
        rest = content[self._sent:]
        self._sent = len(self._text)
        return rest, calls


class ForcedCall:
    """The output of a request whose ``tool_choice`` names a function: all of it is that call's
    arguments (JSON mode keeps them one JSON object); no content."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._text = ""

    def feed(self, delta: str) -> str:
        self._text += delta
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The call; none when the output was cut short (max_tokens) before its arguments were
        whole, and no content either: half a call is neither."""
        try:
            json.loads(self._text)
        except ValueError:
            return "", []
        return "", [ToolCall(self.name, self._text)]


class FirstCall:
    """Another splitter's content and only its first call (``parallel_tool_calls`` false)."""

    def __init__(self, split: ToolCallStream) -> None:
        self._split = split

    def feed(self, delta: str) -> str:
        return self._split.feed(delta)

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self._split.finish()
        return content, calls[:1]


class RequiredCall:
    """The output of a request whose ``tool_choice`` is required: one JSON object ``{NAME:
    ARGUMENTS}`` (``ChatCompletionRequest.required_grammar``), the call of that function with
    those arguments; no content. An output cut short (max_tokens) is no call, and not content
    either: the choice ends with ``length`` and neither."""

    def __init__(self) -> None:
        self._text = ""

    def feed(self, delta: str) -> str:
        self._text += delta
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        try:
            call = json.loads(self._text)
        except ValueError:
            return "", []
        if not isinstance(call, dict) or len(call) != 1:
            return "", []
        (name, args), = call.items()
        return "", [ToolCall(name, json.dumps(args, ensure_ascii=False))]
