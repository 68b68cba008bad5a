"""An answer in OpenAI's shapes, from its choices' outputs: one accumulator per choice turns each
output into a delta (content, the thought as ``reasoning_content``, tool calls at the end,
logprobs) and keeps what the whole choice needs, so streamed and whole answers take one path.
Chunks are dicts: the chat and completion routes send them as SSE, the Responses route reads
them as they are."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

from cluster.request import FinishReason, RequestOutput
from deploy.errors import APIError, error_body
from deploy.ingress.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    joined_logprobs,
    prompt_logprobs,
)
from deploy.ingress.prepare import Prepared
from model.reasoning import ReasoningStream, ReasoningTokens
from model.sampling_params import TokenLogprob

__all__ = ["Answer", "usage_of"]

log = logging.getLogger(__name__)


class _Choice:
    """One choice as its outputs come."""

    def __init__(self, index: int, answer: Answer) -> None:
        p, think = answer.prepared, answer.think
        self.index, self.answer = index, answer
        self.splitter = p.calls() if p.calls is not None else None
        self.thought = ReasoningStream(p.thought) if think is not None else None
        self.counts = ReasoningTokens(p.thought, *think) if think is not None else None
        self.first: RequestOutput | None = None
        self.last: RequestOutput | None = None
        self.echo: dict | None = None  # the echoed prompt's logprobs
        self.text_offset = 0  # completions' logprobs: where the next token's text starts
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list = []
        self.entries: list[TokenLogprob] = []

    def feed(self, item: RequestOutput) -> tuple[str, str | None, list | None, dict | None]:
        """The delta of one output: its content, thought and (at the end) calls, and its logprobs."""
        a, p = self.answer, self.answer.prepared
        if p.scores_only:  # none of the engine's tokens go out
            item = item._replace(new_token_ids=[], text="", new_logprobs=[],
                                 finish_reason=item.finish_reason and FinishReason.LENGTH)
        echo = None
        if self.first is None:
            self.first = item
            if p.echoes is not None:  # the choice starts with its prompt
                item = item._replace(text=p.echoes[self.index // p.n] + item.text)
                echo = self.echo = a.echoed(self.index, item)
        self.last = item
        text, reasoning, calls = item.text, None, None
        if self.thought is not None:  # the thought as reasoning deltas, the rest as content
            reasoning, text = self.thought.feed(text)
            self.counts.feed(item.new_token_ids)
            if item.finished:
                rest_r, rest_c = self.thought.finish()
                reasoning, text = reasoning + rest_r, text + rest_c
            self.reasoning.append(reasoning)
        if self.splitter is not None:  # content goes out at once, the calls at the end
            text = self.splitter.feed(text)
            if item.finished:
                rest, calls = self.splitter.finish()
                text += rest
                self.calls = calls
        self.content.append(text)
        entries = item.new_logprobs or []
        self.entries += entries
        return text, reasoning, calls, self._logprobs(entries, echo)

    def _logprobs(self, entries: list[TokenLogprob], echo: dict | None) -> dict | None:
        a = self.answer
        if not a.want_logprobs:
            return None
        if a.prepared.kind == "chat":
            return chat_logprobs(entries, a.tokenizer.token_bytes)
        if echo is not None:  # the prompt's scored tokens first
            self.text_offset = echo["text_offset"][-1] + len(echo["tokens"][-1])
        lp = completion_logprobs(entries, a.token_text, self.text_offset)
        self.text_offset += sum(len(t) for t in lp["tokens"])
        return lp if echo is None else joined_logprobs(echo, lp)

    def whole(self) -> dict:
        a = self.answer
        lp = None
        if a.want_logprobs and a.prepared.kind == "chat":
            lp = chat_logprobs(self.entries, a.tokenizer.token_bytes)
        elif a.want_logprobs:
            start = self.echo["text_offset"][-1] + len(self.echo["tokens"][-1]) if self.echo is not None else 0
            lp = completion_logprobs(self.entries, a.token_text, start)
            lp = lp if self.echo is None else joined_logprobs(self.echo, lp)
        reasoning = "".join(self.reasoning) if self.thought is not None else None
        return a.choice(self.index, "".join(self.content), self.last.finish_reason, False, lp, self.calls, reasoning)


class Answer:
    """The answer to a ``Prepared`` request from its choices' ``(index, output)`` pairs."""

    def __init__(self, prepared: Prepared, outputs: AsyncIterator[tuple[int, RequestOutput]], tokenizer,
                 model_name: str) -> None:
        self.prepared, self.outputs, self.tokenizer, self.model_name = prepared, outputs, tokenizer, model_name
        chat = prepared.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.want_logprobs = prepared.requests[0].sampling.logprobs is not None
        self.think = tokenizer.think_ids() if prepared.thought is not None else None
        self.choices = [_Choice(i, self) for i in range(prepared.total)]
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": self.id, "created": self.created, "model": model_name}
        self._whole_head = {**head, "object": kind}
        self._chunk_head = {**head, "object": kind + ".chunk" if chat else kind}

    def token_text(self, token: int) -> str:
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")

    def echoed(self, i: int, first: RequestOutput) -> dict | None:
        """With logprobs, choice i's echoed prompt's scored tokens (from its first output)."""
        if not self.want_logprobs:
            return None
        prompt = list(self.prepared.requests[i // self.prepared.n].prompt_ids)
        return echo_logprobs(prompt, _scores(first), self.prepared.echo_k, self.token_text)

    def choice(self, i: int, text: str, finish: FinishReason | None, delta: bool, lp: dict | None,
               calls: list | None = None, reasoning: str | None = None) -> dict:
        finish_s = finish and str(finish)
        if self.prepared.kind != "chat":
            return {"index": i, "text": text, "finish_reason": finish_s, "logprobs": lp}
        msg = {"role": "assistant", "content": text} if not delta or text else {}
        if calls:
            msg = {"role": "assistant", "content": text or None,
                   "tool_calls": [c.openai(k) for k, c in enumerate(calls)]}
            finish_s = self.prepared.tool_finish if finish_s == "stop" else finish_s
        if self.think is not None and (reasoning or not delta):
            msg = {"role": "assistant", **msg, "reasoning_content": reasoning or None}
        return {"index": i, "delta" if delta else "message": msg, "finish_reason": finish_s, "logprobs": lp}


    def usage(self) -> dict:
        counts = [c.counts for c in self.choices] if self.think is not None else None
        return usage_of([c.last for c in self.choices], self.prepared.n, counts, self.prepared.scores_only)

    async def whole(self) -> dict:
        """The whole answer, once every choice has finished."""
        async for i, item in self.outputs:
            self.choices[i].feed(item)
        p = self.prepared
        choices = [c.whole() for c in self.choices]
        if p.prompt_k is not None and p.kind == "completion":
            for c, out in zip(self.choices, choices, strict=True):
                out["prompt_logprobs"] = self._prompt_logprobs(c)
        out = {**self._whole_head, "choices": choices, "usage": self.usage()}
        if p.prompt_k is not None and p.kind == "chat":  # one prompt for every choice
            out["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
        return out

    def _prompt_logprobs(self, c: _Choice) -> list:
        prompt = list(self.prepared.requests[c.index // self.prepared.n].prompt_ids)
        return prompt_logprobs(prompt, _scores(c.first), self.prepared.prompt_k, self.token_text)

    async def chunks(self) -> AsyncIterator[dict]:
        """The streamed answer: a chunk per output, a usage chunk when asked for; a failure (the
        status line went out already) is an error chunk."""
        usage = {"usage": None} if self.prepared.include_usage else {}
        try:
            async for i, item in self.outputs:
                text, reasoning, calls, lp = self.choices[i].feed(item)
                yield {**self._chunk_head, "choices": [self.choice(i, text, item.finish_reason, True, lp, calls,
                                                                   reasoning)], **usage}
            if usage:
                yield {**self._chunk_head, "choices": [], "usage": self.usage()}
        except Exception as e:  # noqa: BLE001 - reported in the stream
            err = e if isinstance(e, APIError) and e.status == 503 else APIError(500, "the request failed", "server_error")
            if err.status == 500:
                log.exception("streaming request failed")
            yield error_body(err.message, err.type, None, err.code)


def _scores(first: RequestOutput) -> list[TokenLogprob | None]:
    if first.prompt_logprobs is None:
        raise RuntimeError("the replica's first output has no prompt logprobs")
    return first.prompt_logprobs


def usage_of(lasts: list[RequestOutput], n: int, reasoning: list[ReasoningTokens] | None = None,
             scores_only: bool = False) -> dict:
    """Usage of a request of one prompt or a batch, whose prompt p's choices are ``lasts[p * n
    : p * n + n]``: each prompt's usage, summed; ``scores_only``: no completion tokens (the
    engine's one token was not returned)."""
    total: dict = {}
    for p in range(0, len(lasts), n):
        group = lasts[p : p + n]
        if scores_only:
            group = [last._replace(completion_tokens=0) for last in group]
        _add(total, _prompt_usage(group, reasoning[p : p + n] if reasoning is not None else None))
    return total


def _prompt_usage(lasts: list[RequestOutput], reasoning: list[ReasoningTokens] | None) -> dict:
    """Usage of one prompt from each choice's last output: the prompt counts once, and as cached
    only the tokens every choice found in the cache (``prompt_cache_hit_sources``: where that
    choice's cached KV came from: this replica's pool or node's RAM, the node's SSD, another
    node); ``reasoning``: each choice's count of its thought's tokens (a model that reasons)."""
    least = min(lasts, key=lambda last: last.cached_tokens)
    prompt, hit = lasts[0].prompt_tokens, least.cached_tokens
    completion = sum(last.completion_tokens for last in lasts)
    sources = least.sources
    out = {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_cache_hit_tokens": hit, "prompt_cache_miss_tokens": prompt - hit,
        "prompt_cache_hit_sources": {"ram": sources.ram, "ssd": sources.ssd, "remote": sources.remote},
        # the cache's accounting of this prompt: what the fleet held (the directory's answer),
        # what routing chose to load, and why the computed tokens of whole units were computed
        "prompt_cache_accounting": sources.accounting(prompt),
        "prompt_tokens_details": {"cached_tokens": hit},
    }
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": sum(r.count for r in reasoning)}
    return out


def _add(total: dict, part: dict) -> None:
    """Add ``part``'s numbers into ``total``'s, key by key (nested dicts too)."""
    for key, value in part.items():
        if isinstance(value, dict):
            _add(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0) + value
