"""DeepSeek-V4's multi-token-prediction (MTP) layer: the draft of speculative decoding.

Legend: R rows, S streams (``hc_mult``), M hidden, V vocab.

A V4 checkpoint stores it as ``mtp.{k}.`` (``num_nextn_predict_layers`` of them): a decoder block
like the model's, attending over a sliding window only and routing top-k. For position i it reads
the model's streams there (after the last layer, before their final collapse) and the embedding
of token i+1, mixed on every stream, and predicts token i+2 with its own collapse and norm and
the model's LM head:

    streams = e_proj(enorm(embed(t[i+1]))) + h_proj(hnorm(h[i]))   (h[i]: [S, M], per stream)
    -> the block -> hc_head -> norm -> LM head

Chained, the layer reads its own output streams at the previous draft. Its window rows live in
the pool's ``swa`` plane after the model's layers (``HybridKVPool(draft_layers=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.layers import linear, rms_norm
from model.v4.config import V4Config
from model.v4.layers import HyperHead

__all__ = ["V4MtpLayer"]


@dataclass(slots=True)
class V4MtpLayer:
    enorm: torch.Tensor  # [M] the next token's embedding
    hnorm: torch.Tensor  # [M] each stream it drafts from
    e_proj: torch.Tensor  # [M, M]
    h_proj: torch.Tensor  # [M, M]
    layer: object  # model.v4.model.V4Layer (layer num_hidden_layers + k)
    hc_head: HyperHead
    norm: torch.Tensor  # [M] before the LM head

    def inputs(self, embed: torch.Tensor, streams: torch.Tensor, next_ids: torch.Tensor, eps: float) -> torch.Tensor:
        """[R, S, M]: the block's input streams for ``streams`` [R, S, M] and the next tokens [R]."""
        e = linear(rms_norm(embed[next_ids.to(embed.device)], self.enorm, eps), self.e_proj)  # [R, M]
        r, s, m = streams.shape
        h = linear(rms_norm(streams.reshape(r * s, m).to(e.dtype), self.hnorm, eps), self.h_proj).view(r, s, m)
        return (e.unsqueeze(1) + h).contiguous()

    def normed(self, streams: torch.Tensor, cfg: V4Config) -> torch.Tensor:
        """[R, M]: the block's output streams [R, S, M] collapsed and normed, as the LM head reads them."""
        return rms_norm(self.hc_head(streams, cfg), self.norm, cfg.rms_norm_eps)
