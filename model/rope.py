"""Rotary position embedding with DeepSeek's YaRN scaling.

Legend: T tokens, H heads, R rope dims (``qk_rope_head_dim``).

``rope_interleave`` models rotate adjacent pairs (x0, x1), (x2, x3)...; the result is written
de-interleaved (all first elements, then all second elements). Queries and keys get the same
permutation, so every dot product equals the one of the interleaved rotation; the RoPE key stored
in the latent cache uses this layout.
"""

from __future__ import annotations

import math

import torch

from model.config import ModelConfig, RopeScaling, yarn_mscale

__all__ = ["RotaryEmbedding", "apply_rope", "yarn_inv_freq"]


def _yarn_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    assert cfg.rope_scaling is not None
    return yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)


def yarn_inv_freq(dim: int, base: float, rs: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies [dim/2] for ``dim`` rotated dims, and its attention factor."""

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rs.factor * pos_freqs)
    keep = 1 - ramp  # share of the original (extrapolated) frequency per dim
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    attention_factor = (
        yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
        if rs.mscale and rs.mscale_all_dim
        else yarn_mscale(rs.factor)
    )
    return inv_freq, attention_factor


class RotaryEmbedding:
    """Precomputed cos/sin tables, grown on demand; indexable by absolute position."""

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.rope_scaling is None:
            dim = cfg.qk_rope_head_dim
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.attention_factor = 1.0
        else:
            inv_freq, self.attention_factor = _yarn_inv_freq(cfg)
        self.inv_freq = inv_freq  # [R/2]
        self.interleave = cfg.rope_interleave
        self._cos = torch.empty(0, inv_freq.numel())
        self._sin = torch.empty(0, inv_freq.numel())

    def _grow(self, n: int, device: torch.device) -> None:
        n = max(n, 2 * self._cos.shape[0], 256)
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq  # [N, R/2] (on the CPU)
        freqs = freqs.to(device)
        self._cos = freqs.cos() * self.attention_factor
        self._sin = freqs.sin() * self.attention_factor

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, top: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for ``positions`` [T] -> two [T, R/2] tensors, on the positions' device.
        ``top`` (> every position), when the caller knows it, spares reading the positions back
        from a GPU."""
        if top is None:
            top = int(positions.max()) + 1 if positions.numel() else 0
        if top > self._cos.shape[0] or self._cos.device != positions.device:
            self._grow(top, positions.device)
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate ``x`` [T, ..., R] by per-token angles (``cos``/``sin`` [T, R/2], broadcast over the
    middle dims). Output layout is de-interleaved ``[rotated firsts, rotated seconds]``."""
    extra = x.dim() - 2
    cos = cos.view(cos.shape[0], *([1] * extra), cos.shape[1])
    sin = sin.view(sin.shape[0], *([1] * extra), sin.shape[1])
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
