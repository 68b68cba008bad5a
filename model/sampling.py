"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Legend: B sequences, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "sample"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """logits [B, V] fp32 (any device) -> token ids [B] on the CPU. ``generators[b]`` (a CPU
    generator) makes row b reproducible."""
    out = logits.argmax(dim=-1).cpu()  # [B]
    for b, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[b].cpu() / p.temperature  # [V]
        if p.top_k:
            kth = row.topk(min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = row.sort(descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = (cum - sorted_logits.softmax(-1)) >= p.top_p
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = row.softmax(-1)
        out[b] = torch.multinomial(probs, 1, generator=generators[b])[0]
    return out
