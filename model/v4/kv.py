"""DeepSeek-V4's paged KV: one pool per kind of state, all addressed through a sequence's pages.

Legend: L layers, Lc CSA layers, Lh HCA layers, P pages, Z page size (tokens), D head dim,
I indexer head dim, m a compressor's ratio (tokens per entry), E entries.

Per token (``window`` planes, needed only near the end of a sequence):
  ``swa``      [L, P*Z, D]          the sliding window's K=V, every layer;
  ``csa_src``  [Lc, P*Z, 4D + 4I]   a CSA layer's compressor inputs: kv (2D), gate (2D), then its
                                    indexer's kv (2I) and gate (2I);
  ``hca_src``  [Lh, P*Z, 2D]        an HCA layer's compressor inputs: kv (D), gate (D).
Per compressed entry (``compressed`` planes, what a long sequence keeps):
  ``csa_kv`` [Lc, P*Sc, D], ``csa_ik`` [Lc, P*Sc, I], ``hca_kv`` [Lh, P*Sh, D].

Entry e of a ratio-m compressor closes with token (e+1)*m - 1 and lives in that token's page, in
slot e mod S of the page's S = max(1, Z // m) entry slots; so a page holds exactly the entries that
close inside it, a complete page never changes again, and a 64-token cache unit is whole pages:
its compressed entries, then its window rows (``read_pages``).
"""

from __future__ import annotations

import torch

from model.v4.config import CSA, HCA, V4Config

__all__ = ["HybridKVPool", "entry_slots"]


def entry_slots(table: torch.Tensor, entries: torch.Tensor, ratio: int, page_size: int) -> torch.Tensor:
    """Slots of entries [E] (ids of one sequence's ratio-m entries) in a compressed plane, for the
    sequence's pages ``table`` [pages]."""
    per_page = max(1, page_size // ratio)
    page = table[((entries + 1) * ratio - 1) // page_size]
    return page * per_page + entries % per_page


class HybridKVPool:
    def __init__(self, cfg: V4Config, num_pages: int, page_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        if page_size <= 0 or 64 % page_size:
            raise ValueError(f"page_size must divide the 64-token cache unit, got {page_size}")
        for ratio in (cfg.csa_ratio, cfg.hca_ratio):
            if page_size % ratio and ratio % page_size:
                raise ValueError(f"page_size {page_size} and a compressor's ratio {ratio}: one must divide the other")
        self.cfg, self.num_pages, self.page_size = cfg, num_pages, page_size
        self.num_layers = cfg.num_hidden_layers
        self.csa_layers = [i for i, t in enumerate(cfg.layer_types) if t == CSA]
        self.hca_layers = [i for i, t in enumerate(cfg.layer_types) if t == HCA]
        # a model layer's index in its kind's planes
        self.plane_idx = {i: k for kinds in (self.csa_layers, self.hca_layers) for k, i in enumerate(kinds)}
        d, ix, slots = cfg.head_dim, cfg.index_head_dim, num_pages * page_size
        self.entry_slots_per_page = {CSA: max(1, page_size // cfg.csa_ratio), HCA: max(1, page_size // cfg.hca_ratio)}
        lc, lh = len(self.csa_layers), len(self.hca_layers)
        sc, sh = self.entry_slots_per_page[CSA], self.entry_slots_per_page[HCA]

        def plane(layers: int, rows: int, dim: int) -> torch.Tensor:
            return torch.zeros(layers, rows, dim, dtype=dtype, device=device)

        # compressed planes first, then the window planes: the order of a unit's bytes
        self.planes: dict[str, torch.Tensor] = {
            "csa_kv": plane(lc, num_pages * sc, d), "csa_ik": plane(lc, num_pages * sc, ix),
            "hca_kv": plane(lh, num_pages * sh, d),
            "swa": plane(self.num_layers, slots, d), "csa_src": plane(lc, slots, 4 * d + 4 * ix),
            "hca_src": plane(lh, slots, 2 * d),
        }
        per_page = sum(p.shape[0] * p.shape[2] * p.shape[1] // num_pages for p in self.planes.values())
        if per_page % page_size:
            raise ValueError(f"page_size {page_size}: a page's {per_page} values are not whole token rows")
        self.row_dim = per_page // page_size  # a unit is [1, 64, row_dim]: its pages' bytes, not per-token rows
        self.latent_dim = self.row_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.planes["swa"].dtype

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes.values())

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes each plane holds per token of a sequence, from its shapes."""
        z = self.page_size
        return {name: p.shape[0] * p.shape[2] * p.element_size() * (p.shape[1] // self.num_pages) / z
                for name, p in self.planes.items()}

    # -- pages in and out (cache units) ---------------------------------------------------
    def read_pages(self, pages: list[int] | torch.Tensor) -> torch.Tensor:
        """Whole pages of every plane, compressed planes first: -> [1, len(pages)*Z, row_dim]."""
        pages_t = torch.as_tensor(pages, dtype=torch.long, device=self.planes["swa"].device)
        parts = [p.view(p.shape[0], self.num_pages, -1)[:, pages_t].transpose(0, 1).reshape(len(pages_t), -1)
                 for p in self.planes.values()]  # [pages, this plane's values per page]
        return torch.cat(parts, dim=1).reshape(1, len(pages_t) * self.page_size, self.row_dim)

    def write_pages(self, pages: list[int] | torch.Tensor, rows: torch.Tensor) -> None:
        """Inverse of ``read_pages``."""
        pages_t = torch.as_tensor(pages, dtype=torch.long, device=self.planes["swa"].device)
        expected = (1, len(pages_t) * self.page_size, self.row_dim)
        if tuple(rows.shape) != expected:
            raise ValueError(f"KV rows of shape {tuple(rows.shape)} != expected {expected}")
        flat = rows.reshape(len(pages_t), -1).to(pages_t.device, self.dtype)
        at = 0
        for p in self.planes.values():
            per_page = p.shape[0] * (p.shape[1] // self.num_pages) * p.shape[2]
            part = flat[:, at : at + per_page].view(len(pages_t), p.shape[0], -1).transpose(0, 1)
            p.view(p.shape[0], self.num_pages, -1)[:, pages_t] = part
            at += per_page
