"""Reference computations the serving tests compare against: the model alone, one sequence."""

from __future__ import annotations

import torch


def logprobs_alone(model, prompt, tokens: list[int]) -> list[torch.Tensor]:
    """The model's log-softmax [V] before each of ``tokens`` after ``prompt``, one fresh prefill
    per step (no decode path, no shared pool)."""
    out = []
    for i in range(len(tokens)):
        ids = list(prompt) + tokens[:i]
        pool = model.new_pool(-(-len(ids) // 16), 16)
        out.append(model.prefill(torch.tensor(ids), pool, torch.arange(pool.num_pages)).log_softmax(-1))
    return out


def prompt_logprobs_alone(model, prompt) -> torch.Tensor:
    """The model's log-softmax [P - 1, V] at each prompt position but the last (row i scores
    token i + 1), from one fresh prefill of the whole prompt."""
    pool = model.new_pool(-(-len(prompt) // 16), 16)
    return model.prefill(torch.tensor(list(prompt)), pool, torch.arange(pool.num_pages), all_logits=True)[:-1].log_softmax(-1)
