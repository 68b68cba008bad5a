"""``deploy/local.py``'s rules that need no cluster (the cluster itself: ``test_cli_up.py``)."""

from __future__ import annotations

import pytest

from deploy.local import shared_cpu_threads


@pytest.mark.parametrize("args, threads", [
    ({}, 7),  # a lone replica computes with the machine but one core (for the proxy, the ingress, Ray)
    ({"replicas": 2, "decode_replicas": 1}, 2),  # 7 CPUs among three replicas
    ({"replicas": 16}, 1),  # never none
    ({"cpu_threads": 3}, 3),  # as given
    ({"replica_cpus": 2.0}, None),  # a reservation given: Ray's threads for it
    ({"device": "cuda"}, None),
])
def test_tide_up_shares_the_machines_cpus_among_its_replicas(monkeypatch, args, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert shared_cpu_threads(8.0, args) == threads


def test_omp_num_threads_set_stands(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert shared_cpu_threads(8.0, {}) is None
    assert shared_cpu_threads(8.0, {"cpu_threads": 4}) == 4
