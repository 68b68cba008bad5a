"""OpenAI-compatible request bodies, validation and error shapes (the ingress's edge)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Container
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deploy.openai_fields import accepted_body, unserved_message
from model.grammar import GrammarError, GrammarSpec
from model.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_REPETITION_PENALTY, TokenLogprob

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "KeyGrant", "Limits", "chat_logprobs",
           "completion_logprobs", "echo_logprobs", "error_body", "joined_logprobs", "prompt_logprobs"]


class APIError(Exception):
    """An error reported to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s  # sent as Retry-After (a 503 the client should retry)


@dataclass(frozen=True, slots=True)
class KeyGrant:
    """What an API key may do: its tenant (whose salt isolates its cache) and the models it may
    use (None: all)."""

    tenant: str
    models: frozenset[str] | None = None

    @classmethod
    def parse(cls, value: str) -> KeyGrant:
        """``TENANT`` or ``TENANT:MODEL[+MODEL...]`` (the value of ``api_keys``, ``--api-key``
        and ``TIDE_API_KEYS`` after the key)."""
        tenant, sep, models = value.partition(":")
        names = frozenset(m for m in models.split("+") if m)
        if not tenant or (sep and not names):
            raise ValueError(f"API key grant {value!r} must be TENANT or TENANT:MODEL[+MODEL...]")
        return cls(tenant, names if sep else None)

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models



MAX_JSON_NESTING = 128  # objects and arrays inside each other in a tool's parameters


def _nesting(value: Any) -> int:
    """How deep objects and arrays nest in a JSON value (without recursion: a hostile value
    may nest thousands deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_NESTING:
            stack.extend((c, depth + 1) for c in children)
    return deepest

def _rerooted(schema: dict, prefix: str) -> tuple[dict, dict]:
    """``schema`` made a part of another one: (the schema, its definitions under names that
    start with ``prefix``), its ``$ref``s (to ``#`` or its own ``$defs``/``definitions``) pointing
    there."""
    own = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    to_root = False  # a $ref to "#": the schema itself becomes a definition

    def move(node: Any) -> Any:
        nonlocal to_root
        if isinstance(node, list):
            return [move(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: move(v) for k, v in node.items() if k not in ("$defs", "definitions")}
        ref = node.get("$ref")
        if ref == "#":
            out["$ref"], to_root = f"#/$defs/{prefix}", True
        elif isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
            out["$ref"] = f"#/$defs/{prefix}{ref.split('/', 2)[2]}"
        return out

    defs = {f"{prefix}{name}": move(sub) for name, sub in own.items()}
    moved = move(schema)
    if to_root:
        defs[prefix] = moved
    return moved, defs


def checked(spec: GrammarSpec, param: str, max_bytes: int) -> GrammarSpec:
    """``spec`` if this server can enforce it within ``max_bytes`` (``Limits.max_grammar_bytes``),
    else a 400 naming what it cannot."""
    if spec.size > max_bytes:
        raise APIError(400, f"{param}: the grammar is {spec.size} bytes, over the limit of {max_bytes} "
                            "(limits.max_grammar_bytes)", param=param, code="unsupported_schema")
    try:
        spec.check()
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="unsupported_schema") from None
    return spec


def schema_spec(schema: dict, param: str, max_bytes: int, any_whitespace: bool = False) -> GrammarSpec:
    """A JSON schema this server can enforce, as its grammar (a 400 naming what it cannot)."""
    if _nesting(schema) > MAX_JSON_NESTING:
        raise APIError(400, f"{param}: the schema nests more than {MAX_JSON_NESTING} objects and arrays deep",
                       param=param, code="unsupported_schema")
    text = json.dumps(schema, ensure_ascii=False)  # property order is the output's order
    return checked(GrammarSpec("json_schema", text, any_whitespace=any_whitespace), param, max_bytes)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class Limits(BaseModel):
    """The ingress's input limits (``limits:`` in the app's args); a misspelled or negative one
    is an error, not a silent default."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=4 << 20, ge=1)
    body_timeout_s: float = Field(default=30.0, gt=0)  # a body must arrive whole within this (408)
    max_prompt_tokens: int = Field(default=32768, ge=1)
    max_tokens: int = Field(default=4096, ge=1)
    max_stop: int = Field(default=4, ge=0)
    max_stop_token_ids: int = Field(default=64, ge=0)
    max_n: int = Field(default=8, ge=1)  # choices per request (OpenAI's n)
    max_prompts: int = Field(default=64, ge=1)  # prompts of one /v1/completions batch
    max_logit_bias: int = Field(default=1024, ge=0)  # tokens one request may bias
    max_grammar_bytes: int = Field(default=65536, ge=1)  # a structured output's schema, regex, grammar or choices
    # a request's templates, tokenizing and grammar checks run on a pool of prep_workers threads,
    # at most tenant_prep_concurrency of one tenant's at once (deploy.prep_pool)
    prep_workers: int = Field(default=4, ge=1)
    tenant_prep_concurrency: int = Field(default=2, ge=1)
    # stored Responses (deploy.response_store): how long one is kept, its largest size (its
    # conversation included; a larger one is not kept), and how many a tenant keeps
    stored_response_ttl_s: int = Field(default=30 * 86400, ge=1)
    max_stored_response_bytes: int = Field(default=4 << 20, ge=1)
    max_stored_responses: int = Field(default=10000, ge=1)
    # a request's cost (deploy.request_cost): prompt + max_tokens over its prompts and n choices,
    # and prompt tokens scored (echo with logprobs, prompt_logprobs; each prompt once)
    max_request_tokens: int = Field(default=262144, ge=1)
    max_scored_tokens: int = Field(default=32768, ge=0)
    # per tenant and ingress replica, 0: off; over either a request is a 429 with Retry-After
    tenant_requests_per_minute: int = Field(default=0, ge=0)
    tenant_burst: int = Field(default=0, ge=0)  # requests a tenant may send at once (0: a second's worth)
    tenant_concurrency: int = Field(default=0, ge=0)  # a tenant's requests under way at once
    tenant_tokens_per_minute: int = Field(default=0, ge=0)  # request costs' tokens a tenant may draw


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

    def grammar(self, max_bytes: int, any_whitespace: bool = False) -> GrammarSpec | None:
        """What the output must match, from ``response_format`` or vLLM's structured outputs
        (None: free text); a 400 for one this server cannot enforce or over ``max_bytes``.
        ``any_whitespace``: the server's default for JSON (a request's
        ``structured_outputs.disable_any_whitespace`` decides for itself)."""
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        vllm = self._structured_outputs(max_bytes, any_whitespace)
        if vllm is not None:
            if kind != "text":
                raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
            return vllm
        if kind == "text":
            return None
        if kind == "json_object":
            return GrammarSpec("json_object", any_whitespace=any_whitespace)
        if kind != "json_schema":
            raise APIError(400, f"response_format {kind!r} is not supported by this server (text, json_object or "
                           "json_schema)", param="response_format", code="unsupported_parameter")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(400, "response_format json_schema needs json_schema: {name, schema}", param="response_format")
        return schema_spec(spec.get("schema", {}), "response_format", max_bytes, any_whitespace)

    def _structured_outputs(self, max_bytes: int, any_whitespace: bool) -> GrammarSpec | None:
        options = dict(self.structured_outputs or {})
        if "disable_any_whitespace" in options:
            any_whitespace = not options.pop("disable_any_whitespace")
        given = {k: v for k, v in options.items() if v is not None and v is not False}
        for name, value in (("json", self.guided_json), ("choice", self.guided_choice), ("regex", self.guided_regex),
                            ("grammar", self.guided_grammar)):
            if value is not None:
                given[name] = value
        if not given:
            return None
        if len(given) > 1:
            raise APIError(400, f"structured outputs take one of json, json_object, choice, regex and grammar, got "
                                f"{sorted(given)}", param="structured_outputs")
        (kind, value), = given.items()
        param = "structured_outputs"
        if kind == "json":
            try:
                schema = json.loads(value) if isinstance(value, str) else value
            except ValueError:
                raise APIError(400, "structured_outputs json: not a JSON schema", param=param) from None
            if not isinstance(schema, dict):
                raise APIError(400, "structured_outputs json: a schema is an object", param=param)
            return schema_spec(schema, param, max_bytes, any_whitespace)
        if kind == "json_object":
            return GrammarSpec("json_object", any_whitespace=any_whitespace)
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise APIError(400, "structured_outputs choice: a list of texts", param=param)
            return checked(GrammarSpec("choice", choices=tuple(value)), f"{param} choice", max_bytes)
        if kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise APIError(400, f"structured_outputs {kind}: a non-empty text", param=param)
            return checked(GrammarSpec(kind, value), f"{param} {kind}", max_bytes)
        raise APIError(400, f"structured_outputs {kind!r} is not supported by this server (json, json_object, "
                       "choice, regex, grammar)", param=param, code="unsupported_parameter")

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

    def forced_grammar(self, name: str, max_bytes: int, any_whitespace: bool = False) -> GrammarSpec:
        """The named function's arguments: per its parameters schema where it has one this
        server can enforce, else any JSON object."""
        fn = next(t["function"] for t in self.tools or [] if t["function"]["name"] == name)
        params = fn.get("parameters")
        if isinstance(params, dict) and params:
            try:
                return schema_spec(params, "tools", max_bytes, any_whitespace)
            except APIError:
                pass  # a schema it cannot enforce: the arguments are still one JSON object
        return GrammarSpec("json_object", any_whitespace=any_whitespace)

    def required_grammar(self, max_bytes: int, any_whitespace: bool = False) -> GrammarSpec | None:
        """With ``tool_choice`` required: the one call the output is, ``{NAME: ARGUMENTS}`` with
        one of the tools' names, each tool's arguments per its parameters (any JSON object
        where it has none, or one this server cannot enforce); None otherwise."""
        if self.tool_choice != "required":
            return None
        tools = self.tool_functions()
        if not tools:
            raise APIError(400, "tool_choice required needs tools", param="tool_choice")
        calls: list[dict[str, Any]] = []
        all_defs: dict[str, Any] = {}
        for tool in tools:
            name, params = tool["function"]["name"], tool["function"].get("parameters")
            params = params if isinstance(params, dict) and params else {"type": "object"}
            moved, defs = _rerooted(params, f"{name}.")
            try:
                schema_spec({**moved, "$defs": defs}, "tools", max_bytes)
            except APIError:  # a schema it cannot enforce: the arguments are still one JSON object
                moved, defs = {"type": "object"}, {}
            calls.append({"type": "object", "properties": {name: moved}, "required": [name],
                          "additionalProperties": False})
            all_defs.update(defs)
        return schema_spec({"anyOf": calls, "$defs": all_defs}, "tools", max_bytes, any_whitespace)

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
            if _nesting(fn.get("parameters")) > MAX_JSON_NESTING:
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


def completion_logprobs(entries: list[TokenLogprob], token_text, offset: int = 0) -> dict:
    """``choices[].logprobs`` of /v1/completions for the tokens of ``entries`` (the outputs'
    ``new_logprobs``); ``token_text(id)`` is a token's text, ``offset`` where the first token's
    text starts in the completion (a stream continues from the previous chunk)."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(token_text(e.token))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(i): v for i, v in e.top} for e in entries], "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], scored: list[TokenLogprob | None], k: int, token_text) -> dict:
    """``choices[].logprobs`` of an echoed prompt (``echo`` with ``logprobs`` k): its tokens, each
    scored given those before it with the k most likely there (``scored``: the engine's prompt
    logprobs); the first has none."""
    first = token_text(prompt_ids[0])
    rest = completion_logprobs([dataclasses.replace(e, top=e.top[:k]) for e in scored[1:]], token_text, len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}


def prompt_logprobs(prompt_ids: list[int], scored: list[TokenLogprob | None], k: int, token_text) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else {token id: {logprob,
    rank, decoded_token}} for the token and the ``k`` most likely there."""
    out: list = [None]
    for tok, e in zip(prompt_ids[1:], scored[1:], strict=True):
        entry = {str(i): {"logprob": v, "rank": r, "decoded_token": token_text(i)}
                 for r, (i, v) in enumerate(e.top[:k], start=1)}
        entry[str(tok)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": token_text(tok)}
        out.append(entry)
    return out


def joined_logprobs(first: dict, then: dict) -> dict:
    """Two ``completion_logprobs`` of consecutive text as one."""
    return {k: first[k] + then[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat_logprobs(entries: list[TokenLogprob], token_bytes) -> dict:
    """``choices[].logprobs`` of /v1/chat/completions; ``token_bytes(id)`` is a token's bytes."""

    def one(token: int, logprob: float) -> dict:
        raw = token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]}
                        for e in entries], "refusal": None}
