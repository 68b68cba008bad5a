"""Mixture-of-Experts: the DeepSeek gates, the expert executor seam, and the MoE block.

Legend: T tokens, M hidden, E routed experts, K experts per token, I moe intermediate size,
G expert groups.

The routed-expert computation is an ``ExpertExecutor``: given hidden states and each token's
top-K expert ids and weights, it returns the weighted sum of those experts' outputs. The model
ships ``LocalExpertExecutor`` (all experts in this process); expert parallelism replaces it from
outside with one that dispatches tokens to remote shards. The model never knows which it has.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.layers import SwiGLU

__all__ = ["ExpertExecutor", "ExpertWeights", "Gate", "LocalExpertExecutor", "MoE", "route"]


@dataclass(slots=True)
class Gate:
    weight: torch.Tensor  # [E, M], kept in fp32
    e_score_correction_bias: torch.Tensor | None = None  # [E] (V3)


def route(cfg: ModelConfig, gate: Gate, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K routing. x [T, M] -> (expert ids [T, K] int64, weights [T, K] fp32).

    V2: softmax scores, ``greedy`` or ``group_limited_greedy`` (groups ranked by their max score).
    V3 (``noaux_tc``): sigmoid scores; the bias only steers the *choice* (groups ranked by the sum
    of their top-2 biased scores), the weights are the unbiased scores, optionally normalised.
    """
    logits = F.linear(x.float(), gate.weight.float())  # [T, E]
    t, e = logits.shape
    g = cfg.n_group
    if cfg.scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        scores = logits.sigmoid()
    choice = scores
    if cfg.topk_method == "noaux_tc" and gate.e_score_correction_bias is not None:
        choice = scores + gate.e_score_correction_bias.float()
    if cfg.topk_method in ("group_limited_greedy", "noaux_tc") and g > 1:
        grouped = choice.view(t, g, e // g)
        if cfg.topk_method == "noaux_tc":
            group_scores = grouped.topk(min(2, e // g), dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values  # [T, G]
        group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = group_mask[:, :, None].expand(t, g, e // g).reshape(t, e)
        fill = float("-inf") if cfg.topk_method == "noaux_tc" else 0.0
        choice = choice.masked_fill(~keep, fill)
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices  # [T, K]
    weights = scores.gather(1, ids)  # [T, K]
    if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


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
    """All routed experts of one layer, stacked and pre-transposed for grouped GEMMs."""

    gate_up_t: torch.Tensor  # [E, M, 2I]
    down_t: torch.Tensor  # [E, I, M]

    @classmethod
    def stack(cls, gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> ExpertWeights:
        """From per-expert ``gate_up`` [2I, M] and ``down`` [M, I] matrices."""
        return cls(
            gate_up_t=torch.stack(gate_up).transpose(1, 2).contiguous(),
            down_t=torch.stack(down).transpose(1, 2).contiguous(),
        )


def grouped_expert_forward(
    w: ExpertWeights,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    pool: ThreadPoolExecutor | None = None,
) -> torch.Tensor:
    """Sort token copies by expert and run each expert on its contiguous slice.

    ``expert_ids`` index ``w``'s first dim (physical slots for a shard, logical experts locally).
    Few tokens (decode): each expert is a GEMV that one core runs at a fraction of memory
    bandwidth, so experts are spread over ``pool``'s threads. Many tokens (prefill): one grouped
    GEMM per projection, parallel inside. Shapes as ``ExpertExecutor``.
    """
    t, k = expert_ids.shape
    out = torch.zeros_like(x)
    if t == 0:
        return out
    flat_ids = expert_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)  # [T*K]
    token_idx = order // k
    xs = x.index_select(0, token_idx)  # [T*K, M]
    counts = torch.bincount(flat_ids, minlength=w.gate_up_t.shape[0])  # [E]
    if _HAS_GROUPED_MM and (pool is None or t * k > _GEMV_ROWS):
        offs = counts.cumsum(0).to(torch.int32)
        gu = torch._grouped_mm(xs, w.gate_up_t, offs=offs)  # [T*K, 2I]
        g, u = gu.chunk(2, dim=-1)
        ys = torch._grouped_mm(F.silu(g) * u, w.down_t, offs=offs)  # [T*K, M]
    else:
        ys = torch.empty_like(xs)
        spans, begin = [], 0
        for expert, n in enumerate(counts.tolist()):
            if n:
                spans.append((expert, begin, begin + n))
                begin += n

        inference = torch.is_inference_mode_enabled()  # thread-local: carry it into the workers

        def run(part: list[tuple[int, int, int]]) -> None:
            with torch.inference_mode(inference):
                _run_experts(part)

        def _run_experts(part: list[tuple[int, int, int]]) -> None:
            for expert, lo, hi in part:
                g, u = (xs[lo:hi] @ w.gate_up_t[expert]).chunk(2, dim=-1)
                torch.matmul(F.silu(g) * u, w.down_t[expert], out=ys[lo:hi])

        if pool is None:
            run(spans)
        else:
            n_parts = pool._max_workers  # noqa: SLF001 - the pool is ours
            list(pool.map(run, [spans[i::n_parts] for i in range(n_parts)]))
    ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
    return out.index_add_(0, token_idx, ys)


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
# Up to this many (token, expert) rows the experts run as per-thread GEMVs (decode-sized batches).
_GEMV_ROWS = 256


class LocalExpertExecutor:
    """Every routed expert of every MoE layer in this process."""

    def __init__(self, layers: dict[int, ExpertWeights], num_threads: int | None = None) -> None:
        self.layers = layers
        n = num_threads or torch.get_num_threads()
        self.pool = ThreadPoolExecutor(n, thread_name_prefix="experts") if n > 1 else None

    def __call__(
        self, layer_idx: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return grouped_expert_forward(self.layers[layer_idx], x, expert_ids, weights, self.pool)


class MoE:
    """Gate + routed experts (through the executor) + shared experts."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, gate: Gate, shared: SwiGLU | None) -> None:
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.gate = gate
        self.shared = shared
        self.executor: ExpertExecutor | None = None
        # Optional hook for load statistics (EPLB): called with expert ids [T, K].
        self.on_route = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert self.executor is not None, "no expert executor set"
        ids, weights = route(self.cfg, self.gate, x)
        if self.on_route is not None:
            self.on_route(self.layer_idx, ids)
        y = self.executor(self.layer_idx, x, ids, weights)  # [T, M]
        if self.shared is not None:
            y = y + self.shared(x)
        return y
