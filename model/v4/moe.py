"""DeepSeek-V4's MoE: sqrt-softplus top-K routing, hash routing in the first layers, clipped SwiGLU.

Legend: T tokens, M hidden, E routed experts, K experts per token, V vocabulary.

The routed experts go through the same ``ExpertExecutor`` seam as V2/V3's (``model.moe``), so
expert parallelism serves V4 unchanged: only the choice of experts differs. A hash layer's
choice is a fixed table ``tid2eid`` [V, K] of the token's id; its weights still come from the gate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import Impl
from model.layers import SwiGLU
from model.moe import Gate, MoE
from model.v4.config import V4Config

__all__ = ["V4Gate", "V4MoE", "route_v4"]


@dataclass(slots=True)
class V4Gate:
    weight: torch.Tensor  # [E, M] fp32
    bias: torch.Tensor | None = None  # [E]: steers the choice of a top-K layer
    tid2eid: torch.Tensor | None = None  # [V, K] int64: a hash layer's experts per token id


def route_v4(cfg: V4Config, gate: V4Gate, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, M], token_ids [T] -> (expert ids [T, K] int64, weights [T, K] fp32): the chosen
    experts' scores normalised to sum 1, times ``routed_scaling_factor``."""
    logits = F.linear(x.float(), gate.weight.float())  # [T, E]
    if cfg.scoring_func == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif cfg.scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1)
    if gate.tid2eid is not None:
        ids = gate.tid2eid[token_ids.to(gate.tid2eid.device)].long()  # [T, K]
    else:
        choice = scores if gate.bias is None else scores + gate.bias.float()
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


class V4MoE(MoE):
    """V4's gate and shared expert around the routed experts' executor; ``submit`` needs the rows'
    token ids (hash layers route by them)."""

    def __init__(self, cfg: V4Config, layer_idx: int, gate: V4Gate, shared: SwiGLU | None, impl: Impl = "ref") -> None:
        super().__init__(cfg, layer_idx, Gate(gate.weight), shared, impl)  # type: ignore[arg-type]
        self.v4_gate = gate

    def route(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        assert token_ids is not None, "V4's MoE routes by token ids too"
        return route_v4(self.cfg, self.v4_gate, x, token_ids)
