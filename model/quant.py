"""8-bit weights for CPU decode: int8 with a float32 scale per row and group of 128 columns.

Decode on a CPU is bound by streaming the weights; int8 reads a quarter of fp32's bytes. The
projections that run through ``model.layers.linear`` (attention's q/kv_a/o, dense and shared MLPs,
the LM head) and the routed experts are held as ``Q8Weight``; decode-sized batches run the int8
CPU kernels (``kernels.cpu_gemv``), larger ones dequantize the weight for the call. The embedding,
norms, the gate and ``kv_b`` (which the absorbed attention splits and keeps as its own copies)
stay as they are. DeepSeek's FP8 checkpoints are dequantized at load and re-quantized here: int8
on the same 128-column blocks, a finer grid than e4m3's 3 mantissa bits, and one the CPU widens to
float in two instructions.

Legend: N output features, K input features, G columns per scale, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_gemv import Q8_GROUP, dequantize_q8, quantize_q8
from kernels.fp8_gemm import dequantize_blocks
from model.weights_id import FP8_WEIGHTS

__all__ = ["CPU_WEIGHTS", "FP8_WEIGHTS", "Fp8Weight", "Q8Weight", "quantize_model", "weight_bytes"]

CPU_WEIGHTS = ("fp32", "int8")  # how a CPU model holds its weights (load_model's cpu_weights)


@dataclass(frozen=True, slots=True)
class Q8Weight:
    """A weight [..., N, K] as int8 ``q`` with float32 ``scale`` [..., N, K / G]."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, w: torch.Tensor, group: int = Q8_GROUP) -> Q8Weight:
        return cls(*quantize_q8(w, group))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """float32 [..., N, K]."""
        return dequantize_q8(self.q, self.scale)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """A weight [..., N, K] as DeepSeek's fp8 checkpoints store it: e4m3 ``q`` with float32
    ``scale`` [..., ceil(N/bn), ceil(K/bk)], one per ``block`` (bn, bk) (their
    ``weight_scale_inv``: w = q * scale). Multiplied by ``kernels.fp8_gemm`` (Triton)."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """float32 [..., N, K]."""
        return dequantize_blocks(self.q, self.scale, self.block)

    def to(self, device: torch.device | str, copy: bool = False) -> Fp8Weight:
        return Fp8Weight(self.q.to(device, copy=copy), self.scale.to(device, copy=copy), self.block)

    def __getitem__(self, i: int) -> Fp8Weight:
        """Expert ``i`` of stacked experts [E, N, K]."""
        return Fp8Weight(self.q[i], self.scale[i], self.block)

    @staticmethod
    def cat_rows(parts: list[Fp8Weight]) -> Fp8Weight | None:
        """The parts' rows one after another (a fused gate/up projection); None when a part but
        the last ends inside a scale block (its scales could not be concatenated)."""
        block = parts[0].block
        if any(p.block != block for p in parts) or any(p.shape[-2] % block[0] for p in parts[:-1]):
            return None
        return Fp8Weight(torch.cat([p.q for p in parts], -2), torch.cat([p.scale for p in parts], -2), block)

    @staticmethod
    def stack(parts: list[Fp8Weight]) -> Fp8Weight:
        """[E, N, K] from E weights [N, K] (the routed experts of a layer)."""
        return Fp8Weight(torch.stack([p.q for p in parts]), torch.stack([p.scale for p in parts]), parts[0].block)


def weight_bytes(model) -> int:
    """Bytes of the tensors a model holds for its weights (int8 ones with their scales)."""
    seen: set[int] = set()
    total = 0

    def add(x) -> None:
        nonlocal total
        if isinstance(x, Q8Weight | Fp8Weight):
            add(x.q)
            add(x.scale)
        elif isinstance(x, torch.Tensor) and x.data_ptr() not in seen:
            seen.add(x.data_ptr())
            total += x.numel() * x.element_size()

    for t in _tensors(model):
        add(t)
    return total


def _tensors(model):
    from model.layers import SwiGLU
    from model.moe import MoE

    yield from (model.embed, model.norm, model.lm_head)
    for layer in model.layers:
        yield from (layer.input_norm, layer.post_attn_norm)
        w = layer.attn.w
        yield from (getattr(w, f) for f in w.__slots__ if getattr(w, f) is not None)
        mlps = [layer.mlp] if isinstance(layer.mlp, SwiGLU) else [layer.mlp.shared] if layer.mlp.shared else []
        for mlp in mlps:
            yield from (mlp.gate_up, mlp.down)
        if isinstance(layer.mlp, MoE):
            yield layer.mlp.gate.weight
    executor = next((m.executor for m in model.moe_layers()), None)
    for experts in getattr(executor, "layers", {}).values():
        yield from (experts.gate_up, experts.down)


def quantize_model(model, group: int = Q8_GROUP) -> None:
    """Hold ``model``'s projections and local routed experts as ``Q8Weight`` (in place; the fp32
    copies are released). A float32 CPU model only."""
    from model.layers import SwiGLU
    from model.moe import MoE

    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise ValueError(f"int8 weights are for a float32 CPU model, not {model.dtype} on {model.device}")
    model.lm_head = Q8Weight.of(model.lm_head, group)
    for layer in model.layers:
        w = layer.attn.w
        for name in ("q", "q_a", "q_b", "kv_a", "o"):
            if getattr(w, name) is not None:
                setattr(w, name, Q8Weight.of(getattr(w, name), group))
        mlp = layer.mlp.shared if isinstance(layer.mlp, MoE) else layer.mlp
        if isinstance(mlp, SwiGLU):
            mlp.gate_up, mlp.down = Q8Weight.of(mlp.gate_up, group), Q8Weight.of(mlp.down, group)
    executor = next((m.executor for m in model.moe_layers()), None)
    for experts in getattr(executor, "layers", {}).values():
        experts.gate_up, experts.down = Q8Weight.of(experts.gate_up, group), Q8Weight.of(experts.down, group)
