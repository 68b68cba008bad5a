"""Mixture-of-Experts: the DeepSeek gates, the expert executor seam, and the MoE block.

Legend: T tokens, M hidden, E routed experts, K experts per token, I moe intermediate size,
G expert groups.

The routed-expert computation is an ``ExpertExecutor``: given hidden states and each token's
top-K expert ids and weights, it returns the weighted sum of those experts' outputs. The model
ships ``LocalExpertExecutor`` (all experts in this process); expert parallelism replaces it from
outside with one that dispatches tokens to remote shards. The model never knows which it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels import Impl
from kernels.cpu_gemv import moe_route, moe_routed, moe_routed_q8, ref_moe_route, ref_moe_routed
from kernels.fp8_gemm import moe_grouped_mlp_fp8
from kernels.moe_grouped import moe_grouped_mlp
from kernels.moe_route import moe_route_v3
from model.config import ModelConfig
from model.layers import SMALL_ROWS, SwiGLU, needs_grad
from model.quant import Fp8Weight, Q8Weight

__all__ = ["ExpertExecutor", "ExpertWeights", "Gate", "LocalExpertExecutor", "MoE", "route"]


@dataclass(slots=True)
class Gate:
    weight: torch.Tensor  # [E, M], kept in fp32
    e_score_correction_bias: torch.Tensor | None = None  # [E] (V3)


def route(
    cfg: ModelConfig, gate: Gate, x: torch.Tensor, impl: Impl = "ref"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K routing. x [T, M] -> (expert ids [T, K] int64, weights [T, K] fp32).

    V2: softmax scores, ``greedy`` or ``group_limited_greedy`` (groups ranked by their max score).
    V3 (``noaux_tc``): sigmoid scores; the bias only steers the *choice* (groups ranked by the sum
    of their top-2 biased scores), the weights are the unbiased scores, optionally normalised.
    """
    logits = F.linear(x.float(), gate.weight.float())  # [T, E]
    if impl == "triton" and cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid":
        return moe_route_v3(
            logits, gate.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group,
            cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor,
        )
    small = logits.shape[0] <= SMALL_ROWS and logits.device.type == "cpu" and not needs_grad(logits)
    return (moe_route if small else ref_moe_route)(
        logits, gate.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
        cfg.topk_method, cfg.scoring_func == "softmax", cfg.norm_topk_prob, cfg.routed_scaling_factor,
    )


class ExpertExecutor(Protocol):
    """Computes routed experts for one MoE layer.

    ``x`` [T, M], ``expert_ids`` [T, K] (logical expert ids), ``weights`` [T, K] fp32 ->
    [T, M] in ``x``'s dtype: sum_k weights[t, k] * expert_{ids[t, k]}(x[t]). Mutates nothing the
    caller owns; T == 0 returns an empty [0, M] tensor.
    """

    def __call__(
        self, layer_idx: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor: ...


@dataclass(slots=True)
class ExpertWeights:
    """Routed experts of one layer, stacked in Hugging Face layout."""

    gate_up: torch.Tensor | Q8Weight | Fp8Weight  # [E, 2I, M]  (gate_proj rows, then up_proj rows)
    down: torch.Tensor | Q8Weight | Fp8Weight  # [E, M, I]
    limit: float | None = None  # DeepSeek-V4's SwiGLU clip (model.layers.swiglu)

    @classmethod
    def stack(cls, gate_up: list, down: list, limit: float | None = None) -> ExpertWeights:
        """From per-expert ``gate_up`` [2I, M] and ``down`` [M, I] matrices (tensors, or all
        ``Fp8Weight``)."""
        if isinstance(gate_up[0], Fp8Weight):
            return cls(Fp8Weight.stack(gate_up), Fp8Weight.stack(down), limit)
        return cls(torch.stack(gate_up), torch.stack(down), limit)


def grouped_expert_forward(
    w: ExpertWeights, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
    impl: Impl = "ref",
) -> torch.Tensor:
    """Sort token copies by expert and run each expert on its contiguous slice of rows.

    ``expert_ids`` index ``w``'s first dim (physical slots for a shard, logical experts locally).
    Many rows (prefill): one grouped GEMM per projection. Few rows (decode): every expert is a
    GEMV, which BLAS runs far below memory bandwidth, so a CPU kernel that streams each active
    expert's weights once takes over (``kernels.cpu_gemv``). ``impl="triton"`` runs the Triton
    grouped GEMM (``kernels.moe_grouped``) instead. Shapes as ``ExpertExecutor``.
    """
    t, k = expert_ids.shape
    num_slots = w.gate_up.shape[0]
    if t == 0:
        return torch.zeros_like(x)
    if w.limit is not None:  # clipped SwiGLU (V4): the CPU kernel at decode sizes, else expert by expert
        gate_up, down = (m.dequantize() if isinstance(m, Fp8Weight | Q8Weight) else m for m in (w.gate_up, w.down))
        small = t * k <= _GEMV_ROWS_PER_EXPERT * num_slots and x.dtype == torch.float32 and x.device.type == "cpu"
        if small:
            return moe_routed(x.contiguous(), expert_ids.contiguous(), weights.float().contiguous(), gate_up, down,
                              w.limit)
        return ref_moe_routed(x, expert_ids, weights.to(x.dtype), gate_up.to(x.dtype), down.to(x.dtype), w.limit)
    if isinstance(w.gate_up, Fp8Weight):  # e4m3 experts as the checkpoint stores them
        return moe_grouped_mlp_fp8(x, expert_ids, weights, w.gate_up.q, w.gate_up.scale, w.down.q, w.down.scale,
                                   w.gate_up.block)
    if isinstance(w.gate_up, Q8Weight):  # int8 experts (model.quant): the kernel, or fp32 for this call
        if t * k <= _GEMV_ROWS_PER_EXPERT * num_slots and x.dtype == torch.float32 and x.device.type == "cpu":
            return moe_routed_q8(x.contiguous(), expert_ids.contiguous(), weights.float().contiguous(),
                                 w.gate_up.q, w.gate_up.scale, w.down.q, w.down.scale)
        w = ExpertWeights(w.gate_up.dequantize(), w.down.dequantize())
    if impl == "triton":
        return moe_grouped_mlp(x, expert_ids, weights, w.gate_up, w.down)
    if t * k <= _GEMV_ROWS_PER_EXPERT * num_slots and x.dtype == torch.float32 and x.device.type == "cpu":
        return moe_routed(x.contiguous(), expert_ids.contiguous(), weights.float().contiguous(), w.gate_up, w.down)
    if not _HAS_GROUPED_MM or x.device.type != "cpu":  # CUDA's grouped GEMM wants bf16 on sm_90
        return ref_moe_routed(x, expert_ids, weights.to(x.dtype), w.gate_up, w.down)
    flat_ids = expert_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)  # [T*K]
    token_idx = order // k
    xs = x.index_select(0, token_idx)  # [T*K, M]
    offs = torch.bincount(flat_ids, minlength=num_slots).cumsum(0).to(torch.int32)  # [E]
    g, u = torch._grouped_mm(xs, w.gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # [T*K, I]
    ys = torch._grouped_mm(F.silu(g) * u, w.down.transpose(1, 2), offs=offs)  # [T*K, M]
    ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, token_idx, ys)


def _grouped_mm_works() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a, b = torch.ones(3, 2), torch.ones(2, 2, 2)
        y = torch._grouped_mm(a, b, offs=torch.tensor([1, 3], dtype=torch.int32))
        return bool(torch.allclose(y, torch.full((3, 2), 2.0)))
    except (RuntimeError, NotImplementedError):
        return False


_HAS_GROUPED_MM = _grouped_mm_works()
# Up to this many (token, expert) rows per expert on average, experts run as multi-row GEMVs
# (decode batches, short prefill chunks); above it BLAS's grouped GEMM wins.
_GEMV_ROWS_PER_EXPERT = 16


class LocalExpertExecutor:
    """Every routed expert of every MoE layer in this process."""

    def __init__(self, layers: dict[int, ExpertWeights], impl: Impl = "ref") -> None:
        self.layers = layers
        self.impl = impl

    def __call__(
        self, layer_idx: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return grouped_expert_forward(self.layers[layer_idx], x, expert_ids, weights, self.impl)


class MoE:
    """Gate + routed experts (through the executor) + shared experts."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, gate: Gate, shared: SwiGLU | None, impl: Impl = "ref"
    ) -> None:
        self.cfg = cfg
        self.impl = impl
        self.layer_idx = layer_idx
        self.gate = gate
        self.shared = shared
        self.executor: ExpertExecutor | None = None
        # Optional hook for load statistics (EPLB): called with expert ids [T, K].
        self.on_route = None

    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.submit(x, token_ids)()

    def route(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, M] (and the rows' token ids [T], which V2/V3 do not read) -> (expert ids [T, K],
        weights [T, K] fp32)."""
        return route(self.cfg, self.gate, x, self.impl)

    def submit(self, x: torch.Tensor, token_ids: torch.Tensor | None = None):
        """Start the routed experts (asynchronously when the executor has ``submit``) and compute
        the shared experts meanwhile; returns a function that waits and gives [T, M]."""
        assert self.executor is not None, "no expert executor set"
        ids, weights = self.route(x, token_ids)
        if self.on_route is not None:
            self.on_route(self.layer_idx, ids)
        submit = getattr(self.executor, "submit", None)
        if submit is not None:
            routed = submit(self.layer_idx, x, ids, weights)
        else:
            y = self.executor(self.layer_idx, x, ids, weights)  # [T, M]
            routed = lambda: y  # noqa: E731
        shared = self.shared(x) if self.shared is not None else None
        return lambda: routed() if shared is None else routed() + shared
