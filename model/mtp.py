"""DeepSeek's multi-token-prediction (MTP, "NextN") layers: the draft of speculative decoding.

Legend: R rows, M hidden, V vocab.

A V3/R1 checkpoint declares ``num_nextn_predict_layers`` and stores them after its last decoder
layer (``model.layers.{L + k}.``). For position i, MTP layer k reads the hidden state there (the
main model's last layer normed as its LM head reads it, or layer k-1's output when chained) and
the embedding of token i+1, and predicts token i+2:

    eh_proj([enorm(embed(t[i+1])), hnorm(h[i])]) -> one decoder layer -> head norm -> LM head

Its decoder layer (MLA attention, then MoE) keeps its latents in the pool's layer L + k, beside
the model's, so pages, prefix sharing, cache units and handoffs carry them with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import ModelConfig
from model.layers import linear, rms_norm

__all__ = ["MtpLayer", "mtp_prefix"]


def mtp_prefix(cfg: ModelConfig, k: int) -> str:
    """The HF name prefix of MTP layer ``k`` (after the model's last decoder layer)."""
    return f"model.layers.{cfg.num_hidden_layers + k}."


@dataclass(slots=True)
class MtpLayer:
    enorm: torch.Tensor  # [M] the next token's embedding
    hnorm: torch.Tensor  # [M] the hidden state it drafts from
    eh_proj: torch.Tensor  # [M, 2M]
    layer: object  # model.model.DecoderLayer
    head_norm: torch.Tensor  # [M]
    embed: torch.Tensor  # [V, M]: the model's, unless the checkpoint stores its own
    lm_head: torch.Tensor  # [V, M]: likewise

    def inputs(self, hidden: torch.Tensor, next_ids: torch.Tensor, eps: float) -> torch.Tensor:
        """[R, M]: the decoder layer's input for ``hidden`` [R, M] and the next tokens [R]."""
        e = rms_norm(self.embed[next_ids.to(self.embed.device)], self.enorm, eps)
        h = rms_norm(hidden.to(e.dtype), self.hnorm, eps)
        return linear(torch.cat((e, h), dim=-1), self.eh_proj)

    def head(self, h: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logits [R, V], the normed hidden states [R, M] a chained draft reads)."""
        normed = rms_norm(h, self.head_norm, eps)
        return linear(normed, self.lm_head).float(), normed
