"""DeepSeek Sparse Attention (V3.2): the lightning indexer that picks each query's keys.

Legend: T queries, S keys (positions 0..S-1 of one sequence), B sequences, M hidden size,
Q ``q_lora_rank``, G indexer heads (``index_n_heads``), I indexer head dim (``index_head_dim``),
P rope dims (``qk_rope_head_dim``), K ``index_topk``.

Each layer keeps one indexer key [I] per token beside its latent (a second plane of the KV pool).
A query scores every earlier key with ``sum_g w[g] * relu(q[g] . k * I^-0.5)`` and attends only to
its top K; a sequence of at most K tokens attends densely. The scores are what DeepSeek's
reference computes in fp8 after a Hadamard rotation; the rotation is orthogonal (it preserves
dot products), so they are computed here directly, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.layers import linear
from model.rope import apply_rope

__all__ = ["Indexer", "IndexerWeights", "SCORE_ROWS", "index_scores", "select_top_k"]

SCORE_ROWS = 256  # queries scored at once: their [rows, G, S] scores bound the scratch memory


@dataclass(slots=True)
class IndexerWeights:
    wq_b: torch.Tensor  # [G*I, Q]
    wk: torch.Tensor  # [I, M]
    k_norm: torch.Tensor  # [I] (LayerNorm weight)
    k_norm_bias: torch.Tensor  # [I]
    weights_proj: torch.Tensor  # [G, M]


class Indexer:
    def __init__(self, cfg: ModelConfig, w: IndexerWeights) -> None:
        self.cfg, self.w = cfg, w
        self.topk = cfg.index_topk
        self.heads, self.dim = cfg.index_n_heads, cfg.index_head_dim
        self.scale = self.dim**-0.5

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, M] -> the tokens' indexer keys [T, I] (LayerNorm, then half-split RoPE on the
        first P dims, unlike the interleaved RoPE of the MLA latent)."""
        k = F.layer_norm(linear(x, self.w.wk), (self.dim,), self.w.k_norm, self.w.k_norm_bias, 1e-6)  # [T, I]
        p = self.cfg.qk_rope_head_dim
        return torch.cat((apply_rope(k[:, :p], cos, sin, interleave=False), k[:, p:]), dim=-1)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, M], q_resid [T, Q] (the normed low-rank query) -> (queries [T, G, I] fp32,
        head weights [T, G] fp32, scale folded in)."""
        t, p = x.shape[0], self.cfg.qk_rope_head_dim
        q = linear(q_resid, self.w.wq_b).view(t, self.heads, self.dim)  # [T, G, I]
        q = torch.cat((apply_rope(q[..., :p], cos, sin, interleave=False), q[..., p:]), dim=-1)
        weights = F.linear(x.float(), self.w.weights_proj.float()) * self.heads**-0.5  # [T, G]
        return q.float(), weights

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
               ) -> torch.Tensor:
        """``select_top_k`` with this layer's K and scale."""
        return select_top_k(q, weights, keys, visible, self.topk, self.scale)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, G, I], weights [T, G], keys [S, I] (one sequence's) or [T, S, I] (a key set per
    query) -> the lightning indexer's scores [T, S] fp32: sum_g w[g] * relu(q[g] . k * scale)."""
    k = keys.float()
    if k.dim() == 2:
        s = torch.einsum("tgi,si->tgs", q, k)  # [T, G, S]
    else:
        s = torch.einsum("tgi,tsi->tgs", q, k)
    return torch.einsum("tg,tgs->ts", weights, s.mul_(scale).relu_())


def select_top_k(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, top_k: int,
                 scale: float) -> torch.Tensor:
    """The top-K visible keys of each query as a mask: q [T, G, I], weights [T, G], keys [S, I] or
    [T, S, I], visible [T, S] bool (causality, padding) -> [T, S] bool, True at the keys each
    query attends (a subset of ``visible``; all of it where at most K keys are)."""
    if visible.shape[-1] <= top_k:
        return visible
    out = torch.zeros_like(visible)
    for r in range(0, q.shape[0], SCORE_ROWS):
        rows = slice(r, r + SCORE_ROWS)
        ks = keys if keys.dim() == 2 else keys[rows]
        sc = index_scores(q[rows], weights[rows], ks, scale).masked_fill_(~visible[rows], float("-inf"))
        out[rows] = _top_k_earliest(sc, top_k)
    return out & visible


def _top_k_earliest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, S] -> bool [T, S]: each row's k best, ties at the k-th score broken towards earlier
    keys. (``topk`` breaks ties by its own order, which changes with the row's length: a
    sequence's selection, and its tokens, would then depend on the batch it is padded in.)"""
    threshold = scores.topk(k, dim=-1).values[:, -1:]  # [T, 1]
    above = scores > threshold
    tied = scores == threshold
    room = k - above.sum(dim=-1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=-1) <= room))
