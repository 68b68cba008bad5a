"""The expert-parallel data plane over a ``torch.distributed`` process group (gloo on CPU).

Legend: H shards, W = H + 1 ranks, R rows, M hidden.

One group per attention replica: rank 0 is the replica, ranks 1..H are the shards. A round (one
MoE layer of one forward pass) is four all-to-alls issued in the same order on every rank:

1. headers  [W, 4] int64: (command, placement row, placement version, rows) from rank 0 to each shard
2. slot ids [R] int64 and 3. hidden rows [R, M], rank 0 -> shards
4. outputs  [R, M], shards -> rank 0

A ``STOP`` header ends the shards' serve loops. Membership is checked when a group forms: each
rank proves it holds the group's key (made by the replica, handed to its shards through Ray),
so a process that reached the TCP store first cannot stand in for a shard. The rows themselves
cross gloo in the clear: keep the group on a private network (loopback under ``tide up``).
The group is a standalone ``ProcessGroupGloo``
over its own TCP store (no global ``init_process_group``), so a shard can serve several replicas'
groups at once, one thread each, and a group is re-formed by building a new one on a new port.
Measured on a 2-core VM, a gloo all-to-all of 0.26 MB takes ~0.7 ms against 11-25 ms for a Ray
actor call of the same size; Ray only sets groups up and tears them down.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from cluster.ep import EPTransportError

__all__ = ["GlooTransport", "check_members", "form_group", "listen_socket", "serve_shard"]

log = logging.getLogger(__name__)

CMD_LAYER, CMD_STOP = 1, 2


def form_group(
    host: str, port: int, rank: int, world: int, timeout_s: float, op_timeout_s: float | None = None,
    bind: str | None = None, listen_fd: int | None = None, key: bytes | None = None, group_id: str = "",
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group's TCP store and build the gloo group; blocks until all
    ``world`` ranks have joined or ``timeout_s`` passes. Each collective then times out after
    ``op_timeout_s`` (default ``timeout_s``) on this rank: short on the replica, which must notice
    a hung shard, long on shards, which wait idle between requests (a dead replica closes the
    connection, which they notice at once). ``bind``: the address this rank's gloo connections
    listen on (default: what the host name resolves to); ``listen_fd``: rank 0's store serves on
    this listening socket (bound by the caller to one address) instead of on every interface;
    ``key``: the group's key (``check_members``), ``group_id`` its id."""
    store = dist.TCPStore(host, port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, **({"master_listen_fd": listen_fd} if listen_fd is not None else {}))
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=op_timeout_s or timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind) if bind else
                     dist.ProcessGroupGloo.create_default_device()]
    pg = dist.ProcessGroupGloo(store, rank, world, opts)
    if key is not None:
        check_members(pg, rank, world, key, group_id)
    return pg


def _member_tag(key: bytes, group_id: str, rank: int, world: int) -> torch.Tensor:
    tag = hmac.new(key, f"tide-ep-member:{group_id}:{rank}:{world}".encode(), hashlib.sha256).digest()
    return torch.frombuffer(bytearray(tag), dtype=torch.int32)  # [8]


def check_members(pg, rank: int, world: int, key: bytes, group_id: str) -> None:
    """Every rank shows an HMAC of (group, its rank, world) under ``key``; every rank checks
    all of them. ``EPTransportError`` naming a rank whose tag is wrong: the group is not used."""
    tags = [torch.zeros(8, dtype=torch.int32) for _ in range(world)]
    pg.allgather([tags], [_member_tag(key, group_id, rank, world)]).wait()
    for r, got in enumerate(tags):
        if not hmac.compare_digest(got.numpy().tobytes(), _member_tag(key, group_id, r, world).numpy().tobytes()):
            raise EPTransportError(f"expert-parallel group {group_id}: rank {r} failed the membership check "
                                   "(it does not hold the group's key)")


def listen_socket(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` and a free port, for rank 0's store (``listen_fd``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


def _a2a(pg, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
    try:
        pg.alltoall_base(out, inp, out_splits, in_splits).wait()
    except RuntimeError as e:  # gloo reports a closed or timed-out peer this way
        raise EPTransportError(f"expert-parallel all-to-all failed: {e}") from e


class GlooTransport:
    """Rank 0's side (the attention replica). See ``cluster.ep.Transport``."""

    def __init__(self, pg, world: int, dtype: torch.dtype) -> None:
        self.pg = pg
        self.world = world
        self.dtype = dtype
        self._ones = [1] * world

    def dispatch_combine(
        self, layer: int, version: int, counts: list[int], local_slots: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor:
        return self.start(layer, version, counts, local_slots, x)()

    def start(
        self, layer: int, version: int, counts: list[int], local_slots: torch.Tensor, x: torch.Tensor
    ):
        """Post the round's four all-to-alls without waiting; returns the function that waits.
        Gloo tags collectives in the order they are posted, so rounds started back to back (two
        micro-batches) pair up with the shards' rounds in the same order."""
        assert len(counts) == self.world - 1, (counts, self.world)
        header = torch.zeros(self.world, 4, dtype=torch.long)
        header[1:, 0] = CMD_LAYER
        header[1:, 1] = layer
        header[1:, 2] = version
        header[1:, 3] = torch.tensor(counts)
        splits, none = [0, *counts], [0] * self.world
        x = x.to(self.dtype).contiguous()
        out = torch.empty_like(x)
        keep = (header, torch.empty_like(header), local_slots.long().contiguous(), x)  # alive until done
        try:
            works = [
                self.pg.alltoall_base(keep[1], header, self._ones, self._ones),
                self.pg.alltoall_base(torch.empty(0, dtype=torch.long), keep[2], none, splits),
                self.pg.alltoall_base(torch.empty(0, x.shape[1], dtype=self.dtype), x, none, splits),
                self.pg.alltoall_base(out, torch.empty(0, x.shape[1], dtype=self.dtype), splits, none),
            ]
        except RuntimeError as e:
            raise EPTransportError(f"expert-parallel all-to-all failed: {e}") from e

        def wait(_keep=keep) -> torch.Tensor:  # the default argument keeps the buffers alive
            try:
                for w in works:
                    w.wait()
            except RuntimeError as e:
                raise EPTransportError(f"expert-parallel all-to-all failed: {e}") from e
            return out

        return wait

    def stop(self) -> None:
        """End the shards' serve loops (best effort: a broken group needs no stop)."""
        header = torch.zeros(self.world, 4, dtype=torch.long)
        header[1:, 0] = CMD_STOP
        try:
            _a2a(self.pg, torch.empty_like(header), header, self._ones, self._ones)
        except EPTransportError:
            pass


def serve_shard(
    pg, rank: int, world: int, hidden: int, dtype: torch.dtype,
    compute: Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor],
) -> str:
    """A shard's loop for one group: receive rows, ``compute(version, row, local_slots, x)``,
    send the outputs back. Returns why it ended (``stop`` or the transport error)."""
    ones = [1] * world
    none = [0] * world
    zero_header = torch.zeros(world, 4, dtype=torch.long)
    while True:
        header = torch.empty(world, 4, dtype=torch.long)
        try:
            _a2a(pg, header, zero_header, ones, ones)
            cmd, layer, version, rows = header[0].tolist()
            if cmd == CMD_STOP:
                return "stop"
            from_root = [rows] + [0] * (world - 1)
            slots = torch.empty(rows, dtype=torch.long)
            _a2a(pg, slots, torch.empty(0, dtype=torch.long), from_root, none)
            x = torch.empty(rows, hidden, dtype=dtype)
            _a2a(pg, x, torch.empty(0, hidden, dtype=dtype), from_root, none)
            y = compute(version, layer, slots, x).to(dtype).contiguous()
            _a2a(pg, torch.empty(0, hidden, dtype=dtype), y, none, from_root)
        except EPTransportError as e:
            log.info("shard rank %d leaves its group: %s", rank, e)
            return f"error: {e}"
        except Exception as e:  # noqa: BLE001 - leaving closes the group, so rank 0 fails fast and recovers
            log.exception("shard rank %d failed a round", rank)
            return f"error: {e}"
