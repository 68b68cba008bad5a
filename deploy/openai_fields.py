"""OpenAI's documented request fields that this server accepts without serving them, per route.

A request model (``deploy.protocol``, ``deploy.responses_api``) declares the fields it serves;
an unknown field is a 400 naming it, so a typo never falls back to a default silently. The
fields OpenAI documents that are not served are one of two kinds, listed here and nowhere else:

- ``NO_OP``: accepted and without effect here, each for the reason given (a hint this server
  has no use for, or a record it does not keep); they are dropped before the model reads the body.
- ``UNSERVED``: a capability this server does not have (audio, web search, stored prompts...):
  accepted at their empty values (clients send ``null``), a 400 naming the field otherwise,
  because ignoring them would answer a different question than the one asked.

``tests/deploy/test_openai_fields.py`` checks these lists with the request models against the
official ``openai`` package's parameter types: a field OpenAI adds fails it until it is listed.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

__all__ = ["NO_OP", "UNSERVED", "accepted_body", "unserved_message"]

_HINTS = {
    "store": "nothing is kept for OpenAI's evals or distillation",
    "metadata": "tags for OpenAI's stored completions; nothing is stored",
    "service_tier": "one tier here",
    "user": "an end-user id for abuse monitoring (usage is counted per API key's tenant)",
    "safety_identifier": "an end-user id for abuse monitoring (usage is counted per API key's tenant)",
    "prompt_cache_key": "the prompt cache finds prefixes by content on every node, with no key",
    "prompt_cache_options": "the prompt cache finds prefixes by content on every node, with no key",
    "prompt_cache_retention": "the cache keeps units until evicted by size, on every node's SSD",
}

NO_OP: dict[str, dict[str, str]] = {
    "chat": {
        **_HINTS,
        "reasoning_effort": "DeepSeek's models reason as their chat template says (chat_template_kwargs)",
        "verbosity": "a length hint for OpenAI's models; max_tokens bounds the answer",
        "prediction": "predicted outputs speed up generation only; the output is the same without them",
    },
    "completions": {"user": _HINTS["user"]},
    "responses": {
        **_HINTS,
        "include": "extra outputs (encrypted reasoning, logprobs, search results) of OpenAI's hosted tools; "
                   "the reasoning comes back as its item, unencrypted",
        "reasoning": "DeepSeek's models reason as their chat template says",
        "stream_options": "obfuscation padding of streamed events, which a self-hosted server has no use for",
        "truncation": "a conversation longer than the model's context is a 400 either way (nothing is dropped)",
        "top_logprobs": "Responses logprobs come only with include message.output_text.logprobs, not served",
        "max_tool_calls": "it bounds calls of OpenAI's built-in tools, of which this server has none",
    },
}

UNSERVED: dict[str, dict[str, str]] = {
    "chat": {
        "audio": "audio output",
        "modalities": "output modalities other than text",
        "web_search_options": "web search",
        "functions": "the deprecated functions (use tools)",
        "function_call": "the deprecated function_call (use tool_choice)",
        "moderation": "moderation of the output",
    },
    "completions": {},
    "responses": {
        "background": "background responses",
        "background_options": "background responses",
        "conversation": "stored conversations (send the conversation as input)",
        "prompt": "stored prompt templates",
        "image": "image generation",
        "context_management": "server-side compaction of the context",
        "moderation": "moderation of the output",
        "access_programs": "OpenAI's access programs",
    },
}

_EMPTY = (None, False, "", [], {}, ["text"], "disabled")  # ["text"]: modalities; "disabled": truncation


def accepted_body(route: str, body: Any, declared: Container[str] = ()) -> tuple[Any, str | None]:
    """(``body``, a request's JSON object, without its ``NO_OP`` and empty ``UNSERVED`` fields
    but those the request model ``declared`` (a Response echoes its ``metadata``); the first
    ``UNSERVED`` field given a value, else None). Anything else is left for the model to judge."""
    if not isinstance(body, dict):
        return body, None
    for name in UNSERVED[route]:
        if body.get(name) not in _EMPTY:
            return body, name
    dropped = NO_OP[route].keys() | UNSERVED[route].keys()
    return {k: v for k, v in body.items() if k not in dropped or k in declared}, None


def unserved_message(route: str, name: str) -> str:
    return f"{name}: this server does not serve {UNSERVED[route][name]}"
