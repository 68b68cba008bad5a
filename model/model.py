"""The DeepSeek-V2/V3 decoder: prefill (optionally after a cached prefix) and batched decode.

Legend: T new tokens, B sequences, S attended tokens, M hidden, V vocab, D latent dims.

Single device, no processes, no scheduling: the engine owns the ``LatentKVPool`` and the block
tables; this module reads and writes latents where it is told to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from kernels import Impl
from kernels.cpu_gemv import cpu_kernels
from kernels.index_topk import index_topk, kept_indices
from model.config import ModelConfig
from model.cpu_step import CpuStep, Stack
from model.dsa import Indexer
from model.kv_cache import LatentKVPool, slots_for
from model.layers import SwiGLU, linear, rms_norm
from model.mla import MLA, MQA_MAX_QUERIES, absorbed_pays
from model.moe import MoE
from model.mtp import MtpLayer
from model.rope import RotaryEmbedding

__all__ = ["DecoderLayer", "DeepseekModel"]

AttnPath = Literal["naive", "absorbed", "auto"]


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor  # [M]
    attn: MLA
    post_attn_norm: torch.Tensor  # [M]
    mlp: SwiGLU | MoE
    indexer: Indexer | None = None  # V3.2's: the keys each query attends


class DeepseekModel:
    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        layers: list[DecoderLayer],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        impl: Impl = "ref",
        mtp: list[MtpLayer] | None = None,
    ) -> None:
        """``mtp``: the checkpoint's multi-token-prediction layers, when loaded (the draft of
        speculative decoding); their latents live in the pool after the decoder layers'."""
        assert len(layers) == cfg.num_hidden_layers, (len(layers), cfg.num_hidden_layers)
        self.cfg = cfg
        self.embed = embed  # [V, M]
        self.layers = layers
        self.norm = norm  # [M]
        self.lm_head = lm_head  # [V, M]
        self.rope = RotaryEmbedding(cfg)
        # "triton": decode attends over the paged pool with kernels.mla_decode and the pool copies
        # units with kernels.unit_copy (MoE layers carry their own impl); "ref": pure torch.
        self.impl = impl
        # a decode pass of its own on a float32 CPU model runs as one C++ call (model.cpu_step)
        # where the model allows; False keeps it layer by layer in Python
        self.cpu_step = not cfg.index_topk
        self._cpu_step: CpuStep | None = None
        self.mtp = list(mtp or [])
        self._mtp_steps: list[CpuStep | None] = [None] * len(self.mtp)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights and pools live; token ids, block tables and positions may come from
        anywhere and are moved here."""
        return self.embed.device

    @property
    def paged_kernel(self) -> str | None:
        """The kernel that attends a decode batch over the paged pool in place: Triton's, or on a
        float32 CPU model the C++ one (``kernels.cpu_gemv``) when it is built; None: gather."""
        if self.cfg.index_topk:  # V3.2: the indexer's selection runs over gathered keys
            return None
        if self.impl == "triton":
            return "triton"
        if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels() is not None:
            return "cpu"
        return None

    @property
    def sparse_kernel(self) -> str | None:
        """The kernel that attends V3.2's queries over their chosen latents in place (each
        query's latents a table of one-token pages): Triton's, or the C++ one on a float32 CPU
        model; None: torch over gathered latents."""
        if self.impl == "triton":
            return "triton"
        if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels() is not None:
            return "cpu"
        return None

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def set_expert_executor(self, executor) -> None:
        """Route every MoE layer's experts, the MTP layers' too, through ``executor`` (see
        ``model.moe.ExpertExecutor``)."""
        for moe in self.moe_layers() + [m.layer.mlp for m in self.mtp if isinstance(m.layer.mlp, MoE)]:
            moe.executor = executor

    def new_pool(self, num_pages: int, page_size: int = 16) -> LatentKVPool:
        return LatentKVPool(self.cfg, num_pages, page_size, self.dtype, self.impl, self.device,
                            layers=self.cfg.num_hidden_layers + len(self.mtp))

    def warmup(self, prefill_tokens: int = 256, decode_batch: int = 1) -> None:
        """Run one prefill and one decode step on a scratch pool, so a server's first request does
        not pay for compiling and tuning the Triton kernels (tens of seconds per kernel on a GPU).
        The tiles are tuned per shape key: attention once, the grouped GEMM per rows-per-expert
        bucket, so a prefill and a decode cover the common ones. Leaves no state behind."""
        z = 16
        n = max(1, min(prefill_tokens, self.cfg.max_position_embeddings - 1))
        pages = -(-(n + 1) // z)
        pool = self.new_pool(pages * decode_batch, z)
        gen = torch.Generator().manual_seed(0)
        tables = torch.arange(pages * decode_batch).view(decode_batch, pages)
        for row in tables:
            self.prefill(torch.randint(0, self.cfg.vocab_size, (n,), generator=gen), pool, row)
        self.decode(torch.zeros(decode_batch, dtype=torch.long), pool, tables, torch.full((decode_batch,), n))

    def _ffn(self, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        return h + layer.mlp(rms_norm(h, layer.post_attn_norm, self.cfg.rms_norm_eps))

    def _normed(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(self._normed(h), self.lm_head).float()

    def _logits_hidden(self, h: torch.Tensor, hidden: bool):
        """The logits of ``h``, with its normed rows when ``hidden``."""
        if not hidden:
            return self._logits(h)
        normed = self._normed(h)
        return linear(normed, self.lm_head).float(), normed

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: torch.Tensor,
        pool: LatentKVPool,
        block_table: torch.Tensor,
        start: int = 0,
        attn: AttnPath = "auto",
        all_logits: bool = False,
        hidden: bool = False,
        before_layer: Callable[[int], None] | None = None,
    ):
        """Run ``token_ids`` [T] at positions ``start..start+T-1`` of one sequence.

        The latents of positions ``0..start-1`` must already be in ``pool`` at ``block_table``
        (computed earlier or loaded from the unit cache); the new tokens' latents are written
        there too. Returns fp32 logits, [V] for the last token or [T, V] with ``all_logits``.

        ``attn="auto"`` takes the path with fewer FLOPs (``model.mla.absorbed_pays``): absorbed for
        a short suffix after a long cached prefix, where expanding every cached token would
        dominate; naive otherwise, also for a long chunk of a chunked prefill.

        ``hidden``: (the logits, every token's final hidden state normed [T, M]: what the MTP
        layers draft from).

        ``before_layer(i)`` is called before layer ``i`` reads the pool: the prefix's latents
        of that layer may arrive as late as then (a prefix loaded layer by layer).
        """
        chunk = _Chunk.build(self, token_ids, block_table, start, pool.page_size, attn)
        h = self._forward(pool, chunk, None, before_layer=before_layer)
        if hidden:
            normed = self._normed(h)
            return linear(normed if all_logits else normed[-1], self.lm_head).float(), normed
        return self._logits(h if all_logits else h[-1])

    @torch.inference_mode()
    def decode(
        self,
        token_ids: torch.Tensor,
        pool: LatentKVPool,
        block_tables: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnPath = "absorbed",
        micro_batches: int = 1,
        max_len: int | None = None,
        hidden: bool = False,
    ):
        """One decode step for B sequences of different lengths.

        token_ids [B], block_tables [B, pages] (padded rows may repeat any valid page),
        positions [B] = the position of each new token (its sequence length before the step).
        Writes the new latents and returns fp32 logits [B, V].

        ``micro_batches=2`` splits the batch in two and pipelines them: while one half's MoE
        round is with the expert executor (remote shards under expert parallelism), the other
        half computes attention. Results are the same as one batch.

        ``max_len``: a bound on every sequence's length (the new token included) when the caller
        knows it; the step then never reads the positions back to the host (CUDA graphs).

        A float32 CPU model runs the absorbed step as one C++ call where it can (``model.cpu_step``:
        the same kernels in the same order, so the same logits).

        Rows may be the same sequence's consecutive positions (a speculative step's verify
        rows): each row's latent is written before any row attends. ``hidden``: (the logits,
        the rows' final hidden states normed [B, M]).
        """
        if micro_batches not in (1, 2):
            raise ValueError(f"micro_batches must be 1 or 2, got {micro_batches}")
        b = token_ids.shape[0]
        step = self._whole_cpu_step(b) if attn != "naive" else None
        if step is not None:  # one C++ call (its experts are local: nothing to pipeline)
            return step(_DecodeBatch.build(self, token_ids, block_tables, positions, pool.page_size, "absorbed",
                                           max_len), pool, hidden)
        if micro_batches == 2 and b >= 2:
            half = (b + 1) // 2
            parts = [_DecodeBatch.build(self, token_ids[sl], block_tables[sl], positions[sl], pool.page_size, attn,
                                        max_len) for sl in (slice(0, half), slice(half, b))]
            outs = [self._logits_hidden(h, hidden) for h in self._pipelined(parts, pool)]
            return torch.cat(outs) if not hidden else tuple(torch.cat(o) for o in zip(*outs, strict=True))
        batch = _DecodeBatch.build(self, token_ids, block_tables, positions, pool.page_size, attn, max_len)
        return self._logits_hidden(self._forward(pool, None, batch), hidden)

    @torch.inference_mode()
    def draft(self, k: int, hidden: torch.Tensor, next_ids: torch.Tensor, pool: LatentKVPool,
              block_tables: torch.Tensor, positions: torch.Tensor,
              max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer ``k`` over B rows, each a position of a sequence (rows may be one sequence's
        consecutive positions): ``hidden`` [B, M] the hidden state there (``decode(hidden=True)``'s
        or layer k-1's), ``next_ids`` [B] the token after it. Writes the layer's latents at those
        positions; returns (fp32 logits [B, V] of the token after next, the normed hidden states
        [B, M] that layer k+1 reads). ``max_len``: as ``decode``'s."""
        mtp, eps = self.mtp[k], self.cfg.rms_norm_eps
        batch = _DecodeBatch.build(self, next_ids, block_tables, positions, pool.page_size, "absorbed", max_len)
        batch.h = mtp.inputs(hidden, next_ids, eps)
        step = self._mtp_cpu_step(k, batch.h.shape[0])
        if step is not None and batch.paged == "cpu":
            return step(batch, pool, hidden=True)
        return mtp.head(self._forward(pool, None, batch, [(self.cfg.num_hidden_layers + k, mtp.layer)]), eps)

    @torch.inference_mode()
    def verify_draft(self, token_ids: torch.Tensor, pool: LatentKVPool, block_tables: torch.Tensor,
                     positions: torch.Tensor):
        """``decode(hidden=True)`` over a speculative step's verify rows and MTP layer 0 over the
        same rows, each row's argmax as the token after it, as one C++ call (``CpuStep.verify``)
        -> (logits [B, V], normed hidden [B, M], argmaxes [B], the draft after each row [B], MTP
        layer 0's normed hidden [B, M]); the MTP latents are right for the rows whose token turns
        out to be their argmax. None where the C++ steps cannot run this pass (call ``decode``)."""
        rows = token_ids.shape[0]
        step = self._whole_cpu_step(rows)
        draft = self._mtp_cpu_step(0, rows) if step is not None and self.mtp else None
        if draft is None:
            return None
        return step.verify(_DecodeBatch.build(self, token_ids, block_tables, positions, pool.page_size, "absorbed"),
                           pool, draft)

    @torch.inference_mode()
    def draft_chunk(self, k: int, hidden: torch.Tensor, next_ids: torch.Tensor, pool: LatentKVPool,
                    block_table: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer ``k`` over a prompt chunk's positions ``start..start+T-1`` of one sequence
        (``hidden`` [T, M], ``next_ids`` [T] as in ``draft``): writes their latents; returns the
        last position's (fp32 logits [V], normed hidden state [M])."""
        mtp, eps = self.mtp[k], self.cfg.rms_norm_eps
        chunk = _Chunk.build(self, next_ids, block_table, start, pool.page_size, "auto")
        chunk.h = mtp.inputs(hidden, next_ids, eps)
        h = self._forward(pool, chunk, None, [(self.cfg.num_hidden_layers + k, mtp.layer)])
        logits, normed = mtp.head(h[-1:], eps)
        return logits[0], normed[0]

    def _mtp_cpu_step(self, k: int, rows: int) -> CpuStep | None:
        """The C++ step of MTP layer ``k`` when it can run a pass of ``rows`` rows."""
        if not self.cpu_step or self.device.type != "cpu" or self.dtype != torch.float32:
            return None
        mtp = self.mtp[k]
        stack = Stack([mtp.layer], mtp.head_norm, mtp.lm_head, self.cfg.num_hidden_layers + k, mtp)
        step = self._mtp_steps[k] = CpuStep.of(self, self._mtp_steps[k], stack)
        return step if step.takes(rows) else None

    def _whole_cpu_step(self, rows: int) -> CpuStep | None:
        """The C++ decode step (``model.cpu_step``) when it can run a pass of ``rows`` rows."""
        if not self.cpu_step or self.device.type != "cpu" or self.dtype != torch.float32:
            return None
        self._cpu_step = CpuStep.of(self, self._cpu_step)
        return self._cpu_step if self._cpu_step.takes(rows) else None

    @torch.inference_mode()
    def mixed(
        self,
        chunk_ids: torch.Tensor,
        chunk_table: torch.Tensor,
        chunk_start: int,
        token_ids: torch.Tensor,
        block_tables: torch.Tensor,
        positions: torch.Tensor,
        pool: LatentKVPool,
        decode_attn: AttnPath = "absorbed",
        micro_batches: int = 1,
        hidden: bool = False,
    ):
        """A prefill chunk of one sequence and a decode step of B others in one forward pass:
        every projection and expert GEMM runs once over the T + B rows (the weights are read
        once), attention runs per part. Arguments as ``prefill(chunk_ids, pool, chunk_table,
        chunk_start)`` and ``decode(token_ids, pool, block_tables, positions)``; returns their
        logits, ([V] of the chunk's last token, [B, V]), the same as the two calls would.

        ``micro_batches=2``: the chunk and the batch are the two micro-batches, pipelined as in
        ``decode``: one's MoE round is with the expert executor while the other attends.

        ``hidden``: also the chunk's and the batch's final hidden states normed ([T, M], [B, M]).
        """
        if micro_batches not in (1, 2):
            raise ValueError(f"micro_batches must be 1 or 2, got {micro_batches}")
        chunk = _Chunk.build(self, chunk_ids, chunk_table, chunk_start, pool.page_size, "auto")
        batch = _DecodeBatch.build(self, token_ids, block_tables, positions, pool.page_size, decode_attn)
        step = self._whole_cpu_step(chunk.t + batch.h.shape[0]) if micro_batches == 1 else None
        if step is not None and chunk.paged == batch.paged == "cpu":  # one C++ call
            out = step.mixed(chunk, batch, _Rows.of(chunk, batch), pool, hidden)
            if not hidden:
                return out[0], out[1:]
            logits, normed = out
            return logits[0], logits[1:], normed[: chunk.t], normed[chunk.t :]
        if micro_batches == 2:
            h = torch.cat(self._pipelined([chunk, batch], pool))
        else:
            h = self._forward(pool, chunk, batch)
        if hidden:
            normed = self._normed(h)
            logits = linear(normed[chunk.t - 1 :], self.lm_head).float()
            return logits[0], logits[1:], normed[: chunk.t], normed[chunk.t :]
        logits = self._logits(h[chunk.t - 1 :])
        return logits[0], logits[1:]

    def _forward(self, pool: LatentKVPool, chunk: _Chunk | None, batch: _DecodeBatch | None,
                 layers: list[tuple[int, DecoderLayer]] | None = None,
                 before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states [T + B, M] after the last layer: the chunk's T rows, then the batch's B.
        Projections and FFNs run over all rows at once; each part attends over its own KV (on a
        float32 CPU model, where every part is read in place, all of them in one C++ call).
        ``layers``: (pool layer, layer) to run instead of the decoder's (an MTP layer);
        ``before_layer``: as ``prefill``'s."""
        parts = [p for p in (chunk, batch) if p is not None]
        h, cos, sin, new_slots = _Rows.of(*parts)
        fused = all(p.paged == "cpu" for p in parts)
        for i, layer in layers or enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            x = rms_norm(h, layer.input_norm, self.cfg.rms_norm_eps)
            if fused:  # one call past the projections
                h = self._ffn(layer, h + _attend_fused(layer.attn, x, cos, sin, pool, i, new_slots, chunk, batch))
                continue
            h = self._ffn(layer, h + _attend_parts(i, layer, x, cos, sin, new_slots, pool, chunk, batch))
        return h

    def _pipelined(self, parts: list[_Chunk | _DecodeBatch], pool: LatentKVPool) -> list[torch.Tensor]:
        """Two micro-batches (decode halves, or a prefill chunk and a decode batch), one layer
        apart: finishing micro-batch m's MoE of layer i-1 and its attention of layer i run while
        the other's MoE round is in flight. Returns each part's hidden states."""
        h = [p.h for p in parts]
        pending: list = [None, None]  # (residual, finisher) of an MoE round in flight
        for i, layer in enumerate(self.layers):
            for m, part in enumerate(parts):
                if pending[m] is not None:
                    residual, finish = pending[m]
                    h[m], pending[m] = residual + finish(), None
                h[m] = h[m] + self._attention(i, layer, h[m], part, pool)
                x = rms_norm(h[m], layer.post_attn_norm, self.cfg.rms_norm_eps)
                if isinstance(layer.mlp, MoE):
                    pending[m] = (h[m], layer.mlp.submit(x))
                else:
                    h[m] = h[m] + layer.mlp(x)
        for m in range(len(parts)):
            if pending[m] is not None:
                residual, finish = pending[m]
                h[m] = residual + finish()
        return h

    def _attention(self, i: int, layer: DecoderLayer, h: torch.Tensor, part: _Chunk | _DecodeBatch,
                   pool: LatentKVPool) -> torch.Tensor:
        """Attention output [rows, M] of layer ``i`` for one part (writes its new latents)."""
        x = rms_norm(h, layer.input_norm, self.cfg.rms_norm_eps)
        if part.paged == "cpu":
            chunk, batch = (part, None) if isinstance(part, _Chunk) else (None, part)
            return _attend_fused(layer.attn, x, part.cos, part.sin, pool, i, part.new_slots, chunk, batch)
        chunk, batch = (part, None) if isinstance(part, _Chunk) else (None, part)
        return _attend_parts(i, layer, x, part.cos, part.sin, part.new_slots, pool, chunk, batch)


class _Rows(NamedTuple):
    """The per-row inputs of a pass's parts (a chunk's rows, then a batch's) joined."""

    h: torch.Tensor  # [rows, M] embeddings
    cos: torch.Tensor
    sin: torch.Tensor
    new_slots: torch.Tensor  # [rows]

    @classmethod
    def of(cls, *parts: _Chunk | _DecodeBatch) -> _Rows:
        if len(parts) == 1:
            return cls(parts[0].h, parts[0].cos, parts[0].sin, parts[0].new_slots)
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in cls._fields))


def _attend_parts(i: int, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  new_slots: torch.Tensor, pool: LatentKVPool, chunk: _Chunk | None, batch: _DecodeBatch | None
                  ) -> torch.Tensor:
    """[T + B, M]: layer ``i``'s attention output for the normed inputs ``x`` of a chunk's T rows
    and a batch's B rows (either may be absent), each part over its own sequences' KV, the new
    latents (and V3.2's indexer keys) written first."""
    attn, t = layer.attn, chunk.t if chunk is not None else 0
    q_nope, q_rope, latent, q_resid = attn.project(x, cos, sin)
    pool.write(i, new_slots, latent)
    sparse = None
    if layer.indexer is not None:
        pool.write_index(i, new_slots, layer.indexer.keys(x, cos, sin))
        sparse = layer.indexer, *layer.indexer.queries(x, q_resid, cos, sin)
    outs = []
    if chunk is not None:
        part = None if sparse is None else (sparse[0], sparse[1][:t], sparse[2][:t])
        outs.append(chunk.attend(i, attn, q_nope[:t], q_rope[:t], latent[:t], pool, part))
    if batch is not None:
        part = None if sparse is None else (sparse[0], sparse[1][t:], sparse[2][t:])
        outs.append(batch.attend(i, attn, q_nope[t:], q_rope[t:], pool, part))
    return attn.output(outs[0] if len(outs) == 1 else torch.cat(outs))


def _attend_picked(attn: MLA, q_nope: torch.Tensor, q_rope: torch.Tensor, pool: LatentKVPool, i: int,
                   slots: torch.Tensor, kept: torch.Tensor, kernel: str | None) -> torch.Tensor:
    """[R, H, V]: each of R queries over its own chosen latents of layer ``i`` (``slots`` [R, K],
    ``kept`` [R, K] bool, the kept ones first): the paged kernel with a one-token page per
    latent, or torch over the gathered latents."""
    if kernel is not None:
        return attn.attend_paged(q_nope, q_rope, pool.data[i], slots, kept.sum(dim=1), 1, kernel)
    latents = pool.read(i, slots)  # [R, K, D]
    return attn.attend_absorbed(q_nope[:, None], q_rope[:, None], latents, kept[:, None])[:, 0]


_NO_TABLES, _NO_LENS = torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long)  # a pass with no decode rows


def _attend_fused(attn: MLA, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: LatentKVPool, i: int,
                  new_slots: torch.Tensor, chunk: _Chunk | None, batch: _DecodeBatch | None) -> torch.Tensor:
    """[T + B, M]: layer ``i``'s attention output for the normed inputs ``x`` of a chunk's T rows
    and a batch's B rows (either may be absent), their new latents written: one C++ call past the
    projections (``MLA.attend_fused``; every part's ``paged == "cpu"``)."""
    tables, lens = (_NO_TABLES, _NO_LENS) if batch is None else (batch.block_tables, batch.lens())
    chunk_table, start = (None, 0) if chunk is None else (chunk.block_table, chunk.start)
    return attn.attend_fused(x, cos, sin, pool.data[i], new_slots, tables, lens, pool.page_size, chunk_table, start)


@dataclass(slots=True)
class _Chunk:
    """What every layer of a forward pass needs for a prefill chunk of one sequence."""

    h: torch.Tensor  # [T, M] embeddings
    t: int
    start: int
    positions: torch.Tensor  # [T]
    span: torch.Tensor  # [S] every position of the sequence so far, S = start + T
    all_slots: torch.Tensor  # [S]
    new_slots: torch.Tensor  # [T]
    cos: torch.Tensor
    sin: torch.Tensor
    attn: str  # "naive" | "absorbed"
    block_table: torch.Tensor  # [pages]
    paged: str | None  # absorbed chunk read in place: "cpu" (all queries at once) | "triton" (a row per query)
    mask: torch.Tensor | None = None  # [1, T, S] (absorbed path over a gather, built on first use)
    row_tables: torch.Tensor | None = None  # [T, pages] (paged path, built on first use)
    sparse_kernel: str | None = None  # V3.2: ``DeepseekModel.sparse_kernel``

    @classmethod
    def build(cls, model: DeepseekModel, token_ids, block_table, start: int, page_size: int, attn: AttnPath) -> _Chunk:
        t = token_ids.shape[0]
        if t == 0:
            raise ValueError("prefill needs at least one token")
        if block_table.shape[0] * page_size < start + t:
            raise ValueError(
                f"block table of {block_table.shape[0]} pages holds {block_table.shape[0] * page_size} "
                f"tokens, sequence needs {start + t}"
            )
        if attn == "auto":
            attn = "absorbed" if absorbed_pays(model.cfg, t, start + t) else "naive"
        dev = model.device
        token_ids, block_table = token_ids.to(dev), block_table.to(dev)
        span = torch.arange(start + t, device=dev)
        all_slots = slots_for(block_table, span, page_size)
        cos, sin = model.rope.cos_sin(span[start:], model.dtype, top=start + t)
        # an absorbed chunk attends in place: on the CPU all its queries at once (the kernel reads
        # each latent once for all of them), with Triton a short chunk's queries as decode rows
        paged = model.paged_kernel if attn == "absorbed" else None
        if paged == "triton" and t > MQA_MAX_QUERIES:
            paged = None
        return cls(model.embed[token_ids], t, start, span[start:], span, all_slots, all_slots[start:], cos, sin,
                   attn, block_table, paged, sparse_kernel=model.sparse_kernel if model.cfg.index_topk else None)

    def attend(self, i: int, attn: MLA, q_nope, q_rope, latent, pool: LatentKVPool, sparse=None) -> torch.Tensor:
        """[T, H, V]: the chunk's queries over its sequence's latents in layer ``i`` (written).
        ``sparse``: (indexer, its queries [T, G, I], head weights [T, G]) of a V3.2 layer: each
        query attends only to the keys the indexer selects."""
        if sparse is not None and self.start + self.t > sparse[0].topk:
            return self._attend_sparse(i, attn, q_nope, q_rope, latent, pool, *sparse)
        if self.paged == "cpu":  # every latent read once for all the chunk's queries, in place
            return attn.attend_chunk_paged(q_nope, q_rope, pool.data[i], self.block_table, self.start,
                                           pool.page_size)
        if self.paged:
            # each query is a decode row of its own length: no gather of the prefix, no [T, S] mask
            if self.row_tables is None:
                self.row_tables = self.block_table[None].expand(self.t, -1).contiguous()
            return attn.attend_paged(q_nope, q_rope, pool.data[i], self.row_tables, self.positions + 1,
                                     pool.page_size, self.paged)
        latents = latent if self.start == 0 else pool.read(i, self.all_slots)  # [S, D]
        if self.attn == "naive":
            return attn.attend_naive(q_nope, q_rope, latents, self.start)
        if self.mask is None:
            self.mask = (self.span[None, :] <= self.positions[:, None])[None]
        return attn.attend_absorbed(q_nope[None], q_rope[None], latents[None], self.mask)[0]

    def _attend_sparse(self, i: int, attn: MLA, q_nope, q_rope, latent, pool: LatentKVPool, indexer: Indexer,
                       iq: torch.Tensor, iw: torch.Tensor) -> torch.Tensor:
        """[T, H, V] over each query's top-K keys of the sequence (DeepSeek Sparse Attention)."""
        visible = self.span[None, :] <= self.positions[:, None]  # [T, S]
        keep = indexer.select(iq, iw, pool.read_index(i, self.all_slots), visible)  # [T, S]
        if self.sparse_kernel is not None:  # each query over only its chosen latents, in place
            picked = kept_indices(keep, indexer.topk)  # [T, K]
            return _attend_picked(attn, q_nope, q_rope, pool, i, self.all_slots[picked.clamp(min=0)], picked >= 0,
                                  self.sparse_kernel)
        latents = latent if self.start == 0 else pool.read(i, self.all_slots)  # [S, D]
        if self.attn == "naive":
            return attn.attend_naive(q_nope, q_rope, latents, self.start, mask=keep)
        return attn.attend_absorbed(q_nope[None], q_rope[None], latents[None], keep[None])[0]


@dataclass(slots=True)
class _DecodeBatch:
    """What every layer of a forward pass needs for one decode (micro-)batch."""

    h: torch.Tensor  # [B, M] embeddings
    positions: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, pages]
    new_slots: torch.Tensor  # [B]
    cos: torch.Tensor
    sin: torch.Tensor
    attn: str  # "absorbed" | "naive"
    paged: str | None  # a kernel that reads the pool in place: "triton" | "cpu"; None: gather (torch)
    seq_lens: torch.Tensor | None = None  # [B] positions + 1 (paged paths, built on first use)
    read_slots: torch.Tensor | None = None  # [B, S] (torch path)
    mask: torch.Tensor | None = None  # [B, 1, S] (torch path)
    impl: str = "ref"  # the model's kernels (V3.2's indexer top-k: Triton's, or the CPU's)
    sparse_kernel: str | None = None  # V3.2: ``DeepseekModel.sparse_kernel``

    @classmethod
    def build(cls, model: DeepseekModel, token_ids, block_tables, positions, page_size: int, attn: AttnPath,
              max_len: int | None = None) -> _DecodeBatch:
        """``max_len``: a bound on every row's length, when the caller knows it (a fixed-shape
        step: no read of the positions back from a GPU)."""
        b = token_ids.shape[0]
        if max_len is None:
            max_len = int(positions.max()) + 1  # before the move: positions usually come from the host
        dev = model.device
        token_ids, block_tables, positions = token_ids.to(dev), block_tables.to(dev), positions.to(dev)
        if block_tables.shape[1] * page_size < max_len:
            raise ValueError(f"block tables hold {block_tables.shape[1] * page_size} tokens, need {max_len}")
        attn = "absorbed" if attn == "auto" else attn
        new_slots = slots_for(block_tables, positions[:, None], page_size)[:, 0]
        cos, sin = model.rope.cos_sin(positions, model.dtype, top=max_len)
        batch = cls(model.embed[token_ids], positions, block_tables, new_slots, cos, sin, attn,
                    model.paged_kernel if attn == "absorbed" else None, impl=model.impl,
                    sparse_kernel=model.sparse_kernel if model.cfg.index_topk else None)
        if not batch.paged:
            span = torch.arange(max_len, device=dev)  # [S]
            batch.read_slots = slots_for(block_tables, span.expand(b, max_len).contiguous(), page_size)
            batch.mask = (span[None, :] <= positions[:, None])[:, None, :]
        return batch

    def lens(self) -> torch.Tensor:
        """[B]: each row's length with its new token (the paged paths' ``seq_lens``)."""
        if self.seq_lens is None:
            self.seq_lens = self.positions + 1
        return self.seq_lens

    def attend(self, i: int, attn: MLA, q_nope, q_rope, pool: LatentKVPool, sparse=None) -> torch.Tensor:
        """[B, H, V]: each row's query over its sequence's latents in layer ``i`` (written).
        ``sparse``: as ``_Chunk.attend``'s, a row per query."""
        if sparse is not None and self.read_slots is not None and self.read_slots.shape[1] > sparse[0].topk:
            # each row's top-k keys by the indexer (read in place), then only their latents
            indexer, iq, iw = sparse
            picked = index_topk(iq, iw, pool.index_k[i], self.read_slots, self.lens(), indexer.topk, indexer.scale,
                                self.impl)  # [B, K], -1 past a short row's keys
            return _attend_picked(attn, q_nope, q_rope, pool, i, self.read_slots.gather(1, picked.clamp(min=0)),
                                  picked >= 0, self.sparse_kernel)
        if self.paged:
            return attn.attend_paged(q_nope, q_rope, pool.data[i], self.block_tables, self.lens(), pool.page_size,
                                     self.paged)
        latents = pool.read(i, self.read_slots)  # [B, S, D]
        if self.attn == "absorbed":
            return attn.attend_absorbed(q_nope[:, None], q_rope[:, None], latents, self.mask)[:, 0]
        pos = self.positions.tolist()
        return torch.cat([
            attn.attend_naive(q_nope[j : j + 1], q_rope[j : j + 1], latents[j, : pos[j] + 1], pos[j])
            for j in range(len(pos))
        ])
