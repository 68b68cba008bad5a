"""OpenAI-compatible request bodies and their field validation (the ingress's edge). What a
body's structured output compiles to is ``deploy.ingress.structured``'s."""

from __future__ import annotations

from collections.abc import Container
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deploy.errors import APIError
from deploy.ingress.structured import MAX_JSON_NESTING, nesting
from deploy.openai_fields import accepted_body, unserved_message
from model.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_REPETITION_PENALTY

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions"]


class StreamOptions(BaseModel):
    include_usage: bool = False


def documented_fields(route: str, body: Any, declared: Container[str] = ()) -> Any:
    """``body`` without the OpenAI fields this server accepts and does not serve
    (``deploy.openai_fields``; those in ``declared`` stay); a 400 naming one it cannot serve
    that was given a value."""
    body, unserved = accepted_body(route, body, declared)
    if unserved is not None:
        raise APIError(400, unserved_message(route, unserved), param=unserved, code="unsupported_parameter")
    return body


class _Sampling(BaseModel):
    # An unknown field is a 400 naming it (a typo must not silently fall back to a default);
    # OpenAI's documented fields that are not served here are dropped first (ROUTE's lists in
    # deploy.openai_fields)
    model_config = ConfigDict(extra="forbid")
    ROUTE: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _documented(cls, body: Any) -> Any:
        return documented_fields(cls.ROUTE, body)

    model: str
    max_tokens: int | None = Field(default=None)
    max_completion_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # a 64-bit seed, as torch takes
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    # vLLM's sampling extensions (model.sampling_params and cluster.request say what they do)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # each prompt token's logprob and rank with the k most likely there (the first has none)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def check_prompt_logprobs(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs is not supported with stream (as in vLLM)", param="prompt_logprobs")
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    # vLLM's structured outputs: {"json": schema} | {"json_object": true} | {"choice": [texts]} |
    # {"regex": text} | {"grammar": EBNF}, with "disable_any_whitespace"; and the older names
    # guided_json, guided_choice, guided_regex and guided_grammar (model.grammar enforces them)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_choice: list[str] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None

    # OpenAI parameters this server does not implement: accepted at their defaults (clients send
    # them), refused otherwise (a 400 naming the parameter, never silently ignored)
    UNSUPPORTED: ClassVar[tuple[tuple[str, object], ...]] = ()

    def check_supported(self) -> None:
        for name, default in self.UNSUPPORTED:
            value = getattr(self, name)
            if value not in (default, {}, []):
                raise APIError(400, f"{name}={value!r} is not supported by this server", param=name,
                               code="unsupported_parameter")

    def stop_token_tuple(self, vocab_size: int, limit: int) -> tuple[int, ...]:
        """``stop_token_ids``, each in the vocabulary (a 400 naming the first that is not)."""
        ids = self.stop_token_ids or []
        if len(ids) > limit:
            raise APIError(400, f"{len(ids)} stop_token_ids exceed the limit of {limit}", param="stop_token_ids")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                           param="stop_token_ids")
        return tuple(ids)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        return stops

    def logit_bias_pairs(self, vocab_size: int, limit: int) -> list[tuple[int, float]]:
        """``logit_bias`` as (token id, bias) pairs, each id in the vocabulary and each bias in
        [-100, 100] (a 400 naming the bad entry otherwise)."""
        if not self.logit_bias:
            return []
        if len(self.logit_bias) > limit:
            raise APIError(400, f"logit_bias has {len(self.logit_bias)} entries; the limit is {limit}",
                           param="logit_bias")
        pairs = []
        for key, bias in self.logit_bias.items():
            digits = key.strip()  # a token id has a few digits; int() refuses thousands (a 500)
            token = int(digits) if key.isascii() and digits.isdigit() and len(digits) <= 12 else -1
            if not 0 <= token < vocab_size:
                shown = key if len(key) <= 24 else key[:20] + f"... ({len(key)} characters)"
                raise APIError(400, f"logit_bias key {shown!r} is not a token id in [0, {vocab_size})",
                               param="logit_bias")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise APIError(400, f"logit_bias of token {key} is {bias}; it must be in [-100, 100]",
                               param="logit_bias")
            pairs.append((token, float(bias)))
        return pairs

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")  # e.g. an earlier answer's reasoning_content: DeepSeek's API refuses it too

    role: Literal["system", "user", "assistant", "developer", "tool"]
    name: str | None = None  # a participant's name (OpenAI's; templates may ignore it)
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message answers this call
    prefix: bool = False  # the last message, an assistant's: the answer continues it (DeepSeek's)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (``developer`` is their ``system``)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            for call in self.tool_calls:
                fn = call.get("function")
                if call.get("type", "function") != "function" or not isinstance(fn, dict) \
                        or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
                    raise APIError(400, "each tool call must be {type: function, function: {name, arguments}} with "
                                   "arguments a JSON string", param="messages")
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"unsupported content part type {part.get('type')!r}; only text", param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    ROUTE = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template (V3.1: thinking)
    # vLLM's: the prompt ends where the assistant speaks (False: after the last message as it is),
    # or the answer goes on from the last message, an assistant's (DeepSeek's ``prefix``)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def answer_prefix(self) -> str | None:
        """The text the answer starts with (the last message, an assistant's with ``prefix`` or
        under ``continue_final_message``)."""
        last = self.messages[-1]
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise APIError(400, "continue_final_message goes with add_generation_prompt false",
                               param="continue_final_message")
            if last.role != "assistant":
                raise APIError(400, "continue_final_message needs the last message to be an assistant's",
                               param="continue_final_message")
        if any(m.prefix for m in self.messages[:-1]) or (last.prefix and last.role != "assistant"):
            raise APIError(400, "only the last message, an assistant's, may be a prefix", param="messages")
        return last.text() if last.prefix or self.continue_final_message else None

    logprobs: bool = False  # each output token's logprob
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # and its k most likely alternatives
    tools: list[dict[str, Any]] | None = None  # functions the model may call
    parallel_tool_calls: bool = True  # False: at most one call comes back (the first)
    # "auto" (with tools), "none", "required" (one call of any of the tools) or a named function
    tool_choice: str | dict[str, Any] | None = None

    def forced_function(self) -> str | None:
        """The function ``tool_choice`` names ({"type": "function", "function": {"name": ...}}),
        which must be one of ``tools``; None for auto and none."""
        if not isinstance(self.tool_choice, dict):
            return None
        fn = self.tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if self.tool_choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, "tool_choice must be auto, none or {type: function, function: {name}}",
                           param="tool_choice")
        if name not in {t["function"]["name"] for t in self.tool_functions() or []}:
            raise APIError(400, f"tool_choice names {name!r}, which is not one of the tools", param="tool_choice")
        return name

    def tool_functions(self) -> list[dict[str, Any]] | None:
        """The tools the model may call (None: it calls none, its output is all content)."""
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        if isinstance(choice, str) and choice not in ("auto", "none", "required"):
            raise APIError(400, f"tool_choice {choice!r} is not supported by this server (auto, none, required "
                           "or a named function)", param="tool_choice", code="unsupported_parameter")
        if not self.tools or choice == "none":
            return None
        for i, tool in enumerate(self.tools):
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, "each tool must be {type: function, function: {name, description, parameters}}",
                               param="tools")
            if nesting(fn.get("parameters")) > MAX_JSON_NESTING:
                raise APIError(400, f"tools[{i}].function.parameters nest more than {MAX_JSON_NESTING} objects and "
                               "arrays deep", param="tools")
        return self.tools

    def logprobs_k(self) -> int | None:
        """The engine's ``logprobs`` (None: off)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    ROUTE = "completions"
    # one prompt (text or token ids) or a batch of them; prompt p's choices are p * n .. p * n + n - 1
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # chosen token's + this many alternatives
    # the choice's text starts with its prompt, and with logprobs so do its logprobs (each prompt
    # token scored given those before it; the first has none); max_tokens 0 then scores the prompt only
    echo: bool = False
    suffix: str | None = None  # fill in the middle: the text after the completion (DeepSeek's FIM)
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: the one prompt, or each of the batch."""
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)

    def scores_only(self) -> bool:
        """Echo with max_tokens 0: the prompt comes back (scored with logprobs), nothing is generated."""
        return self.echo and self.requested_max_tokens() == 0

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of={self.best_of} is not supported by this server (only best_of = n)",
                           param="best_of", code="unsupported_parameter")

    def logprobs_k(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and not isinstance(v[0], int) and not all(v):
            raise ValueError(f"prompt {[bool(p) for p in v].index(False)} of the batch is empty")
        return v
