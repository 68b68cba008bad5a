"""DeepSeek-V4's attention: a sliding window over one shared K=V head, plus compressed entries.

Legend: T queries (one segment: consecutive positions of one sequence), H heads, D head dim,
R rope dims, M hidden size, Q ``q_lora_rank``, W sliding window, m a compressor's ratio,
E entries, G indexer heads, I indexer head dim, c 2 (CSA's overlapping windows) or 1 (HCA).

Each query attends, with a learned per-head sink in the softmax's denominator, over the K=V rows
of the last W positions (itself included) and over compressed entries whose window has closed
by its position: all of them (HCA), or the indexer's top ``index_topk`` (CSA). A compressed entry
is the softmax-gated sum of its window's rows (CSA: the previous window's first half joins each
window's second half), RMS-normed, rotated at the window's first position. The output's rope
dims are rotated back before the grouped output projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.index_topk import index_topk
from model.dsa import select_top_k
from model.kv_cache import slots_for
from model.layers import linear, rms_norm
from model.v4.config import CSA, SLIDING, V4Config
from model.v4.kv import HybridKVPool, entry_slots
from model.v4.layers import Rope, rms_unweighted, rope_tail

__all__ = ["Attention", "AttentionWeights", "CompressorWeights", "IndexerWeights", "QUERY_BLOCK", "Segment"]

QUERY_BLOCK = 256  # a prefill chunk's queries attend this many at a time, each block over its own window


@dataclass(slots=True)
class Segment:
    """Consecutive positions ``start .. start+T-1`` of one sequence, computed in a pass: its rows
    of the pass and its pages."""

    rows: slice
    start: int
    table: torch.Tensor  # [pages] of the sequence: its compressed entries
    window: torch.Tensor  # [pages]: its per-token window rows (pages out of the window: any)
    positions: torch.Tensor  # [T]

    @property
    def end(self) -> int:
        return self.start + self.positions.shape[0]


@dataclass(slots=True)
class CompressorWeights:
    wkv: torch.Tensor  # [c*Dc, M]
    wgate: torch.Tensor  # [c*Dc, M]
    ape: torch.Tensor  # [m, c*Dc] fp32: the gate's bias per position in the window
    norm: torch.Tensor  # [Dc]


@dataclass(slots=True)
class IndexerWeights:
    wq_b: torch.Tensor  # [G*I, Q]
    weights_proj: torch.Tensor  # [G, M]
    compressor: CompressorWeights  # its own compressed keys, I dims, CSA's windows


@dataclass(slots=True)
class AttentionWeights:
    wq_a: torch.Tensor  # [Q, M]
    q_norm: torch.Tensor  # [Q]
    wq_b: torch.Tensor  # [H*D, Q]
    wkv: torch.Tensor  # [D, M]
    kv_norm: torch.Tensor  # [D]
    wo_a: torch.Tensor  # [groups*o_lora, H*D/groups]
    wo_b: torch.Tensor  # [M, groups*o_lora]
    sink: torch.Tensor  # [H] fp32
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None


def _pool_entries(kv: torch.Tensor, gate: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """kv [E, S, Dc], gate [E, S, Dc] fp32 (bias added; -inf where a slot is empty) -> the entries
    [E, Dc]: per dim, the softmax over the S slots weighting kv, then RMSNorm."""
    pooled = (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)
    return rms_norm(pooled, norm, eps)


class Attention:
    def __init__(self, cfg: V4Config, layer_idx: int, w: AttentionWeights, rope: Rope, impl: str = "ref",
                 kind: str | None = None) -> None:
        """``kind``: the layer's (default ``cfg.layer_types[layer_idx]``; an MTP layer's, after the
        model's, is given)."""
        self.cfg, self.layer_idx, self.w, self.rope = cfg, layer_idx, w, rope
        self.impl = impl  # the indexer top-k's kernel at decode (kernels.index_topk)
        self.kind = kind or cfg.layer_types[layer_idx]
        self.ratio = 0 if self.kind == SLIDING else cfg.ratio(layer_idx)
        self.scale = cfg.head_dim**-0.5

    # -- a pass ----------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, positions: torch.Tensor, segments: list[Segment], pool: HybridKVPool,
                 compress_rope: Rope) -> torch.Tensor:
        """x [N, M] (the normed block inputs of every segment's rows), positions [N] -> [N, M].
        Writes the rows' window state (and closing windows' entries) to ``pool`` first."""
        cfg, w = self.cfg, self.w
        n, h, d = x.shape[0], cfg.num_attention_heads, cfg.head_dim
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        q_resid = rms_norm(linear(x, w.wq_a), w.q_norm, cfg.rms_norm_eps)  # [N, Q]
        q = rope_tail(rms_unweighted(linear(q_resid, w.wq_b).view(n, h, d), cfg.rms_norm_eps), cos, sin)  # [N, H, D]
        kv = rope_tail(rms_norm(linear(x, w.wkv), w.kv_norm, cfg.rms_norm_eps), cos, sin)  # [N, D]
        slots = torch.cat([slots_for(s.window, s.positions, pool.page_size) for s in segments])
        pool.planes["swa"][self.layer_idx].index_copy_(0, slots, kv.to(pool.dtype))
        iq = iw = None
        if w.compressor is not None:
            self._write_sources(x, slots, pool)
            for s in segments:
                self._close_windows(s, pool, compress_rope)
            if w.indexer is not None:
                icos, isin = compress_rope.cos_sin(positions, x.dtype)
                gi, di = cfg.index_n_heads, cfg.index_head_dim
                iq = rope_tail(linear(q_resid, w.indexer.wq_b).view(n, gi, di), icos, isin).float()  # [N, G, I]
                iw = F.linear(x.float(), w.indexer.weights_proj.float()) * gi**-0.5  # [N, G]
        out = torch.empty_like(q)
        singles = [s for s in segments if s.rows.stop - s.rows.start == 1]  # decode rows: attended together
        for s in segments:
            if s.rows.stop - s.rows.start > 1:
                sel = None if iq is None else (iq[s.rows], iw[s.rows])
                out[s.rows] = self._attend(q[s.rows], s, pool, sel)
        if singles:
            at = torch.tensor([s.rows.start for s in singles], device=q.device)
            sel = None if iq is None else (iq[at], iw[at])
            out[at] = self._attend_rows(q[at], singles, pool, sel)
        o = rope_tail(out, cos, sin, inverse=True).reshape(n, cfg.o_groups, -1)  # [N, groups, H*D/groups]
        wo_a = w.wo_a.view(cfg.o_groups, cfg.o_lora_rank, -1)  # [groups, o_lora, H*D/groups]
        o = torch.einsum("ngk,glk->ngl", o, wo_a.to(o.dtype)).flatten(1)  # [N, groups*o_lora]
        return linear(o, w.wo_b)

    # -- compressed entries ----------------------------------------------------------------
    def _write_sources(self, x: torch.Tensor, slots: torch.Tensor, pool: HybridKVPool) -> None:
        """The rows' compressor inputs (kv and gate projections, the indexer's after) into the
        layer's source plane: a window's entry is made from them once it closes."""
        w = self.w
        parts = [linear(x, w.compressor.wkv), linear(x, w.compressor.wgate)]
        if w.indexer is not None:
            parts += [linear(x, w.indexer.compressor.wkv), linear(x, w.indexer.compressor.wgate)]
        plane = pool.planes["csa_src" if self.kind == CSA else "hca_src"][pool.plane_idx[self.layer_idx]]
        plane.index_copy_(0, slots, torch.cat(parts, dim=-1).to(pool.dtype))

    def _close_windows(self, s: Segment, pool: HybridKVPool, rope: Rope) -> None:
        """The entries whose window closes inside ``s`` (e with (e+1)*m - 1 in [start, end)),
        made from the sources of their window (and for CSA the one before) and written."""
        m, first, stop = self.ratio, s.start // self.ratio, s.end // self.ratio
        if first >= stop:
            return
        cfg, k = self.cfg, pool.plane_idx[self.layer_idx]
        entries = torch.arange(first, stop, device=s.table.device)  # [E]
        lo = max(0, first - 1) if self.kind == CSA else first  # CSA reads the window before too
        pos = torch.arange(lo * m, stop * m, device=s.table.device)
        src_plane = pool.planes["csa_src" if self.kind == CSA else "hca_src"][k]
        src = src_plane.index_select(0, slots_for(s.window, pos, pool.page_size)).view(stop - lo, m, -1)
        e_pos = entries * m
        cos, sin = rope.cos_sin(e_pos, src.dtype)
        d, di = cfg.head_dim, cfg.index_head_dim
        if self.kind == CSA:
            kv_main = self._csa_entries(src[..., : 4 * d], self.w.compressor, d, first - lo)
            kv_idx = self._csa_entries(src[..., 4 * d :], self.w.indexer.compressor, di, first - lo)
            at = entry_slots(s.table, entries, m, pool.page_size)
            pool.planes["csa_kv"][k].index_copy_(0, at, rope_tail(kv_main, cos, sin).to(pool.dtype))
            pool.planes["csa_ik"][k].index_copy_(0, at, rope_tail(kv_idx, cos, sin).to(pool.dtype))
            return
        c = self.w.compressor
        gate = src[..., d:].float() + c.ape.float()  # [E, m, D]
        kv_hca = _pool_entries(src[..., :d], gate, c.norm, cfg.rms_norm_eps)
        at = entry_slots(s.table, entries, m, pool.page_size)
        pool.planes["hca_kv"][k].index_copy_(0, at, rope_tail(kv_hca, cos, sin).to(pool.dtype))

    def _csa_entries(self, src: torch.Tensor, c: CompressorWeights, dim: int, skip: int) -> torch.Tensor:
        """Overlapping-window entries from sources [windows, m, 4*dim] (kv 2*dim, gate 2*dim) of
        consecutive windows; the first ``skip`` (0 or 1) windows only lend their first half to
        the next. Entry w: the first halves (Ca) of window w-1 with the second halves (Cb) of
        window w, 2m slots; window 0 has no Ca (its slots get weight 0)."""
        m = src.shape[1]
        kv, gate = src[..., : 2 * dim], src[..., 2 * dim :].float() + c.ape.float()  # [win, m, 2*dim]
        n = kv.shape[0] - skip
        prev_kv = kv.new_zeros(n, m, dim)
        prev_gate = gate.new_full((n, m, dim), float("-inf"))
        if skip:
            prev_kv, prev_gate = kv[:-1, :, :dim], gate[:-1, :, :dim]
        elif n > 1:
            prev_kv[1:], prev_gate[1:] = kv[:-1, :, :dim], gate[:-1, :, :dim]
        cur_kv, cur_gate = kv[skip:, :, dim:], gate[skip:, :, dim:]
        return _pool_entries(torch.cat((prev_kv, cur_kv), dim=1), torch.cat((prev_gate, cur_gate), dim=1),
                             c.norm, self.cfg.rms_norm_eps)

    # -- attention of one segment ----------------------------------------------------------
    def _attend(self, q: torch.Tensor, s: Segment, pool: HybridKVPool, indexer) -> torch.Tensor:
        """q [T, H, D] of segment ``s`` -> [T, H, D]: over the window rows and the visible
        (CSA: selected) compressed entries, with the sink; ``QUERY_BLOCK`` queries at a time, each
        block reading only its window's rows."""
        out = torch.empty_like(q)
        for lo in range(0, q.shape[0], QUERY_BLOCK):
            rows = slice(lo, lo + QUERY_BLOCK)
            block = None if indexer is None else (indexer[0][rows], indexer[1][rows])
            out[rows] = self._attend_block(q[rows], s.positions[rows], s, pool, block)
        return out

    def _attend_block(self, q: torch.Tensor, positions: torch.Tensor, s: Segment, pool: HybridKVPool,
                      indexer) -> torch.Tensor:
        cfg, page = self.cfg, pool.page_size
        first, last = int(positions[0]), int(positions[-1])
        key_pos = torch.arange(max(0, first - cfg.sliding_window + 1), last + 1, device=s.table.device)  # [Sw]
        keys = pool.planes["swa"][self.layer_idx].index_select(0, slots_for(s.window, key_pos, page))  # [Sw, D]
        qp = positions[:, None]
        mask = (key_pos[None, :] <= qp) & (key_pos[None, :] > qp - cfg.sliding_window)  # [Tb, Sw]
        if self.ratio:
            entries = torch.arange((last + 1) // self.ratio, device=s.table.device)  # those closed by the block's end
            at = entry_slots(s.table, entries, self.ratio, page)
            k = pool.plane_idx[self.layer_idx]
            visible = entries[None, :] < (qp + 1) // self.ratio  # [Tb, E]
            if self.kind == CSA:
                ikeys = pool.planes["csa_ik"][k].index_select(0, at)
                visible = select_top_k(*indexer, ikeys, visible, cfg.index_topk, cfg.index_head_dim**-0.5)
                keys = torch.cat((keys, pool.planes["csa_kv"][k].index_select(0, at)))
            else:
                keys = torch.cat((keys, pool.planes["hca_kv"][k].index_select(0, at)))
            mask = torch.cat((mask, visible), dim=1)
        keys = keys.to(q.dtype)
        logits = torch.einsum("thd,sd->hts", q, keys).mul_(self.scale)  # [H, Tb, S]
        logits.masked_fill_(~mask[None], float("-inf"))
        sink = self.w.sink.to(logits.dtype)[:, None, None].expand(-1, logits.shape[1], 1)
        combined = torch.cat((logits, sink), dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1]
        return torch.einsum("hts,sd->thd", probs, keys)

    def _attend_rows(self, q: torch.Tensor, rows: list[Segment], pool: HybridKVPool, indexer) -> torch.Tensor:
        """q [B, H, D] of B one-token segments (decode rows) -> [B, H, D], all at once: each over
        its window's rows and its visible entries (CSA: the indexer's top-k, read in place)."""
        cfg, page, dev = self.cfg, pool.page_size, q.device
        pos = torch.cat([s.positions for s in rows])  # [B]
        window = torch.stack([s.window for s in rows])  # [B, pages]
        key_pos = pos[:, None] - torch.arange(cfg.sliding_window - 1, -1, -1, device=dev)  # [B, W], the row last
        valid = key_pos >= 0
        slots = slots_for(window, key_pos.clamp(min=0), page)
        keys = pool.planes["swa"][self.layer_idx].index_select(0, slots.reshape(-1)).view(*slots.shape, -1)  # [B, W, D]
        mask = valid
        if self.ratio:
            k = pool.plane_idx[self.layer_idx]
            num = (pos + 1) // self.ratio  # [B] entries closed by each row's token
            width = max(1, int(num.max()))
            entries = torch.arange(width, device=dev).expand(len(rows), width)
            table = torch.stack([s.table for s in rows])  # [B, pages]
            per_page = max(1, page // self.ratio)
            at = table.gather(1, ((entries + 1) * self.ratio - 1).clamp(max=table.shape[1] * page - 1) // page) \
                * per_page + entries % per_page  # [B, E]
            seen = entries < num[:, None]
            if self.kind == CSA:  # the indexer's top-k of each row's entries, then only those
                picked = index_topk(*indexer, pool.planes["csa_ik"][k], at, num, cfg.index_topk,
                                    cfg.index_head_dim**-0.5, self.impl)  # [B, K]
                at, seen = at.gather(1, picked.clamp(min=0)), picked >= 0
                plane = pool.planes["csa_kv"][k]
            else:
                plane = pool.planes["hca_kv"][k]
            keys = torch.cat((keys, plane.index_select(0, at.reshape(-1)).view(*at.shape, -1)), dim=1)
            mask = torch.cat((mask, seen), dim=1)
        keys = keys.to(q.dtype)
        logits = torch.einsum("bhd,bsd->bhs", q, keys).mul_(self.scale)  # [B, H, S]
        logits.masked_fill_(~mask[:, None], float("-inf"))
        sink = self.w.sink.to(logits.dtype)[None, :, None].expand(logits.shape[0], -1, 1)
        combined = torch.cat((logits, sink), dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1]
        return torch.einsum("bhs,bsd->bhd", probs, keys)
