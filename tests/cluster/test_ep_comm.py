"""The expert-parallel group (``cluster/ep_comm.py``): its backend choice, and its formation
over gloo, in-process (two ranks in two threads); NCCL between two GPUs where there are two."""

from __future__ import annotations

import threading

import pytest
import torch

from cluster.ep import EPTransportError
from cluster.ep_comm import form_group, group_backend, group_device, listen_socket


def _form(keys: list[bytes | None], timeout_s: float = 20.0) -> list:
    """Form a group of ``len(keys)`` ranks on loopback, rank r holding ``keys[r]``; each rank's
    group or the exception it raised."""
    sock = listen_socket("127.0.0.1")
    port, fd = sock.getsockname()[1], sock.detach()
    out: list = [None] * len(keys)

    def rank(r: int) -> None:
        try:
            out[r] = form_group("127.0.0.1", port, r, len(keys), timeout_s, bind="127.0.0.1",
                                listen_fd=fd if r == 0 else None, key=keys[r], group_id="g1")
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.security
def test_a_rank_without_the_groups_key_cannot_join_and_no_rank_uses_the_group():
    ok = _form([b"k" * 32, b"k" * 32])
    assert not any(isinstance(g, Exception) for g in ok), ok
    # rank 1 reached the store but holds another key: the group's entries are named under the
    # key (it cannot find or rewrite them), so neither side ever forms a group with it
    bad = _form([b"k" * 32, b"x" * 32], timeout_s=3.0)
    assert all(isinstance(g, EPTransportError) for g in bad), bad
    assert "not every rank joined" in str(bad[0])


@pytest.mark.security
def test_a_member_whose_tag_is_wrong_is_named_by_every_rank(monkeypatch):
    """Past the store, each rank still proves the key: one that found the store's names without
    the key fails the membership check on every rank, and the replica names it."""
    import cluster.ep_comm

    monkeypatch.setattr(cluster.ep_comm, "store_prefix", lambda key, gid: "shared")  # it found the store's names
    bad = _form([b"k" * 32, b"x" * 32])
    assert all(isinstance(g, EPTransportError) for g in bad), bad
    assert "rank 1 failed the membership check" in str(bad[0])


def test_the_backend_is_nccl_on_cuda_and_gloo_on_the_host_and_a_wrong_one_is_named():
    assert group_backend("auto", "cpu") == "gloo" and group_device("gloo", "cuda:1") == torch.device("cpu")
    assert group_backend("gloo", "cuda") == "gloo"
    with pytest.raises(ValueError, match="nccl needs CUDA devices"):
        group_backend("nccl", "cpu")
    with pytest.raises(ValueError, match="'mpi'"):
        group_backend("mpi", "cpu")
    if torch.distributed.is_nccl_available():
        assert group_backend("auto", "cuda") == "nccl" and group_device("nccl", "cuda:1") == torch.device("cuda", 1)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def collective_round(rank: int, world: int, port: int, backend: str) -> str:
    """One rank of a ``backend`` group (NCCL: on GPU ``rank``): rank 0 sends two layers' rounds
    of random experts through an ``EPExecutor`` and compares them with the local executor; the
    others serve their shard. Returns "equal" (rank 0: and every round's rows were on its
    group's device), "stop" (a shard) or what went wrong."""
    from cluster.ep import EPExecutor, ShardExperts, Wire
    from cluster.ep_comm import CollectiveTransport, serve_shard
    from cluster.eplb import EplbConfig, plan
    from model.moe import ExpertWeights, LocalExpertExecutor

    e, m, inter, k, shards = 8, 16, 12, 3, world - 1
    gen = torch.Generator().manual_seed(0)
    experts = {layer: ExpertWeights(torch.randn(e, 2 * inter, m, generator=gen) * 0.2,
                                    torch.randn(e, m, inter, generator=gen) * 0.2) for layer in (1, 3)}
    placement = plan(torch.rand(2, e, generator=gen, dtype=torch.float64), EplbConfig(e + shards, 1, 1, shards, "global"))
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    pg = form_group("127.0.0.1", port, rank, world, 120.0, bind="127.0.0.1", key=b"k" * 32, group_id=backend,
                    backend=backend, device=dev)
    if rank:
        per = placement.slots_per_shard
        mine = ShardExperts(dev)
        mine.put(0, {row: ExpertWeights(experts[layer].gate_up[placement.phy2log[row, (rank - 1) * per : rank * per]].to(dev),
                                        experts[layer].down[placement.phy2log[row, (rank - 1) * per : rank * per]].to(dev))
                     for row, layer in enumerate((1, 3))})
        return serve_shard(pg, rank, world, m, torch.float32, mine.compute, Wire(), dev)
    transport = CollectiveTransport(pg, world, torch.float32, Wire(), dev)
    devices = []
    start = transport.start

    def watched(layer, version, rnd):
        devices.extend({rnd.rows.device, rnd.pair_slot.device, rnd.pair_weight.device})
        return start(layer, version, rnd)

    transport.start = watched
    x, ids = torch.randn(20, m, generator=gen), torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(20)])
    w = torch.rand(20, k, generator=gen)
    try:
        ex = EPExecutor(placement, [1, 3], transport)
        for layer in (1, 3):
            got = ex(layer, x.to(dev), ids.to(dev), w.to(dev))
            if got.device != dev:
                return f"output on {got.device}"
            torch.testing.assert_close(got.cpu(), LocalExpertExecutor(experts)(layer, x, ids, w), atol=2e-2, rtol=2e-2)
    except AssertionError as err:
        return f"differs: {err}"
    finally:
        transport.stop()
    return "equal" if set(devices) == {dev} else f"rows crossed {devices}"


def _rank(rank: int, world: int, port: int, backend: str, out) -> None:
    try:
        out.put((rank, collective_round(rank, world, port, backend)))
    except Exception as e:  # noqa: BLE001 - the test reports it
        out.put((rank, f"raised {e!r}"))


def test_a_round_through_the_collective_transport_equals_the_local_experts():
    """The same code NCCL runs (buffers on the group's device, the executor routing there), over
    gloo on the host: three ranks in threads."""
    import queue
    import threading

    world, port, out = 3, _free_port(), queue.Queue()
    threads = [threading.Thread(target=_rank, args=(r, world, port, "gloo", out), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    results = dict(out.get(timeout=120) for _ in threads)
    assert results == {0: "equal", 1: "stop", 2: "stop"}, results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: a GPU per rank)")
def test_an_nccl_round_keeps_the_rows_on_the_gpus_and_equals_the_local_experts():
    import torch.multiprocessing as mp

    world, port = 2, _free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, "nccl", out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(60)
    assert results == {0: "equal", 1: "stop"}, results
