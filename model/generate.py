"""Single-sequence generation without an engine (reference path, CLI, tests).

The serving engine (``cluster/``) batches many sequences over a shared pool; this loop runs one
sequence over a private pool and is the "one process computing everything" reference.
"""

from __future__ import annotations

import torch

from model.grammar import GrammarState, apply_masks
from model.model import DeepseekModel
from model.sampling import SamplingParams, sample

__all__ = ["generate"]


def generate(
    model: DeepseekModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams | None = None,
    eos_id: int | None = None,
    page_size: int = 16,
    grammar: GrammarState | None = None,
) -> list[int]:
    """Generated token ids (the EOS id included when it ends the output); greedy by default.
    ``grammar``: structured output (each token keeps the output a prefix of what the grammar
    matches; the output ends when it is whole), from where the state says (an R1 state's
    ``constrain_after``)."""
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
    while True:
        if grammar is not None and grammar.active:
            logits = apply_masks(logits, [0], [grammar])
        tok = int(sample(logits, [params], [gen], [out], [list(prompt_ids) + out] if params.repeats else None)[0])
        out.append(tok)
        if grammar is not None:
            grammar.feed(tok)
        done = grammar is not None and grammar.done()
        if tok == eos_id or len(out) == max_new_tokens or done:
            return out
        pos = len(prompt_ids) + len(out) - 1
        logits = model.decode(torch.tensor([tok]), pool, table[None], torch.tensor([pos]))
