"""The expert-parallel group's formation over gloo, in-process (two ranks in two threads)."""

from __future__ import annotations

import threading

import pytest

from cluster.ep import EPTransportError
from cluster.ep_gloo import form_group, listen_socket


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
    import cluster.ep_gloo

    monkeypatch.setattr(cluster.ep_gloo, "store_prefix", lambda key, gid: "shared")  # it found the store's names
    bad = _form([b"k" * 32, b"x" * 32])
    assert all(isinstance(g, EPTransportError) for g in bad), bad
    assert "rank 1 failed the membership check" in str(bad[0])
