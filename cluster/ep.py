"""Expert parallelism, the transport-agnostic part: dispatch, combine, and what a shard computes.

Legend: T tokens, K experts per token, M hidden, E logical experts, S physical slots, P slots per
shard, H shards, U rows (one per token and shard it has an expert on), Q (token, k) pairs.

An attention replica runs the model with an ``EPExecutor`` as its expert executor. For each MoE
layer the executor maps every (token, k) pair to one physical copy of its expert (copies of a hot
expert take turns) and builds a ``Round``: each token's hidden row once per shard that holds one
of its experts (not once per pair), and per pair its row, its slot on the shard and its routing
weight. A shard runs its pairs, weights them and sums them per row (``shard_round``), so the
combine also carries one row per token and shard; the executor adds the shards' rows per token.
A ``Wire`` says how rows travel: as the model's dtype, or as DeepSeek serves V3 (dispatch in FP8
e4m3 with one scale per token and 128 channels, combine in BF16). A ``Transport`` moves a round's
tensors as they are. A shard (``ShardExperts``) only knows its slots' weights, per placement
version, so a new placement can be loaded beside the serving one and switched to atomically.

Transport failures (a shard died, the group broke) raise ``EPTransportError``; the executor calls
the injected ``recover`` (which re-forms the group) and resends the same layer. A layer's result
depends only on its inputs, so a retried round returns the same values.

The executor routes where its transport's buffers live (``transport.device``; the host when a
transport names none): with the NCCL transport (``cluster.ep_comm``) on the replica's GPU, so a
round's rows, pairs and outputs stay on the devices; with gloo on the host, the combined output
moving back to the replica's device once per layer. A shard computes on the device its rows
arrive on, after moving them to its experts' device if that differs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from cluster.eplb import Placement
from kernels import resolve_impl
from model.moe import ExpertWeights, grouped_expert_forward

__all__ = ["EPExecutor", "EPTransportError", "Round", "ShardExperts", "Transport", "Wire", "choose_slots",
           "shard_round"]

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_BLOCK = 128  # channels per FP8 scale (DeepSeek's activation blocks)


class EPTransportError(RuntimeError):
    """The expert-parallel group cannot complete a round (a peer died, hung or left)."""


@dataclass(frozen=True, slots=True)
class Wire:
    """How a round's rows travel. ``dispatch``: "native" (the model's dtype) or "fp8" (e4m3, one
    float32 scale per row and ``SCALE_BLOCK`` channels; a row narrower or not a multiple gets
    one scale); ``combine``: "native" or "bf16". FP8 payloads travel as their uint8 bytes
    (collectives need not know float8 types)."""

    dispatch: str = "native"
    combine: str = "native"

    def __post_init__(self) -> None:
        if self.dispatch not in ("native", "fp8") or self.combine not in ("native", "bf16"):
            raise ValueError(f"wire dispatch must be native or fp8 and combine native or bf16, got {self}")

    @staticmethod
    def named(name: str, dtype: torch.dtype) -> Wire:
        """The wire a config names for a ``dtype`` model: "fp8", "native" or "auto" (``deepseek``)."""
        wires = {"auto": Wire.deepseek(dtype), "native": Wire(), "fp8": Wire("fp8", "bf16")}
        if name not in wires:
            raise ValueError(f"ep wire must be one of {', '.join(wires)}, got {name!r}")
        return wires[name]

    @staticmethod
    def deepseek(dtype: torch.dtype) -> Wire:
        """FP8 dispatch and BF16 combine for a BF16 model (as DeepSeek serves V3/R1); a float32
        or float16 model's rows travel as they are."""
        return Wire("fp8", "bf16") if dtype == torch.bfloat16 else Wire()

    def blocks(self, hidden: int) -> int:
        """FP8 scales per row."""
        return hidden // SCALE_BLOCK if hidden % SCALE_BLOCK == 0 else 1

    def encode_rows(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(payload, scales [U, blocks] or None) of rows ``x`` [U, M]."""
        if self.dispatch == "native":
            return x.to(dtype).contiguous(), None
        u, m = x.shape
        xb = x.float().reshape(u, self.blocks(m), -1)
        scales = xb.abs().amax(-1).clamp_min(1e-12) / FP8_MAX  # [U, blocks]
        q = (xb / scales[..., None]).to(torch.float8_e4m3fn).reshape(u, m)
        return q.view(torch.uint8), scales.contiguous()

    def decode_rows(self, payload: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if self.dispatch == "native":
            return payload.to(dtype)
        u, m = payload.shape
        x = payload.view(torch.float8_e4m3fn).float().reshape(u, scales.shape[1], -1) * scales[..., None]
        return x.reshape(u, m).to(dtype)

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16 if self.combine == "bf16" else dtype

    def rows_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The payload dtype of dispatched rows (what a shard allocates)."""
        return torch.uint8 if self.dispatch == "fp8" else dtype

    def encode_out(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return y.to(self.out_dtype(dtype)).contiguous()

    def decode_out(self, payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return payload.to(dtype)


@dataclass(frozen=True, slots=True)
class Round:
    """One MoE layer's dispatch, grouped by shard: ``counts`` [H] rows and ``pair_counts`` [H]
    pairs per shard; ``rows`` [U, M] the encoded hidden rows (``Wire``) and ``scales`` their FP8
    scales; per pair (shard-major) ``pair_row`` [Q] its row among its shard's rows,
    ``pair_slot`` [Q] its slot on the shard and ``pair_weight`` [Q] (float32) its routing
    weight."""

    counts: list[int]
    pair_counts: list[int]
    rows: torch.Tensor
    scales: torch.Tensor | None
    pair_row: torch.Tensor
    pair_slot: torch.Tensor
    pair_weight: torch.Tensor

    def part(self, h: int) -> Round:
        """Shard ``h``'s part (one shard's counts)."""
        r0, r1 = sum(self.counts[:h]), sum(self.counts[: h + 1])
        q0, q1 = sum(self.pair_counts[:h]), sum(self.pair_counts[: h + 1])
        return Round([r1 - r0], [q1 - q0], self.rows[r0:r1], None if self.scales is None else self.scales[r0:r1],
                     self.pair_row[q0:q1], self.pair_slot[q0:q1], self.pair_weight[q0:q1])

    def dispatch_bytes(self) -> int:
        """Bytes this round sends to the shards (rows, scales and the pairs' row, slot and weight)."""
        meta = self.pair_row.numel() * 8 + self.pair_slot.numel() * 8 + self.pair_weight.numel() * 4
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.rows.numel() * self.rows.element_size() + scales + meta


class Transport(Protocol):
    """Moves one MoE layer's ``Round`` to the shards and their outputs back: returns the combine
    payload [U, M] (``Wire.encode_out`` of each row's weighted sum over its pairs) in the round's
    row order. Raises ``EPTransportError`` when the round cannot complete. A transport may also
    offer ``start(...)`` with the same arguments, returning a function that waits for the
    result, so that the caller computes while the round is in flight (two micro-batches)."""

    def dispatch_combine(self, layer: int, version: int, rnd: Round) -> torch.Tensor: ...


def shard_round(compute: Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor], wire: Wire,
                dtype: torch.dtype, version: int, layer: int, rnd: Round) -> torch.Tensor:
    """What a shard does with its part of a round: decode the rows, run each pair through its
    slot's expert (``compute(version, layer, slots, x)``, unweighted), weight, sum per row and
    encode -> the combine payload [U, M]."""
    x = wire.decode_rows(rnd.rows, rnd.scales, dtype)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    if rnd.pair_row.numel():
        y = compute(version, layer, rnd.pair_slot, x.index_select(0, rnd.pair_row))
        out.index_add_(0, rnd.pair_row, y.float() * rnd.pair_weight[:, None])
    return wire.encode_out(out, dtype)


def choose_slots(expert_ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """Physical slot of each (token, k): expert_ids [T, K], log2phy [E, C], logcnt [E] -> [T, K].
    An expert's tokens are dealt to its copies in turn, in token order: its j-th token in the
    batch goes to copy j mod copies, whatever rank the expert has among that token's top-k (so
    each copy takes its share, within one token)."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within
    grouped = flat[order]
    first = torch.searchsorted(grouped, grouped)  # where each pair's expert group starts
    nth = torch.empty_like(flat)
    nth[order] = torch.arange(flat.numel(), device=flat.device) - first  # the pair's place among its expert's pairs
    return log2phy[flat, nth % logcnt[flat]].view_as(expert_ids)


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
        wire: Wire = Wire(),
    ) -> None:
        assert placement.phy2log.shape[0] == len(moe_layers), (placement.phy2log.shape, moe_layers)
        self.row_of = {layer: i for i, layer in enumerate(moe_layers)}
        self.transport = transport
        self.recover = recover
        self.max_retries = max_retries
        self.load_decay = load_decay
        self.wire = wire
        self.load = torch.zeros(placement.logcnt.shape, dtype=torch.float64)  # [L, E]
        self.stats = {"rounds": 0, "retries": 0, "rows": 0, "pairs": 0, "dispatch_bytes": 0, "combine_bytes": 0,
                      "wait_s": 0.0}
        self._lock = threading.Lock()
        self._placement, self._version = placement, version
        self._pending: tuple[Placement, int, Transport | None] | None = None
        self._in_flight = 0
        self._on_device: tuple = (None, None)  # (placement id, device) and its slot tables there

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
        device = x.device
        with self._lock:
            self._apply_pending()
            placement, version = self._placement, self._version
            self._in_flight += 1
        route = getattr(self.transport, "device", None) or torch.device("cpu")  # where the round's buffers live
        x, expert_ids, weights = x.to(route), expert_ids.to(route), weights.to(route)
        row = self.row_of[layer_idx]
        self._count(row, expert_ids)
        log2phy, logcnt = self._slot_tables(placement, row, route)
        slots = choose_slots(expert_ids, log2phy, logcnt)  # [T, K]
        rnd, row_token = self._round(x, slots, weights, placement)
        args = (row, version, rnd)
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
                payload = started()
            except EPTransportError as e:
                payload = self._retry(e, transport, args)
            finally:
                with self._lock:
                    self.stats["wait_s"] += time.perf_counter() - t0
                    self._in_flight -= 1
                    self._apply_pending()
            st = self.stats
            st["rounds"] += 1
            st["rows"] += payload.shape[0]
            st["pairs"] += rnd.pair_row.numel()
            st["dispatch_bytes"] += rnd.dispatch_bytes()
            st["combine_bytes"] += payload.numel() * payload.element_size()
            ys = self.wire.decode_out(payload.to(route), x.dtype).float()
            out = torch.zeros(x.shape, dtype=torch.float32, device=route).index_add_(0, row_token, ys)
            return out.to(x.dtype).to(device)

        return finish

    def _round(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
               placement: Placement) -> tuple[Round, torch.Tensor]:
        """The round of rows ``x`` [T, M] whose pairs go to ``slots`` [T, K], and the token of each
        row [U]."""
        t, k = slots.shape
        per, shards = placement.slots_per_shard, placement.num_shards
        flat = slots.reshape(-1)
        pair_shard = flat // per
        pair_token = torch.arange(t, device=slots.device).repeat_interleave(k)
        # one row per (shard, token): sorted by shard, then token
        keys, pair_key = torch.unique(pair_shard * t + pair_token, return_inverse=True)
        row_shard, row_token = keys // t, keys % t
        counts = torch.bincount(row_shard, minlength=shards)
        first_row = torch.cumsum(counts, 0) - counts  # each shard's first row
        order = torch.argsort(pair_shard, stable=True)  # pairs grouped by shard
        rows, scales = self.wire.encode_rows(x.index_select(0, row_token), x.dtype)
        rnd = Round(counts.tolist(), torch.bincount(pair_shard, minlength=shards).tolist(), rows, scales,
                    (pair_key - first_row[pair_shard])[order], (flat % per)[order],
                    weights.reshape(-1)[order].float().contiguous())
        return rnd, row_token

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

    def _slot_tables(self, placement: Placement, row: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Placement row ``row``'s log2phy and logcnt on ``device`` (copied once per placement)."""
        if device.type == "cpu":
            return placement.log2phy[row], placement.logcnt[row]
        key = (id(placement), device)
        if self._on_device[0] != key:
            self._on_device = (key, (placement.log2phy.to(device), placement.logcnt.to(device)))
        log2phy, logcnt = self._on_device[1]
        return log2phy[row], logcnt[row]

    def _count(self, row: int, expert_ids: torch.Tensor) -> None:
        counts = torch.bincount(expert_ids.reshape(-1), minlength=self.load.shape[1]).double().cpu()
        self.load[row].mul_(self.load_decay).add_(counts)


class ShardExperts:
    """One shard's expert weights, per placement version: ``weights[version][row]`` stacks the
    shard's P slots of placement row ``row`` (a MoE layer), on ``device``. ``compute`` runs the
    experts on ``device`` and returns its outputs where its inputs were (``impl``: see
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
        came_from = x.device
        x, slots = x.to(self.device), local_slots.to(self.device)
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=self.device)
        return grouped_expert_forward(layers[row], x, slots[:, None], ones, self.impl).to(came_from)
