"""The ingress's one place that tokenizes and checks limits: a validated body becomes a typed
``Prepared`` (the engine requests of its prompts, its choices, how to render its answer).

Everything here runs on a prep thread (``deploy.prep_pool``): templates, tokenizing and grammar
checks hold the GIL for as long as a hostile body makes them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from cluster.request import GenerationRequest
from deploy.errors import APIError
from deploy.ingress import structured
from deploy.ingress.config import IngressConfig
from deploy.limits import KeyGrant
from deploy.protocol import ChatCompletionRequest, CompletionRequest
from model.reasoning import thought_open
from model.sampling_params import SamplingParams
from model.tool_calls import FirstCall, ForcedCall, RequiredCall

__all__ = ["Prepared", "Preparer"]


@dataclass(frozen=True)
class Prepared:
    """A request ready to run: one engine request per prompt (``requests``), each with ``n``
    choices; the rest says how its answer is rendered (``deploy.ingress.render``)."""

    kind: Literal["chat", "completion"]
    requests: tuple[GenerationRequest, ...]
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # a stream ends with a usage chunk
    # chat with tools: a factory of the splitter that reads a choice's output into content and
    # calls, and the finish_reason of a call (OpenAI says "stop" for a function the request named)
    calls: Callable | None = None
    tool_finish: str = "tool_calls"
    thought: bool | None = None  # a model that reasons: whether the prompt opened the thought
    echoes: tuple[str, ...] | None = None  # completions' echo: each prompt's text starts its choices'
    echo_k: int | None = None  # ... and with logprobs its scored tokens, with this many top logprobs
    scores_only: bool = False  # echo with max_tokens 0: none of the engine's output comes back
    prompt_k: int | None = None  # vLLM's prompt_logprobs (not streamed)

    @property
    def total(self) -> int:
        """Choices over all prompts; prompt p's choice j has index p * n + j."""
        return self.n * len(self.requests)


class Preparer:
    def __init__(self, cfg: IngressConfig, tokenizer, context_len: int, vocab_size: int) -> None:
        self.cfg, self.limits = cfg, cfg.limits
        self.tokenizer, self.context_len, self.vocab_size = tokenizer, context_len, vocab_size

    def check_model(self, name: str | None, grant: KeyGrant) -> None:
        served = self.cfg.model_name
        if name is not None and name != served:
            raise APIError(404, f"model {name!r} does not exist; available: {served!r}", param="model",
                           code="model_not_found")
        if not grant.allows(served):
            raise APIError(403, f"this API key has no access to model {served!r}", "permission_error",
                           param="model", code="model_not_allowed")

    def check_tokens(self, tokens: list[int], param: str) -> None:
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param=param)

    # -- chat ------------------------------------------------------------------------------
    def chat(self, body: ChatCompletionRequest, grant: KeyGrant) -> Prepared:
        """A chat: its prompt rendered with the chat template, its tools' and thought's rendering."""
        messages = [m.template_dict() for m in body.messages]
        tools, forced = body.tool_functions(), body.forced_function()
        required = structured.required_grammar(body, *self.cfg.grammar_limits)
        prompt_ids = self._chat_prompt(body, messages, tools)
        think = self.tokenizer.think_ids()
        thought = thought_open(prompt_ids, *think) if think is not None else None
        fields = {}
        if thought:  # R1: JSON mode, a schema or a named function constrain only the answer, after the thought
            fields["constrain_after"] = think[1]
        if forced is not None:  # the output is that function's arguments: per its schema, or any JSON object
            fields["grammar"] = structured.forced_grammar(body, forced, *self.cfg.grammar_limits)
        if required is not None:  # the output is one call, {NAME: ARGUMENTS}, of one of the tools
            fields["grammar"] = required
        req = self._request(body, prompt_ids, grant, prompt_logprobs=body.prompt_logprobs, **fields)
        calls, finish = self._splitter(body, tools), "tool_calls"
        if forced is not None:
            calls, finish = functools.partial(ForcedCall, forced), "stop"
        elif required is not None:
            calls = RequiredCall
        return Prepared("chat", (req,), body.n, body.stream, _include_usage(body), calls, finish, thought,
                        prompt_k=body.prompt_logprobs)

    def _chat_prompt(self, body: ChatCompletionRequest, messages: list[dict], tools) -> list[int]:
        prefix = body.answer_prefix()  # chat prefix completion: the answer goes on from that text
        extra = body.chat_template_kwargs or {}
        try:
            if prefix is None:
                return self.tokenizer.apply_chat_template(messages, tools, **extra,
                                                          generation_prompt=body.add_generation_prompt)
            return self.tokenizer.apply_chat_template(messages[:-1], tools, **extra) + self.tokenizer.encode(prefix)
        except ValueError as e:
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise APIError(400, str(e), param=param) from None
        except TypeError as e:  # the template called with variables it cannot take
            raise APIError(400, f"the chat template failed: {e}", param="messages") from None

    def _splitter(self, body: ChatCompletionRequest, tools) -> Callable | None:
        if tools is None:
            return None
        if not body.parallel_tool_calls:
            return lambda: FirstCall(self.tokenizer.tool_call_stream())
        return self.tokenizer.tool_call_stream

    # -- completions -----------------------------------------------------------------------
    def completion(self, body: CompletionRequest, grant: KeyGrant) -> Prepared:
        """A completion of one prompt or a batch; with ``echo`` each prompt's text."""
        prompts = body.prompts()
        if len(prompts) > self.limits.max_prompts:
            raise APIError(400, f"a batch of {len(prompts)} prompts exceeds the limit of {self.limits.max_prompts}",
                           param="prompt")
        if body.echo and body.suffix is not None:
            raise APIError(400, "echo and suffix (fill in the middle) do not go together", param="echo")
        asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        scored = max(asked, default=None)  # echo with logprobs and prompt_logprobs score the prompt
        reqs: list[GenerationRequest] = []
        for p, prompt in enumerate(prompts):
            try:
                ids = self._completion_ids(body, prompt)
                if not reqs:
                    reqs.append(self._request(body, ids, grant, "prompt", prompt_logprobs=scored,
                                              scores_only=body.scores_only()))
                else:  # the batch's other prompts: the first's request with their own ids and length
                    reqs.append(dataclasses.replace(reqs[0], prompt_ids=tuple(ids),
                                                    max_tokens=self._max_tokens(body, ids, "prompt", body.scores_only())))
            except APIError as e:
                if len(prompts) > 1:  # which prompt of the batch
                    e.message = f"prompt {p} of the batch: {e.message}"
                raise
        echoes = None
        if body.echo:
            echoes = tuple(p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts)
        return Prepared("completion", tuple(reqs), body.n, body.stream, _include_usage(body), echoes=echoes,
                        echo_k=body.logprobs if body.echo else None, scores_only=body.scores_only(),
                        prompt_k=body.prompt_logprobs)

    def _completion_ids(self, body: CompletionRequest, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids: a text's (after the BOS token, or in the fill-in-the-
        middle form with ``suffix``), or the ids given, each in the vocabulary."""
        if body.suffix is not None:  # fill in the middle
            if not isinstance(prompt, str):
                raise APIError(400, "suffix (fill in the middle) needs a text prompt", param="suffix")
            try:
                return self.tokenizer.fim_prompt(prompt, body.suffix)
            except ValueError as e:
                raise APIError(400, str(e), param="suffix") from None
        if isinstance(prompt, str):
            return self.encode(prompt)
        self.check_tokens(prompt, "prompt")
        return list(prompt)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """A text's ids as completions take it: after the BOS token (``bos``)."""
        first = [self.tokenizer.bos_id] if bos and self.tokenizer.bos_id is not None else []
        return first + self.tokenizer.encode(text)

    # -- both ------------------------------------------------------------------------------
    def _request(self, body, prompt_ids: list[int], grant: KeyGrant, prompt_param: str = "messages", *,
                 prompt_logprobs: int | None = None, scores_only: bool = False, **extra) -> GenerationRequest:
        """The engine's request for a validated body (``extra``: more ``GenerationRequest``
        fields); the replica gives it its id. ``prompt_logprobs``: score the prompt's tokens
        (echo); ``scores_only``: the caller keeps none of the output (echo with max_tokens 0),
        so the engine stops at its first token."""
        self.check_model(body.model, grant)
        body.check_supported()
        body.check_prompt_logprobs()
        if body.n > self.limits.max_n:
            raise APIError(400, f"n={body.n} exceeds the limit of {self.limits.max_n}", param="n")
        stops = body.stop_list()
        if len(stops) > self.limits.max_stop:
            raise APIError(400, f"{len(stops)} stop strings exceed the limit of {self.limits.max_stop}", param="stop")
        max_tokens = self._max_tokens(body, prompt_ids, prompt_param, scores_only)
        bias = tuple(body.logit_bias_pairs(self.vocab_size, self.limits.max_logit_bias))
        stop_ids = body.stop_token_tuple(self.vocab_size, self.limits.max_stop_token_ids)
        try:
            sampling = SamplingParams(
                body.temperature, body.top_p, body.top_k, body.seed, body.logprobs_k(), body.presence_penalty,
                body.frequency_penalty, bias, repetition_penalty=body.repetition_penalty, min_p=body.min_p,
                prompt_logprobs=prompt_logprobs)
            return GenerationRequest("", tuple(prompt_ids), max_tokens, sampling, tuple(stops), body.ignore_eos,
                                     grant.tenant, stop_token_ids=stop_ids, min_tokens=body.min_tokens,
                                     include_stop=body.include_stop_str_in_output,
                                     **({"grammar": structured.grammar(body, *self.cfg.grammar_limits)} | extra))
        except ValueError as e:  # a combination the field checks above let through
            raise APIError(400, str(e)) from None

    def _max_tokens(self, body, prompt_ids: list[int], prompt_param: str, scores_only: bool) -> int:
        """The engine's max_tokens for a prompt of this body (its checks against the limits and
        the context length are the prompt's own; ``scores_only``: 1)."""
        n_prompt, lim = len(prompt_ids), self.limits
        if n_prompt > lim.max_prompt_tokens:
            raise APIError(400, f"prompt of {n_prompt} tokens exceeds the limit of {lim.max_prompt_tokens}",
                           param=prompt_param, code="context_length_exceeded")
        room = self.context_len - n_prompt
        if room < 1:
            raise APIError(400, f"prompt of {n_prompt} tokens does not fit the context length {self.context_len}",
                           param=prompt_param, code="context_length_exceeded")
        max_tokens = 1 if scores_only else body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = min(room, lim.max_tokens)
        if not 1 <= max_tokens <= lim.max_tokens:
            zero = " (0 with echo: the prompt only)" if max_tokens == 0 and prompt_param == "prompt" else ""
            raise APIError(400, f"max_tokens={max_tokens} must be in [1, {lim.max_tokens}]{zero}", param="max_tokens")
        if max_tokens > room:
            raise APIError(400, f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context "
                           f"length {self.context_len}", param="max_tokens", code="context_length_exceeded")
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens={body.min_tokens} exceeds max_tokens={max_tokens}", param="min_tokens")
        return max_tokens


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
