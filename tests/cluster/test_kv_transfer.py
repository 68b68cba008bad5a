"""The P/D handoff's transport (``cluster/kv_transfer.py``): a tensor put in an outbox comes back
bit for bit through its ticket, once; anything lost, stale or altered is ``KVLost``, never KV."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from cluster.kv_transfer import PART_MIN_BYTES, KVLost, KVOutbox, fetch_kv


@pytest.fixture(params=[False, True], ids=["plain", "sealed"])
def outbox(request):
    box = KVOutbox("127.0.0.1", seal=request.param)
    yield box
    box.close()


@pytest.mark.parametrize("shape,dtype", [((3, 5, 7), torch.float32), ((2, 9, 33), torch.bfloat16),
                                         # over PART_MIN_BYTES twice: ranges on connections side by side
                                         ((3, PART_MIN_BYTES // 4 // 96 + 5, 48), torch.float16)])
def test_a_tensor_comes_back_bit_for_bit_once(outbox, shape, dtype):
    kv = torch.randn(shape).to(dtype)
    ticket = outbox.put(kv)
    assert ticket.nbytes == kv.numel() * kv.element_size() and (ticket.key is not None) == outbox.seal
    got = fetch_kv(ticket)
    assert got.dtype == dtype and got.shape == kv.shape and torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    assert outbox.held() == 0 and outbox.counters["sent_bytes"] == ticket.nbytes
    with pytest.raises(KVLost, match="holds it no more"):
        fetch_kv(ticket)


def test_the_wire_carries_no_plain_kv_when_sealed_and_a_wrong_key_is_lost_not_wrong():
    box = KVOutbox("127.0.0.1", seal=True)
    try:
        kv = torch.arange(4096, dtype=torch.float32).reshape(2, 32, 64)
        ticket = box.put(kv)
        wrong = dataclasses.replace(ticket, key=bytes(32))
        with pytest.raises(KVLost, match="seal"):
            fetch_kv(wrong)  # the bytes went once: the ticket is spent
        assert box.counters["sent_bytes"] == ticket.nbytes
    finally:
        box.close()


def test_unknown_expired_dropped_and_closed_outboxes_are_lost():
    box = KVOutbox("127.0.0.1", seal=False, ttl_s=0.05, max_bytes=2 * 4096 + 100)
    try:
        forged = dataclasses.replace(box.put(torch.zeros(4)), ticket=bytes(32))
        with pytest.raises(KVLost):
            fetch_kv(forged)
        stale = box.put(torch.zeros(16))
        time.sleep(0.1)
        with pytest.raises(KVLost):
            fetch_kv(stale)
        box.ttl_s = 60
        first, second = box.put(torch.ones(1024)), box.put(torch.ones(1024) * 2)
        third = box.put(torch.ones(1024) * 3)  # over max_bytes with the one before: the oldest goes
        assert box.counters["dropped"] >= 1
        with pytest.raises(KVLost):
            fetch_kv(first)
        assert torch.equal(fetch_kv(third), torch.ones(1024) * 3)
    finally:
        box.close()
    with pytest.raises(KVLost):
        fetch_kv(second)  # its replica went
