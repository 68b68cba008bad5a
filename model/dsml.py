"""DeepSeek-V3.2's and V4's chat encoding: prompts from OpenAI messages, and their DSML tool calls.

These checkpoints ship their chat format as encoding rules (``encoding/encoding_dsv32.py``,
``encoding_dsv4.py``) rather than a Jinja template; this module writes the same prompts. A turn
is ``<｜User｜>TEXT<｜Assistant｜>``, then ``<think>`` (thinking on: the output reasons until
``</think>``) or ``</think>`` (thinking off). An assistant turn is its reasoning (only after the
last user turn, thinking on), its text, its calls and ``<｜end▁of▁sentence｜>``. Tools are
described in the system prompt; calls are DSML, after the text::

    <｜DSML｜function_calls>                       (V4: tool_calls)
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

Tool results follow the calls: V3.2 as ``<function_results>`` of ``<result>``s; V4 as
``<tool_result>`` blocks of the next user turn. ``DsmlCallStream`` parses an output's calls as
``model.tool_calls.ToolCallStream`` parses V3's.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from model.tool_calls import ToolCall, ToolCallStream

__all__ = ["DSML_FORMATS", "DsmlCallStream", "DsmlFormat", "parse_dsml_calls", "render_dsml"]

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"

_V32_TOOLS = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{d}function_calls>" block like the following as part of your reply to the user:
<{d}function_calls>
<{d}invoke name="$FUNCTION_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$FUNCTION_NAME2">
...
</{d}invoke>
</{d}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{d}function_calls>
...
</{d}function_calls>

<function_results>
...
</function_results>

{think}...thinking about results{end_think}

Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""

_V4_TOOLS = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{d}tool_calls>" block like the following:

<{d}tool_calls>
<{d}invoke name="$TOOL_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$TOOL_NAME2">
...
</{d}invoke>
</{d}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside {think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

# V4's thinking-mode prompts by reasoning effort, before everything else ("low" adds none)
_EFFORT = {
    "low": "",
    "high": ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
             "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
             "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
             "scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, "
             "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"),
    "max": ("Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
            "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
            "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
            "resolve the underlying cause rather than any surface symptom.\nDo not stop reasoning until you have "
            "independently verified the solution from multiple angles and are certain that no assumption remains "
            "unchecked and no error remains undiscovered.\n\n"),
}


@dataclass(frozen=True, slots=True)
class DsmlFormat:
    name: str  # "v3.2" | "v4"
    calls_block: str  # the DSML block that holds an output's calls
    tools_template: str

    @property
    def calls_open(self) -> str:
        return f"<{DSML}{self.calls_block}>"


DSML_FORMATS = {"v3.2": DsmlFormat("v3.2", "function_calls", _V32_TOOLS),
                "v4": DsmlFormat("v4", "tool_calls", _V4_TOOLS)}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _calls(fmt: DsmlFormat, tool_calls: list[dict]) -> str:
    """An assistant turn's OpenAI ``tool_calls`` as its DSML block (after two newlines)."""
    invokes = []
    for call in tool_calls:
        fn = call["function"]
        args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
        if not isinstance(args, dict):
            args = {"arguments": fn["arguments"]}
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>" for k, v in args.items())
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>')
    return f"\n\n{fmt.calls_open}\n" + "\n".join(invokes) + f"\n</{DSML}{fmt.calls_block}>"


def _tools_block(fmt: DsmlFormat, tools: list[dict]) -> str:
    schemas = "\n".join(_json(t.get("function", t)) for t in tools)
    return fmt.tools_template.format(d=DSML, think=THINK, end_think=END_THINK, schemas=schemas)


def render_dsml(fmt: DsmlFormat, messages: list[dict], tools: list[dict] | None = None, thinking: bool = False,
                generation_prompt: bool = True, reasoning_effort: str = "low") -> str:
    """The prompt text of OpenAI ``messages`` (roles system, user, assistant, tool; ``developer``
    arrives as system) with ``tools`` (OpenAI function tools) in the system prompt. ``thinking``:
    the model reasons first; earlier turns' reasoning is not kept (DeepSeek's default; V4 keeps
    every turn's thinking marks where tools are given). ``generation_prompt`` False: the text
    ends after the last message. A bad message is a ``ValueError`` naming it."""
    if reasoning_effort not in _EFFORT:
        raise ValueError(f"reasoning_effort {reasoning_effort!r} is not one of {', '.join(_EFFORT)}")
    messages = [dict(m) for m in messages]
    if tools:
        if messages and messages[0].get("role") == "system":
            messages[0]["tools"] = tools
        else:
            messages.insert(0, {"role": "system", "content": "", "tools": tools})
    for i, m in enumerate(messages):
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"message {i}: role {m.get('role')!r} is not one of system, user, assistant, tool")
        if not isinstance(m.get("content") or "", str):
            raise ValueError(f"message {i}: content must be text")
    turn = _V4Turns if fmt.name == "v4" else _V32Turns
    return BOS + (_EFFORT[reasoning_effort] if thinking and fmt.name == "v4" else "") + \
        turn(fmt, messages, thinking, generation_prompt).render()


class _V32Turns:
    """V3.2: a user turn always ends with the assistant's mark; tool results are a
    ``<function_results>`` block after the calls, then the assistant goes on."""

    user_roles = ("user",)

    def __init__(self, fmt: DsmlFormat, messages: list[dict], thinking: bool, generation_prompt: bool) -> None:
        self.fmt, self.messages, self.thinking, self.generation_prompt = fmt, messages, thinking, generation_prompt
        users = [i for i, m in enumerate(messages) if m["role"] in self.user_roles]
        self.last_user = users[-1] if users else -1
        self.keep_thinking = False  # every assistant turn keeps its thinking marks

    def render(self) -> str:
        return "".join(getattr(self, m["role"])(i, m, m.get("content") or "") for i, m in enumerate(self.messages))

    def _following(self, i: int) -> str | None:
        return self.messages[i + 1]["role"] if i + 1 < len(self.messages) else None

    def _opens(self, i: int) -> str:
        """The assistant's mark and whether it thinks, after message ``i``."""
        reasons = self.thinking and (self.keep_thinking or i >= self.last_user)
        return ASSISTANT + (THINK if reasons else END_THINK)

    def system(self, i: int, m: dict, content: str) -> str:
        return content + ("\n\n" + _tools_block(self.fmt, m["tools"]) if m.get("tools") else "")

    def user(self, i: int, m: dict, content: str) -> str:
        last = self._following(i) is None
        return USER + content + (self._opens(i) if not last or self.generation_prompt else "")

    def assistant(self, i: int, m: dict, content: str) -> str:
        reasoning = (m.get("reasoning_content") or "") + END_THINK \
            if self.thinking and (self.keep_thinking or i > self.last_user) else ""
        return reasoning + content + (_calls(self.fmt, m["tool_calls"]) if m.get("tool_calls") else "") + EOS

    def _calls_before(self, i: int) -> tuple[bool, bool]:
        """Whether tool message ``i`` is the first and the last of its assistant turn's results."""
        j = i
        while j > 0 and self.messages[j - 1]["role"] == "tool":
            j -= 1
        calling = self.messages[j - 1] if j > 0 else {}
        if calling.get("role") != "assistant" or len(calling.get("tool_calls") or []) < i - j + 1:
            raise ValueError(f"message {i}: a tool result must follow an assistant turn with a call for it")
        return i == j, self._following(i) != "tool"

    def tool(self, i: int, m: dict, content: str) -> str:
        first, last = self._calls_before(i)
        out = ("\n\n<function_results>" if first else "") + f"\n<result>{content}</result>"
        if last:
            out += "\n</function_results>\n\n" + self._opens(i)[len(ASSISTANT):]
        return out


class _V4Turns(_V32Turns):
    """V4: tool results open a user turn of ``<tool_result>`` blocks (a user message after them
    joins it), and the assistant's mark comes only before an assistant turn or at the end."""

    user_roles = ("user", "tool")

    def __init__(self, fmt: DsmlFormat, messages: list[dict], thinking: bool, generation_prompt: bool) -> None:
        super().__init__(fmt, messages, thinking, generation_prompt)
        self.keep_thinking = any(m.get("tools") for m in messages)

    def _transition(self, i: int) -> str:
        following = self._following(i)
        return self._opens(i) if following == "assistant" or (following is None and self.generation_prompt) else ""

    def user(self, i: int, m: dict, content: str) -> str:
        joins = i > 0 and self.messages[i - 1]["role"] == "tool"
        return ("\n\n" if joins else USER) + content + self._transition(i)

    def tool(self, i: int, m: dict, content: str) -> str:
        first, last = self._calls_before(i)
        out = (USER if first else "\n\n") + f"<tool_result>{content}</tool_result>"
        return out + (self._transition(i) if last and self._following(i) != "user" else "")


_INVOKE = re.compile(rf'<{re.escape(DSML)}invoke name="([^"]*)">\n?(.*?)</{re.escape(DSML)}invoke>', re.DOTALL)
_PARAM = re.compile(rf'<{re.escape(DSML)}parameter name="([^"]*)" string="(true|false)">(.*?)</{re.escape(DSML)}parameter>',
                    re.DOTALL)


def parse_dsml_calls(fmt: DsmlFormat, text: str) -> tuple[str, list[ToolCall]]:
    """``text`` -> (the message content, the calls). Text without the calls block is all content;
    a call with a non-string parameter that is not JSON is dropped."""
    at = text.find(fmt.calls_open)
    if at < 0:
        return text, []
    calls = []
    for name, body in _INVOKE.findall(text[at:]):
        args: dict[str, Any] = {}
        try:
            for key, is_str, value in _PARAM.findall(body):
                args[key] = value if is_str == "true" else json.loads(value)
        except ValueError:
            continue
        calls.append(ToolCall(name, _json(args)))
    content = text[:at]
    return content[:-2] if content.endswith("\n\n") else content, calls


class DsmlCallStream(ToolCallStream):
    """Content deltas of a streamed output whose end may hold DSML calls (after two newlines,
    which are not content)."""

    def __init__(self, fmt: DsmlFormat) -> None:
        super().__init__(fmt.calls_open, functools.partial(parse_dsml_calls, fmt), lead="\n\n")
