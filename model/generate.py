"""Single-sequence generation without an engine (reference path, CLI, tests).

The serving engine (``cluster/``) batches many sequences over a shared pool; this loop runs one
sequence over a private pool and is the "one process computing everything" reference.
"""

from __future__ import annotations

import torch

from model.model import DeepseekModel
from model.sampling import SamplingParams, sample
from model.structured import JsonMasks

__all__ = ["generate"]


def generate(
    model: DeepseekModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams | None = None,
    eos_id: int | None = None,
    page_size: int = 16,
    json_masks: JsonMasks | None = None,
    constrain_after: int | None = None,
) -> list[int]:
    """Generated token ids (the EOS id included when it ends the output); greedy by default.
    ``json_masks``: JSON mode (each token keeps the output a prefix of what the masks' grammar
    accepts: one JSON object, or a schema's value; the output ends when it is whole), from the
    first token or, with ``constrain_after`` (R1's ``</think>`` id), from the token after it."""
    params = params or SamplingParams()
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    total = len(prompt_ids) + max_new_tokens
    if total > model.cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the context "
            f"length {model.cfg.max_position_embeddings}"
        )
    num_pages = -(-total // page_size)
    pool = model.new_pool(num_pages, page_size)
    table = torch.arange(num_pages)
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    logits = model.prefill(torch.tensor(prompt_ids), pool, table)[None]  # [1, V]
    out: list[int] = []
    state = json_masks.grammar.start if json_masks is not None else None
    active = constrain_after is None
    while True:
        if json_masks is not None and active:
            logits = json_masks.apply(logits, [0], [state], fallback=eos_id)
        tok = int(sample(logits, [params], [gen], [out], [list(prompt_ids) + out] if params.repeats else None)[0])
        out.append(tok)
        if json_masks is not None and active:
            state = json_masks.advance(state, tok)
        elif tok == constrain_after:
            active = True
        done = json_masks is not None and active and json_masks.done(state)
        if tok == eos_id or len(out) == max_new_tokens or done:
            return out
        pos = len(prompt_ids) + len(out) - 1
        logits = model.decode(torch.tensor([tok]), pool, table[None], torch.tensor([pos]))
