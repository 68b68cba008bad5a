"""Paged latent KV pool.

Legend: L layers, P pages, Z page size (tokens), D latent values per token
(``kv_lora_rank + qk_rope_head_dim``), S tokens of one sequence.

The pool holds ``[L, P*Z, D]`` values. A sequence owns a *block table*: the list of its pages in
order; token at position ``p`` lives in slot ``block_table[p // Z] * Z + p % Z``. The page size
divides the 64-token cache unit, so a unit maps to whole pages and can be copied in or out as
``unit_pages = 64 // Z`` page rows. Page allocation belongs to the engine (``cluster/``).
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
    ) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        if page_size <= 0 or 64 % page_size:
            raise ValueError(f"page_size must divide the 64-token cache unit, got {page_size}")
        self.num_layers = cfg.num_hidden_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.latent_dim = cfg.latent_dim
        self.impl = impl
        self.data = torch.zeros(cfg.num_hidden_layers, num_pages * page_size, cfg.latent_dim, dtype=dtype,
                                device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write(self, layer_idx: int, slots: torch.Tensor, latents: torch.Tensor) -> None:
        """latents [T, D] into ``slots`` [T] (either may live on another device than the pool)."""
        dev = self.data.device
        self.data[layer_idx].index_copy_(0, slots.to(dev), latents.to(dev, self.data.dtype))

    def read(self, layer_idx: int, slots: torch.Tensor) -> torch.Tensor:
        """slots [...] -> [..., D]."""
        # index_select on a flat index is several times faster than advanced indexing here
        flat = self.data[layer_idx].index_select(0, slots.reshape(-1).to(self.data.device))
        return flat.view(*slots.shape, self.latent_dim)

    def read_pages(self, pages: list[int] | torch.Tensor) -> torch.Tensor:
        """Whole pages for every layer, in order: -> [L, len(pages)*Z, D] (a copy)."""
        pages_t = torch.as_tensor(pages, dtype=torch.long, device=self.data.device)
        if self.impl == "triton":
            return gather_units(self.data, pages_t[None], self.page_size)[0]
        view = self.data.view(self.num_layers, self.num_pages, self.page_size, self.latent_dim)
        return view[:, pages_t].reshape(self.num_layers, -1, self.latent_dim)

    def write_pages(self, pages: list[int] | torch.Tensor, latents: torch.Tensor) -> None:
        """Inverse of ``read_pages``: latents [L, len(pages)*Z, D]."""
        pages_t = torch.as_tensor(pages, dtype=torch.long, device=self.data.device)
        expected = (self.num_layers, len(pages_t) * self.page_size, self.latent_dim)
        if tuple(latents.shape) != expected:
            raise ValueError(f"latents shape {tuple(latents.shape)} != expected {expected}")
        if self.impl == "triton":
            scatter_units(self.data, pages_t[None], latents[None].to(self.data.device, self.dtype), self.page_size)
            return
        view = self.data.view(self.num_layers, self.num_pages, self.page_size, self.latent_dim)
        view[:, pages_t] = latents.view(self.num_layers, len(pages_t), self.page_size, -1).to(
            self.data.device, self.dtype)
