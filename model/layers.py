"""Small building blocks: RMSNorm and the SwiGLU MLP (dense layers and shared experts).

Legend: T tokens, H hidden, I intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_gemv import rms_norm as cpu_rms_norm
from kernels.cpu_gemv import small_linear, small_linear_q8
from kernels.fp8_gemm import fp8_linear
from model.quant import Fp8Weight, Q8Weight

__all__ = ["linear", "needs_grad", "rms_norm", "swiglu", "SwiGLU"]

# Up to this many rows a linear layer is a (multi-row) GEMV: see kernels.cpu_gemv.
SMALL_ROWS = 32


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on these tensors: the C++ kernels have no backward, so
    such an op (training) takes the torch path."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear(x: torch.Tensor, w: torch.Tensor | Q8Weight | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for x [T, K], w [N, K] (a tensor, int8 ``Q8Weight`` or e4m3 ``Fp8Weight``);
    decode-sized fp32 CPU batches use the GEMV kernels, larger ones an int8 weight dequantized for
    the call; fp8 weights run the block-scaled fp8 GEMM (x quantized per row and block)."""
    if isinstance(w, Fp8Weight):
        y = fp8_linear(x.reshape(-1, x.shape[-1]), w.q, w.scale, w.block).view(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias
    small = bias is None and x.dim() == 2 and x.shape[0] <= SMALL_ROWS and x.dtype == torch.float32 \
        and x.device.type == "cpu" and not (isinstance(w, torch.Tensor) and needs_grad(x, w))
    if isinstance(w, Q8Weight):
        if small:
            return small_linear_q8(x.contiguous(), w.q, w.scale)
        return F.linear(x, w.dequantize().to(x.dtype), bias)
    if small:
        return small_linear(x.contiguous(), w)
    return F.linear(x, w, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 (as Hugging Face does), returned in ``x``'s dtype."""
    if x.dtype == torch.float32:
        if x.dim() == 2 and x.device.type == "cpu" and weight.dtype == torch.float32 and not needs_grad(x, weight):
            return cpu_rms_norm(x.contiguous(), weight.contiguous(), eps)
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class SwiGLU:
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one [2I, H] matrix; with
    ``limit`` (DeepSeek-V4) gate is clipped above at it and up to [-limit, limit] first."""

    def __init__(self, gate_up: torch.Tensor | Q8Weight | Fp8Weight, down: torch.Tensor | Q8Weight | Fp8Weight,
                 limit: float | None = None) -> None:
        assert gate_up.shape[0] == 2 * down.shape[1], (gate_up.shape, down.shape)
        self.gate_up = gate_up  # [2I, H]
        self.down = down  # [H, I]
        self.limit = limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g, u = linear(x, self.gate_up).chunk(2, dim=-1)  # [T, I] each
        return linear(swiglu(g, u, self.limit), self.down)  # [T, H]


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up, both clipped first where ``limit`` is given (gate above, up both ways)."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
