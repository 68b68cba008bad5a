"""DeepSeek-V4's paged KV: one pool per kind of state, all addressed through a sequence's pages.

Legend: L layers, Lc CSA layers, Lh HCA layers, P pages, Z page size (tokens), D head dim,
I indexer head dim, m a compressor's ratio (tokens per entry), E entries.

Per compressed entry (entry planes, what a long sequence keeps), in P pages:
  ``csa_kv`` [Lc, P*Sc, D], ``csa_ik`` [Lc, P*Sc, I], ``hca_kv`` [Lh, P*Sh, D].
Per token (window planes, needed only near the end of a sequence), in Pw window pages (P, or
fewer where ``cluster.window_kv`` gives them out and takes them back apart):
  ``swa``      [L, Pw*Z, D]          the sliding window's K=V, every layer (then the MTP layers',
                                     sliding-window only, when the pool has draft layers);
  ``csa_src``  [Lc, Pw*Z, 4D + 4I]   a CSA layer's compressor inputs: kv (2D), gate (2D), then its
                                     indexer's kv (2I) and gate (2I);
  ``hca_src``  [Lh, Pw*Z, 2D]        an HCA layer's compressor inputs: kv (D), gate (D).
A sequence's table is [pages] (the same pages for both) or [2, pages] (entry pages, window pages).

Entry e of a ratio-m compressor closes with token (e+1)*m - 1 and lives in that token's page, in
slot e mod S of the page's S = max(1, Z // m) entry slots; so a page holds exactly the entries that
close inside it, and a complete page never changes again.

The prompt cache gets two kinds of records (both page-size independent): a 64-token unit's
compressed entries (``read_unit``), for every unit; and a *resume* record of the window rows that
going on after a unit needs (``read_resume``), only where a prefix is likely to end. A prefix load
reads every unit's entries and the last unit's resume record: for a long prefix, a small share of
what its per-token rows would be.
"""

from __future__ import annotations

import torch

from model.kv_cache import slots_for
from model.v4.config import CSA, HCA, V4Config

__all__ = ["HybridKVPool", "entry_slots"]

_COMPRESSED = ("csa_kv", "csa_ik", "hca_kv")


def _two_rows(table: torch.Tensor) -> torch.Tensor:
    """[pages] (one page list for entries and window rows) or [2, pages] -> [2, pages]."""
    return table[None].expand(2, -1) if table.dim() == 1 else table


def entry_slots(table: torch.Tensor, entries: torch.Tensor, ratio: int, page_size: int) -> torch.Tensor:
    """Slots of entries [E] (ids of one sequence's ratio-m entries) in a compressed plane, for the
    sequence's pages ``table`` [pages]."""
    per_page = max(1, page_size // ratio)
    page = table[((entries + 1) * ratio - 1) // page_size]
    return page * per_page + entries % per_page


class HybridKVPool:
    def __init__(self, cfg: V4Config, num_pages: int, page_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", num_window_pages: int | None = None,
                 draft_layers: int = 0) -> None:
        """``num_window_pages``: pages of the window planes (default ``num_pages``: a sequence's
        pages then hold both; fewer, when window pages are given and taken back apart).
        ``draft_layers``: MTP layers whose window rows the ``swa`` plane holds after the model's
        (layer ``num_hidden_layers + k``); resume records and handoffs carry them too."""
        num_window_pages = num_pages if num_window_pages is None else num_window_pages
        if num_pages <= 0 or num_window_pages <= 0:
            raise ValueError(f"num_pages and num_window_pages must be > 0, got {num_pages}, {num_window_pages}")
        if page_size <= 0 or 64 % page_size:
            raise ValueError(f"page_size must divide the 64-token cache unit, got {page_size}")
        for ratio in (cfg.csa_ratio, cfg.hca_ratio):
            if page_size % ratio and ratio % page_size:
                raise ValueError(f"page_size {page_size} and a compressor's ratio {ratio}: one must divide the other")
        self.cfg, self.num_pages, self.page_size = cfg, num_pages, page_size
        self.num_layers = cfg.num_hidden_layers + draft_layers
        self.csa_layers = [i for i, t in enumerate(cfg.layer_types) if t == CSA]
        self.hca_layers = [i for i, t in enumerate(cfg.layer_types) if t == HCA]
        # a model layer's index in its kind's planes
        self.plane_idx = {i: k for kinds in (self.csa_layers, self.hca_layers) for k, i in enumerate(kinds)}
        self.num_window_pages = num_window_pages
        d, ix, slots = cfg.head_dim, cfg.index_head_dim, num_window_pages * page_size
        self.entry_slots_per_page = {CSA: max(1, page_size // cfg.csa_ratio), HCA: max(1, page_size // cfg.hca_ratio)}
        lc, lh = len(self.csa_layers), len(self.hca_layers)
        sc, sh = self.entry_slots_per_page[CSA], self.entry_slots_per_page[HCA]

        def plane(layers: int, rows: int, dim: int) -> torch.Tensor:
            return torch.zeros(layers, rows, dim, dtype=dtype, device=device)

        # entry planes (``num_pages`` pages), then window planes (``num_window_pages``)
        self.planes: dict[str, torch.Tensor] = {
            "csa_kv": plane(lc, num_pages * sc, d), "csa_ik": plane(lc, num_pages * sc, ix),
            "hca_kv": plane(lh, num_pages * sh, d),
            "swa": plane(self.num_layers, slots, d), "csa_src": plane(lc, slots, 4 * d + 4 * ix),
            "hca_src": plane(lh, slots, 2 * d),
        }
        # a cache unit: each compressed plane's entries that close in its 64 tokens (one slot where
        # a window spans units), padded to whole token rows
        self._unit_parts = [(name, max(1, 64 // self._ratio(name))) for name in _COMPRESSED]
        values = sum(self.planes[name].shape[0] * n * self.planes[name].shape[2] for name, n in self._unit_parts)
        self.row_dim = -(-values // 64)  # a unit is [1, 64, row_dim]: its entries' values, not per-token rows
        # what going on at a unit's end needs besides the entries, the unit's last token (which the
        # engine computes again, for its logits) included: that token's window of rows and the
        # compressor inputs of the entries it closes (CSA: two windows, HCA: one) or leaves open;
        # each at most cfg.window_keep rows
        self._resume_rows = {"swa": cfg.sliding_window, "csa_src": 2 * cfg.csa_ratio, "hca_src": cfg.hca_ratio}
        self.resume_dim = sum(self.planes[n].shape[0] * r * self.planes[n].shape[2] for n, r in self._resume_rows.items())

    def _ratio(self, name: str) -> int:
        return self.cfg.csa_ratio if name.startswith("csa") else self.cfg.hca_ratio

    @property
    def dtype(self) -> torch.dtype:
        return self.planes["swa"].dtype

    row_layers = 1  # a unit's rows are its pages' bytes, one "layer" of row_dim values a token

    def handoff_shape(self, tokens: int) -> tuple[int]:
        """The shape of ``export_tokens``' KV for a prompt of ``tokens`` tokens: its pages'
        entries, then the record of its window state at its end."""
        return (-(-tokens // self.page_size) * self.entry_values_per_page() + self.resume_dim,)

    def entry_values_per_page(self) -> int:
        """A page's values of the compressed planes."""
        return sum(self.planes[n].numel() // self.num_pages for n in _COMPRESSED)

    def export_tokens(self, table: torch.Tensor, tokens: int) -> torch.Tensor:
        """What another replica (same page size) needs to go on after the first ``tokens`` tokens
        of the sequence at ``table`` ([pages] or [2, pages]): host memory."""
        table = _two_rows(table.to(self.planes["swa"].device))
        pages = table[0, : -(-tokens // self.page_size)]
        parts = [self.planes[n].view(self.planes[n].shape[0], self.num_pages, -1)[:, pages].transpose(0, 1).reshape(-1)
                 for n in _COMPRESSED]
        return torch.cat([*parts, self.read_resume(table[1], tokens).reshape(-1)]).cpu()

    def import_tokens(self, table: torch.Tensor, kv: torch.Tensor, tokens: int) -> None:
        """Inverse of ``export_tokens`` of ``tokens`` tokens."""
        table = _two_rows(table.to(self.planes["swa"].device))
        n = -(-tokens // self.page_size)
        pages, flat, at = table[0, :n], kv.to(table.device, self.dtype), 0
        for name in _COMPRESSED:
            p = self.planes[name]
            size = p.numel() // self.num_pages * n
            p.view(p.shape[0], self.num_pages, -1)[:, pages] = flat[at : at + size].view(n, p.shape[0], -1).transpose(0, 1)
            at += size
        self.write_resume(table[1], tokens, flat[at:].view(1, 1, self.resume_dim))

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes.values())

    # -- cache units in and out -------------------------------------------------------------
    def read_unit(self, pages: list[int] | torch.Tensor, unit_idx: int) -> torch.Tensor:
        """The compressed entries that close in unit ``unit_idx`` of a sequence (tokens 64u ..
        64u+63, on ``pages``) -> [1, 64, row_dim] (a copy). Resuming after it needs its resume
        record too (``read_resume``)."""
        table = torch.as_tensor(pages, dtype=torch.long, device=self.planes["swa"].device)
        parts = []
        for name, n in self._unit_parts:
            at, valid = self._unit_slots(name, table, unit_idx, n)
            part = self.planes[name].index_select(1, at)  # [layers, n, dim]
            parts.append((part if valid is None else part * valid[None, :, None]).reshape(-1))
        flat = torch.cat(parts)
        return torch.cat((flat, flat.new_zeros(64 * self.row_dim - flat.numel()))).view(1, 64, self.row_dim)

    def write_unit(self, pages: list[int] | torch.Tensor, unit_idx: int, rows: torch.Tensor) -> None:
        """Inverse of ``read_unit``."""
        if tuple(rows.shape) != (1, 64, self.row_dim):
            raise ValueError(f"unit of shape {tuple(rows.shape)} != expected {(1, 64, self.row_dim)}")
        table = torch.as_tensor(pages, dtype=torch.long, device=self.planes["swa"].device)
        flat, at_value = rows.reshape(-1).to(table.device, self.dtype), 0
        for name, n in self._unit_parts:
            plane = self.planes[name]
            size = plane.shape[0] * n * plane.shape[2]
            at, valid = self._unit_slots(name, table, unit_idx, n)
            if valid is None or bool(valid.all()):
                plane.index_copy_(1, at, flat[at_value : at_value + size].view(plane.shape[0], n, plane.shape[2]))
            at_value += size

    def read_resume(self, table: torch.Tensor, end: int) -> torch.Tensor:
        """What resuming a sequence (window pages ``table``) at position ``end`` (a unit's end) needs
        beside its compressed entries: its last window and compressor-input rows -> [1, 1,
        resume_dim] (rows before position 0 are zeros)."""
        parts = []
        for name, rows in self._resume_rows.items():
            plane = self.planes[name]
            pos = torch.arange(end - rows, end, device=table.device)
            got = plane.index_select(1, slots_for(table, pos.clamp(min=0), self.page_size))  # [layers, rows, dim]
            parts.append((got * (pos >= 0).to(got.dtype)[None, :, None]).reshape(-1))
        return torch.cat(parts).view(1, 1, self.resume_dim)

    def write_resume(self, table: torch.Tensor, end: int, record: torch.Tensor, start: int = 0) -> None:
        """Inverse of ``read_resume``: the rows of positions >= ``start`` (pages before it may be
        shared, and hold them already) into the sequence's pages."""
        if tuple(record.shape) != (1, 1, self.resume_dim):
            raise ValueError(f"resume record of shape {tuple(record.shape)} != expected {(1, 1, self.resume_dim)}")
        flat, at = record.reshape(-1).to(table.device, self.dtype), 0
        for name, rows in self._resume_rows.items():
            plane = self.planes[name]
            size = plane.shape[0] * rows * plane.shape[2]
            keep = min(rows, max(0, start - (end - rows)))  # rows before ``start`` (or position 0)
            pos = torch.arange(end - rows + keep, end, device=table.device)
            part = flat[at : at + size].view(plane.shape[0], rows, plane.shape[2])[:, keep:]
            plane.index_copy_(1, slots_for(table, pos, self.page_size), part)
            at += size

    def _unit_slots(self, name: str, table: torch.Tensor, unit_idx: int, n: int
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The slots of a unit's ``n`` entries of plane ``name`` on its pages ``table``, and for a
        window wider than a unit, a 0 mask where none closes in this unit."""
        m = self._ratio(name)
        if m <= 64:  # the unit's own entries k = 0 .. 64/m - 1 (its first page starts a window)
            return entry_slots(table, torch.arange(n, device=table.device), m, self.page_size), None
        # one entry slot per page (m > Z): the entry closing at the unit's last token, if one does
        closes = (unit_idx + 1) * 64 % m == 0
        return table[-1:], torch.tensor([1.0 if closes else 0.0], device=table.device, dtype=self.dtype)
