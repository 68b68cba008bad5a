"""EP dispatch/combine without Ray: an in-process transport over per-shard weights must give the
local executor's result; copies are used in turn; a failed round is retried after recovery."""

from __future__ import annotations

import pytest
import torch

from cluster.ep import EPExecutor, EPTransportError, ShardExperts, choose_slots
from cluster.eplb import EplbConfig, Placement, plan
from model.moe import ExpertWeights, LocalExpertExecutor

E, M, INTER, K, SHARDS, SLOTS = 8, 16, 12, 3, 3, 12


class InProcessTransport:
    """Shards as ``ShardExperts`` objects in this process; rows travel by slicing."""

    def __init__(self, placement: Placement, experts: dict[int, ExpertWeights], fail_rounds: int = 0,
                 device: str = "cpu", impl: str = "auto"):
        self.shards = []
        per = placement.slots_per_shard
        for h in range(SHARDS):
            s = ShardExperts(device, impl)
            s.put(0, {row: _slots_of(experts[layer], placement.phy2log[row, h * per : (h + 1) * per], device)
                      for row, layer in enumerate(sorted(experts))})
            self.shards.append(s)
        self.fail_rounds = fail_rounds

    def dispatch_combine(self, layer, version, counts, local_slots, x):
        assert x.device.type == "cpu" and local_slots.device.type == "cpu"  # rows travel in host memory
        if self.fail_rounds:
            self.fail_rounds -= 1
            raise EPTransportError("peer closed")
        out, start = [], 0
        for h, n in enumerate(counts):
            out.append(self.shards[h].compute(version, layer, local_slots[start : start + n], x[start : start + n]))
            start += n
        return torch.cat(out)


def _slots_of(w: ExpertWeights, experts: torch.Tensor, device: str = "cpu") -> ExpertWeights:
    return ExpertWeights(w.gate_up[experts].to(device), w.down[experts].to(device))


@pytest.fixture
def setup():
    gen = torch.Generator().manual_seed(0)
    experts = {layer: ExpertWeights(torch.randn(E, 2 * INTER, M, generator=gen) * 0.2,
                                    torch.randn(E, M, INTER, generator=gen) * 0.2) for layer in (1, 3)}
    load = torch.rand(2, E, generator=gen, dtype=torch.float64) + torch.tensor([5.0] + [0.0] * (E - 1))
    placement = plan(load, EplbConfig(SLOTS, 1, 1, SHARDS, "global"))
    x = torch.randn(20, M, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(20)])
    w = torch.rand(20, K, generator=gen)
    return experts, placement, x, ids, w


def test_ep_executor_matches_the_local_executor(setup):
    experts, placement, x, ids, w = setup
    local = LocalExpertExecutor(experts)
    ep = EPExecutor(placement, [1, 3], InProcessTransport(placement, experts))
    for layer in (1, 3):
        torch.testing.assert_close(ep(layer, x, ids, w), local(layer, x, ids, w), atol=1e-5, rtol=1e-5)
    assert ep.stats["rounds"] == 2 and ep.stats["rows"] == 2 * 20 * K
    assert ep.load.sum() == 2 * 20 * K  # tokens counted per expert for EPLB
    assert ep(1, x[:0], ids[:0], w[:0]).shape == (0, M)


def test_shards_running_the_triton_grouped_gemm_match_the_local_executor(setup):
    """What a GPU shard runs (``impl="auto"`` on CUDA); without CUDA in Triton's interpreter."""
    experts, placement, x, ids, w = setup
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ep = EPExecutor(placement, [1, 3], InProcessTransport(placement, experts, device=device, impl="triton"))
    assert ep.transport.shards[0].impl == "triton"
    torch.testing.assert_close(ep(1, x, ids, w), LocalExpertExecutor(experts)(1, x, ids, w), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_a_gpu_replica_with_gpu_shards_matches_the_local_executor(setup):
    """Rows leave the replica's GPU for host memory (the transport), shards compute on their GPU
    (Triton), and the combined output comes back on the replica's GPU."""
    experts, placement, x, ids, w = setup
    transport = InProcessTransport(placement, experts, device="cuda")
    assert transport.shards[0].impl == "triton"
    ep = EPExecutor(placement, [1, 3], transport)
    got = ep(3, x.cuda(), ids.cuda(), w.cuda())
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), LocalExpertExecutor(experts)(3, x, ids, w), atol=1e-4, rtol=1e-4)


def test_copies_are_used_in_turn(setup):
    _, placement, *_ = setup
    hot = int(placement.logcnt[0].argmax())
    copies = int(placement.logcnt[0, hot])
    assert copies > 1
    ids = torch.full((12, 1), hot)
    slots = choose_slots(ids, placement.log2phy[0], placement.logcnt[0]).flatten()
    counts = torch.bincount(slots, minlength=SLOTS)
    used = counts[counts > 0]
    assert len(used) == copies and used.max() - used.min() <= 1
    assert all(int(placement.phy2log[0, s]) == hot for s in slots)


def test_a_failed_round_is_retried_after_recovery(setup):
    experts, placement, x, ids, w = setup
    recovered = []

    def recover(error):
        recovered.append(str(error))
        return InProcessTransport(placement, experts)

    ep = EPExecutor(placement, [1, 3], InProcessTransport(placement, experts, fail_rounds=1), recover=recover)
    torch.testing.assert_close(ep(1, x, ids, w), LocalExpertExecutor(experts)(1, x, ids, w), atol=1e-5, rtol=1e-5)
    assert recovered == ["peer closed"] and ep.stats["retries"] == 1
    never = EPExecutor(placement, [1, 3], InProcessTransport(placement, experts, fail_rounds=1))
    with pytest.raises(EPTransportError):
        never(1, x, ids, w)


def test_a_failed_recovery_fails_the_round_and_the_next_round_recovers(setup):
    """When recovery itself fails (the shards stayed away), the round fails with
    ``EPTransportError`` and the executor keeps a transport, so the next round recovers again."""
    experts, placement, x, ids, w = setup
    attempts = []

    def recover(error):
        attempts.append(str(error))
        if len(attempts) == 1:
            raise EPTransportError("expert shards did not recover")
        return InProcessTransport(placement, experts)

    broken = InProcessTransport(placement, experts, fail_rounds=99)
    ep = EPExecutor(placement, [1, 3], broken, recover=recover)
    with pytest.raises(EPTransportError, match="did not recover"):
        ep(1, x, ids, w)
    assert ep.transport is broken
    torch.testing.assert_close(ep(1, x, ids, w), LocalExpertExecutor(experts)(1, x, ids, w), atol=1e-5, rtol=1e-5)
    assert len(attempts) == 2


def test_switch_placement_applies_between_rounds(setup):
    experts, placement, x, ids, w = setup
    ep = EPExecutor(placement, [1, 3], InProcessTransport(placement, experts))
    other = Placement.from_phy2log(placement.phy2log.roll(4, dims=1), E, SHARDS)
    ep.switch_placement(other, 1)
    assert ep.version == 1 and ep.placement is other


def test_a_shard_without_the_version_refuses():
    s = ShardExperts()
    with pytest.raises(KeyError, match="version 3"):
        s.compute(3, 0, torch.zeros(1, dtype=torch.long), torch.zeros(1, M))
