"""Expert parallelism, the transport-agnostic part: dispatch, combine, and what a shard computes.

Legend: T tokens, K experts per token, M hidden, E logical experts, S physical slots, P slots per
shard, R rows (token copies) sent to one shard.

An attention replica runs the model with an ``EPExecutor`` as its expert executor. For each MoE
layer the executor maps every (token, k) pair to one physical copy of its expert (copies of a hot
expert take turns), groups the rows by the shard that owns the slot, and hands them to a
``Transport`` that returns each row's *unweighted* expert output; the executor applies the routing
weights and sums per token. A shard (``ShardExperts``) only knows its slots' weights, per placement
version, so a new placement can be loaded beside the serving one and switched to atomically.

Transport failures (a shard died, the group broke) raise ``EPTransportError``; the executor calls
the injected ``recover`` (which re-forms the group) and resends the same layer. A layer's result
depends only on its inputs, so a retried round returns the same values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

from cluster.eplb import Placement
from model.moe import ExpertWeights, grouped_expert_forward

__all__ = ["EPExecutor", "EPTransportError", "ShardExperts", "Transport", "choose_slots"]


class EPTransportError(RuntimeError):
    """The expert-parallel group cannot complete a round (a peer died, hung or left)."""


class Transport(Protocol):
    """Moves one MoE layer's rows to the shards and their outputs back.

    ``counts`` [H] rows per shard, ``local_slots`` [R_total] (slot within its shard) and ``x``
    [R_total, M] sorted by shard. Returns [R_total, M] unweighted expert outputs in the same order.
    Raises ``EPTransportError`` when the round cannot complete."""

    def dispatch_combine(
        self, layer: int, version: int, counts: list[int], local_slots: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor: ...


def choose_slots(expert_ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """Physical slot of each (token, k): expert_ids [T, K], log2phy [E, C], logcnt [E] -> [T, K].
    Copies of an expert are used in turn (row-major over the batch), which spreads their load."""
    flat = expert_ids.reshape(-1)
    turn = torch.arange(flat.numel()) % logcnt[flat]
    return log2phy[flat, turn].view_as(expert_ids)


class EPExecutor:
    """``model.moe.ExpertExecutor`` over expert shards. ``moe_layers[i]`` is the model layer of
    placement row i. Counts tokens per expert (``load``, decayed) for EPLB."""

    def __init__(
        self,
        placement: Placement,
        moe_layers: list[int],
        transport: Transport,
        recover: Callable[[BaseException], Transport] | None = None,
        max_retries: int = 3,
        load_decay: float = 0.99,
    ) -> None:
        assert placement.phy2log.shape[0] == len(moe_layers), (placement.phy2log.shape, moe_layers)
        self.row_of = {layer: i for i, layer in enumerate(moe_layers)}
        self.moe_layers = list(moe_layers)
        self.transport = transport
        self.recover = recover
        self.max_retries = max_retries
        self.load_decay = load_decay
        self.load = torch.zeros(placement.logcnt.shape, dtype=torch.float64)  # [L, E]
        self.stats = {"rounds": 0, "retries": 0, "rows": 0}
        self._lock = threading.Lock()
        self._placement, self._version = placement, 0
        self._pending: tuple[Placement, int] | None = None
        self._busy = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def placement(self) -> Placement:
        return self._placement

    def switch_placement(self, placement: Placement, version: int) -> None:
        """Use ``placement`` (whose weights every shard holds as ``version``) from the next layer
        on; a round in flight finishes on the old one (``version`` changes once it has)."""
        with self._lock:
            if self._busy:
                self._pending = (placement, version)
            else:
                self._placement, self._version = placement, version

    def __call__(
        self, layer_idx: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        t, k = expert_ids.shape
        if t == 0:
            return torch.zeros_like(x)
        with self._lock:
            if self._pending is not None:
                (self._placement, self._version), self._pending = self._pending, None
            placement, version = self._placement, self._version
            self._busy = True
        try:
            return self._dispatch(layer_idx, x, expert_ids, weights, placement, version)
        finally:
            with self._lock:
                self._busy = False
                if self._pending is not None:
                    (self._placement, self._version), self._pending = self._pending, None

    def _dispatch(self, layer_idx, x, expert_ids, weights, placement: Placement, version: int) -> torch.Tensor:
        k = expert_ids.shape[1]
        row = self.row_of[layer_idx]
        self._count(row, expert_ids)
        slots = choose_slots(expert_ids, placement.log2phy[row], placement.logcnt[row])  # [T, K]
        per = placement.slots_per_shard
        flat = slots.reshape(-1)
        order = torch.argsort(flat // per, stable=True)  # rows grouped by shard
        counts = torch.bincount(flat // per, minlength=placement.num_shards).tolist()
        token = order // k
        xs = x.index_select(0, token)  # [T*K, M]
        ys = self._round(row, version, counts, (flat % per)[order], xs)
        ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype))

    def _round(self, row: int, version: int, counts: list[int], local: torch.Tensor, xs: torch.Tensor):
        for attempt in range(self.max_retries + 1):
            try:
                ys = self.transport.dispatch_combine(row, version, counts, local, xs)
                self.stats["rounds"] += 1
                self.stats["rows"] += xs.shape[0]
                return ys
            except EPTransportError as e:
                if self.recover is None or attempt == self.max_retries:
                    raise
                self.stats["retries"] += 1
                self.transport = None  # type: ignore[assignment]  # let the broken group close
                self.transport = self.recover(e)
        raise AssertionError("unreachable")

    def _count(self, row: int, expert_ids: torch.Tensor) -> None:
        counts = torch.bincount(expert_ids.reshape(-1), minlength=self.load.shape[1]).double()
        self.load[row].mul_(self.load_decay).add_(counts)


class ShardExperts:
    """One shard's expert weights, per placement version: ``weights[version][row]`` stacks the
    shard's P slots of placement row ``row`` (a MoE layer). Thread-safe."""

    def __init__(self) -> None:
        self._versions: dict[int, dict[int, ExpertWeights]] = {}
        self._lock = threading.Lock()

    def put(self, version: int, weights: dict[int, ExpertWeights]) -> None:
        with self._lock:
            self._versions[version] = weights

    def drop_except(self, keep: set[int]) -> None:
        with self._lock:
            for v in [v for v in self._versions if v not in keep]:
                del self._versions[v]

    def layer(self, version: int, row: int) -> ExpertWeights:
        with self._lock:
            return self._versions[version][row]

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def compute(self, version: int, row: int, local_slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Unweighted outputs of ``x`` [R, M] through the experts in ``local_slots`` [R] -> [R, M]."""
        with self._lock:
            layers = self._versions.get(version)
        if layers is None:
            raise KeyError(f"placement version {version} is not loaded on this shard (have {self.versions()})")
        if x.shape[0] == 0:
            return x
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32)
        return grouped_expert_forward(layers[row], x, local_slots[:, None], ones)
