"""Paged latent KV pool.

Legend: L layers, P pages, Z page size (tokens), D latent values per token
(``kv_lora_rank + qk_rope_head_dim``), I indexer key dims (V3.2), S tokens of one sequence.

The pool holds ``[L, P*Z, D]`` values, and for V3.2 a second plane ``[L, P*Z, I]`` of indexer
keys: both are per token, so one block table addresses both (pages are freed and shared for both
at once). A sequence owns a *block table*: the list of its pages in order; token at position
``p`` lives in slot ``block_table[p // Z] * Z + p % Z``. The page size divides the 64-token cache
unit, so a unit maps to whole pages and can be copied in or out as ``unit_pages = 64 // Z`` page
rows. A token's *row* is what units and handoffs carry: its latent, then its indexer key
(``row_dim`` = D + I). Page allocation belongs to the engine (``cluster/``).
"""

from __future__ import annotations

import torch

from kernels import Impl
from kernels.unit_copy import gather_units, scatter_units
from model.config import ModelConfig

__all__ = ["LatentKVPool", "slots_for"]


def slots_for(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot index of each position. block_table [..., pages] long, positions [..., S] -> [..., S]."""
    page = torch.gather(block_table, -1, positions // page_size)
    return page * page_size + positions % page_size


class LatentKVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        impl: Impl = "ref",
        device: str | torch.device = "cpu",
        layers: int | None = None,
    ) -> None:
        """``layers``: the model's decoder layers (default) and its MTP layers that keep latents
        beside them (``model.mtp``)."""
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        if page_size <= 0 or 64 % page_size:
            raise ValueError(f"page_size must divide the 64-token cache unit, got {page_size}")
        self.num_layers = layers = layers or cfg.num_hidden_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.latent_dim = cfg.latent_dim
        self.row_dim = cfg.kv_dim
        self.impl = impl
        self.data = torch.zeros(layers, num_pages * page_size, cfg.latent_dim, dtype=dtype, device=device)
        self.index_k = None if not cfg.index_topk else torch.zeros(
            layers, num_pages * page_size, cfg.index_head_dim, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def row_layers(self) -> int:
        """The first dim of ``read_pages``' rows (a unit's ``num_layers``)."""
        return self.num_layers

    def handoff_shape(self, tokens: int) -> tuple[int, int, int]:
        """The shape of ``export_tokens``' KV for a prompt of ``tokens`` tokens."""
        return (self.num_layers, tokens, self.row_dim)

    def export_tokens(self, table: torch.Tensor, tokens: int) -> torch.Tensor:
        """The first ``tokens`` tokens' rows of the sequence at ``table`` [pages], for another
        replica: [L, tokens, row_dim] in host memory."""
        slots = slots_for(table, torch.arange(tokens), self.page_size)
        return torch.stack([self.read_rows(layer, slots) for layer in range(self.num_layers)]).cpu()

    def import_tokens(self, table: torch.Tensor, kv: torch.Tensor, tokens: int) -> None:
        """Inverse of ``export_tokens`` (of ``tokens`` tokens): ``kv`` into the sequence at ``table``."""
        slots = slots_for(table, torch.arange(kv.shape[1]), self.page_size)
        for layer in range(self.num_layers):
            self.write_rows(layer, slots, kv[layer])

    def nbytes(self) -> int:
        planes = [self.data] if self.index_k is None else [self.data, self.index_k]
        return sum(p.numel() * p.element_size() for p in planes)

    def write(self, layer_idx: int, slots: torch.Tensor, latents: torch.Tensor) -> None:
        """latents [T, D] into ``slots`` [T] (either may live on another device than the pool)."""
        dev = self.data.device
        self.data[layer_idx].index_copy_(0, slots.to(dev), latents.to(dev, self.data.dtype))

    def read(self, layer_idx: int, slots: torch.Tensor) -> torch.Tensor:
        """slots [...] -> [..., D]."""
        # index_select on a flat index is several times faster than advanced indexing here
        flat = self.data[layer_idx].index_select(0, slots.reshape(-1).to(self.data.device))
        return flat.view(*slots.shape, self.latent_dim)

    def write_index(self, layer_idx: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """V3.2's indexer keys [T, I] into ``slots`` [T]."""
        dev = self.index_k.device
        self.index_k[layer_idx].index_copy_(0, slots.to(dev), keys.to(dev, self.index_k.dtype))

    def read_index(self, layer_idx: int, slots: torch.Tensor) -> torch.Tensor:
        """slots [...] -> V3.2's indexer keys [..., I]."""
        flat = self.index_k[layer_idx].index_select(0, slots.reshape(-1).to(self.index_k.device))
        return flat.view(*slots.shape, self.index_k.shape[-1])

    def write_rows(self, layer_idx: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole rows [T, row_dim] (the latent, then any indexer key) into ``slots`` [T]."""
        self.write(layer_idx, slots, rows[:, : self.latent_dim])
        if self.index_k is not None:
            self.write_index(layer_idx, slots, rows[:, self.latent_dim :])

    def read_rows(self, layer_idx: int, slots: torch.Tensor) -> torch.Tensor:
        """slots [T] -> whole rows [T, row_dim]."""
        if self.index_k is None:
            return self.read(layer_idx, slots)
        return torch.cat((self.read(layer_idx, slots), self.read_index(layer_idx, slots)), dim=-1)

    def read_unit(self, pages: list[int] | torch.Tensor, unit_idx: int) -> torch.Tensor:
        """A cache unit's rows (its pages' ``read_pages``; any unit reads alike)."""
        return self.read_pages(pages)

    def write_unit(self, pages: list[int] | torch.Tensor, unit_idx: int, rows: torch.Tensor) -> None:
        self.write_pages(pages, rows)

    def write_layer(self, pages: list[int] | torch.Tensor, layer: int, rows: torch.Tensor) -> None:
        """One layer of ``write_pages``: rows [len(pages)*Z, row_dim] into ``layer`` of ``pages``."""
        pages_t = torch.as_tensor(pages, dtype=torch.long, device=self.data.device)
        self._put((layer, pages_t), rows.view(len(pages_t), self.page_size, -1))

    def _put(self, where: tuple, rows: torch.Tensor) -> None:
        """``rows`` (row_dim values each, a page's Z together) into the pages at ``where`` of the
        planes viewed as [L, pages, Z, -1]: the latent part, and the indexer keys where kept."""
        rows = rows.to(self.data.device, self.dtype)
        self.data.view(self.num_layers, self.num_pages, self.page_size, -1)[where] = rows[..., : self.latent_dim]
        if self.index_k is not None:
            self.index_k.view(self.num_layers, self.num_pages, self.page_size, -1)[where] = rows[..., self.latent_dim :]

    def read_pages(self, pages: list[int] | torch.Tensor) -> torch.Tensor:
        """Whole pages for every layer, in order: -> rows [L, len(pages)*Z, row_dim] (a copy)."""
        pages_t = torch.as_tensor(pages, dtype=torch.long, device=self.data.device)
        if self.impl == "triton" and self.index_k is None:
            return gather_units(self.data, pages_t[None], self.page_size)[0]
        planes = [self.data] if self.index_k is None else [self.data, self.index_k]
        out = [p.view(self.num_layers, self.num_pages, self.page_size, -1)[:, pages_t] for p in planes]
        return (out[0] if len(out) == 1 else torch.cat(out, dim=-1)).reshape(self.num_layers, -1, self.row_dim)

    def write_pages(self, pages: list[int] | torch.Tensor, rows: torch.Tensor) -> None:
        """Inverse of ``read_pages``: rows [L, len(pages)*Z, row_dim]."""
        pages_t = torch.as_tensor(pages, dtype=torch.long, device=self.data.device)
        expected = (self.num_layers, len(pages_t) * self.page_size, self.row_dim)
        if tuple(rows.shape) != expected:
            raise ValueError(f"KV rows of shape {tuple(rows.shape)} != expected {expected}")
        if self.impl == "triton" and self.index_k is None:
            scatter_units(self.data, pages_t[None], rows[None].to(self.data.device, self.dtype), self.page_size)
            return
        self._put((slice(None), pages_t), rows.view(self.num_layers, len(pages_t), self.page_size, -1))
