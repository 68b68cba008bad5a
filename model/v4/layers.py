"""DeepSeek-V4's building blocks: its RoPE, the unweighted RMSNorm, and the manifold-constrained
hyper-connections (mHC) that replace the residual stream.

Legend: T tokens, M hidden size, N streams (``hc_mult``), D head dim, R rope dims (the trailing
``qk_rope_head_dim`` of a head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.rope import yarn_inv_freq
from model.v4.config import V4Config

__all__ = ["HyperConnection", "HyperHead", "Rope", "rms_unweighted", "rope_tail"]


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight over the last dim (statistics in fp32, result in x's dtype)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Rope:
    """cos/sin tables [positions, R/2] of one RoPE kind: ``main`` (sliding-only layers) or
    ``compress`` (layers with a compressor, and the compressors; YaRN-scaled where the config
    says, without YaRN's attention factor)."""

    def __init__(self, cfg: V4Config, kind: str) -> None:
        dim = cfg.qk_rope_head_dim
        if kind == "compress" and cfg.compress_rope_scaling is not None:
            self.inv_freq, _ = yarn_inv_freq(dim, cfg.compress_rope_theta, cfg.compress_rope_scaling)
        else:
            base = cfg.rope_theta if kind == "main" else cfg.compress_rope_theta
            self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [R/2]
        self._cos = self._sin = torch.empty(0, self.inv_freq.numel())

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, R/2] on the positions' device."""
        top = int(positions.max()) + 1 if positions.numel() else 0
        if top > self._cos.shape[0] or self._cos.device != positions.device:
            n = max(top, 2 * self._cos.shape[0], 256)
            freqs = (torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq).to(positions.device)
            self._cos, self._sin = freqs.cos(), freqs.sin()
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing R dims of ``x`` [T, ..., D] as interleaved pairs (the layout kept), by
    per-token angles (cos/sin [T, R/2]); ``inverse`` rotates back (the angle negated)."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape).float(), sin.view(shape).float()
    if inverse:
        sin = -sin
    rope = x[..., -r:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-r], rotated), dim=-1)


@dataclass(slots=True)
class HyperConnection:
    """One block's mHC: from the N streams, the weights that collapse them into the block's input
    (pre), spread its output back (post) and mix the streams (comb, doubly stochastic)."""

    fn: torch.Tensor  # [(2+N)*N, N*M] fp32
    base: torch.Tensor  # [(2+N)*N] fp32
    scale: torch.Tensor  # [3] fp32

    def __call__(self, streams: torch.Tensor, cfg: V4Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, M] -> (post [T, N], comb [T, N, N], the block's input [T, M])."""
        t, n = streams.shape[0], cfg.hc_mult
        flat = rms_unweighted(streams.reshape(t, -1).float(), cfg.rms_norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn.float()).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + cfg.hc_eps  # [T, N]
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)  # [T, N]
        comb = torch.softmax(comb_w.view(t, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + cfg.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)  # Sinkhorn-Knopp to doubly stochastic
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + cfg.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)  # [T, M]
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after a block: its output [T, M] spread by post [T, N] plus the streams
        [T, N, M] mixed by comb [T, N, N] (``comb^T @ streams``)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


@dataclass(slots=True)
class HyperHead:
    """The last collapse of the N streams into one, before the final norm."""

    fn: torch.Tensor  # [N, N*M] fp32
    base: torch.Tensor  # [N]
    scale: torch.Tensor  # [1]

    def __call__(self, streams: torch.Tensor, cfg: V4Config) -> torch.Tensor:
        """streams [T, N, M] -> [T, M]."""
        flat = rms_unweighted(streams.flatten(1).float(), cfg.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float() + self.base.float()) + cfg.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
