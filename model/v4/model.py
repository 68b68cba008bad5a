"""The DeepSeek-V4 decoder: prefill (after any computed prefix), batched decode, and both in one pass.

Legend: N rows of a pass, T a chunk's tokens, B decode rows, M hidden, V vocab, S streams
(``hc_mult``).

The same calls as ``model.model.DeepseekModel`` (the engine drives either): the pool is a
``HybridKVPool``. A sequence's table is [pages] (the same pages hold its entries and its window
rows) or [2, pages] (pages for its entries, then window pages, those out of the window any);
a decode batch's is [B, pages] or [B, 2, pages]. Every part of a pass (a prefill chunk, each
decode row) is a ``Segment``: projections, hyper-connections and experts run over all rows at
once, attention per segment over its own sequence's pages.

With ``hidden`` a pass also returns its rows' streams after the last layer [N, S, M] (before
their final collapse): what the MTP layers (``model.v4.mtp``) draft from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import Impl
from model.layers import linear, rms_norm
from model.v4.attention import Attention, Segment
from model.v4.config import V4Config
from model.v4.kv import HybridKVPool
from model.v4.layers import HyperConnection, HyperHead, Rope
from model.v4.moe import V4MoE
from model.v4.mtp import V4MtpLayer

__all__ = ["DeepseekV4Model", "V4Layer"]


@dataclass(slots=True)
class V4Layer:
    attn_norm: torch.Tensor  # [M]
    attn: Attention
    ffn_norm: torch.Tensor  # [M]
    mlp: V4MoE
    attn_hc: HyperConnection
    ffn_hc: HyperConnection


def _two_rows(table: torch.Tensor) -> torch.Tensor:
    """A sequence's tables as [2, pages]: its pages for compressed entries, then for window rows
    (one [pages] table: the same pages for both)."""
    return table[None].expand(2, -1) if table.dim() == 1 else table


class DeepseekV4Model:
    def __init__(self, cfg: V4Config, embed: torch.Tensor, layers: list[V4Layer], norm: torch.Tensor,
                 lm_head: torch.Tensor, hc_head: HyperHead, ropes: dict[str, Rope], impl: Impl = "ref",
                 mtp: list[V4MtpLayer] | None = None) -> None:
        """``mtp``: the checkpoint's multi-token-prediction layers, when loaded (the draft of
        speculative decoding)."""
        assert len(layers) == cfg.num_hidden_layers, (len(layers), cfg.num_hidden_layers)
        self.cfg, self.embed, self.layers, self.norm, self.lm_head = cfg, embed, layers, norm, lm_head
        self.hc_head, self.ropes, self.impl = hc_head, ropes, impl
        self.mtp = list(mtp or [])
        self.cpu_step = False  # no fused C++ step: the engine reads it as DeepseekModel's
        self.paged_kernel = None
        self.window_keep = cfg.window_keep  # its window rows live in pages of their own (cluster.window_kv)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def moe_layers(self) -> list[V4MoE]:
        return [layer.mlp for layer in self.layers]

    def set_expert_executor(self, executor) -> None:
        for moe in self.moe_layers() + [m.layer.mlp for m in self.mtp]:
            moe.executor = executor

    def new_pool(self, num_pages: int, page_size: int = 16, num_window_pages: int | None = None) -> HybridKVPool:
        return HybridKVPool(self.cfg, num_pages, page_size, self.dtype, self.device, num_window_pages,
                            draft_layers=len(self.mtp))

    def warmup(self, prefill_tokens: int = 256, decode_batch: int = 1) -> None:
        """One prefill and one decode step on a scratch pool (nothing is left behind)."""
        n = max(1, min(prefill_tokens, self.cfg.max_position_embeddings - 1))
        pages = -(-(n + 1) // 16)
        pool = self.new_pool(pages * decode_batch, 16)
        tables = torch.arange(pages * decode_batch).view(decode_batch, pages)
        gen = torch.Generator().manual_seed(0)
        for row in tables:
            self.prefill(torch.randint(0, self.cfg.vocab_size, (n,), generator=gen), pool, row)
        self.decode(torch.zeros(decode_batch, dtype=torch.long), pool, tables, torch.full((decode_batch,), n))

    # -- the engine's calls ----------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, pool: HybridKVPool, block_table: torch.Tensor, start: int = 0,
                attn: str = "auto", all_logits: bool = False, hidden: bool = False):
        """Run ``token_ids`` [T] at positions ``start..start+T-1`` of one sequence whose earlier
        state is in ``pool`` at ``block_table``; returns fp32 logits, [V] for the last token or
        [T, V] with ``all_logits`` (and with ``hidden`` every token's streams [T, S, M]).
        ``attn`` is accepted for DeepseekModel's signature."""
        seg = self._chunk(token_ids, block_table, start, pool.page_size, 0)
        streams = self._forward(token_ids.to(self.device), seg.positions, [seg], pool)
        h = self.hc_head(streams, self.cfg)
        logits = self._logits(h if all_logits else h[-1])
        return (logits, streams) if hidden else logits

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, pool: HybridKVPool, block_tables: torch.Tensor,
               positions: torch.Tensor, attn: str = "absorbed", micro_batches: int = 1,
               max_len: int | None = None, hidden: bool = False):
        """One token for each of B sequences: token_ids [B], block_tables [B, pages], positions
        [B] (each sequence's length before the step) -> fp32 logits [B, V] (and with ``hidden``
        the rows' streams [B, S, M]). Rows may be one sequence's consecutive positions (a
        speculative step's verify rows): every row's state is written before any row attends."""
        if micro_batches not in (1, 2):
            raise ValueError(f"micro_batches must be 1 or 2, got {micro_batches}")
        segs = self._rows(block_tables, positions, pool.page_size, 0)
        streams = self._forward(token_ids.to(self.device), positions.to(self.device), segs, pool)
        logits = self._logits(self.hc_head(streams, self.cfg))
        return (logits, streams) if hidden else logits

    @torch.inference_mode()
    def mixed(self, chunk_ids: torch.Tensor, chunk_table: torch.Tensor, chunk_start: int, token_ids: torch.Tensor,
              block_tables: torch.Tensor, positions: torch.Tensor, pool: HybridKVPool, decode_attn: str = "absorbed",
              micro_batches: int = 1, hidden: bool = False):
        """A prefill chunk and a decode batch in one pass: ([V] of the chunk's last token, [B, V]),
        with ``hidden`` then the chunk's and the batch's streams ([T, S, M], [B, S, M])."""
        chunk = self._chunk(chunk_ids, chunk_table, chunk_start, pool.page_size, 0)
        t = chunk_ids.shape[0]
        segs = [chunk, *self._rows(block_tables, positions, pool.page_size, t)]
        ids = torch.cat((chunk_ids.to(self.device), token_ids.to(self.device)))
        streams = self._forward(ids, torch.cat((chunk.positions, positions.to(self.device))), segs, pool)
        h = self.hc_head(streams, self.cfg)
        logits = self._logits(torch.cat((h[t - 1 : t], h[t:])))
        if hidden:
            return logits[0], logits[1:], streams[:t], streams[t:]
        return logits[0], logits[1:]

    # -- the MTP layers' calls (as DeepseekModel's) ----------------------------------------------
    @torch.inference_mode()
    def draft(self, k: int, hidden: torch.Tensor, next_ids: torch.Tensor, pool: HybridKVPool,
              block_tables: torch.Tensor, positions: torch.Tensor,
              max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer ``k`` over B rows, each a position of a sequence (rows may be one sequence's
        consecutive positions): ``hidden`` [B, S, M] the streams there (a pass's, or layer
        k-1's), ``next_ids`` [B] the token after it. Writes the layer's window rows at those
        positions; returns (fp32 logits [B, V] of the token after next, the layer's output
        streams [B, S, M] that a chained draft reads)."""
        segs = self._rows(block_tables, positions, pool.page_size, 0)
        return self._draft_pass(k, hidden, next_ids, positions.to(self.device), segs, pool)

    @torch.inference_mode()
    def draft_chunk(self, k: int, hidden: torch.Tensor, next_ids: torch.Tensor, pool: HybridKVPool,
                    block_table: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer ``k`` over a prompt chunk's positions ``start..start+T-1`` of one sequence
        (``hidden`` [T, S, M], ``next_ids`` [T] as in ``draft``): writes their window rows;
        returns the last position's (fp32 logits [V], streams [S, M])."""
        seg = self._chunk(next_ids, block_table, start, pool.page_size, 0)
        logits, streams = self._draft_pass(k, hidden, next_ids, seg.positions, [seg], pool, last=True)
        return logits[0], streams[-1]

    def verify_draft(self, token_ids, pool, block_tables, positions) -> None:
        """No fused verify-and-draft step for V4 (the engine runs ``decode``, then ``draft``)."""
        return None

    def _draft_pass(self, k: int, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                    segs: list[Segment], pool: HybridKVPool, last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        mtp, ids = self.mtp[k], next_ids.to(self.device)
        x = mtp.inputs(self.embed, hidden.to(self.device), ids, self.cfg.rms_norm_eps)
        streams = self._block(mtp.layer, x, ids, positions, segs, pool)
        normed = mtp.normed(streams[-1:] if last else streams, self.cfg)
        return linear(normed, self.lm_head).float(), streams

    # -- the pass --------------------------------------------------------------------------
    def _chunk(self, token_ids: torch.Tensor, table: torch.Tensor, start: int, page_size: int, row: int) -> Segment:
        t = token_ids.shape[0]
        if t == 0:
            raise ValueError("prefill needs at least one token")
        table = _two_rows(table.to(self.device))
        if table.shape[1] * page_size < start + t:
            raise ValueError(f"block table of {table.shape[1]} pages holds {table.shape[1] * page_size} tokens, "
                             f"sequence needs {start + t}")
        positions = torch.arange(start, start + t, device=self.device)
        return Segment(slice(row, row + t), start, table[0], table[1], positions)

    def _rows(self, tables: torch.Tensor, positions: torch.Tensor, page_size: int, row: int) -> list[Segment]:
        tables, pos = tables.to(self.device), positions.tolist()
        if tables.dim() == 2:
            tables = tables[:, None].expand(-1, 2, -1)
        if pos and tables.shape[2] * page_size < max(pos) + 1:
            raise ValueError(f"block tables hold {tables.shape[2] * page_size} tokens, need {max(pos) + 1}")
        return [Segment(slice(row + b, row + b + 1), p, tables[b, 0], tables[b, 1], positions[b : b + 1].to(self.device))
                for b, p in enumerate(pos)]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, segs: list[Segment], pool: HybridKVPool
                 ) -> torch.Tensor:
        """The streams [N, S, M] after the last layer (``hc_head`` collapses them)."""
        streams = self.embed[ids].unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [N, S, M]
        for layer in self.layers:
            streams = self._block(layer, streams, ids, positions, segs, pool)
        return streams

    def _block(self, layer: V4Layer, streams: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
               segs: list[Segment], pool: HybridKVPool) -> torch.Tensor:
        """One decoder block: attention, then the MoE, each between its hyper-connections."""
        cfg = self.cfg
        post, comb, x = layer.attn_hc(streams, cfg)
        out = layer.attn(rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), positions, segs, pool, self.ropes["compress"])
        streams = HyperConnection.merge(streams, out, post, comb)
        post, comb, x = layer.ffn_hc(streams, cfg)
        out = layer.mlp(rms_norm(x, layer.ffn_norm, cfg.rms_norm_eps), ids)
        return HyperConnection.merge(streams, out, post, comb)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(h, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()
