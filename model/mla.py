"""Multi-head Latent Attention (MLA), DeepSeek-V2/V3.

Legend: T new tokens, S attended tokens (cached + new), B sequences, H heads,
N nope dims (``qk_nope_head_dim``), P rope dims, R ``kv_lora_rank``, V ``v_head_dim``,
D = R + P latent values per token, M model hidden size.

Per token and layer only the latent ``[c_kv (R), k_rope (P)]`` is cached. Two equivalent ways to
attend over it:

* naive (prefill): expand every cached latent to per-head keys/values with ``W_UK``/``W_UV``
  (``kv_b_proj``), then run ordinary attention. Cheap when T ~ S.
* absorbed (decode): fold ``W_UK`` into the query and ``W_UV`` after the attention, so the heads
  attend directly over the latent cache. Cheap when T << S: no per-token expansion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu_gemv import mla_chunk_paged, mla_decode_paged, mla_fused
from kernels.mla_decode import mla_decode
from model.config import ModelConfig
from model.layers import linear, rms_norm
from model.rope import apply_rope

__all__ = ["MLA", "MLAWeights", "absorbed_pays"]

# Up to this many queries per sequence (decode, short suffixes) the absorbed path is two plain
# bmm's over the shared latent; longer query runs use the fused SDPA kernel (no [Q*H, S] scores).
MQA_MAX_QUERIES = 16


def absorbed_pays(cfg: ModelConfig, new_tokens: int, total_tokens: int) -> bool:
    """Whether attending ``new_tokens`` queries over ``total_tokens`` (cached + new) costs fewer
    FLOPs absorbed than naive. Per head: naive expands every latent to a key and a value
    (S R (N+V)) and then attends (T S (N+P+V)); absorbed folds ``W_UK`` into the queries and
    ``W_UV`` into the outputs (T R (N+V)) but attends over the latent (T S (2R+P)). With
    S >> T, absorbed wins only below T = R (N+V) / (2R - N - V) queries (DeepSeek-V3: ~170)."""
    n, p, v, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    t, s = new_tokens, total_tokens
    naive = s * r * (n + v) + t * s * (n + p + v)
    absorbed = t * r * (n + v) + t * s * (2 * r + p)
    return absorbed < naive


@dataclass(slots=True)
class MLAWeights:
    kv_a: torch.Tensor  # [D, M]  (kv_a_proj_with_mqa)
    kv_a_norm: torch.Tensor  # [R]
    kv_b: torch.Tensor  # [H*(N+V), R]
    o: torch.Tensor  # [M, H*V]
    q: torch.Tensor | None = None  # [H*(N+P), M] when q_lora_rank is None
    q_a: torch.Tensor | None = None  # [q_lora, M]
    q_a_norm: torch.Tensor | None = None  # [q_lora]
    q_b: torch.Tensor | None = None  # [H*(N+P), q_lora]
    kv_a_bias: torch.Tensor | None = None
    q_a_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


class MLA:
    def __init__(self, cfg: ModelConfig, w: MLAWeights) -> None:
        self.cfg = cfg
        self.w = w
        h, n, v, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        kv_b = w.kv_b.view(h, n + v, r)
        self.w_uk = kv_b[:, :n, :].contiguous()  # [H, N, R]
        self.w_uv_t = kv_b[:, n:, :].transpose(1, 2).contiguous()  # [H, R, V]
        self.scale = cfg.softmax_scale

    # -- projections -------------------------------------------------------------------
    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, M] -> (q_nope [T, H, N], q_rope [T, H, P], latent [T, D], q_resid [T, Q]) with
        RoPE applied; q_resid is the normed low-rank query (None without ``q_lora_rank``), which
        V3.2's indexer reads too."""
        cfg, w = self.cfg, self.w
        t = x.shape[0]
        q_resid = None if w.q is not None else rms_norm(linear(x, w.q_a, w.q_a_bias), w.q_a_norm, cfg.rms_norm_eps)
        q = (linear(x, w.q) if q_resid is None else linear(q_resid, w.q_b)).view(t, cfg.num_attention_heads,
                                                                                   cfg.qk_head_dim)  # [T, H, N+P]
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        kv = linear(x, w.kv_a, w.kv_a_bias)  # [T, D]
        c_kv, k_rope = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        c_kv = rms_norm(c_kv, w.kv_a_norm, cfg.rms_norm_eps)  # [T, R]
        q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)  # [T, H, P]
        k_rope = apply_rope(k_rope, cos, sin, cfg.rope_interleave)  # [T, P]
        return q_nope, q_rope, torch.cat((c_kv, k_rope), dim=-1), q_resid

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, M] -> the heads' queries [T, H*(N+P)], before RoPE."""
        w = self.w
        if w.q is not None:
            return linear(x, w.q)
        return linear(rms_norm(linear(x, w.q_a, w.q_a_bias), w.q_a_norm, self.cfg.rms_norm_eps), w.q_b)

    def attend_fused(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, new_slots: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int, chunk_table: torch.Tensor | None = None,
        chunk_start: int = 0,
    ) -> torch.Tensor:
        """The whole absorbed attention of a float32 CPU model's pass: x [T+B, M] -> [T+B, M] for
        a prefill chunk's T rows (positions ``chunk_start ..`` of the sequence at
        ``chunk_table``; none without it) and then B decode rows (block_tables [B, X], seq_lens
        [B] with the new token), as ``output(attend_...(*project(x)))`` after writing the new
        latents to ``kv`` [slots, D] at ``new_slots`` [T+B]. The projections are the GEMV
        kernels; the rest (RoPE, the latents' norm and write, W_UK, the paged attention of every
        row, W_UV) is one C++ call (``kernels.cpu_gemv.mla_fused``)."""
        w = self.w
        kv_a = linear(x, w.kv_a, w.kv_a_bias)  # [T+B, D]
        o = mla_fused(self._queries(x), kv_a, w.kv_a_norm, self.cfg.rms_norm_eps, cos, sin, self.cfg.rope_interleave,
                      self.w_uk, self.w_uv_t, kv, new_slots, block_tables, seq_lens, self.scale, page_size,
                      chunk_table, chunk_start)  # [T+B, H*V]
        return linear(o, w.o, w.o_bias)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o [T, H, V] -> [T, M]."""
        return linear(o.flatten(1), self.w.o, self.w.o_bias)

    # -- attention over the latent cache -----------------------------------------------
    def attend_naive(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor, start: int,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of T queries at positions ``start..start+T-1`` over ``latents`` [S, D]
        (positions 0..S-1, S = start + T), or with ``mask`` [T, S] bool (True = attend) the keys
        it keeps. Returns [T, H, V]."""
        cfg = self.cfg
        h, n, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        s, t = latents.shape[0], q_nope.shape[0]
        assert s == start + t, (s, start, t)
        kv = F.linear(latents[:, :r], self.w.kv_b).view(s, h, -1)  # [S, H, N+V]
        k_nope, v = kv.split([n, cfg.v_head_dim], dim=-1)
        k_rope = latents[:, None, r:].expand(s, h, cfg.qk_rope_head_dim)  # [S, H, P]
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1)[None]  # [1, H, T, N+P]
        k = torch.cat((k_nope, k_rope), dim=-1).transpose(0, 1)[None]  # [1, H, S, N+P]
        # The fused (flash) SDPA kernels want equal q/k/v head dims and 4-D inputs; pad V with
        # zeros up to N+P and drop the padding afterwards (zeros contribute nothing).
        v = F.pad(v, (0, k.shape[-1] - v.shape[-1])).transpose(0, 1)[None]  # [1, H, S, N+P]
        if mask is None and start == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            mask = _causal_mask(t, start, q.device) if mask is None else mask
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        o = o[0, ..., : cfg.v_head_dim]  # [H, T, V]
        return o.transpose(0, 1)  # [T, H, V]

    def attend_absorbed(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Queries of B sequences (T_b = 1 for decode, or T queries of one sequence with B=1 via
        a [1, T, S] mask) attending directly over latents.

        q_nope [B, Q, H, N], q_rope [B, Q, H, P], latents [B, S, D], mask [B, Q, S] bool (True =
        attend). Returns [B, Q, H, V]."""
        r = self.cfg.kv_lora_rank
        b, nq, h, _ = q_nope.shape
        q_lat = torch.einsum("bqhn,hnr->bqhr", q_nope, self.w_uk)  # [B, Q, H, R]
        s, d = latents.shape[1], latents.shape[2]
        if nq <= MQA_MAX_QUERIES:
            o_lat = self._attend_latent_mqa(q_lat, q_rope, latents, mask)  # [B, Q, H, R]
            out = torch.bmm(o_lat.reshape(b * nq, h, r).transpose(0, 1), self.w_uv_t)  # [H, B*Q, V]
            return out.transpose(0, 1).reshape(b, nq, h, -1)
        q_full = torch.cat((q_lat, q_rope), dim=-1).transpose(1, 2)  # [B, H, Q, D]
        # Multi-query attention over the latent: every head reads the same keys ([c_kv, k_rope])
        # and values (c_kv, zero-padded to D so the fused SDPA kernel applies).
        k = latents[:, None].expand(b, h, s, d)
        v = F.pad(latents[:, :, :r], (0, d - r))[:, None].expand(b, h, s, d)
        o = F.scaled_dot_product_attention(q_full, k, v, attn_mask=mask[:, None], scale=self.scale)
        o_lat = o[..., :r].transpose(0, 1).reshape(h, b * nq, r)  # [H, B*Q, R]
        out = torch.bmm(o_lat, self.w_uv_t)  # [H, B*Q, V]
        return out.transpose(0, 1).reshape(b, nq, h, -1)  # [B, Q, H, V]

    def _attend_latent_mqa(
        self, q_lat: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Every head reads the same keys and values (the latent), so all Q*H query rows of a
        sequence go through two bmm's: scores [B, Q*H, S] and the weighted sum of ``c_kv``.
        Returns [B, Q, H, R]."""
        r = self.cfg.kv_lora_rank
        b, nq, h, _ = q_lat.shape
        q_full = torch.cat((q_lat, q_rope), dim=-1).reshape(b, nq * h, -1)  # [B, Q*H, D]
        scores = torch.bmm(q_full, latents.transpose(1, 2)).view(b, nq, h, -1)  # [B, Q, H, S]
        scores = scores.float().mul_(self.scale).masked_fill_(~mask[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(latents.dtype).view(b, nq * h, -1)
        return torch.bmm(probs, latents[:, :, :r]).view(b, nq, h, r)

    def attend_paged(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
        kernel: str = "triton",
    ) -> torch.Tensor:
        """Absorbed decode straight over one layer of the paged pool (no gather): ``kernel``
        "triton" (``kernels.mla_decode``) or "cpu" (the C++ one of ``kernels.cpu_gemv``, fp32).

        q_nope [B, H, N], q_rope [B, H, P], kv [slots, D], block_tables [B, X], seq_lens [B]
        (tokens to attend, the new one included). Returns [B, H, V]."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1).to(kv.dtype)  # [B, H, R]
        decode = mla_decode_paged if kernel == "cpu" else mla_decode
        o_lat = decode(
            q_lat.contiguous(), q_rope.to(kv.dtype).contiguous(), kv, block_tables, seq_lens,
            self.scale, page_size,
        )  # [B, H, R]
        out = torch.bmm(o_lat.transpose(0, 1).to(self.w_uv_t.dtype), self.w_uv_t)  # [H, B, V]
        return out.transpose(0, 1)  # [B, H, V]


    def attend_chunk_paged(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
        start: int, page_size: int,
    ) -> torch.Tensor:
        """Absorbed attention of a prefill chunk's T queries (positions ``start .. start+T-1``) over
        their sequence's latents in one layer of the paged pool, each latent read once for every
        query and head (the C++ kernel of ``kernels.cpu_gemv``, fp32).

        q_nope [T, H, N], q_rope [T, H, P], kv [slots, D], block_table [X]. Returns [T, H, V]."""
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, R]
        o_lat = mla_chunk_paged(q_lat.contiguous(), q_rope.contiguous(), kv, block_table, start, self.scale,
                                page_size)  # [T, H, R]
        return torch.bmm(o_lat.transpose(0, 1), self.w_uv_t).transpose(0, 1)  # [T, H, V]


def _causal_mask(t: int, start: int, device: torch.device) -> torch.Tensor:
    """[T, start+T] bool: query i (position start+i) sees keys 0..start+i."""
    q_pos = torch.arange(start, start + t, device=device)[:, None]
    k_pos = torch.arange(start + t, device=device)[None, :]
    return k_pos <= q_pos
