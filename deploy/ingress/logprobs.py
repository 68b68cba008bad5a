"""Token logprobs in the OpenAI and vLLM shapes: chat's, completions' (with echo), prompt logprobs."""

from __future__ import annotations

import dataclasses

from model.sampling_params import TokenLogprob

__all__ = ["chat_logprobs", "completion_logprobs", "echo_logprobs", "joined_logprobs", "prompt_logprobs"]


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
            "top_logprobs": [_by_text(e.top, token_text) for e in entries], "text_offset": offsets}


def _by_text(top: list[tuple[int, float]], token_text) -> dict[str, float]:
    """The alternatives keyed by their text, as OpenAI's completions give them: of tokens with the
    same text (special tokens, partial characters) the likelier one's logprob."""
    out: dict[str, float] = {}
    for i, v in top:
        out.setdefault(token_text(i), v)
    return out


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
