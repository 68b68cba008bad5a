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

On GPUs the rows cross host memory: the executor routes on the host, hands the transport host
tensors and moves the combined output back to the replica's device; a shard moves its rows to its
own device and its outputs back (the gloo transport moves host tensors). An NCCL transport that
keeps the rows on the devices is not built.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from cluster.eplb import Placement
from kernels import resolve_impl
from model.moe import ExpertWeights, grouped_expert_forward

__all__ = ["EPExecutor", "EPTransportError", "ShardExperts", "Transport", "choose_slots"]


class EPTransportError(RuntimeError):
    """The expert-parallel group cannot complete a round (a peer died, hung or left)."""


class Transport(Protocol):
    """Moves one MoE layer's rows to the shards and their outputs back.

    ``counts`` [H] rows per shard, ``local_slots`` [R_total] (slot within its shard) and ``x``
    [R_total, M] sorted by shard. Returns [R_total, M] unweighted expert outputs in the same order.
    Raises ``EPTransportError`` when the round cannot complete. A transport may also offer
    ``start(...)`` with the same arguments, returning a function that waits for the result, so
    that the caller computes while the round is in flight (two micro-batches)."""

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
    """``model.moe.ExpertExecutor`` over expert shards, with ``submit`` for overlapped rounds.
    ``moe_layers[i]`` is the model layer of placement row i. Counts tokens per expert (``load``,
    decayed) for EPLB, and the time spent blocked on rounds (``stats["wait_s"]``). ``version``:
    the placement's version on the shards."""

    def __init__(
        self,
        placement: Placement,
        moe_layers: list[int],
        transport: Transport,
        recover: Callable[[BaseException], Transport] | None = None,
        max_retries: int = 3,
        load_decay: float = 0.99,
        version: int = 0,
    ) -> None:
        assert placement.phy2log.shape[0] == len(moe_layers), (placement.phy2log.shape, moe_layers)
        self.row_of = {layer: i for i, layer in enumerate(moe_layers)}
        self.transport = transport
        self.recover = recover
        self.max_retries = max_retries
        self.load_decay = load_decay
        self.load = torch.zeros(placement.logcnt.shape, dtype=torch.float64)  # [L, E]
        self.stats = {"rounds": 0, "retries": 0, "rows": 0, "wait_s": 0.0}
        self._lock = threading.Lock()
        self._placement, self._version = placement, version
        self._pending: tuple[Placement, int, Transport | None] | None = None
        self._in_flight = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def placement(self) -> Placement:
        return self._placement

    def switch_placement(self, placement: Placement, version: int, transport: Transport | None = None) -> None:
        """Use ``placement`` (whose weights every shard holds as ``version``), and ``transport``
        when the shard set changes, for the next round started when none is in flight;
        ``version`` changes then."""
        with self._lock:
            self._pending = (placement, version, transport)
            self._apply_pending()

    def _apply_pending(self) -> None:
        if self._pending is not None and self._in_flight == 0:
            placement, version, transport = self._pending
            self._placement, self._version, self._pending = placement, version, None
            if transport is not None:
                self.transport = transport

    def __call__(
        self, layer_idx: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return self.submit(layer_idx, x, expert_ids, weights)()

    def submit(
        self, layer_idx: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        """Send the layer's rows now; the returned function waits and combines -> [T, M]."""
        t, k = expert_ids.shape
        if t == 0:
            empty = torch.zeros_like(x)
            return lambda: empty
        device = x.device  # routing and rows on the host (no-ops on a CPU replica)
        x, expert_ids, weights = x.cpu(), expert_ids.cpu(), weights.cpu()
        with self._lock:
            self._apply_pending()
            placement, version = self._placement, self._version
            self._in_flight += 1
        row = self.row_of[layer_idx]
        self._count(row, expert_ids)
        slots = choose_slots(expert_ids, placement.log2phy[row], placement.logcnt[row])  # [T, K]
        per = placement.slots_per_shard
        flat = slots.reshape(-1)
        order = torch.argsort(flat // per, stable=True)  # rows grouped by shard
        counts = torch.bincount(flat // per, minlength=placement.num_shards).tolist()
        token = order // k
        args = (row, version, counts, (flat % per)[order], x.index_select(0, token))
        transport = self.transport
        started: Callable[[], torch.Tensor] | EPTransportError
        try:
            start = getattr(transport, "start", None)
            started = start(*args) if start is not None else (lambda: transport.dispatch_combine(*args))
        except EPTransportError as e:
            started = e

        def finish() -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                if isinstance(started, EPTransportError):
                    raise started
                ys = started()
            except EPTransportError as e:
                ys = self._retry(e, transport, args)
            finally:
                with self._lock:
                    self.stats["wait_s"] += time.perf_counter() - t0
                    self._in_flight -= 1
                    self._apply_pending()
            self.stats["rounds"] += 1
            self.stats["rows"] += ys.shape[0]
            ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
            return torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype)).to(device)

        return finish

    def _retry(self, error: EPTransportError, used: Transport, args: tuple) -> torch.Tensor:
        """Re-form the group (once per failure, however many rounds saw it) and resend."""
        for _ in range(self.max_retries if self.recover is not None else 0):
            self.stats["retries"] += 1
            with self._lock:
                if self.transport is used:
                    self.transport = None  # type: ignore[assignment]  # let the broken group close
                    try:
                        self.transport = self.recover(error)
                    except BaseException:
                        self.transport = used  # the next round fails on it and recovers again
                        raise
                used = self.transport
            try:
                return used.dispatch_combine(*args)
            except EPTransportError as e:
                error = e
        raise error

    def _count(self, row: int, expert_ids: torch.Tensor) -> None:
        counts = torch.bincount(expert_ids.reshape(-1), minlength=self.load.shape[1]).double()
        self.load[row].mul_(self.load_decay).add_(counts)


class ShardExperts:
    """One shard's expert weights, per placement version: ``weights[version][row]`` stacks the
    shard's P slots of placement row ``row`` (a MoE layer), on ``device``. ``compute`` takes and
    returns host tensors and runs the experts on ``device`` (``impl``: see
    ``kernels.resolve_impl``; ``auto`` runs the Triton grouped GEMM on CUDA). Thread-safe."""

    def __init__(self, device: str | torch.device = "cpu", impl: str = "auto") -> None:
        self.device = torch.device(device)
        self.impl = resolve_impl(impl, self.device)
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
        x, slots = x.to(self.device), local_slots.to(self.device)
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=self.device)
        return grouped_expert_forward(layers[row], x, slots[:, None], ones, self.impl).cpu()
